"""A run directory, the one module that knows its layout: what `gear train` writes there and
what `gear train --resume`, `gear eval`, `gear inspect` and `gear compare` read back::

    RUN_DIR/config.yaml        the resolved configuration (`write_config`; written first: a
                               directory that holds it is a run, `is_run_dir`)
    RUN_DIR/metrics.jsonl      one JSON object per logging step (`append_metrics`,
                               `read_metrics`); each step once, also across stops and resumes
                               (`truncate_run_logs`)
    RUN_DIR/checkpoint-<step>/ HF checkpoints, each complete or not at all (written under
                               `STAGING`, then renamed: `gear.app.callbacks.atomic_checkpoints`);
                               the newest is what a resumed run continues from
                               (`resume_checkpoint`: a damaged one is refused, never skipped)
    RUN_DIR/credit/            per-token credit records (`gear.viz.record`)
    RUN_DIR/final/             the trained model
    RUN_DIR/plots/             the curves and a trajectory (`gear.app.train.render_outputs`)
    RUN_DIR/summary.json|.md   held-out scores before and after training, wall time
                               (`read_summary`, `write_summary`)

Files are read and written through `gear.io`: a damaged file is an `InputError` naming it, a
written one appears whole or not at all.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from gear.io import (
    InputError,
    check_model_files,
    check_torch_file,
    read_json,
    read_text,
    read_yaml,
    write_text,
)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
FINAL_DIR = "final"
CREDIT_DIR = "credit"
STAGING = ".checkpoint-staging"  # hidden, and outside HF's `checkpoint-<step>` pattern


# ------------------------------------------------------------------------------ config.yaml


def write_config(run_dir: Path, values: dict[str, Any]) -> Path:
    """RUN_DIR/config.yaml: the run's resolved configuration, as plain YAML."""
    import yaml

    return write_text(Path(run_dir) / CONFIG_FILE, yaml.safe_dump(values, sort_keys=False))


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a gear run directory (it holds config.yaml, written first)."""
    return (Path(path) / CONFIG_FILE).is_file()


def run_config_file(run_dir: Path, todo: str) -> dict[str, Any]:
    """The mapping in RUN_DIR/config.yaml; an InputError when it is missing, broken or empty."""
    path = Path(run_dir) / CONFIG_FILE
    values = read_yaml(path, todo)
    if not values:
        raise InputError(path, "empty", todo)
    if not isinstance(values, dict):
        raise InputError(
            path, f"expected a mapping of keys to values, got {type(values).__name__}", todo
        )
    return values


# ------------------------------------------------------------------------------ checkpoints

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # HF's pattern (transformers.trainer_utils)


def checkpoints(run_dir: Path) -> list[Path]:
    """A run's `checkpoint-<step>` directories, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if CHECKPOINT.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(CHECKPOINT.match(p.name).group(1)))  # type: ignore[union-attr]


def check_checkpoint(checkpoint: Path) -> None:
    """An InputError naming the first missing or damaged file of a checkpoint: weights
    (`check_model_files`), optimizer.pt and scheduler.pt (without them HF's Trainer resumes
    silently with a new optimizer), rng_state*.pth, trainer_state.json. DeepSpeed and FSDP
    checkpoints keep weights and optimizer in their own layout: only their other files are
    checked."""
    checkpoint = Path(checkpoint)
    sharded = any(
        p.name.startswith("global_step") or "fsdp" in p.name for p in checkpoint.iterdir()
    )
    weights = check_model_files(checkpoint)
    if not weights and not sharded:
        raise InputError(
            checkpoint, "holds no model weights (adapter_model.safetensors or model.safetensors)"
        )
    for name in ("optimizer.pt", "scheduler.pt"):
        if (checkpoint / name).is_file():
            check_torch_file(checkpoint / name)
        elif not sharded:
            raise InputError(checkpoint / name, "missing")
    for rng in sorted(checkpoint.glob("rng_state*.pth")):
        check_torch_file(rng)
    state = read_json(checkpoint / "trainer_state.json")
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise InputError(checkpoint / "trainer_state.json", "holds no global_step")


def checkpoint_problem(checkpoint: Path) -> InputError | None:
    """What is wrong with a checkpoint (`check_checkpoint`), or None when it is complete."""
    try:
        check_checkpoint(checkpoint)
    except InputError as e:
        return e
    return None


def newest_complete(found: list[Path]) -> tuple[Path | None, list[InputError]]:
    """The newest complete checkpoint of `found` (oldest first; None if none is complete) and
    the problems of the newer, damaged ones, newest first."""
    damaged = []
    for checkpoint in reversed(found):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            return checkpoint, damaged
        damaged.append(problem)
    return None, damaged


def resume_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `gear train --resume` continues from: the run's newest, checked (None
    when it has none). A damaged newest checkpoint is refused, never skipped: an InputError
    naming the damaged file and the previous complete checkpoint, with the command that
    continues from it (move the damaged one aside). Nothing on disk is changed."""
    run_dir = Path(run_dir)
    found = checkpoints(run_dir)
    if not found:
        return None
    newest = found[-1]
    problem = checkpoint_problem(newest)
    if problem is None:
        return newest
    previous, _ = newest_complete(found[:-1])
    move = f"`mv {newest} {run_dir / ('damaged-' + newest.name)}`"
    if previous is not None:
        todo = (
            f"{newest.name} is damaged and the previous complete checkpoint is {previous.name}: "
            f"to continue from it, move the damaged one aside ({move}) and run "
            f"`gear train --resume {run_dir}` again"
        )
    else:
        todo = (
            f"{newest.name} is damaged and no earlier checkpoint is complete: move it aside "
            f"({move}) and `gear train --resume {run_dir}` trains the run again from step 0"
        )
    raise problem.with_todo(todo)


def last_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint (highest step), complete or not, or None. Staging leftovers
    of a killed save are never candidates (they are not named `checkpoint-<step>`)."""
    found = checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_step(checkpoint: Path | None) -> int:
    """The step of a `checkpoint-<step>` directory; 0 for None (a run starting from scratch)."""
    return int(Path(checkpoint).name.rsplit("-", 1)[1]) if checkpoint is not None else 0


def target_steps(args: Any, checkpoint: Path | None) -> int:
    """The step a run ends at: `max_steps`, or where it is -1 (train by epochs), the
    `max_steps` the checkpoint's trainer state computed."""
    if args.max_steps > 0 or checkpoint is None:
        return args.max_steps
    state = Path(checkpoint) / "trainer_state.json"
    return int(json.loads(state.read_text()).get("max_steps", -1)) if state.is_file() else -1


# ------------------------------------------------------------------------------ metrics.jsonl


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _record_step(line: str) -> float:
    """The step of one metrics.jsonl line; inf for a line that is not a complete record (a
    write cut short by kill -9)."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, int | float) and not isinstance(step, bool) else math.inf


METRICS_TODO = "restore it from a copy, or move it aside (the run's curves are then lost)"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """RUN_DIR/metrics.jsonl as one record per step, in step order: the records of a step
    (TRL's log, an evaluation, the end-of-training summary) merged, a later value of a key
    replacing an earlier one, so a step written twice (a run resumed by an older gear, which
    kept the records of steps it trained again) counts once, as last written. Lines that are
    not complete JSON records (a write cut short) are skipped; a file that cannot be read as
    text is an `InputError` naming it."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[float, dict[str, Any]] = {}
    for line in read_text(path, METRICS_TODO).splitlines():
        if not line.strip() or _record_step(line) == math.inf:
            continue
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return [by_step[step] for step in sorted(by_step)]


def truncate_run_logs(run_dir: Path, step: int) -> None:
    """Forget what a run logged after `step` (the checkpoint it resumes from): metrics.jsonl
    keeps its records of steps <= `step` (rewritten atomically); credit records of steps after
    it are deleted (a record is named after the step its rollouts train, 1-based as in
    metrics.jsonl: step_000003.jsonl was written during the third step). The steps after the
    checkpoint are trained again and logged anew, so each step appears once."""
    metrics = Path(run_dir) / METRICS_FILE
    if metrics.is_file():
        lines = read_text(metrics, METRICS_TODO).splitlines()
        keep = [line for line in lines if line.strip() and _record_step(line) <= step]
        if len(keep) != len(lines):
            write_text(metrics, "".join(line + "\n" for line in keep))
    for record in (Path(run_dir) / CREDIT_DIR).glob("step_*.jsonl"):
        try:
            later = int(record.stem.removeprefix("step_")) > step
        except ValueError:
            continue
        if later:
            record.unlink()


def append_metrics(path: Path, step: int, values: dict[str, Any]) -> None:
    """Append one record, {"step": step, ...values}, to a run's metrics.jsonl (NaN and inf as
    null)."""
    with Path(path).open("a") as f:
        f.write(json.dumps({"step": step, **{k: _clean(v) for k, v in values.items()}}) + "\n")


# ------------------------------------------------------------------------------ summary

SUMMARY_TODO = (
    "restore it from a copy, or remove it: the run then scores the model before training "
    "again (its recorded training time is lost)"
)


def read_summary(run_dir: Path, todo: str = SUMMARY_TODO) -> dict[str, Any]:
    """RUN_DIR/summary.json ({} where there is none yet); an `InputError` naming it when it is
    damaged, with `todo`."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return {}
    summary = read_json(path, todo)
    if not isinstance(summary, dict):
        raise InputError(path, "not a JSON object", todo)
    return summary


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """summary.json and a short summary.md."""
    write_text(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, default=str))
    before, after = summary.get("eval_before"), summary.get("eval_after")
    lines = [f"# Run summary: {run_dir.name}", ""]
    lines += [
        f"- task: `{summary.get('task')}`, method: `{summary.get('method')}`, "
        f"model: `{summary.get('model')}`, steps: {summary.get('steps')}"
    ]
    if summary.get("precision"):
        lines.append(f"- precision: {summary['precision']}")
    if summary.get("train_seconds") is not None:
        lines.append(f"- training wall time: {summary['train_seconds']:.0f} s")
    if before or after:
        first = before or after or {}
        sampled = "mean_reward" in first  # eval_samples > 0: the learning metric beside greedy
        head = "| held-out | greedy pass@1 |" + (
            f" mean reward ({first['samples']} samples, T={first['sample_temperature']:g}) |"
            if sampled
            else ""
        )
        lines += ["", head + " problems |", "|---|---|" + ("---|" if sampled else "") + "---|"]
        for name, ev in (("before", before), ("after", after)):
            if ev:
                reward = f" {ev['mean_reward']:.3f} |" if sampled and "mean_reward" in ev else ""
                lines.append(f"| {name} | {ev['pass@1']:.3f} |{reward} {ev['n_problems']} |")
        if verdicts := learning_lines(before, after):  # a blank line ends the table
            lines += ["", *(f"- {line}" for line in verdicts)]
    write_text(run_dir / "summary.md", "\n".join(lines) + "\n")


def learning_lines(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[str]:
    """Whether the run learned, in words: after - before per metric with a 95% paired t-interval
    over the held-out problems (each problem scored before and after on the same draws)."""
    from gear.evidence import paired

    if not (before and after):
        return []
    lines = []
    for metric, name in (("mean_reward", "mean reward"), ("greedy", "greedy pass@1")):
        a = (after.get("per_problem") or {}).get(metric)
        b = (before.get("per_problem") or {}).get(metric)
        if not a or not b or len(a) != len(b):
            continue
        d = paired(a, b)
        lo, hi = d["ci"]
        verdict = (
            "learned: the interval is above 0"
            if lo > 0
            else "got worse: the interval is below 0"
            if hi < 0
            else "no change this evaluation can tell from 0"
        )
        lines.append(
            f"{name}, after - before: {d['mean']:+.3f} (95% interval over {d['n']} problems "
            f"[{lo:+.3f}, {hi:+.3f}]): {verdict}"
        )
    return lines


# ------------------------------------------------------------------------------ what a run gives to evaluate


def _step_of(checkpoint: Path, config: dict[str, Any]) -> str:
    """`checkpoint-2 (step 2 of 40)`: the step of a checkpoint and the run's max_steps."""
    step = CHECKPOINT.match(checkpoint.name).group(1)  # type: ignore[union-attr]
    total = (config.get("trainer") or {}).get("max_steps")
    of = f" of {total}" if isinstance(total, int) and total > 0 else ""
    return f"{checkpoint.name} (step {step}{of})"


def unfinished_note(
    run_dir: Path, checkpoint: Path | None, damaged: list[InputError], config: dict[str, Any]
) -> str:
    """What `gear eval` / `gear inspect` say of a run without final/: that it did not finish,
    its newest complete checkpoint and the newer damaged ones."""
    note = (
        f"{run_dir} has no final/: the run stopped before it finished (continue it with "
        f"`gear train --resume {run_dir}`)"
    )
    if checkpoint is not None:
        note += f"; its newest complete checkpoint is {_step_of(checkpoint, config)}"
    if damaged:
        note += "; damaged: " + ", ".join(f"{d.path} ({d.problem})" for d in damaged)
    return note


def evaluation_target(target: str) -> tuple[str, dict[str, Any], str | None]:
    """What `gear eval TARGET` evaluates, checked before any model is loaded: (the model path
    or name, the run's config mapping ({} when TARGET is no run), a note to print or None).

    A run directory: its `final/`; a run without one (stopped before it finished) is evaluated
    at its newest complete checkpoint, and the note says so. A run's `final/` or checkpoint
    directory: that model, with the run's task. A model directory: that model. Anything that is
    not a directory (`smollm2`, a Hub id, a .gguf file): as it is. A directory that is neither a
    run nor a model, a damaged config.yaml or damaged weights: an InputError."""
    path = Path(target)
    if not path.is_dir():
        return target, {}, None
    run_todo = (
        f"fix or restore it, or evaluate a model of the run directly (`gear eval {path}/final`)"
    )
    if is_run_dir(path):
        config = run_config_file(path, run_todo)
        found = checkpoints(path)
        final = path / FINAL_DIR
        if final.is_dir():
            try:
                if not check_model_files(final):
                    raise InputError(final, "holds no model weights")
            except InputError as e:
                newest, _ = newest_complete(found)
                raise e.with_todo(
                    f"evaluate the run's newest complete checkpoint instead (`gear eval {newest}`),"
                    f" or let `gear train --resume {path}` continue from it and write final/ again"
                    if newest is not None
                    else "the run has no complete checkpoint to evaluate instead"
                ) from None
            return str(final), config, None
        newest, damaged = newest_complete(found)
        if newest is None:
            when = "and its checkpoints are damaged" if damaged else "before its first checkpoint"
            raise InputError(
                final,
                f"missing: the run stopped before it finished, {when}, so it has no model to "
                "evaluate",
                f"`gear train --resume {path}` continues it"
                + (" (and says what to do about the damaged checkpoint)" if damaged else ""),
            )
        note = unfinished_note(path, newest, damaged, config) + f"; evaluating {newest.name}"
        return str(newest), config, note
    if (CHECKPOINT.match(path.name) or path.name == FINAL_DIR) and is_run_dir(path.parent):
        config = run_config_file(path.parent, run_todo)  # a model of a run: the run's task
        if not check_model_files(path):
            raise InputError(path, "holds no model weights")
        return str(path), config, None
    if not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
        raise InputError(
            path,
            "neither a gear run directory (no config.yaml) nor a model directory (no config.json "
            "or adapter_config.json)",
            "give `gear eval` a run directory, a model directory, 'smollm2' or a Hub model id",
        )
    check_model_files(path)  # the weight files it has (a Hub layout may have others)
    return str(path), {}, None
