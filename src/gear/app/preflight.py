"""What a run checks before its model loads: one function, `preflight`, for `gear train`,
`gear train --dry-run` and `gear compare` alike, so the three cannot disagree.

It builds everything the run will use that needs no model, and so checks it: the task and its
data (every row of the data file the run reads, the file and line of a bad one named), what the
credit method needs of the task, the precision on this machine, the trainer's arguments, the
LoRA config, and the run directory (a new run's must not hold a run; a resumed run's newest
checkpoint must be complete and its summary.json readable). It writes nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gear.app.config import RunConfig


@dataclasses.dataclass
class Preflight:
    """A run checked and ready for its model: what `gear train` builds before loading it."""

    task: Any  # gear.tasks.Task
    precision: Any  # gear.app.precision.Precision
    args: Any  # the GEARConfig (`gear.app.config.trainer_args`)
    peft_config: Any  # the LoraConfig (`lora_config`), None for full fine-tuning
    run_dir: Path
    train_dataset: Any  # the rows the run trains on
    checkpoint: Path | None  # the checkpoint a resumed run continues from
    summary: dict[str, Any]  # summary.json as far as it exists ({} for a new run)


def preflight(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False) -> Preflight:
    """Everything a run of `cfg` in `run_dir` (default: `cfg.output_dir`, else
    `default_run_dir`) checks before its model loads; `resume`: the run continues the one in
    `run_dir`. A ValueError (an `InputError` for a file), or NotImplementedError, names what is
    wrong; nothing is written."""
    from gear.app.config import (
        check_resume_steps,
        check_task_method,
        default_run_dir,
        run_precision,
        trainer_args,
    )
    from gear.app.rundir import is_run_dir, read_summary, resume_checkpoint
    from gear.tasks import get_task

    run_dir = Path(run_dir or cfg.output_dir or default_run_dir(cfg))
    if resume and not run_dir.is_dir():
        raise ValueError(f"--resume: run directory {run_dir} does not exist")
    if not resume and is_run_dir(run_dir):
        raise ValueError(
            f"{run_dir} already holds a run; continue it with `gear train --resume {run_dir}`, "
            f"or give a new run another --output-dir"
        )
    task = get_task(cfg.task, **cfg.task_options)
    # the data the run reads, every row checked (a malformed file is refused here, not after
    # minutes of model loading); the held-out rows too, which the run scores before training
    train_dataset = task.dataset("train", n=cfg.train_size, seed=cfg.seed)
    if cfg.eval_n:
        task.dataset("test", n=cfg.eval_n, seed=cfg.eval_seed)
    check_task_method(cfg, task)
    precision = run_precision(cfg)
    args = trainer_args(cfg, run_dir, hint_kind=task.hint_kind, precision=precision)
    peft_config = lora_config(cfg)
    checkpoint = resume_checkpoint(run_dir) if resume else None  # checked: never a damaged one
    if resume:
        check_resume_steps(args.max_steps, run_dir)
    summary = read_summary(run_dir)  # a new study run's holds its shared eval_before
    return Preflight(
        task, precision, args, peft_config, run_dir, train_dataset, checkpoint, summary
    )


def lora_config(cfg: RunConfig) -> Any:
    """The PEFT `LoraConfig` of a run (`lora_r` > 0): every linear layer but the LM head, scale
    `lora_alpha` (2 x rank by default); None for full fine-tuning."""
    if not cfg.lora_r:
        return None
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise ValueError(
            f"lora_r={cfg.lora_r} needs PEFT (`pip install peft`); or set lora_r=0 for full "
            f"fine-tuning ({e})"
        ) from None
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha or 2 * cfg.lora_r,
        lora_dropout=cfg.lora_dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )
