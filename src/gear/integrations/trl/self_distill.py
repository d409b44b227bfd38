"""`loss_mode="self_distill"` (OPSD, arXiv 2601.18734): the per-token reverse KL(student ||
detached teacher) over the full vocabulary replaces the policy-gradient loss; no reward.

The teacher pass runs inside the loss, under no_grad and in eval mode, on the current
micro-batch, so the "current" teacher is exactly the weights being trained.
"""

from __future__ import annotations

from math import nan
from typing import Any

import torch
from torch import Tensor, nn

from gear.credit.signals import reverse_kl_from_hidden
from gear.integrations.trl.forwards import Forwards, eval_mode


def no_reward(completions: list, **kwargs: Any) -> list[float]:
    """Reward 0 for every completion: the reward source of `loss_mode="self_distill"` runs."""
    return [0.0] * len(completions)


def self_distill_loss(
    forwards: Forwards,
    model: nn.Module,
    teacher_model: nn.Module,
    inputs: dict[str, Any],
    accumulation: float,
    separate_teacher: bool,
) -> tuple[Tensor, dict[str, float]]:
    """OPSD: sum over valid tokens of KL(pi_S || sg(pi_T)), full vocabulary, divided by the
    generation batch's valid-token count per accumulation window (TRL's 'dapo' normaliser:
    `num_items_in_batch` / processes * `accumulation`, the current accumulation steps over
    `steps_per_generation` in training, 1 in evaluation), so the gradient is that of the
    token-mean KL whatever the accumulation. Rows without a ground truth have no teacher to
    follow and no loss.

    Args:
        model: the policy as TRL passes it to the loss. teacher_model: the model the teacher
            pass runs (the policy itself for the current teacher); `separate_teacher`: whether
            it is a separate model with its own LM head (frozen / EMA).
        inputs: TRL's micro-batch: (B, P) `prompt_ids` / `prompt_mask`, (B, T)
            `completion_ids` / `completion_mask` (and `tool_mask`), and GEAR's (B, P_T + T)
            `gear_teacher_input_ids` / `gear_teacher_attention_mask`, (B,) `gear_has_hint`.
    Returns:
        the loss, and `gear/kl_mean`, `gear/entropy_mean` over the valid tokens of all processes
        (NaN when there is none).
    """
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    mask = mask * inputs["gear_has_hint"][:, None]
    n_keep = completion_ids.size(1)
    accelerator = forwards.accelerator
    with torch.no_grad(), eval_mode(accelerator.unwrap_model(teacher_model)):
        teacher_hidden = forwards.hidden(
            teacher_model,
            inputs["gear_teacher_input_ids"],
            inputs["gear_teacher_attention_mask"],
            n_keep,
        )
    student_hidden = forwards.hidden(
        model,
        torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
        torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
        n_keep,
        grad=True,
    )
    valid = mask.bool()
    with forwards.heads(model, teacher_model if separate_teacher else None) as (ws, bs, wt, bt):
        kl_valid, entropy_valid = reverse_kl_from_hidden(
            student_hidden[valid].to(ws.dtype),
            teacher_hidden[valid].to(wt.dtype),
            ws,
            lm_head_bias=bs,
            teacher_lm_head_weight=wt,
            teacher_lm_head_bias=bt,
            chunk_size=forwards.chunk_size,
            **forwards.kernel_kwargs(),
        )
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / accelerator.num_processes
    normalizer = normalizer * accumulation
    # `0 * student_hidden.sum()` keeps the graph connected when no token of the micro-batch is valid
    loss = kl_valid.sum() / normalizer + 0.0 * student_hidden.sum()
    totals = accelerator.reduce(
        torch.stack([kl_valid.detach().sum(), entropy_valid.sum(), valid.sum().float()]),
        reduction="sum",
    )
    # no valid token anywhere (no row with a hint): nothing measured, NaN (TRL logs None), not 0
    kl_mean, entropy_mean = (totals[:2] / totals[2]).tolist() if totals[2] > 0 else (nan, nan)
    return loss, {"gear/kl_mean": kl_mean, "gear/entropy_mean": entropy_mean}
