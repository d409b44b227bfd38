"""`loss_mode="self_distill"` (OPSD, arXiv 2601.18734): the per-token reverse KL(student ||
detached teacher) over the full vocabulary replaces the policy-gradient loss; no reward.

The teacher pass runs inside the loss, under no_grad and in eval mode, on the current
micro-batch, so the "current" teacher is exactly the weights being trained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gear.credit.signals import reverse_kl_from_hidden
from gear.integrations.trl.states import eval_mode

if TYPE_CHECKING:
    from gear.integrations.trl.trainer import GEARTrainer


def no_reward(completions: list, **kwargs: Any) -> list[float]:
    """Reward 0 for every completion: the reward source of `loss_mode="self_distill"` runs."""
    return [0.0] * len(completions)


def self_distill_loss(trainer: GEARTrainer, model: nn.Module, inputs: dict[str, Any]) -> Tensor:
    """OPSD: sum over valid tokens of KL(pi_S || sg(pi_T)), full vocabulary, divided by the
    generation batch's valid-token count per accumulation window (TRL's 'dapo' normaliser),
    so the gradient is that of the token-mean KL whatever the accumulation. Rows without a
    ground truth have no teacher to follow and no loss."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mask = mask * inputs["gear_has_hint"][:, None]
    n_keep = completion_ids.size(1)
    teacher_model = trainer._teacher()
    with torch.no_grad(), eval_mode(trainer.accelerator.unwrap_model(teacher_model)):
        teacher_hidden = trainer._final_hidden(
            teacher_model,
            inputs["gear_teacher_input_ids"],
            inputs["gear_teacher_attention_mask"],
            n_keep,
        )
    student_hidden = trainer._final_hidden(
        model,
        torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
        torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
        n_keep,
        grad=True,
    )
    valid = mask.bool()
    with trainer._heads() as (ws, bs, wt, bt):
        kl_valid, entropy_valid = reverse_kl_from_hidden(
            student_hidden[valid].to(ws.dtype),
            teacher_hidden[valid].to(wt.dtype),
            ws,
            lm_head_bias=bs,
            teacher_lm_head_weight=wt,
            teacher_lm_head_bias=bt,
            temperature=trainer._signal_temperature,
            chunk_size=trainer.args.signal_chunk_size,
            softcap=trainer._logit_softcap,
        )
    mode = "train" if trainer.model.training else "eval"
    accelerator = trainer.accelerator
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / accelerator.num_processes
    if mode == "train":
        normalizer = (
            normalizer
            * trainer.current_gradient_accumulation_steps
            / trainer.args.steps_per_generation
        )
    # `0 * student_hidden.sum()` keeps the graph connected when no token of the micro-batch is valid
    loss = kl_valid.sum() / normalizer + 0.0 * student_hidden.sum()
    totals = accelerator.reduce(
        torch.stack([kl_valid.detach().sum(), entropy_valid.sum(), valid.sum().float()]),
        reduction="sum",
    )
    count = totals[2].clamp(min=1.0)
    trainer._metrics[mode]["gear/kl_mean"].append((totals[0] / count).item())
    trainer._metrics[mode]["gear/entropy_mean"].append((totals[1] / count).item())
    return loss
