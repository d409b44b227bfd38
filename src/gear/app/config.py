"""The run config of `gear train`: what a run is asked to do, read and checked in one place.

Configuration is a flat mapping: `RunConfig` fields plus any `GEARConfig` field (TRL's
`GRPOConfig` fields and gear's `credit_*`, `teacher`, ... fields). The recipes shipped in the
package (`gear/app/configs/*.yaml`: `default`, `study`) give whole setups; command-line
`--set key=value` overrides one key. Every value is checked against its field's type and its
declared constraint (`gear.constraints`) before anything is loaded or written
(`resolve_config`, `resolve_values`).

A resumed run (`gear train --resume RUN_DIR`) reads exactly the saved RUN_DIR/config.yaml
(`resume_config`: only the `RESUME_MAY_CHANGE` keys may differ, any other option is an error)
and trains no step past `max_steps` (`check_resume_steps`). `trainer_args` turns a config into
the run's `GEARConfig`, with `bf16` resolved for this machine (`run_precision`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import time
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from gear.app.rundir import (
    CONFIG_FILE,
    CREDIT_DIR,
    METRICS_FILE,
    SUMMARY_FILE,
    checkpoint_step,
    last_checkpoint,
    resume_checkpoint,
    run_config_file,
)
from gear.constraints import Check, field_checks
from gear.io import InputError, read_yaml

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
    task: str = _field("arithmetic", "arithmetic | gsm8k | math | bfcl | tools")
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


def recipe_names() -> list[str]:
    """Names of the recipes shipped in the package (`gear/app/configs/*.yaml`)."""
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
    saved = run_dir / CONFIG_FILE
    if not saved.is_file():
        if any((run_dir / name).exists() for name in (METRICS_FILE, SUMMARY_FILE, CREDIT_DIR)):
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
        raise InputError(run_dir / CONFIG_FILE, str(e), RESTORE_CONFIG) from None
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
    """The `gear.app.precision.Precision` of a run: its `bf16` setting ("auto" by default) resolved
    for this machine and device."""
    from gear.app.precision import choose_precision

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


def check_task_method(cfg: RunConfig, task: Any) -> None:
    """What a run's credit method needs of its task, checked before any model loads: a step
    checker for `first_error` (`Task.step_checker`). A ValueError names the task."""
    method = cfg.trainer.get("credit_method", "gear")
    if method == "first_error" and task.step_checker() is None:
        levels = f" (levels {sorted(task.mix)})" if hasattr(task, "mix") else ""
        raise ValueError(
            f"credit_method first_error blames the first wrong step a step checker finds, and "
            f"task {cfg.task!r}{levels} has none (tasks with one: arithmetic with only the "
            f"multistep and chain levels, e.g. task_options.mix=chain:1); pick another method or "
            f"another task"
        )
