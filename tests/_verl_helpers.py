"""verl's real actor machinery on CPU, for tests: `GearActorRolloutRefWorker` over verl's own
`TrainingWorker` and `FSDPEngineWithLMHead` (micro-batching, dynamic batch size, remove-padding,
verl's forward step and output post-processing), with a tiny Hugging Face model in place of the
FSDP-wrapped one.

verl 0.9.1 has no CPU platform (it falls back to CUDA), so `verl_on_cpu` installs a minimal one
and a one-process gloo group; the engine is built without `__init__` (which would build the
model from a checkpoint path and wrap it in FSDP on a device mesh) and given the attributes its
inference path reads.

Below them, what the test_verl_*.py files share (split from tests/test_verl.py): the config
builder, a batch like verl's and its expected advantages, the tiny model (`tiny_llama`, the
`tiny_lm` fixture of the files that use it), the in-memory TransferQueue, the fake worker groups
and the row builders.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from gear.credit import CreditParams, token_advantages
from gear.credit.signals import signals_from_logits
from gear.integrations.verl.estimators import grpo_advantages


class CPUPlatform:
    """The part of verl's platform interface that the inference path calls."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = SimpleNamespace(
        max_memory_allocated=lambda *a: 0,
        max_memory_reserved=lambda *a: 0,
        empty_cache=lambda: None,
        synchronize=lambda *a: None,
        is_available=lambda: False,
    )

    def current_device(self) -> str:
        return "cpu"

    def communication_backend_name(self) -> str:
        return "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def verl_on_cpu() -> Iterator[None]:
    """verl's platform = CPU and a one-process gloo group, for the duration."""
    import verl.plugin.platform.platform_manager as pm

    old = pm._current_platform
    pm._current_platform = CPUPlatform()
    created = not torch.distributed.is_initialized()
    if created:
        store = os.path.join(tempfile.mkdtemp(), "store")
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
    try:
        yield
    finally:
        if created:
            torch.distributed.destroy_process_group()
        pm._current_platform = old


def cpu_engine(model: torch.nn.Module, use_dynamic_bsz: bool, max_token_len: int, mbs: int):
    """verl's `FSDPEngineWithLMHead` around `model`, unwrapped (no FSDP on one CPU process)."""
    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    e = object.__new__(FSDPEngineWithLMHead)
    e.module = model
    e.engine_config = SimpleNamespace(
        use_dynamic_bsz=use_dynamic_bsz,
        infer_max_token_len_per_gpu=max_token_len,
        infer_micro_batch_size_per_gpu=mbs,
        entropy_checkpointing=False,
        entropy_from_logits_with_chunking=False,
        fsdp_size=1,
        use_fused_kernels=False,
    )
    e.ulysses_sequence_parallel_size = 1
    e.ulysses_device_mesh = e.ulysses_parallel_group = None
    e.use_ulysses_sp = False
    e.pad_to_length, e.pad_to_length_bucket = False, 1
    e._autocast_dtype = torch.float32
    e.scaler = None
    e._is_offload_param = e._is_offload_optimizer = False
    e.mode = None
    e.compute_entropy_from_logits = verl_F.entropy_from_logits
    e.to = lambda *a, **k: None  # no offloading on CPU
    e.forward_calls = 0
    return e


def gear_worker(
    model: torch.nn.Module,
    remove_padding: bool,
    use_dynamic_bsz: bool,
    max_token_len: int = 64,
    mbs: int = 2,
):
    """`GearActorRolloutRefWorker` whose actor is verl's `TrainingWorker` on `cpu_engine`."""
    from verl.workers.engine_workers import TrainingWorker

    from gear.integrations.verl.worker import GearActorRolloutRefWorker

    engine = cpu_engine(model, use_dynamic_bsz, max_token_len, mbs)
    actor = object.__new__(TrainingWorker)
    actor.engine, actor.engine_config = engine, engine.engine_config
    actor.model_config = {"use_remove_padding": remove_padding}
    actor.loss_fn, actor.device_name, actor.flops_counter = None, "cpu", None
    worker = object.__new__(GearActorRolloutRefWorker)
    worker.actor = actor
    worker.enable_routing_replay = False
    # what Worker.__init__ sets up and the engine worker registers (read by verl's tq bridge)
    worker._Worker__dispatch_dp_rank, worker._Worker__collect_dp_rank = {}, {}
    worker._register_dispatch_collect_info(mesh_name="actor", dp_rank=0, is_collect=True)
    return worker


@contextlib.contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """A one-element list counting the model's root forwards while open."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    handle = model.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


def verl_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    teacher_prompts: Sequence[Sequence[int]] | None = None,
    response_masks: Sequence[torch.Tensor] | None = None,
    **non_tensor,
):
    """Rows as verl's v1 trainer hands them to the actor (jagged, prompt ⊕ response, no pad)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    def nested(rows):
        return torch.nested.as_nested_tensor(
            [torch.as_tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged
        )

    masks = response_masks or [torch.ones(len(r), dtype=torch.long) for r in responses]
    fields = {
        "prompts": nested(prompts),
        "responses": nested(responses),
        "input_ids": nested([list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]),
        "position_ids": nested(
            [list(range(len(p) + len(r))) for p, r in zip(prompts, responses, strict=True)]
        ),
        "response_mask": nested(masks),
        "loss_mask": nested(masks),
    }
    if teacher_prompts is not None:
        fields["gear_teacher_prompts"] = nested(teacher_prompts)
    td = TensorDict(fields, batch_size=[len(prompts)])
    tu.assign_non_tensor(td, **non_tensor)
    return td


# ------------------------------------------------------ shared by the test_verl_*.py files

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "verl"
V = 64  # vocabulary of the tiny model


def verl_cfg(**over):
    cfg = {
        "algorithm": {"adv_estimator": "gear", "norm_adv_by_std_in_grpo": True},
        "trainer": {"use_v1": True, "v1": {"trainer_mode": "gear_sync"}},
        "actor_rollout_ref": {
            "actor": {"strategy": "fsdp", "ulysses_sequence_parallel_size": 1},
            "model": {"use_fused_kernels": False},
            "rollout": {"n": 4},
        },
        "data": {},
    }
    for path, value in over.items():
        node = cfg
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return cfg


def verl_like_batch(seed=0):
    """Rows like verl's batch: responses right-padded, a tool observation (mask 0) mid-row,
    the reward on the last valid token, uids in groups of 3."""
    g = torch.Generator().manual_seed(seed)
    n, t = 6, 12
    lengths = [12, 9, 5, 12, 7, 10]
    mask = torch.zeros(n, t, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    mask[0, 4:7] = 0  # tool observation tokens
    mask[3, 2:4] = 0
    rewards = torch.zeros(n, t)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    for i, length in enumerate(lengths):
        rewards[i, length - 1] = scores[i]
    signals = {
        "gear_kl": torch.rand(n, t, generator=g) * 3,
        "gear_entropy": torch.rand(n, t, generator=g) * 2,
        "gear_student_logprobs": -torch.rand(n, t, generator=g) * 4,
        "gear_teacher_logprobs": -torch.rand(n, t, generator=g) * 4,
    }
    uids = ["p0"] * 3 + ["p1"] * 3
    return rewards, mask, uids, signals


def expected_token_advantages(rewards, mask, uids, signals, method, eps=1e-4, norm=True):
    seq = grpo_advantages(rewards.sum(-1), uids, epsilon=eps, norm_adv_by_std=norm)
    return token_advantages(
        seq,
        mask.bool(),
        kl=signals["gear_kl"],
        entropy=signals["gear_entropy"],
        student_logprobs=signals["gear_student_logprobs"],
        teacher_logprobs=signals["gear_teacher_logprobs"],
        params=CreditParams(method=method),
    )


def fake_render(messages, tools):
    """Deterministic 'chat template': one id per character of each message, 2..V-1."""
    ids = [1]
    for m in messages:
        ids += [2 + (ord(c) % (V - 2)) for c in f"<{m['role']}>{m['content']}"]
    if tools is not None:
        ids += [3] * (1 + len(tools))
    return [*ids, 1]


def tiny_llama():
    """The tiny Llama of the verl tests (vocabulary `V`), seeded. The test files that use it make
    it their module fixture `tiny_lm`: one model per module, as before the split."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).eval()


def reference_signals(model, prompt, teacher_prompt, response, temperature):
    """Unpadded, one row at a time: logits at positions P-1 .. P+R-2 of each full sequence."""

    def logits(p):
        ids = torch.tensor([list(p) + list(response)])
        return model(input_ids=ids, use_cache=False).logits[
            :, len(p) - 1 : len(p) - 1 + len(response)
        ]

    with torch.no_grad():
        return signals_from_logits(
            logits(prompt),
            logits(teacher_prompt),
            torch.tensor([list(response)]),
            temperature=temperature,
        )


def tq_row(uid, prompt, response, mask, score, raw_prompt, ground_truth):
    """One rollout row as verl's TransferQueue holds it (the reward on the last token)."""
    rm = torch.zeros(len(response))
    rm[-1] = score
    return {
        "uid": uid,
        "prompts": torch.tensor(prompt),
        "responses": torch.tensor(response),
        "input_ids": torch.tensor(prompt + response),
        "position_ids": torch.arange(len(prompt) + len(response)),
        "response_mask": mask,
        "loss_mask": mask,
        "rm_scores": rm,
        "old_log_probs": torch.zeros(len(response)),
        "raw_prompt": raw_prompt,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
    }


def random_rows(seed, n=5):
    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(
            2, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g
        ).tolist()

    prompts = [ids(3, 9) for _ in range(n)]
    teachers = [p + ids(2, 6) for p in prompts]  # a longer prompt: the hint
    responses = [ids(1, 8) for _ in range(n)]
    return prompts, teachers, responses


def compose(name, overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return hydra_compose(config_name=name, overrides=list(overrides))


class FakeTQ:
    """An in-memory TransferQueue with the key-value calls verl's v1 trainer makes."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        from tensordict.tensorclass import NonTensorData, NonTensorStack

        for name in fields.keys():  # noqa: SIM118 (iterating a TensorDict gives rows)
            value = fields.get(name)
            if isinstance(value, NonTensorData):
                items = [value.data] * len(keys)
            elif isinstance(value, NonTensorStack):
                items = value.tolist()
            else:
                items = list(value.unbind()) if value.is_nested else list(value)
            for key, item in zip(keys, items, strict=True):
                self.rows.setdefault(key, {})[name] = item
        from transfer_queue import KVBatchMeta

        return KVBatchMeta(
            keys=list(keys), tags=tags or [{} for _ in keys], partition_id=partition_id
        )

    def kv_batch_get(self, keys, partition_id, select_fields=None):
        from tensordict import TensorDict
        from tensordict.tensorclass import NonTensorStack

        names = select_fields or list(self.rows[keys[0]])
        out = {}
        for name in names:
            if name not in self.rows[keys[0]]:
                continue
            items = [self.rows[k][name] for k in keys]
            if all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in items):
                out[name] = torch.nested.as_nested_tensor(items, layout=torch.jagged)
            elif all(isinstance(x, torch.Tensor) for x in items):
                out[name] = torch.stack(items)
            else:
                out[name] = NonTensorStack(*items)
        return TensorDict(out, batch_size=[len(keys)])


class FakeActorWorkerGroup:
    """Stands for verl's RayWorkerGroup: splits rows over 2 'ranks' and runs the real
    `GearActorRolloutRefWorker` (verl's TrainingWorker and engine on CPU) on each, as verl's tq
    bridge would: fetch the meta's fields, attach extra_info, write the outputs back."""

    def __init__(self, tq, module):
        self.tq, self.calls = tq, 0
        self.worker = gear_worker(module, True, True, max_token_len=256)
        self.asked: list[tuple[str, list | None, dict]] = []  # (method, fields, GEAR's options)

    def compute_log_prob(self, meta):
        self.calls += 1
        return self._run(meta, self.worker.compute_log_prob)

    def compute_gear_signals(self, meta):  # rollout correction's bypass mode
        return self._run(meta, self.worker.compute_gear_signals)

    def _run(self, meta, method):
        from verl.utils import tensordict_utils as tu

        options = {k: v for k, v in meta.extra_info.items() if k.startswith("gear_")}
        self.asked.append((method.__name__, meta.fields, options))
        half = (len(meta.keys) + 1) // 2
        for keys in (meta.keys[:half], meta.keys[half:]):
            td = self.tq.kv_batch_get(keys, meta.partition_id, meta.fields)
            tu.assign_non_tensor(td, **meta.extra_info)
            with verl_on_cpu():
                out = method(td)
            tensors = [k for k in out.keys() if isinstance(out.get(k), torch.Tensor)]  # noqa: SIM118
            self.tq.kv_batch_put(keys, meta.partition_id, out.select(*tensors))
        return meta


class BridgedActorWorkerGroup:
    """The real worker method behind verl's real tq bridge (its @register wraps it)."""

    def __init__(self, module):
        self.calls = 0
        self.worker = gear_worker(module, True, True, max_token_len=256)

    def compute_log_prob(self, meta):
        self.calls += 1
        with verl_on_cpu():
            return self.worker.compute_log_prob(meta)


def verl_old_log_prob(self, batch, metrics):
    """verl's v1 ``_compute_old_log_prob``, reduced to its call of the actor workers."""
    batch.extra_info.update({"calculate_entropy": True, "compute_loss": False, "temperature": 0.8})
    self.actor_rollout_wg.compute_log_prob(batch)
    return batch


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, rows):
        return [" ".join(map(str, r)) for r in rows]

    def decode(self, ids):
        return " ".join(map(str, ids))
