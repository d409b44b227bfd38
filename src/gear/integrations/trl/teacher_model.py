"""The teacher's weights (spec §4): none for `current`, a no-grad eval copy for `frozen` / `ema`.

- `build_teacher`: the frozen / EMA teacher model, placed like TRL places its reference model.
- `update_ema`: theta_T <- decay * theta_T + (1 - decay) * theta, after each optimizer step
  (`EMATeacherUpdate`).
- `save_teacher` / `load_teacher`: the teacher's weights inside a checkpoint (`TEACHER_FILE`),
  so a resumed run continues with the same frozen / EMA teacher.
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_model, save_model
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel, TrainerCallback
from trl.models import prepare_deepspeed
from trl.trainer.utils import create_model_from_path, disable_dropout_in_model

if TYPE_CHECKING:
    from gear.integrations.trl.trainer import GEARTrainer

TEACHER_FILE = "gear_teacher.safetensors"  # frozen / ema teacher weights inside a checkpoint


class EMATeacherUpdate(TrainerCallback):
    """Moves the EMA teacher towards the policy after every optimizer step."""

    def __init__(self, trainer: GEARTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.update_ema_teacher()


def build_teacher(
    trainer: GEARTrainer, teacher_model: PreTrainedModel | str | None, teacher_tokenizer: Any
) -> nn.Module | None:
    """None for the current teacher, else a no-grad eval copy (frozen / ema) on the device."""
    args = trainer.args
    if args.teacher == "current":
        return None
    if trainer.is_fsdp_enabled:
        raise NotImplementedError(
            f"teacher={args.teacher!r} with FSDP is not supported yet; "
            "use teacher='current' or DDP / DeepSpeed"
        )
    if args.teacher == "ema" and trainer.is_deepspeed_enabled:
        raise NotImplementedError(
            "teacher='ema' with DeepSpeed is not supported yet (the EMA update "
            "needs unpartitioned parameters); use teacher='frozen' or DDP"
        )
    if teacher_model is None:
        teacher = without_fused_forward(
            copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
        )
    else:
        if isinstance(teacher_model, str):
            if teacher_tokenizer is None:
                teacher_tokenizer = AutoTokenizer.from_pretrained(
                    teacher_model, trust_remote_code=args.trust_remote_code
                )
            kwargs = dict(args.model_init_kwargs or {})
            kwargs.setdefault("dtype", trainer.model.dtype)
            teacher = create_model_from_path(teacher_model, **kwargs)
        else:
            teacher = teacher_model
        check_teacher_vocabulary(trainer, teacher, teacher_tokenizer)
    teacher.eval()
    teacher.requires_grad_(False)
    disable_dropout_in_model(teacher)
    if trainer.is_deepspeed_enabled:
        return prepare_deepspeed(teacher, trainer.accelerator)
    return teacher.to(trainer.accelerator.device)


def check_teacher_vocabulary(trainer: GEARTrainer, teacher: nn.Module, tokenizer: Any) -> None:
    """A separate teacher must score the same token ids: same vocabulary, same head size."""
    if tokenizer is not None:
        ours, theirs = trainer._tokenizer.get_vocab(), tokenizer.get_vocab()
        if ours != theirs:
            diff = sorted(set(ours.items()) ^ set(theirs.items()))[:5]
            raise ValueError(
                f"teacher_processing_class: the teacher's tokenizer differs from the policy's "
                f"({len(theirs)} vs {len(ours)} tokens; e.g. differing entries {diff}); "
                "GEAR scores the student's token ids with the teacher, so both must share "
                "one vocabulary"
            )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ours_v = policy.get_output_embeddings().weight.shape[0]
    theirs_v = teacher.get_output_embeddings().weight.shape[0]
    if ours_v != theirs_v:
        raise ValueError(
            f"teacher_model: its LM head has {theirs_v} rows, the policy's {ours_v}; the "
            "teacher must use the policy's tokenizer"
        )
    text_config = teacher.config.get_text_config()
    if logit_scale(text_config) != trainer._logit_scale:
        raise ValueError(
            "teacher_model: its logit scale differs from the policy's, which is not supported"
        )
    if logit_softcap(text_config) != trainer._logit_softcap:
        raise ValueError(
            "teacher_model: its final_logit_softcapping differs from the policy's, which is not "
            "supported"
        )


@torch.no_grad()
def update_ema(teacher: nn.Module, policy: nn.Module, decay: float) -> None:
    """theta_T <- decay * theta_T + (1 - decay) * theta, parameter by parameter."""
    params = dict(policy.named_parameters())
    for name, t in teacher.named_parameters():
        t.lerp_(params[name].detach().to(t.dtype), 1.0 - decay)


def save_teacher(teacher: nn.Module, checkpoint_dir: str) -> None:
    """Write the teacher's weights into a checkpoint folder (`TEACHER_FILE`)."""
    save_model(teacher, os.path.join(checkpoint_dir, TEACHER_FILE))


def load_teacher(teacher: nn.Module, checkpoint_dir: str, device: str, kind: str) -> None:
    """Restore the teacher's weights from a checkpoint folder; warn when it has none."""
    path = os.path.join(checkpoint_dir, TEACHER_FILE)
    if os.path.isfile(path):
        load_model(teacher, path, device=device)
    else:
        warnings.warn(
            f"{path} not found: the {kind} teacher keeps its current weights "
            "(the checkpoint was not written by GEARTrainer)",
            stacklevel=3,
        )


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


def logit_scale(text_config: Any) -> float:
    """The factor a model applies to its logits (mirrors TRL's fused LM head)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text_config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(text_config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if text_config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def logit_softcap(text_config: Any) -> float | None:
    """The model's final-logit softcap c (Gemma 2/3: logits <- c * tanh(logits / c)), or None."""
    value = getattr(text_config, "final_logit_softcapping", None)
    return float(value) if value else None
