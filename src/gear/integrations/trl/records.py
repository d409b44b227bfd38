"""GEAR's logging in TRL: gear/* values into TRL's metrics, and the periodic credit record."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gear.credit import CreditDetails, TokenSignals
from gear.viz.record import credit_record_path, credit_rows, write_credit_record

if TYPE_CHECKING:
    from gear.integrations.trl.trainer import GEARTrainer

SUMMED_STATS = ("gear/teacher_prompts_truncated", "gear/rows_without_ground_truth")


def log_stats(trainer: GEARTrainer, mode: str, stats: dict[str, float]) -> None:
    """Append per-process gear/* values (timings, prompt counts) to TRL's metrics: the mean
    over processes, except counts, which are summed."""
    keys = sorted(stats)
    accelerator = trainer.accelerator
    local = torch.tensor([stats[k] for k in keys], dtype=torch.float32, device=accelerator.device)
    every = accelerator.gather(local).view(-1, len(keys))
    for key, column in zip(keys, every.unbind(1), strict=True):
        value = column.sum() if key in SUMMED_STATS else column.mean()
        trainer._metrics[mode][key].append(value.item())


def maybe_write_credit_record(
    trainer: GEARTrainer,
    output: dict[str, Any],
    details: CreditDetails,
    signals: TokenSignals | None,
    advantages: Tensor,
    prompts: list,
) -> None:
    """Write `output_dir/credit/step_XXXXXX.jsonl` (main process, its first rows) when due."""
    every, n_rows = trainer.args.credit_log_steps, trainer.args.credit_log_rows
    step = trainer.state.global_step
    if every == 0 or n_rows == 0 or step < trainer._gear_next_record_step:
        return
    trainer._gear_next_record_step = step + every
    if not trainer.accelerator.is_main_process:
        return
    tok = trainer._tokenizer
    ids = output["completion_ids"].cpu()
    real = output["completion_mask"].bool().cpu() | details.valid.cpu()
    rows = list(range(min(n_rows, ids.size(0))))
    tokens: list[list[str]] = [[] for _ in range(ids.size(0))]
    completions: list[str] = [""] * ids.size(0)
    for i in rows:
        nz = real[i].nonzero()
        row_ids = ids[i, : int(nz[-1]) + 1 if len(nz) else 0].tolist()
        tokens[i] = tok.batch_decode([[t] for t in row_ids])
        completions[i] = tok.decode(row_ids)
    records = credit_rows(
        details,
        tokens=tokens,
        rewards=local_rewards(trainer, ids.size(0)),
        advantages=advantages,
        prompts=prompts,
        completions=completions,
        step=step,
        method=trainer.credit_params.method,
        rows=rows,
        kl=None if signals is None else signals.kl,
        entropy=None if signals is None else signals.entropy,
        token_ids=ids,
        completion_mask=output["completion_mask"],
    )
    write_credit_record(credit_record_path(trainer.args.output_dir, step), records)


def local_rewards(trainer: GEARTrainer, n: int) -> Tensor:
    """(n,) weighted reward of this process's rows (NaN where no reward function applied)."""
    start = trainer.accelerator.process_index * n
    local = trainer._gear_rewards[start : start + n].float().cpu()
    total = (local * trainer.reward_weights.cpu()[None]).nansum(dim=1)
    return torch.where(torch.isnan(local).all(dim=1), torch.nan, total)
