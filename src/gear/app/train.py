"""The training recipe behind `gear train`: config -> model, task, GEARTrainer -> a run directory.

A run directory holds everything about one run (`gear.app.rundir` owns its layout and its
files)::

    RUN_DIR/config.yaml        the resolved configuration (what was actually run; `bf16` as
                               asked, e.g. `auto`), with the precision chosen on this machine
                               under `precision:`
    RUN_DIR/metrics.jsonl      one JSON object per logging step (TRL's logs + eval/accuracy);
                               each step once, also across stops and resumes
    RUN_DIR/checkpoint-*/      TRL checkpoints (resume with `gear train --resume RUN_DIR`); each
                               appears complete or not at all (written aside, then renamed)
    RUN_DIR/credit/            per-token credit records (gear.viz.record)
    RUN_DIR/plots/*.png        reward, accuracy, entropy, gear/* statistics, a trajectory
    RUN_DIR/summary.json|.md   held-out accuracy before and after training, wall time

This module builds the trainer and trains. The run config (`RunConfig`, the recipes, the check
of every value, what a resumed run may change, `trainer_args`) is read in `gear.app.config`;
evaluation and its cache live in `gear.app.evaluate`; stops and checkpoints in
`gear.app.callbacks`.

A trainer is made by `trainer_args` (the GEARConfig), `load_model_and_data` and
`build_trainer`; studies/lm_recipe.py and benchmarks/step.py make theirs with the same
three, so a run there trains exactly as `gear train` would with that config.

Stops: SIGTERM (what `timeout` and schedulers send) and SIGINT (Ctrl-C) during training finish
the current step (or end a periodic evaluation), save a checkpoint and end the run with
`RunStopped` (`gear.app.callbacks.stop_signals`); a second signal stops at once. `gear train
--resume RUN_DIR` continues from the last complete checkpoint (a damaged newest one is refused,
naming the damaged file and the previous complete checkpoint: `gear.app.rundir.resume_checkpoint`)
with exactly the saved config.yaml (`gear.app.config.resume_config`: only the `RESUME_MAY_CHANGE`
keys may differ, any other option is an error), forgets what was logged after that checkpoint,
and trains no step past `max_steps` (a run stopped in its final evaluation only evaluates and
saves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gear._moved import moved

if TYPE_CHECKING:
    from gear.app.config import RunConfig

# Names that moved out of this module (issue 50; it was gear.run until issue 68): `from
# gear.app.train import NAME` still gives them, with a DeprecationWarning naming the new import.
_CONFIG = """CONFIG_DIR PRECISION_KEY RunConfig _field recipe_names config_path parse_value
_Mismatch _type_name _coerce check_value _field_types trainer_field_types _key_specs check_key
load_mapping resolve_config load_recipe resolve_values RESTORE_CONFIG read_run_config
RESUME_MAY_CHANGE _effective resume_config check_resume_steps default_run_dir _on_cpu
run_precision TRAINER_BASE checkpointing_field trainer_args"""
_EVALUATE = "eval_cache_key _eval_cache_file _cached_scores cached_eval_before store_eval_before"
_STOPS = "RunStopped STOP_SIGNALS stop_signals"
__getattr__ = moved(
    __name__,
    dict.fromkeys(_CONFIG.split(), "gear.app.config")
    | dict.fromkeys(_EVALUATE.split(), "gear.app.evaluate")
    | dict.fromkeys(_STOPS.split(), "gear.app.callbacks")
    | dict.fromkeys(("lora_config",), "gear.app.preflight")
    | dict.fromkeys(("SUMMARY_TODO", "write_summary", "learning_lines"), "gear.app.rundir"),
)


# ------------------------------------------------------------------------------ the run


def load_model_and_data(cfg: RunConfig, task: Any) -> tuple[Any, Any, Any]:
    """A run's model and tokenizer (`load_model`) and its training set (`cfg.train_size` rows
    in the order of `cfg.seed`)."""
    model, tokenizer = load_model(cfg, task)
    return model, tokenizer, task.dataset("train", n=cfg.train_size, seed=cfg.seed)


def load_model(cfg: RunConfig, task: Any) -> tuple[Any, Any]:
    """A run's model (loaded after seeding torch with `cfg.seed`) and its tokenizer as `task`
    needs it."""
    import torch

    from gear.models import load_model_and_tokenizer

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    return model, task.prepare_tokenizer(tokenizer)


def build_trainer(
    args: Any,
    model: Any,
    tokenizer: Any,
    task: Any,
    train_dataset: Any,
    callbacks: list[Any],
    peft_config: Any = None,
) -> Any:
    """The GEARTrainer of a run (`args`: its `trainer_args`; `peft_config`: its `lora_config`)
    on `task`'s reward, with checkpoints that appear complete or not at all. `gear train`, the
    studies and the step benchmark build theirs here."""
    from gear.app.callbacks import atomic_checkpoints
    from gear.integrations.trl import GEARTrainer

    trainer = GEARTrainer(
        model=model,
        reward_funcs=[task.reward],
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
        # the contrast teacher is shown a wrong answer: the task says which (Task.wrong_answer)
        **({"wrong_answer": task.wrong_answer} if args.teacher_context == "contrast" else {}),
        # OAR-G's answer span: the task's parser finds the answer, or its reference is appended
        answer_span=task.answer_span,
        reference_text=task.reference_text,
        # where the task's step checker places a failed row's first error: first_error's blame,
        # and for every method the gear/branch_* diagnostics (None: the task has no checker)
        step_checker=task.step_checker(),
        **task.trainer_kwargs(),
    )
    atomic_checkpoints(trainer)
    return trainer


def train(
    cfg: RunConfig, run_dir: Path | None = None, resume: bool = False, console: Any = None
) -> Path:
    """Run one training job end to end; returns the run directory.

    Raises `RunStopped` when SIGTERM / SIGINT ended it (after saving a checkpoint when the
    signal came during training).
    """
    from gear.app.callbacks import stop_signals
    from gear.app.config import default_run_dir

    run_dir = Path(run_dir or cfg.output_dir or default_run_dir(cfg))
    with stop_signals(run_dir) as stop, cpu_threads(cfg, console):
        return _train(cfg, run_dir, resume, console, stop)


@contextlib.contextmanager
def cpu_threads(cfg: RunConfig, console: Any = None) -> Iterator[None]:
    """On a CPU run, the threads the cores free now allow (`gear.app.threads`), said in the log and
    restored afterwards; on a GPU run nothing changes."""
    import torch

    from gear.app.config import _on_cpu
    from gear.app.threads import apply, choose_threads

    if not _on_cpu(cfg):
        yield
        return
    before = torch.get_num_threads()
    threads = choose_threads()
    _say(console, f"threads: {threads.reason}")
    apply(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _say(console: Any, message: str) -> None:
    if console is not None:
        console.print(message, highlight=False, soft_wrap=True)


def _train(cfg: RunConfig, run_dir: Path, resume: bool, console: Any, stop: Any) -> Path:
    import torch
    from transformers.trainer_callback import PrinterCallback

    from gear.app.callbacks import MetricsFile, ProgressCallback, RunStopped, save_model_atomically
    from gear.app.config import PRECISION_KEY
    from gear.app.evaluate import EvalCallback, cached_eval_before, evaluate_now, store_eval_before
    from gear.app.preflight import preflight
    from gear.app.rundir import (
        FINAL_DIR,
        METRICS_FILE,
        checkpoint_step,
        target_steps,
        truncate_run_logs,
        write_config,
        write_summary,
    )
    from gear.models import model_identity

    # everything that can be wrong is found before anything is written or any model loads
    pre = preflight(cfg, run_dir, resume=resume)
    task, precision, args, checkpoint, summary = (
        pre.task, pre.precision, pre.args, pre.checkpoint, pre.summary
    )  # fmt: skip
    start_step = checkpoint_step(checkpoint)
    _say(console, f"precision: {precision.name} ({precision.reason}; {precision.capability})")
    model, tokenizer = load_model(cfg, task)
    run_dir.mkdir(parents=True, exist_ok=True)
    # the config as asked for (bf16: auto stays auto, resolved again on resume); the choice made
    # on this machine is recorded beside it
    resolved = dataclasses.asdict(cfg) | {"output_dir": cfg.output_dir or str(run_dir)}
    resolved[PRECISION_KEY] = precision.as_dict()
    write_config(run_dir, resolved)
    # steps after the checkpoint are trained again: their records go, so each step is logged once
    truncate_run_logs(run_dir, start_step)

    summary.update(
        task=cfg.task,
        model=cfg.model,
        # the weights the run started from (a local checkpoint's content hash): runs of a study
        # that start from one checkpoint show it
        model_identity=model_identity(cfg.model),
        method=args.credit_method,
        loss_mode=args.loss_mode,
        steps=args.max_steps,
        seed=cfg.seed,
        precision=f"{precision.name} ({precision.capability})",
        threads=torch.get_num_threads(),
    )
    if cfg.eval_n and "eval_before" not in summary:
        summary["eval_before"] = cached_eval_before(cfg, console)
        if summary["eval_before"] is None:  # computed here: kept for later runs
            summary["eval_before"] = evaluate_now(
                model, tokenizer, task, cfg, console, "before training"
            )
            store_eval_before(cfg, summary["eval_before"])
        write_summary(run_dir, summary)

    callbacks = [MetricsFile(run_dir / METRICS_FILE), ProgressCallback(console)]
    if cfg.eval_every and cfg.eval_n:
        callbacks.append(EvalCallback(task, cfg, tokenizer, console, stop))
    callbacks.append(stop)  # last: it sees a signal that came during a periodic evaluation
    trainer = build_trainer(
        args, model, tokenizer, task, pre.train_dataset, callbacks, pre.peft_config
    )
    if console is not None:  # the progress display and metrics.jsonl replace TRL's printed dicts
        trainer.remove_callback(PrinterCallback)
    trained = checkpoint is not None and start_step >= target_steps(args, checkpoint)
    if trained:
        # stopped after the last step (in the final evaluation or the final save): HF's Trainer
        # would train one more step, so only the weights are loaded, for what is left to do
        _say(console, f"training already done: {checkpoint.name}")
        trainer._load_from_checkpoint(str(checkpoint))
        trainer.state.global_step = start_step
    else:
        if checkpoint is not None:
            _say(console, f"resuming from {checkpoint}")
        t0 = time.time()
        stop.training = True
        try:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        finally:
            stop.training = False
            summary["train_seconds"] = summary.get("train_seconds", 0.0) + time.time() - t0
            write_summary(run_dir, summary)
        if stop.signum is not None:
            saved = run_dir / f"checkpoint-{trainer.state.global_step}"
            raise RunStopped(stop.signum, run_dir, saved if saved.is_dir() else None)
    step = trainer.state.global_step
    after = summary.get("eval_after")
    if cfg.eval_n and not (trained and after and after.get("step") == step):
        summary["eval_after"] = evaluate_now(
            trainer.model, tokenizer, task, cfg, console, "after training"
        ) | {"step": step}
    write_summary(run_dir, summary)
    save_model_atomically(trainer, run_dir / FINAL_DIR)
    render_outputs(run_dir)
    return run_dir


def render_outputs(run_dir: Path) -> list[Path]:
    """Plots of metrics.jsonl, and the trajectory of one credit record (picked by
    `gear.viz.record.trajectory_row`: a row where credit acts), under RUN_DIR/plots."""
    from gear.app.rundir import METRICS_FILE
    from gear.viz.plots import plot_metrics, plot_trajectory
    from gear.viz.record import read_credit_records, trajectory_row

    out = run_dir / "plots"
    paths = plot_metrics(run_dir / METRICS_FILE, out) if (run_dir / METRICS_FILE).is_file() else []
    records = read_credit_records(run_dir) if (run_dir / "credit").is_dir() else []
    if records:
        record, why = trajectory_row(records)
        paths.append(plot_trajectory(record, out / "trajectory.png", why))
        print(f"gear: trajectory.png shows step {record['step']}, row {record['row']}: {why}")
    return paths
