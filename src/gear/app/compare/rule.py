"""A study's rule (`gear.app.compare`): what it compares, on what metric, at what level,
written to OUT/rule.json before the first run; its hash, and what a later command changes of it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gear.app.rundir import is_run_dir
from gear.io import write_text

RULE_FILE = "rule.json"
RUN_HASH = "rule.sha256"  # in each run directory: the rule's hash when the run began
GATE_TREND = "interval"  # the gate's trend check a new rule records (gear.evidence.gate)
#: rule fields added since the first studies; an older rule.json lacks them and still resumes
ADDED_FIELDS = ("config_values", "gate_trend")
ALPHA = 0.05  # family-wise, over the candidates (Bonferroni)
EFFECT = 0.05  # the default gain a study is planned for, on the learning metric
GATE_MIN_SEEDS = 2  # the fewest a paired interval needs; more seeds make the gate stricter


def run_name(method: str, seed: int) -> str:
    return f"{method}-seed{seed}"


def metric_of(cfg: Any) -> tuple[str, str]:
    """The learning metric of runs of `cfg` (a RunConfig): its key in summary.json's
    eval_before / eval_after, and its description. A ValueError when runs would have none."""
    if not cfg.eval_n:
        raise ValueError(
            "gear compare needs a held-out evaluation before and after training: eval_n is 0 "
            "(--set eval_n=200)"
        )
    if cfg.eval_samples:
        temperature = float(cfg.trainer.get("temperature", 1.0))
        return "mean_reward", (
            f"held-out mean reward ({cfg.eval_samples} samples per problem at "
            f"T={temperature:g}, {cfg.eval_n} problems, eval_seed {cfg.eval_seed})"
        )
    return "pass@1", (
        f"held-out greedy pass@1 ({cfg.eval_n} problems; eval_samples is 0: --set "
        "eval_samples=8 measures the mean reward of 8 samples, a finer learning metric)"
    )


#: an arm's name: a run directory's prefix (`<name>-seed<s>`)
ARM_NAME = re.compile(r"[A-Za-z0-9_.+=]+")


def parse_arm(spec: str) -> tuple[str, dict[str, Any]]:
    """One `--methods` value, `[name=]method[@key=value,...]`, -> (arm name, the config values
    its runs set: `credit_method` and each key, any key `--set` takes).

    `gear_token@kl_estimator=k1` is the arm `gear_token+kl_estimator=k1`; `lead=gear_token@
    kl_estimator=k1` names it `lead`. A ValueError names what is malformed."""
    from gear.app.config import parse_value

    head, at, opts = spec.partition("@")
    name, eq, method = head.rpartition("=")
    if not eq:
        name, method = "", head
    values: dict[str, Any] = {"credit_method": method.strip()}
    for item in filter(None, (x.strip() for x in opts.split(","))) if at else ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--methods {spec!r}: expected key=value after '@', got {item!r}")
        if key.strip() in values:
            raise ValueError(f"--methods {spec!r}: {key.strip()!r} is set twice")
        values[key.strip()] = parse_value(value.strip())
    if not values["credit_method"]:
        raise ValueError(f"--methods {spec!r}: no credit method ([name=]method[@key=value,...])")
    if at and not opts.strip():
        raise ValueError(f"--methods {spec!r}: nothing after '@' (key=value,...)")
    name = name.strip() or spec.strip().replace("@", "+").replace(",", "+")
    if not ARM_NAME.fullmatch(name) or "-seed" in name:
        raise ValueError(
            f"--methods {spec!r}: the arm's name {name!r} names its run directories: letters, "
            "digits and _ . + = only, without '-seed' (name it: --methods 'NAME=method@key=value')"
        )
    return name, values


def parse_arms(specs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`parse_arm` of each `--methods` value, in order: arm name -> its config values. A
    ValueError for two arms of one name."""
    arms: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, values = parse_arm(spec)
        if name in arms:
            raise ValueError(f"--methods: two arms are named {name!r}; each value once")
        arms[name] = values
    return arms


def check_out(out: Path) -> None:
    """A ValueError where `out` cannot be a study's directory: it is a file, or lies under one."""
    out = Path(out)
    for path in (out, *out.parents):
        if path.is_dir():
            return
        if path.exists():
            where = "is a file" if path == out else f"lies under the file {path}"
            raise ValueError(
                f"--out {out}: {where}; a study is a directory: give --out a directory's path"
            )


def config_values(config: str | None) -> dict[str, Any]:
    """The content of a study's config as its runs read it: the recipe's keys, its `extends`
    resolved (`gear.app.config.load_recipe`), as JSON keeps them."""
    from gear.app.config import load_recipe

    return json.loads(json.dumps(load_recipe(config or "default"), default=str))


def _not_finite(obj: Any, where: str = "") -> list[str]:
    """The keys (`set.learning_rate`) of `obj` that hold inf or NaN, which JSON cannot."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [f"{where}: {obj}"]
    if isinstance(obj, dict):
        return [e for k, v in obj.items() for e in _not_finite(v, f"{where}.{k}" if where else k)]
    if isinstance(obj, list | tuple):
        return [e for i, v in enumerate(obj) for e in _not_finite(v, f"{where}[{i}]")]
    return []


def make_rule(
    methods: Sequence[str],
    baseline: str,
    seeds: Sequence[int],
    cfg: Any,
    *,
    config: str | None,
    overrides: Mapping[str, Any],
    effect: float = EFFECT,
    alpha: float = ALPHA,
) -> dict[str, Any]:
    """The study's rule from the command that starts it; `cfg` is the baseline's resolved
    config (its metric and steps). A ValueError for a study that could not be decided."""
    arms = parse_arms(methods)
    if baseline not in arms:
        raise ValueError(f"--baseline {baseline}: not one of the arms {list(arms)}")
    if len(methods) < 2:
        raise ValueError(f"--methods {list(methods)}: a comparison needs two methods or more")
    for name, values in (("--methods", methods), ("--seeds", seeds)):
        if len(set(values)) != len(values):
            raise ValueError(f"{name} {list(values)}: each value once")
    if not (math.isfinite(effect) and effect > 0):  # inf passes `effect > 0`, JSON has no inf
        raise ValueError(f"--effect {effect}: the gain to detect, a finite number above 0")
    steps = cfg.trainer.get("max_steps")
    if isinstance(steps, int) and 0 < steps < 2:
        raise ValueError(
            f"max_steps {steps}: the learning gate reads the training reward's trend, which "
            "needs 2 steps or more"
        )
    metric, label = metric_of(cfg)
    rule_arms = {}
    if any(len(v) > 1 for v in arms.values()) or any(
        a != v["credit_method"] for a, v in arms.items()
    ):
        # a study of named or optioned arms keeps what each arm sets (a plain study's rule.json
        # is as before, so its hash and resumption are unchanged)
        rule_arms = {"arm_settings": arms}
    return {
        "arms": list(arms),
        "baseline": baseline,
        "metric": metric,
        "metric_label": label,
        "seeds": list(seeds),
        "alpha": alpha,
        "family": "bonferroni",
        "effect": effect,
        "gate_min_seeds": GATE_MIN_SEEDS,
        "config": config,
        "set": dict(overrides),
        **rule_arms,
        # the config's content, not only its path: an edited file is another rule (issue 59)
        "config_values": config_values(config),
        "gate_trend": GATE_TREND,
    }


def rule_hash(rule: Mapping[str, Any]) -> str:
    """SHA-256 of the rule's content (canonical JSON: a reformatted file keeps its hash)."""
    return hashlib.sha256(json.dumps(rule, sort_keys=True).encode()).hexdigest()


def read_rule(out: Path) -> dict[str, Any] | None:
    path = Path(out) / RULE_FILE
    if not path.is_file():
        return None
    from gear.io import InputError, read_json

    rule = read_json(path, "it holds the study's rule: restore it from a copy of the study")
    if not isinstance(rule, dict):
        raise InputError(path, "not a JSON object", "restore the study's rule from a copy")
    missing = {"arms", "baseline", "metric", "seeds", "alpha", "effect"} - set(rule)
    if missing:
        raise ValueError(f"{path}: the rule lacks {sorted(missing)}")
    return rule


def begun_runs(out: Path) -> list[Path]:
    """The run directories of the study that have begun (a config.yaml or a recorded hash)."""
    return sorted(
        d
        for d in Path(out).glob("*-seed*")
        if d.is_dir() and (is_run_dir(d) or (d / RUN_HASH).is_file())
    )


def _canonical(rule: Mapping[str, Any]) -> dict[str, Any]:
    """The rule as two commands are compared: the order of the seeds and of the arms is no
    part of it (an arm is its name and, in `arm_settings`, what it sets)."""
    out = dict(rule)
    for key in ("seeds", "arms"):
        if isinstance(out.get(key), list):
            out[key] = sorted(out[key], key=json.dumps)
    return out


def _diff(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            name = f"{where}.{k}" if where else str(k)
            if k not in a:
                out.append(f"{name}: added {b[k]!r}")
            elif k not in b:
                out.append(f"{name}: removed (was {a[k]!r})")
            else:
                out += _diff(a[k], b[k], name)
        return out
    return [] if a == b else [f"{where}: {a!r} -> {b!r}"]


def rule_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What `new` changes of the rule `old`, one entry per key that changed, nested keys named
    in full (`set.learning_rate: 0.0005 -> 0.05`). The order of seeds and arms is no change,
    nor is a field `old` was written before (`ADDED_FIELDS`)."""
    a, b = _canonical(old), _canonical(new)
    for key in ADDED_FIELDS:
        if key not in a:
            b.pop(key, None)
    return _diff(a, b, "")


def fix_rule(out: Path, rule: Mapping[str, Any], amend: bool = False) -> str:
    """Write `rule` to OUT/rule.json before the first run; returns the hash the study's runs
    record. Where OUT holds the same rule (`rule_changes` finds nothing) the file is kept as
    written and its hash returned. The rule of a study whose runs have begun may change only
    with `amend` (the report then calls no winner): a ValueError names each key that differs."""
    out = Path(out)
    bad = _not_finite(dict(rule))
    if bad:
        raise ValueError(f"the rule holds a value JSON cannot (inf or nan): {'; '.join(bad)}")
    old = read_rule(out)
    if old is not None:
        changes = rule_changes(old, rule)
        if not changes:
            return rule_hash(old)
        begun = begun_runs(out)
        if begun and not amend:
            raise ValueError(
                f"{out / RULE_FILE}: this command changes the study's rule "
                f"({'; '.join(changes)}) after {len(begun)} run(s) began under it. Rerun with "
                "the rule's arguments to continue, give a new study another --out, or pass "
                "--amend-rule to change it (the report then calls no winner)"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / RULE_FILE, json.dumps(rule, indent=1, allow_nan=False) + "\n")
    return rule_hash(rule)


def mark_run(run_dir: Path, h: str) -> None:
    """Record the rule's hash `h` in a run directory before its run begins (kept as first
    written: a run resumed under a changed rule keeps the hash it began under)."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_HASH).is_file() or is_run_dir(run_dir):
        return  # marked, or begun before the rule (left unmarked: the report names it)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / RUN_HASH, h + "\n")


def runs_under_another_rule(out: Path, h: str) -> list[str]:
    """The begun runs of the study (finished or not) whose recorded rule hash is not `h`, or
    that recorded none: each is a sign that the rule changed after the first run began."""
    other = []
    for d in begun_runs(out):
        hash_file = d / RUN_HASH
        if not hash_file.is_file() or hash_file.read_text().strip() != h:
            other.append(d.name)
    return other
