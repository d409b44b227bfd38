"""GEAR's logging in TRL: gear/* values into TRL's metrics, and the periodic credit record."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gear.credit import CreditDetails, TokenSignals
from gear.viz.record import credit_record_path, credit_rows, write_credit_record

SUMMED_STATS = (
    "gear/teacher_prompts_truncated",
    "gear/rows_without_ground_truth",
    "gear/oar_span_fallback",
)


def log_stats(accelerator: Any, metrics: dict[str, list], stats: dict[str, float]) -> None:
    """Append per-process gear/* values (timings, prompt counts) to `metrics` (TRL's
    `_metrics[mode]`): the mean over processes, except counts, which are summed."""
    keys = sorted(stats)
    local = torch.tensor([stats[k] for k in keys], dtype=torch.float32, device=accelerator.device)
    every = accelerator.gather(local).view(-1, len(keys))
    for key, column in zip(keys, every.unbind(1), strict=True):
        value = column.sum() if key in SUMMED_STATS else column.mean()
        metrics[key].append(value.item())


def write_batch_record(
    output_dir: str,
    step: int,
    tokenizer: Any,
    output: dict[str, Any],
    details: CreditDetails,
    signals: TokenSignals | None,
    advantages: Tensor,
    rewards: Tensor,
    prompts: list,
    method: str,
    n_rows: int,
) -> None:
    """Write `output_dir/credit/step_XXXXXX.jsonl`: the first `n_rows` rows of this process's
    batch `output` ((B, T) `completion_ids` / `completion_mask`), their (B,) sequence
    `advantages` and (B,) `rewards` (`local_rewards`)."""
    ids = output["completion_ids"].cpu()
    real = output["completion_mask"].bool().cpu() | details.valid.cpu()
    rows = record_rows(details, advantages, n_rows)
    tokens: list[list[str]] = [[] for _ in range(ids.size(0))]
    completions: list[str] = [""] * ids.size(0)
    for i in rows:
        nz = real[i].nonzero()
        row_ids = ids[i, : int(nz[-1]) + 1 if len(nz) else 0].tolist()
        tokens[i] = tokenizer.batch_decode([[t] for t in row_ids])
        completions[i] = tokenizer.decode(row_ids)
    records = credit_rows(
        details,
        tokens=tokens,
        rewards=rewards,
        advantages=advantages,
        prompts=prompts,
        completions=completions,
        step=step,
        method=method,
        rows=rows,
        kl=None if signals is None else signals.kl,
        entropy=None if signals is None else signals.entropy,
        token_ids=ids,
        completion_mask=output["completion_mask"],
    )
    write_credit_record(credit_record_path(output_dir, step), records)


def record_rows(details: CreditDetails, advantages: Tensor, n: int) -> list[int]:
    """The `n` rows a credit record keeps, by a stated rule: rows where credit acts (a non-zero
    advantage, scored) before tied ones, and among each, those whose policy length is nearest
    the median of the acting rows first (a typical row, not the shortest); in row order."""
    valid = details.valid.cpu()
    lengths = valid.sum(dim=1).tolist()
    acts = (advantages.cpu() != 0).tolist()
    if details.skipped_rows is not None:
        acts = [a and not s for a, s in zip(acts, details.skipped_rows.cpu().tolist(), strict=True)]
    acting = sorted(length for length, a in zip(lengths, acts, strict=True) if a)
    median = acting[len(acting) // 2] if acting else 0
    order = sorted(range(len(lengths)), key=lambda i: (not acts[i], abs(lengths[i] - median), i))
    return sorted(order[:n])


def local_rewards(rewards: Tensor, weights: Tensor, process_index: int, n: int) -> Tensor:
    """(n,) weighted reward of this process's rows (NaN where no reward function applied), from
    the gathered (all rows, reward funcs) `rewards` and the (reward funcs,) `weights`."""
    start = process_index * n
    local = rewards[start : start + n].float().cpu()
    total = (local * weights.cpu()[None]).nansum(dim=1)
    return torch.where(torch.isnan(local).all(dim=1), torch.nan, total)
