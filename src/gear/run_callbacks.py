"""Trainer callbacks of `gear train`: metrics file, progress bar with ETA, periodic evaluation."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import TrainerCallback


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile(TrainerCallback):
    """Appends every log (and evaluations) to RUN_DIR/metrics.jsonl as {"step": s, ...}."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def write(self, step: int, values: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **{k: _clean(v) for k, v in values.items()}}) + "\n")

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any
    ) -> None:
        if logs and state.is_world_process_zero:
            self.write(state.global_step, logs)


class ProgressCallback(TrainerCallback):
    """A rich progress bar with ETA and the latest reward; silent without a console."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.progress: Any = None
        self.task: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.console is None or not state.is_world_process_zero:
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
        if self.progress is not None and logs:
            parts = [
                f"{k.split('/')[-1]} {logs[k]:.3f}"
                for k in ("reward", "gear/kl_mean")
                if isinstance(logs.get(k), float)
            ]
            self.progress.update(self.task, info="  ".join(parts))

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@contextlib.contextmanager
def plain_forward(model: Any) -> Iterator[Any]:
    """Run `model` without accelerate's mixed-precision forward wrapper for a while.

    Under `bf16=True`, accelerate wraps `model.forward` in autocast. That suits one big
    forward, but in generation it recasts every weight at every decoding step (no cast cache
    under no_grad): on CPU, sampling was ~5x slower than in float32. Evaluation generates, so it
    uses the original forward.
    """
    original = getattr(model, "_original_forward", None)
    if original is None:
        yield model
        return
    wrapped = model.forward
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


def evaluate_now(model: Any, tokenizer: Any, task: Any, cfg: Any, console: Any, label: str) -> dict:
    """Held-out pass@1 of `model` now (config: eval_n, eval_temperature, ...), with progress."""
    from gear.evaluate import evaluate

    bar: Any = None
    ctx: Any = contextlib.nullcontext()
    if console is not None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        bar = Progress(
            TextColumn(f"[bold]eval {label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=console,
        )
        ctx = bar
    with ctx, plain_forward(model):
        job = bar.add_task("eval", total=cfg.eval_n) if bar else None
        result = evaluate(
            model,
            tokenizer,
            task,
            split="test",
            n=cfg.eval_n,
            temperature=cfg.eval_temperature,
            max_new_tokens=cfg.eval_max_new_tokens,
            batch_size=cfg.eval_batch_size,
            seed=cfg.seed,
            progress=(lambda done, total: bar.update(job, completed=done, total=total))
            if bar
            else None,
        )
    if console is not None:
        console.print(
            f"held-out pass@1 {label}: [bold]{result.accuracy:.3f}[/] ({result.n_problems} problems)"
        )
    return result.summary()


class EvalCallback(TrainerCallback):
    """Every `eval_every` steps: held-out pass@1, written to metrics.jsonl as eval/accuracy."""

    def __init__(self, task: Any, cfg: Any, tokenizer: Any, console: Any) -> None:
        self.task, self.cfg, self.tokenizer, self.console = task, cfg, tokenizer, console

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
    ) -> None:
        step = state.global_step
        if not (
            state.is_world_process_zero
            and step % self.cfg.eval_every == 0
            and step < state.max_steps
        ):
            return
        result = evaluate_now(model, self.tokenizer, self.task, self.cfg, None, f"step {step}")
        MetricsFile(Path(args.output_dir) / "metrics.jsonl").write(
            step, {"eval/accuracy": result["pass@1"]}
        )
        if self.console is not None:
            self.console.log(f"step {step}: held-out pass@1 {result['pass@1']:.3f}")
