"""The training recipe behind `gear train`: config -> model, task, GEARTrainer -> a run directory.

A run directory holds everything about one run::

    RUN_DIR/config.yaml        the resolved configuration (what was actually run)
    RUN_DIR/metrics.jsonl      one JSON object per logging step (TRL's logs + eval/accuracy)
    RUN_DIR/checkpoint-*/      TRL checkpoints (resume with `gear train --resume RUN_DIR`)
    RUN_DIR/credit/            per-token credit records (gear.viz.record)
    RUN_DIR/plots/*.png        reward, accuracy, entropy, gear/* statistics, a trajectory
    RUN_DIR/summary.json|.md   held-out accuracy before and after training, wall time

Configuration is a flat mapping: `RunConfig` fields plus any `GEARConfig` field (TRL's
`GRPOConfig` fields and gear's `credit_*`, `teacher`, ... fields). YAML files in `configs/`
give whole setups; command-line `--set key=value` overrides one key.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class RunConfig:
    """What `gear train` runs, beyond the trainer's own fields (`trainer`)."""

    model: str = field(
        default="smollm2", metadata={"help": "'smollm2' (embedded) or a HF id/path."}
    )
    task: str = field(default="arithmetic", metadata={"help": "arithmetic | gsm8k | bfcl | tools"})
    task_options: dict[str, Any] = field(default_factory=dict, metadata={"help": "Task options."})
    train_size: int | None = field(
        default=None, metadata={"help": "Training prompts (None: task default)."}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "Run directory (default runs/<name>)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of data order, sampling and init."})
    eval_n: int = field(
        default=100, metadata={"help": "Held-out problems per evaluation (0: none)."}
    )
    eval_every: int = field(
        default=0, metadata={"help": "Evaluate every K steps (0: only before/after)."}
    )
    eval_max_new_tokens: int = field(
        default=64, metadata={"help": "Generation budget of evaluation."}
    )
    eval_temperature: float = field(default=0.0, metadata={"help": "0 = greedy pass@1."})
    eval_batch_size: int = field(default=32, metadata={"help": "Prompts per evaluation batch."})
    trainer: dict[str, Any] = field(default_factory=dict, metadata={"help": "GEARConfig fields."})


def config_path(name_or_path: str) -> Path:
    """A config file: a path, or a name in configs/ (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ValueError(f"config {name_or_path!r}: no such file, and not one of configs/: {names}")


def parse_value(text: str) -> Any:
    """A command-line value as YAML would read it: 1e-5 -> float, true -> bool, [a, b] -> list."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


def resolve_config(config: str | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Merge `configs/default.yaml` (or `config`) with `overrides` into a `RunConfig`.

    Keys are `RunConfig` fields or `GEARConfig` fields; anything else is an error that names
    the key and the valid ones.
    """
    from gear.integrations.trl import GEARConfig

    values: dict[str, Any] = {}
    for source in (config_path(config or "default"),):
        loaded = yaml.safe_load(source.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{source}: expected a mapping of keys to values, got {type(loaded).__name__}"
            )
        values.update(loaded)
    values.update(overrides or {})
    run_keys = {f.name for f in dataclasses.fields(RunConfig)} - {"trainer"}
    trainer_keys = {f.name for f in dataclasses.fields(GEARConfig)}
    run: dict[str, Any] = {}
    trainer: dict[str, Any] = dict(values.pop("trainer", None) or {})
    for key, value in values.items():
        if key in run_keys:
            run[key] = value
        elif key in trainer_keys:
            trainer[key] = value
        else:
            raise ValueError(
                f"unknown config key {key!r}; valid keys are RunConfig fields {sorted(run_keys)} "
                f"or GEARConfig fields (see `gear train --help-config`)"
            )
    unknown = sorted(set(trainer) - trainer_keys)
    if unknown:
        raise ValueError(f"unknown trainer key(s) {unknown}; they must be GEARConfig fields")
    return RunConfig(**run, trainer=trainer)


def default_run_dir(cfg: RunConfig) -> Path:
    method = cfg.trainer.get("credit_method", "gear")
    mode = cfg.trainer.get("loss_mode", "rl")
    tag = "self_distill" if mode == "self_distill" else method
    return Path("runs") / f"{cfg.task}-{tag}-seed{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def trainer_args(cfg: RunConfig, run_dir: Path, hint_kind: str = "auto") -> Any:
    """The `GEARConfig` of a run: CPU-friendly defaults, the task's hint kind, then the config's
    trainer fields."""
    import torch

    from gear.integrations.trl import GEARConfig

    on_gpu = torch.cuda.is_available()
    base: dict[str, Any] = dict(
        output_dir=str(run_dir),
        seed=cfg.seed,
        bf16=True,  # TRL's default; on this CPU (AVX512-BF16) a step is ~20% faster than fp32
        gradient_checkpointing=False,
        use_cpu=not on_gpu,
        report_to="none",
        logging_steps=1,
        save_strategy="steps",
        save_steps=10,
        save_total_limit=2,
        disable_tqdm=True,
        hint_kind=hint_kind,
    )
    base.update(cfg.trainer)
    return GEARConfig(**base)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """summary.json and a short summary.md."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    before, after = summary.get("eval_before"), summary.get("eval_after")
    lines = [f"# Run summary: {run_dir.name}", ""]
    lines += [
        f"- task: `{summary.get('task')}`, method: `{summary.get('method')}`, "
        f"model: `{summary.get('model')}`, steps: {summary.get('steps')}"
    ]
    if summary.get("train_seconds") is not None:
        lines.append(f"- training wall time: {summary['train_seconds']:.0f} s")
    if before or after:
        lines += ["", "| held-out | pass@1 | problems |", "|---|---|---|"]
        for name, ev in (("before", before), ("after", after)):
            if ev:
                lines.append(f"| {name} | {ev['pass@1']:.3f} | {ev['n_problems']} |")
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n")


def train(
    cfg: RunConfig, run_dir: Path | None = None, resume: bool = False, console: Any = None
) -> Path:
    """Run one training job end to end; returns the run directory."""
    import torch
    from transformers.trainer_callback import PrinterCallback

    from gear.integrations.trl import GEARTrainer
    from gear.models import load_model_and_tokenizer
    from gear.run_callbacks import EvalCallback, MetricsFile, ProgressCallback, evaluate_now
    from gear.tasks import get_task

    run_dir = Path(run_dir or cfg.output_dir or default_run_dir(cfg))
    if resume and not run_dir.is_dir():
        raise ValueError(f"--resume: run directory {run_dir} does not exist")
    # validate everything that can be wrong before anything is written
    task = get_task(cfg.task, **cfg.task_options)
    args = trainer_args(cfg, run_dir, hint_kind=task.hint_kind)
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = dataclasses.asdict(cfg) | {"output_dir": str(run_dir)}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    tokenizer = task.prepare_tokenizer(tokenizer)
    train_ds = task.dataset("train", n=cfg.train_size, seed=cfg.seed)

    summary_file = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    summary.update(
        task=cfg.task,
        model=cfg.model,
        method=args.credit_method,
        loss_mode=args.loss_mode,
        steps=args.max_steps,
        seed=cfg.seed,
    )
    if cfg.eval_n and "eval_before" not in summary:
        summary["eval_before"] = evaluate_now(
            model, tokenizer, task, cfg, console, "before training"
        )
        write_summary(run_dir, summary)

    callbacks = [MetricsFile(run_dir / "metrics.jsonl"), ProgressCallback(console)]
    if cfg.eval_every and cfg.eval_n:
        callbacks.append(EvalCallback(task, cfg, tokenizer, console))
    trainer = GEARTrainer(
        model=model,
        reward_funcs=[task.reward],
        args=args,
        train_dataset=train_ds,
        processing_class=tokenizer,
        callbacks=callbacks,
        **task.trainer_kwargs(),
    )
    if console is not None:  # the progress bar and metrics.jsonl replace TRL's printed dicts
        trainer.remove_callback(PrinterCallback)
    checkpoint = resume and any(run_dir.glob("checkpoint-*"))
    t0 = time.time()
    try:
        trainer.train(resume_from_checkpoint=True if checkpoint else None)
    except KeyboardInterrupt:
        trainer._save_checkpoint(trainer.model, trial=None)  # same checkpoint TRL writes on save
        if console:
            console.print(
                f"[yellow]interrupted: checkpoint saved; continue with "
                f"`gear train --resume {run_dir}`[/]"
            )
        raise
    summary["train_seconds"] = summary.get("train_seconds", 0.0) + time.time() - t0
    if cfg.eval_n:
        summary["eval_after"] = evaluate_now(
            trainer.model, tokenizer, task, cfg, console, "after training"
        )
    write_summary(run_dir, summary)
    trainer.save_model(str(run_dir / "final"))
    render_outputs(run_dir)
    return run_dir


def render_outputs(run_dir: Path) -> list[Path]:
    """Plots of metrics.jsonl and a trajectory of the first credit record, under RUN_DIR/plots."""
    from gear.viz.plots import plot_metrics, plot_trajectory
    from gear.viz.record import read_credit_records

    out = run_dir / "plots"
    paths = (
        plot_metrics(run_dir / "metrics.jsonl", out)
        if (run_dir / "metrics.jsonl").is_file()
        else []
    )
    records = read_credit_records(run_dir) if (run_dir / "credit").is_dir() else []
    if records:
        paths.append(plot_trajectory(records[-1], out / "trajectory.png"))
    return paths
