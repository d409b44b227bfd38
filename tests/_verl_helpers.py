"""verl's real actor machinery on CPU, for tests: `GearActorRolloutRefWorker` over verl's own
`TrainingWorker` and `FSDPEngineWithLMHead` (micro-batching, dynamic batch size, remove-padding,
verl's forward step and output post-processing), with a tiny Hugging Face model in place of the
FSDP-wrapped one.

verl 0.9.1 has no CPU platform (it falls back to CUDA), so `verl_on_cpu` installs a minimal one
and a one-process gloo group; the engine is built without `__init__` (which would build the
model from a checkpoint path and wrap it in FSDP on a device mesh) and given the attributes its
inference path reads.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator, Sequence
from types import SimpleNamespace

import torch


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
