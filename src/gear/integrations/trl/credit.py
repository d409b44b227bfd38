"""GEAR's credit of a TRL batch: `gear.credit.credit_details` on the whole generation batch.

With several processes each one's rows are gathered (padded to the longest completion), so the
statistics are exact batch values and batch-level methods (`entropy_top`) see the whole batch,
as in one process; each process keeps its own rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gear.credit import CreditDetails, CreditParams, TokenSignals, credit_details
from gear.credit.implicit import implicit_credit_stats, prefix_counts
from gear.credit.registry import CONTRAST_KL, PASS_SIGNALS, TEACHER_SIGNALS
from gear.credit.signals import without_teacher

#: the signals of a `TokenSignals` (`gear.credit.registry.PASS_SIGNALS`)
SIGNAL_NAMES = PASS_SIGNALS


@dataclass
class ContrastSignals(TokenSignals):
    """`TokenSignals` plus `contrast_kl`, the (N, T) KL to the contrast teacher (a wrong answer;
    `teacher_context='contrast'`), which `batch_credit` hands to the credit core."""

    contrast_kl: Tensor | None = None


def batch_credit(
    accelerator: Any,
    advantages: Tensor,
    valid: Tensor,
    turn_starts: Tensor | None,
    signals: TokenSignals | None,
    params: CreditParams,
    influence: Tensor | None = None,
    answer_mask: Tensor | None = None,
    scored: Tensor | None = None,
    error_mask: Tensor | None = None,
    perturbation: Tensor | None = None,
    completion_ids: Tensor | None = None,
    completion_mask: Tensor | None = None,
    group_size: int | None = None,
) -> CreditDetails:
    """`credit_details` of this process's rows, computed on the generation batch of all processes.

    Args:
        advantages: (B,) this process's sequence advantages.
        valid: (B, T) bool policy tokens; turn_starts: (B, T) bool or None.
        signals: this process's (B, T) signals, or None when the method needs none; a
            `ContrastSignals` also gives the contrast teacher's KL (`params.contrast`).
        influence: (B, T) this process's OAR-G influence (`oar_g`), or None.
        answer_mask: (B, T) bool, the answer's tokens in this process's completions (OAR's
            span, `gear.spans`), or None.
        scored: (B,) bool, this process's rows whose signals were computed (the others have
            advantage 0: `scored_rows`), or None for all.
        error_mask: (B, T) bool, each row's first wrong step as a step checker places it
            (`first_error`), or None.
        perturbation: (B, T) this process's OAR-P influence (`oar_p`), or None.
        completion_ids, completion_mask: (B, T) this process's completions, and `group_size`
            the rows per prompt (TRL's `num_generations`: the gathered batch holds each group's
            rows contiguously), or None: no group prefix tree. With them, `lambda_grpo` gets
            its `prefix_count` and the stats gain `gear.credit.implicit.implicit_credit_stats`
            (the credit GRPO gives through shared prefixes, beside the method's).
    """
    inputs: dict[str, Tensor | None] = {
        "valid": valid,
        "turn_starts": turn_starts,
        **{k: None if signals is None else getattr(signals, k) for k in SIGNAL_NAMES},
        CONTRAST_KL: getattr(signals, CONTRAST_KL, None),
        "influence": influence,
        "perturbation": perturbation,
        "answer_mask": answer_mask,
        "error_mask": error_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    world = accelerator.num_processes
    B, T = valid.shape
    if world > 1:  # pad every process's (B, T_p) to the longest T, gather the rows
        advantages = accelerator.gather(advantages)
        scored = None if scored is None else accelerator.gather(scored.long()).bool()
        inputs = {
            k: None
            if v is None
            else accelerator.gather(accelerator.pad_across_processes(v.float(), dim=1, pad_index=0))
            for k, v in inputs.items()
        }
        for k in ("valid", "turn_starts", "answer_mask", "error_mask", "completion_mask"):
            inputs[k] = None if inputs[k] is None else inputs[k].bool()
        if inputs["completion_ids"] is not None:
            inputs["completion_ids"] = inputs["completion_ids"].long()
    ids, ids_mask = inputs.pop("completion_ids"), inputs.pop("completion_mask")
    tree = ids is not None and ids_mask is not None and group_size is not None
    groups = None
    if tree:  # the gathered batch: each prompt's group_size rows in a row
        groups = torch.arange(ids.shape[0], device=ids.device) // group_size
    lambda_grpo = "prefix_count" in params.required_signals
    counts = prefix_counts(ids, ids_mask, groups) if tree and lambda_grpo else None
    valid_all = inputs.pop("valid")
    details = credit_details(
        advantages,
        valid_all,
        **inputs,
        prefix_count=counts,
        params=params,
        scored=scored,
    )
    if tree:
        details.stats |= implicit_credit_stats(
            ids,
            ids_mask,
            valid_all,
            groups,
            advantages,
            details.token_advantages,
            inputs["error_mask"],
        )
    if world == 1:
        return details
    rows = slice(accelerator.process_index * B, (accelerator.process_index + 1) * B)
    local = {
        f.name: None
        if getattr(details, f.name) is None
        else getattr(details, f.name)[rows]
        if f.name in ("fallback_rows", "skipped_rows")
        else getattr(details, f.name)[rows, :T]
        for f in dataclasses.fields(details)
        if f.name != "stats"
    }
    return CreditDetails(**local, stats=details.stats)


def scored_rows(
    advantages: Tensor, params: CreditParams, skip: bool, accelerator: Any = None
) -> Tensor | None:
    """(B,) bool: the rows whose signals the credit method reads, so the teacher, contrast,
    influence and signal passes need to run on them only: those with a non-zero sequence
    advantage when the method reads advantaged rows only (`CreditParams.signal_rows`); the
    others' token advantages are 0 under any weights. None: every row (`skip` off, or a method
    that reads all rows).

    With several processes every one scores as many rows as the busiest (tied rows fill up the
    difference, in order): a forward is collective under DDP's buffer sync, ZeRO-3 and FSDP,
    so every process must run the same number of them."""
    if not skip or params.signal_rows != "advantaged":
        return None
    scored = advantages != 0
    if accelerator is None or accelerator.num_processes == 1:
        return scored
    count = scored.sum().reshape(1)
    most = int(accelerator.gather(count).max())
    missing = most - int(count)
    if missing > 0:  # fill up with tied rows: their signals are computed and then unused
        filler = (~scored).nonzero().squeeze(1)[:missing]
        scored = scored.clone()
        scored[filler] = True
    return scored


def without_unhinted_rows(signals: TokenSignals, has_hint: Tensor) -> TokenSignals:
    """The signals for credit: rows without a hint (no ground truth) have no teacher, so their
    teacher-dependent signals become NaN (`gear.credit.signals.without_teacher`): weight 1
    (GRPO), counted in gear/fallback_rows."""
    teacher = {k: getattr(signals, k) for k in TEACHER_SIGNALS}
    return dataclasses.replace(signals, **without_teacher(teacher, has_hint))
