"""What happens around training in `gear train`: the metrics file, progress with ETA, clean
stops on SIGTERM / SIGINT (`stop_signals` installs the handler, `SignalStop` ends training after
the step, `RunStopped` ends the run) and checkpoints that appear complete or not at all.
Evaluation during a run (`EvalCallback`) lives with the rest of evaluation, in
`gear.app.evaluate`."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gear._moved import moved
from gear.app.rundir import STAGING, append_metrics

# Evaluation during a run moved to gear.app.evaluate (issue 50): `from gear.app.callbacks
# import NAME` (gear.run_callbacks before issue 68) still gives it, with a DeprecationWarning.
_EVALUATE = "plain_forward evaluate_now _scores _evaluate_with_progress EvalCallback"
# The run directory's files moved to gear.app.rundir (issue 68), which owns its layout.
_RUNDIR = """_clean _record_step METRICS_TODO read_metrics truncate_run_logs last_checkpoint
checkpoint_step target_steps"""
__getattr__ = moved(
    __name__,
    dict.fromkeys(_EVALUATE.split(), "gear.app.evaluate")
    | dict.fromkeys(_RUNDIR.split(), "gear.app.rundir"),
)


class MetricsFile(TrainerCallback):
    """Appends every log (and evaluations) to RUN_DIR/metrics.jsonl as {"step": s, ...}."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, step: int, values: dict[str, Any]) -> None:
        append_metrics(self.path, step, values)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any
    ) -> None:
        if logs and state.is_world_process_zero:
            self.write(state.global_step, logs)


class ProgressCallback(TrainerCallback):
    """Training progress: a rich bar with ETA and the latest reward on a terminal; one plain line
    per step otherwise (nohup, CI, a log file), so a log shows where a run is. Silent without a
    console."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.progress: Any = None
        self.task: Any = None
        self.lines = False  # one line per step instead of a bar
        self.last_time = 0.0
        self.last_step = 0
        self.step_times: list[float] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.console is None or not state.is_world_process_zero:
            return
        self.last_time, self.last_step = time.monotonic(), state.global_step
        if not self.console.is_terminal:
            self.lines = True
            self.console.print(
                f"training: steps {state.global_step + 1}..{state.max_steps}",
                highlight=False,
                soft_wrap=True,
            )
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=state.max_steps, completed=state.global_step, info=""
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any
    ) -> None:
        if not logs:
            return
        if self.progress is not None:
            parts = [f"reward {logs['reward']:.3f}"] if _number(logs.get("reward")) else []
            if (kl := kl_text(logs)) != "kl_mean -":  # the bar leaves out what was not logged
                parts.append(kl)
            self.progress.update(self.task, info="  ".join(parts))
        elif self.lines and "reward" in logs and state.global_step > self.last_step:
            self.console.print(step_line(self, state, logs), highlight=False, soft_wrap=True)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def kl_text(logs: dict[str, Any]) -> str:
    """`kl_mean 0.171`; `all rows tied` when every group's rewards tied (TRL's
    `frac_reward_zero_std` is 1: every advantage is 0, so no KL was measured, or, with
    `skip_zero_advantage_rows` off, one that moves nothing); `kl_mean -` when none was logged."""
    if logs.get("frac_reward_zero_std") == 1:
        return "all rows tied"
    value = logs.get("gear/kl_mean")
    return f"kl_mean {value:.3f}" if _number(value) else "kl_mean -"


def step_line(progress: ProgressCallback, state: Any, logs: dict[str, Any]) -> str:
    """`step 3/28  reward 0.250  kl_mean 0.171  median 31.2 s/step  last 30.8 s  eta 13m 01s`:
    the ETA runs on the median step time; the last step's time stands beside it, so a slow
    step shows at once (a line covering k > 1 steps, `logging_steps`, says `last k steps`)."""
    now = time.monotonic()
    steps = state.global_step - progress.last_step
    last = (now - progress.last_time) / steps
    progress.step_times += [last] * steps
    progress.last_time, progress.last_step = now, state.global_step
    per_step = statistics.median(progress.step_times)
    eta = int(per_step * max(state.max_steps - state.global_step, 0))
    reward = logs.get("reward")
    parts = [
        f"step {state.global_step}/{state.max_steps}",
        f"reward {reward:.3f}" if _number(reward) else "reward -",
        kl_text(logs),
        f"median {per_step:.1f} s/step",
        f"last {last:.1f} s" if steps == 1 else f"last {steps} steps {last:.1f} s/step",
        f"eta {eta // 60}m {eta % 60:02d}s",
    ]
    return "  ".join(parts)


# ------------------------------------------------------------------------------ stops


class EvalInterrupted(BaseException):
    """A stop signal came during a periodic evaluation (raised by `stop_signals`' handler;
    a BaseException, like KeyboardInterrupt, so no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalStop(TrainerCallback):
    """Ends training cleanly after a stop signal: at the end of the current step the trainer
    saves a checkpoint and stops (`stop_signals` installs the handler that calls `request`).
    Register it after `gear.app.evaluate.EvalCallback`, so a signal during a periodic evaluation
    saves the step that evaluation follows; a signal during a checkpoint save stops right after
    it. Under torch.distributed every rank stops at the same step (the flag is reduced with
    max), so no rank waits in a collective for one that left."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.training = False  # set by the recipe around trainer.train()
        self.evaluating = False  # set by EvalCallback around a periodic evaluation

    def request(self, signum: int) -> None:
        self.signum = signum

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """While a periodic evaluation runs, a stop signal ends it (`EvalInterrupted`)."""
        self.evaluating = True
        try:
            yield
        finally:
            self.evaluating = False

    def _any_rank_stopping(self) -> bool:
        import torch
        import torch.distributed as dist

        mine = self.signum or 0
        if not (dist.is_available() and dist.is_initialized()):
            return bool(mine)
        flag = torch.tensor([mine], dtype=torch.long)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())
        return bool(flag.item())

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._any_rank_stopping():
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._any_rank_stopping():  # a signal during this save: this checkpoint is the last
            control.should_training_stop = True


class RunStopped(Exception):
    """A run ended by SIGTERM / SIGINT. `checkpoint`: the checkpoint saved on the way out (None
    when the signal came before training or a second signal cut the save short)."""

    def __init__(self, signum: int, run_dir: Path, checkpoint: Path | None = None) -> None:
        self.signum, self.run_dir, self.checkpoint = signum, run_dir, checkpoint
        name = signal.Signals(signum).name
        if checkpoint is not None:
            what = f"checkpoint saved: {checkpoint}"
        else:
            what = "no new checkpoint saved"
        super().__init__(
            f"stopped by {name}; {what}; continue with `gear train --resume {run_dir}`"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by signal N"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals(run_dir: Path) -> Iterator[Any]:
    """SIGTERM / SIGINT handling for the duration of a run (main thread only).

    Yields a `SignalStop`: while its `training` flag is set, the first signal
    only asks the trainer to save and stop after the current step (during a periodic evaluation
    it also ends that evaluation, `EvalInterrupted`, so the step it follows is saved at once);
    otherwise (loading, the evaluations before and after training), and for a second signal,
    `RunStopped` is raised at once.
    """
    stop = SignalStop()

    def handler(signum: int, frame: Any) -> None:
        if stop.training and stop.signum is None:
            stop.request(signum)
            name = signal.Signals(signum).name
            if stop.evaluating:  # a periodic evaluation: drop it, save the step it follows
                print(
                    f"gear: {name}: stopping the evaluation, then saving a checkpoint of this "
                    f"step (send it again to stop at once)",
                    flush=True,
                )
                raise EvalInterrupted(signum)
            print(
                f"gear: {name}: finishing this step, then saving a checkpoint (send it again "
                f"to stop at once)",
                flush=True,
            )
            return
        raise RunStopped(signum, run_dir)

    import threading

    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# ------------------------------------------------------------------------------ checkpoints


def _publish(staged: Path, target: Path) -> None:
    """Rename a complete directory into place (atomic on one filesystem). A target that already
    exists (the same step saved again) is moved aside first and removed after."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(staged, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_checkpoints(trainer: Any) -> Any:
    """Make `trainer`'s checkpoints appear complete or not at all.

    HF's `Trainer._save_checkpoint` writes model, optimizer, RNG and trainer state file by file
    into RUN_DIR/checkpoint-N, so a kill -9 during a save leaves a half checkpoint that `resume`
    would pick. Here every save is written under RUN_DIR/.checkpoint-staging/checkpoint-N
    (subclasses' extra files included: they ask the same `_get_output_dir`), then renamed into
    RUN_DIR and the old checkpoints rotated. Patches the instance, not the class, so it works
    for any Trainer subclass. Returns the trainer.
    """
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    save = trainer._save_checkpoint  # bound method of the class
    output_dir_of = trainer._get_output_dir

    def _save_checkpoint(model: Any, trial: Any, *a: Any, **kw: Any) -> None:
        run_dir = Path(output_dir_of(trial=trial))
        staging = run_dir / STAGING
        name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
        if trainer.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # a killed save's leftovers
            staging.mkdir(parents=True)
        trainer.accelerator.wait_for_everyone()
        trainer._get_output_dir = lambda trial=None: str(staging)
        try:
            save(model, trial, *a, **kw)
        finally:
            del trainer._get_output_dir  # back to the class's method
        trainer.accelerator.wait_for_everyone()  # every rank's shards are in
        best = trainer.state.best_model_checkpoint
        if best and Path(best).parent == staging:
            trainer.state.best_model_checkpoint = str(run_dir / Path(best).name)
        if trainer.args.should_save:
            _publish(staging / name, run_dir / name)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(
                output_dir=str(run_dir),
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
                use_mtime=False,
            )
        trainer.accelerator.wait_for_everyone()

    trainer._save_checkpoint = _save_checkpoint
    return trainer


def save_model_atomically(trainer: Any, target: Path) -> Path:
    """`trainer.save_model` into a temporary sibling of `target`, then renamed into place."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    if trainer.args.should_save:
        shutil.rmtree(tmp, ignore_errors=True)
    trainer.save_model(str(tmp))
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        _publish(tmp, target)
    return target
