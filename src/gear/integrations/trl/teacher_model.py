"""The teacher's weights (spec §4): none for `current`, a no-grad eval model for `frozen` / `ema`.

- `build_teacher`: the frozen / EMA teacher, placed like TRL places its reference model
  (`prepare_deepspeed` / `prepare_fsdp`). Under DeepSpeed ZeRO-3 a copy of the policy is built
  the way TRL builds its reference model, from the config inside `zero.Init` (partitioned from
  the start), then filled parameter by parameter from the gathered policy: never a `deepcopy` of
  a partitioned model, whose parameters are empty shards.
- A PEFT policy needs no copy of its base (`AdapterTeacher`): the frozen teacher is the policy
  with its adapter disabled; the EMA teacher is the policy with its trainable (adapter) weights
  swapped, for the teacher pass only, for a float32 moving average of them.
- `update_ema`: theta_T <- decay * theta_T + (1 - decay) * theta over the policy's trainable
  floating-point parameters (quantized weights and integer buffers are never touched), with a
  float32 master copy wherever the teacher holds a lower precision, so that updates of
  (1 - decay) * (theta - theta_T) below the teacher dtype's resolution are not rounded away.
- `save_teacher` / `load_teacher`: the teacher's weights (its float32 master where it has one)
  inside a checkpoint (`TEACHER_FILE`), gathered from every rank, so a resumed run continues
  with the same frozen / EMA teacher.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoTokenizer, PreTrainedModel, TrainerCallback
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from trl.models import prepare_deepspeed, prepare_fsdp
from trl.trainer.utils import create_model_from_path, disable_dropout_in_model

from gear.modeling import LogitConventions

if TYPE_CHECKING:
    from trl import GRPOTrainer

TEACHER_FILE = "gear_teacher.safetensors"  # frozen / ema teacher weights inside a checkpoint
MASTER_ATTR = "_gear_ema_master"  # name -> float32 master of a low-precision EMA parameter


class EMATeacherUpdate(TrainerCallback):
    """Moves the EMA teacher towards the policy after every optimizer step (`update()`)."""

    def __init__(self, update: Callable[[], None]) -> None:
        self.update = update

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.update()


# ----------------------------------------------------------------------------------- building


def build_teacher(
    trainer: GRPOTrainer, teacher_model: PreTrainedModel | str | None, teacher_tokenizer: Any
) -> nn.Module | None:
    """None for the current teacher, else the frozen / EMA teacher, ready on the device, placed
    like `trainer` (TRL's) places its reference model."""
    args = trainer.args
    if args.teacher == "current":
        return None
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if teacher_model is None and _is_peft(policy):
        return AdapterTeacher.for_policy(
            lambda: trainer.accelerator.unwrap_model(trainer.model), args.teacher
        )
    if is_deepspeed_zero3_enabled():
        _init_deepspeed_comm()  # zero.Init sizes its partitions by DeepSpeed's world size
    if teacher_model is None:
        teacher = copy_of_policy(policy)
    else:
        if isinstance(teacher_model, str):
            if teacher_tokenizer is None:
                teacher_tokenizer = AutoTokenizer.from_pretrained(
                    teacher_model, trust_remote_code=args.trust_remote_code
                )
            kwargs = dict(args.model_init_kwargs or {})
            kwargs.setdefault("dtype", trainer.model.dtype)
            teacher = create_model_from_path(teacher_model, **kwargs)  # zero.Init under ZeRO-3
        else:
            teacher = teacher_model
        check_teacher_vocabulary(policy, trainer._tokenizer, teacher, teacher_tokenizer)
    teacher.eval()
    teacher.requires_grad_(False)
    disable_dropout_in_model(teacher)
    if trainer.is_deepspeed_enabled:  # ZeRO-3: partitioned like the policy; else replicated
        return prepare_deepspeed(teacher, trainer.accelerator)
    if trainer.is_fsdp_enabled:
        return prepare_fsdp(teacher.to(trainer.accelerator.device), trainer.accelerator)
    return teacher.to(trainer.accelerator.device)


def copy_of_policy(policy: nn.Module) -> nn.Module:
    """An independent model holding the policy's current weights.

    Under ZeRO-3 the model is built from the config, as TRL builds its reference model
    (`from_pretrained` under `zero.Init`), and each parameter is copied from the gathered policy;
    the policy may already be partitioned (loaded under `zero.Init`), and a deep copy would then
    copy empty shards. Elsewhere a deep copy is exact and keeps non-float tensors (quantization
    codes, integer buffers) as they are.
    """
    if not is_deepspeed_zero3_enabled():
        return without_fused_forward(copy.deepcopy(policy))
    teacher = type(policy)._from_config(policy.config, dtype=policy.dtype)  # under zero.Init
    source = dict(policy.named_parameters())
    for name, param in teacher.named_parameters():
        with gathered([source[name], param], modifier_rank=0):
            param.data.copy_(source[name].data)  # rank 0's copy is re-partitioned to all ranks
    buffers = dict(policy.named_buffers())
    for name, buffer in teacher.named_buffers():
        if name in buffers:
            buffer.copy_(buffers[name])
    return teacher


def _init_deepspeed_comm() -> None:
    """Attach DeepSpeed's communication layer to the running process group. HF Trainer does it
    when it initialises the engine (in `train()`), but a model built under `zero.Init` before that
    would be partitioned for a world size of 1."""
    import deepspeed

    if not deepspeed.comm.is_initialized() and torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def check_teacher_vocabulary(
    policy: nn.Module, policy_tokenizer: Any, teacher: nn.Module, tokenizer: Any
) -> None:
    """A separate teacher must score the same token ids: same vocabulary, same head size, and
    turn its head's output into logits alike (`LogitConventions`).

    The head sizes are read from the full shapes: under ZeRO-3 a model loaded under `zero.Init`
    holds size-0 shards (`ds_shape` keeps the full one)."""
    if tokenizer is not None:
        ours, theirs = policy_tokenizer.get_vocab(), tokenizer.get_vocab()
        if ours != theirs:
            diff = sorted(set(ours.items()) ^ set(theirs.items()))[:5]
            raise ValueError(
                f"teacher_processing_class: the teacher's tokenizer differs from the policy's "
                f"({len(theirs)} vs {len(ours)} tokens; e.g. differing entries {diff}); "
                "GEAR scores the student's token ids with the teacher, so both must share "
                "one vocabulary"
            )
    ours_v = full_shape(policy.get_output_embeddings().weight)[0]
    theirs_v = full_shape(teacher.get_output_embeddings().weight)[0]
    if ours_v != theirs_v:
        raise ValueError(
            f"teacher_model: its LM head has {theirs_v} rows, the policy's {ours_v}; the "
            "teacher must use the policy's tokenizer"
        )
    ours_c, theirs_c = LogitConventions.of(policy), LogitConventions.of(teacher)
    if theirs_c.scale != ours_c.scale:
        raise ValueError(
            "teacher_model: its logit scale differs from the policy's, which is not supported"
        )
    if theirs_c.softcap != ours_c.softcap:
        raise ValueError(
            "teacher_model: its final_logit_softcapping differs from the policy's, which is not "
            "supported"
        )


# ----------------------------------------------------------------------------------- PEFT


class AdapterTeacher(nn.Module):
    """The PEFT policy itself, run as the teacher: no copy of the base model.

    - `values is None`: the adapter is disabled for the teacher pass (`frozen` teacher of an
      adapter that starts as the identity, e.g. LoRA with B = 0: exactly the initial policy).
    - otherwise `values` maps each trainable parameter's name to a float32 tensor (full shape)
      swapped in for the teacher pass and swapped back after it: the EMA of the adapter weights,
      or the initial adapter weights of a `frozen` teacher of a pre-trained adapter.

    The policy is looked up through `policy_fn` at each call (the trainer's model, after
    DDP / DeepSpeed / FSDP preparation); it is not a submodule, so this module owns no
    parameters, and `modules()` / `train()` act on the policy (for eval-mode teacher passes).
    """

    def __init__(self, policy_fn: Callable[[], nn.Module], values: dict[str, Tensor] | None):
        super().__init__()
        self._policy_fn = policy_fn
        self.values = values

    @classmethod
    def for_policy(cls, policy_fn: Callable[[], nn.Module], kind: str) -> AdapterTeacher:
        policy = policy_fn()
        output = policy.get_output_embeddings()
        if hasattr(output, "disable_adapters") or hasattr(output, "original_module"):
            raise NotImplementedError(
                f"teacher={kind!r} with a PEFT adapter on the LM head (or the head in "
                "modules_to_save) is not supported: the teacher and student heads would differ; "
                "adapt the decoder layers only, or use teacher='current'"
            )
        names = trainable_names(policy)
        if not names:
            raise ValueError(f"teacher={kind!r}: the PEFT policy has no trainable parameter")
        params = dict(policy.named_parameters())
        with gathered([params[n] for n in names]):
            values = {n: full_tensor(params[n]).detach().float().clone() for n in names}
        if kind == "frozen" and _adapter_is_identity(policy, values):
            values = None  # disabling the adapter gives the initial policy, with no copy at all
        return cls(policy_fn, values)

    @property
    def policy(self) -> nn.Module:
        return self._policy_fn()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.active():
            return self.policy(*args, **kwargs)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: the policy computes the teacher's function."""
        policy = self.policy
        if self.values is None:
            with policy.disable_adapter():
                yield
            return
        params = dict(policy.named_parameters())
        with gathered([params[n] for n in self.values]):
            saved = {n: full_tensor(params[n]).detach().clone() for n in self.values}
        _assign(params, self.values)
        try:
            yield
        finally:
            _assign(params, saved)

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """values <- decay * values + (1 - decay) * theta, in float32."""
        params = dict(self.policy.named_parameters())
        names = list(self.values)
        with gathered([params[n] for n in names]):
            for n in names:
                self.values[n].lerp_(full_tensor(params[n]).float(), 1.0 - decay)

    def modules(self) -> Iterator[nn.Module]:
        return self.policy.modules()

    def train(self, mode: bool = True) -> AdapterTeacher:
        self.policy.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return getattr(self._policy_fn(), name)  # config, get_base_model, heads, ...


def _assign(params: dict[str, nn.Parameter], values: dict[str, Tensor]) -> None:
    """Write full-shape `values` into the (possibly partitioned / sharded) parameters."""
    targets = [params[n] for n in values]
    with gathered(targets, modifier_rank=0), torch.no_grad():
        for n, value in values.items():
            p = params[n]
            local_part(p).copy_(shard_like(value, p))


def _adapter_is_identity(policy: nn.Module, values: dict[str, Tensor]) -> bool:
    """Whether every adapter is a LoRA whose B factors are zero (the default initialisation,
    under which the adapted model equals its base)."""
    configs = getattr(policy, "peft_config", {})
    if not configs or any(
        str(c.peft_type) not in ("LORA", "PeftType.LORA") for c in configs.values()
    ):
        return False
    b = [v for n, v in values.items() if ".lora_B." in n or ".lora_embedding_B." in n]
    others = [n for n in values if ".lora_" not in n]  # modules_to_save would be trained copies
    return bool(b) and not others and all(not v.any() for v in b)


# ----------------------------------------------------------------------------------- EMA


@torch.no_grad()
def update_ema(teacher: nn.Module, policy: nn.Module, decay: float) -> None:
    """theta_T <- decay * theta_T + (1 - decay) * theta over the policy's trainable
    floating-point parameters (its frozen ones never move, so the teacher's copy equals them).

    `teacher` may be a DeepSpeed engine; under ZeRO-3 both models are gathered one module at a
    time (TRL's `SyncRefModelCallback` gathers both whole models at once, which partitioning is
    there to avoid); under FSDP2 both are sharded alike and each rank updates its shard. A
    teacher parameter below float32 keeps a float32 master (outside ZeRO-3)."""
    if isinstance(teacher, AdapterTeacher):
        teacher.update(decay)
        return
    module = teacher.module if hasattr(teacher, "module") else teacher
    source = trainable(dict(policy.named_parameters()))
    pairs = [(n, t, source[n]) for n, t in module.named_parameters() if n in source]
    if not pairs:
        return
    master: dict[str, Tensor] = module.__dict__.setdefault(MASTER_ATTR, {})
    partitioned = any(hasattr(t, "ds_id") for _, t, _ in pairs)
    if partitioned and any(t.dtype != torch.float32 for _, t, _ in pairs):
        _warn_once(
            "teacher='ema' under ZeRO-3 updates the teacher in its own dtype (no float32 "
            "master copy, which would hold the full model on every rank)"
        )
    weight = 1.0 - decay
    for group in by_module(module, pairs):  # under ZeRO-3 one module's parameters at a time
        # the teacher's are written (rank 0's result re-partitioned), the policy's only read
        with gathered([p for _, _, p in group]), gathered([t for _, t, _ in group], 0):
            for name, t, p in group:
                t_local, p_local = local_part(t), local_part(p)
                if t_local.shape != p_local.shape:
                    raise RuntimeError(
                        f"EMA teacher: parameter {name} is sharded as {tuple(t_local.shape)} in "
                        f"the teacher and {tuple(p_local.shape)} in the policy"
                    )
                if t.dtype == torch.float32 or partitioned:
                    t_local.lerp_(p_local.to(t.dtype), weight)
                else:  # low precision: keep the average in float32, the teacher its rounding
                    m = master.get(name)
                    if m is None:
                        m = master[name] = t_local.float().clone()
                    m.lerp_(p_local.float(), weight)
                    t_local.copy_(m)


def by_module(module: nn.Module, pairs: list[tuple[str, Tensor, Tensor]]) -> list[list]:
    """`pairs` (name, teacher parameter, policy parameter) grouped by the teacher module that
    holds the parameter itself (not through a submodule), in `pairs`' order; a tied parameter
    goes with the first module holding it. Gathering group by group keeps at most one module's
    parameters of each model whole at a time, as DeepSpeed's own forward does."""
    owner: dict[int, int] = {}
    for index, sub in enumerate(module.modules()):
        for p in sub.parameters(recurse=False):
            owner.setdefault(id(p), index)
    groups: dict[int, list] = {}
    for pair in pairs:
        groups.setdefault(owner.get(id(pair[1]), -1), []).append(pair)
    return list(groups.values())


def trainable_names(model: nn.Module) -> list[str]:
    return list(trainable(dict(model.named_parameters())))


def trainable(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """The parameters the optimizer moves: requiring grad, floating point."""
    return {n: p for n, p in params.items() if p.requires_grad and p.is_floating_point()}


# ----------------------------------------------------------------------------------- checkpoints


def teacher_state(teacher: nn.Module) -> dict[str, Tensor] | None:
    """name -> full CPU tensor of the teacher's weights (float32 masters where kept), or None
    when the teacher has no weights of its own (a disabled adapter). Collective under ZeRO-3 /
    FSDP2: every rank must call it."""
    if isinstance(teacher, AdapterTeacher):
        if teacher.values is None:
            return None
        return {n: v.detach().cpu().clone() for n, v in teacher.values.items()}
    module = teacher.module if hasattr(teacher, "module") else teacher
    master = module.__dict__.get(MASTER_ATTR, {})
    state: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        with gathered([p]):
            value = full_like(master[name], p) if name in master else full_tensor(p)
            state[name] = value.detach().cpu().clone().contiguous()
    persistent = module.state_dict().keys()  # not e.g. rotary inv_freq, rebuilt at init
    for name, b in module.named_buffers():
        if name in persistent:
            state.setdefault(name, full_tensor(b).detach().cpu().clone().contiguous())
    return state


def save_teacher(teacher: nn.Module, checkpoint_dir: str, write: bool = True) -> None:
    """Write the teacher's weights into a checkpoint folder (`TEACHER_FILE`). Every rank calls
    this (gathering is collective); only those with `write` write the file."""
    state = teacher_state(teacher)
    if write and state is not None:
        os.makedirs(checkpoint_dir, exist_ok=True)
        save_file(state, os.path.join(checkpoint_dir, TEACHER_FILE))


def load_teacher(teacher: nn.Module, checkpoint_dir: str, device: str, kind: str) -> None:
    """Restore the teacher's weights from a checkpoint folder; warn when it has none."""
    if isinstance(teacher, AdapterTeacher) and teacher.values is None:
        return  # the adapter-disabled policy: nothing of its own to restore
    path = os.path.join(checkpoint_dir, TEACHER_FILE)
    if not os.path.isfile(path):
        warnings.warn(
            f"{path} not found: the {kind} teacher keeps its current weights "
            "(the checkpoint was not written by GEARTrainer)",
            stacklevel=3,
        )
        return
    state = load_file(path)
    if isinstance(teacher, AdapterTeacher):
        missing = sorted(set(teacher.values) - set(state))
        if missing:
            raise ValueError(f"{path}: no weights for adapter parameters {missing[:5]}")
        for n, v in teacher.values.items():
            v.copy_(state[n])
        return
    module = teacher.module if hasattr(teacher, "module") else teacher
    master = module.__dict__.get(MASTER_ATTR)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name not in state:
                raise ValueError(f"{path}: no weights for teacher parameter {name}")
            if tuple(state[name].shape) != full_shape(p):
                raise ValueError(
                    f"{path}: teacher parameter {name} is saved with shape "
                    f"{tuple(state[name].shape)}, the teacher's is {full_shape(p)} (a checkpoint "
                    "of another model, or an FSDP2 EMA teacher's float32 master saved as one "
                    "rank's shard by gear before that was fixed)"
                )
            value = state[name].to(device)
            with gathered([p], modifier_rank=0):
                local_part(p).copy_(shard_like(value, p).to(p.dtype))
            if value.dtype == torch.float32 and p.dtype != torch.float32 and p.is_floating_point():
                module.__dict__.setdefault(MASTER_ATTR, {})[name] = shard_like(value, p).clone()
            elif master is not None:
                master.pop(name, None)
        for name, b in module.named_buffers():
            if name in state:
                b.copy_(state[name].to(device))


# ----------------------------------------------------------------------------------- tensors


def gathered(params: list[Tensor], modifier_rank: int | None = None) -> Any:
    """DeepSpeed ZeRO-3's `GatheredParameters` when any of `params` is partitioned, else a
    no-op. Collective: every rank must enter it with the same parameters."""
    if not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def full_shape(p: Tensor) -> tuple[int, ...]:
    """The unpartitioned shape (a ZeRO-3 shard is size 0 outside a gather; a DTensor's shape is
    already the global one)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def full_tensor(p: Tensor) -> Tensor:
    """The whole tensor: a DTensor's all-gather (collective), else the tensor itself."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.data


def full_like(local: Tensor, p: Tensor) -> Tensor:
    """The whole tensor of `local`, this rank's part of a tensor laid out as parameter `p` (as
    `local_part(p)` is): for a DTensor the all-gather of every rank's part (collective), else
    `local` itself. The inverse of `shard_like`; how an FSDP2 teacher's float32 EMA masters,
    held per shard, are saved whole."""
    if not hasattr(p, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    whole = DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return whole.full_tensor()


def local_part(p: Tensor) -> Tensor:
    """The storage this rank holds and may update in place (a DTensor's local shard)."""
    return p.to_local() if hasattr(p, "to_local") else p.data


def shard_like(value: Tensor, p: Tensor) -> Tensor:
    """This rank's part of a full `value` laid out as parameter `p` (a DTensor is sliced locally,
    with no communication)."""
    if not hasattr(p, "device_mesh"):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(p.to_local().device)
    return distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()


def without_fused_forward(model: nn.Module) -> nn.Module:
    """Undo TRL's `add_fused_lm_head` on a deep copy of the policy.

    TRL sets `forward` per instance to a closure over the model it patched, so a copy would keep
    running the *policy*; deleting the instance attribute restores the class's `forward`."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", None), "__code__", None)
        if code is not None and code.co_name == "_fused_forward":
            del module.__dict__["forward"]
    return model


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
