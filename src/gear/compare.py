"""`gear compare`: does a credit method help on your task, and how sure is that? (issue 49)

A study is a directory: one `gear train` run per method and seed (`<method>-seed<s>/`, paired by
seed: the same prompts, sampling and initialisation for every method of a seed, and the same
held-out problems and draws for every run), and the rule the report follows:

    rule.json          arms, baseline, metric, seeds, alpha, the effect, the config's content
                       (`config_values`: the recipe as its runs read it, so an edit of the file
                       between invocations is a change of the rule) and the gate's trend check;
                       written before the first run. Each run directory keeps the rule's hash
                       from when it began (`rule.sha256`); a run that began under another rule,
                       or none, means the rule changed after the first run began, and no winner
                       is called.
    compare.json/.md   the analysis (`gear.evidence.compare_arms`, the one the studies use):
                       the learning gate on the baseline, each candidate - baseline paired by
                       seed (Bonferroni and 95% intervals, MDE at 80% power, greedy pass@1),
                       worst seeds, and one verdict sentence.
    compare.png        the learning curves beside the paired differences with their intervals.
    <run>/error.log    the traceback of a run that raised: the study goes on to the next run,
                       and the report names the run as failed until an attempt finishes it.

Only complete pairs are analysed; every missing, unfinished or failed run is named in the
verdict, and no arm is called a winner while its runs or the baseline's for a seed of the rule
are missing. Where the study directory is under git, `gear.evidence.preregistered` also checks
that the committed rule precedes every committed result.

A rule.json written before a field existed (`ADDED_FIELDS`) lacks it: such a study resumes (the
rest of its rule is compared), and its report says what the rule did not record.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gear.evidence import write_text

RULE_FILE = "rule.json"
RUN_HASH = "rule.sha256"  # in each run directory: the rule's hash when the run began
ERROR_FILE = "error.log"  # in a run directory whose run raised: its traceback
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
    from gear.config import parse_value

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
    resolved (`gear.config.load_recipe`), as JSON keeps them."""
    from gear.config import load_recipe

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
    from gear.inputs import InputError, read_json

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
        if d.is_dir() and ((d / "config.yaml").is_file() or (d / RUN_HASH).is_file())
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
    if (run_dir / RUN_HASH).is_file() or (run_dir / "config.yaml").is_file():
        return  # marked, or begun before the rule (left unmarked: the report names it)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / RUN_HASH, h + "\n")


def record_failure(run_dir: Path, error: BaseException) -> Path:
    """Write the traceback of `error`, which ended the run in `run_dir`, to its error.log."""
    import traceback

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text(run_dir / ERROR_FILE, "".join(traceback.format_exception(error)))


def clear_failure(run_dir: Path) -> None:
    """Before another attempt at a run: its earlier error.log goes (it fails anew, or it ends)."""
    (Path(run_dir) / ERROR_FILE).unlink(missing_ok=True)


def failure(run_dir: Path) -> str | None:
    """The error that ended the run in `run_dir` (the last line of its error.log), or None."""
    path = Path(run_dir) / ERROR_FILE
    if not path.is_file():
        return None
    lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "error.log is empty"


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A study run's summary.json; an `InputError` naming it when it is damaged."""
    from gear.inputs import InputError, read_json

    todo = f"move {run_dir} aside and `gear compare` trains that run again, or restore the file"
    summary = read_json(run_dir / "summary.json", todo)
    if not isinstance(summary, dict):
        raise InputError(run_dir / "summary.json", "not a JSON object", todo)
    return summary


def share_eval_before(out: Path, run_dir: Path, seed: int) -> None:
    """Runs of one seed start from the same model and data: reuse a sibling's before-training
    evaluation instead of repeating it (written into the new run's summary.json)."""
    if (run_dir / "summary.json").is_file():
        return
    for sibling in sorted(out.glob(f"*-seed{seed}/summary.json")):
        before = read_summary(sibling.parent).get("eval_before")
        if before:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text(run_dir / "summary.json", json.dumps({"eval_before": before}, indent=2))
            return


def run_record(run_dir: Path) -> dict[str, Any] | None:
    """The finished run in `run_dir` as a record (`gear.evidence.compare`): its held-out
    scores before and after training (summary.json) and training reward per step
    (metrics.jsonl); None while it has not finished."""
    from gear.run_callbacks import read_metrics

    run_dir = Path(run_dir)
    summary_file = run_dir / "summary.json"
    if not summary_file.is_file():
        return None
    summary = read_summary(run_dir)
    if not summary.get("eval_after") or not summary.get("eval_before"):
        return None
    steps = [m for m in read_metrics(run_dir / "metrics.jsonl") if m.get("reward") is not None]
    hash_file = run_dir / RUN_HASH
    return {
        "name": run_dir.name,
        "seed": summary.get("seed"),
        "method": summary.get("method"),
        "before": summary["eval_before"],
        "after": summary["eval_after"],
        "reward": [m["reward"] for m in steps],
        "steps": [m["step"] for m in steps],
        "rule_sha256": hash_file.read_text().strip() if hash_file.is_file() else None,
        "precision": summary.get("precision"),
    }


def collect(
    out: Path, arms: Sequence[str], seeds: Sequence[int] | None, metric: str
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[int]], dict[str, str], dict[str, str]]:
    """The finished runs of `arms` in `out` (at `seeds`; None: every seed found), the seeds
    asked but not finished per arm, the runs that cannot be used (name -> why) and the runs
    that failed (name -> the error that ended them; `failure`)."""
    runs: dict[str, list[dict[str, Any]]] = {}
    missing: dict[str, list[int]] = {}
    unusable: dict[str, str] = {}
    failed: dict[str, str] = {}
    for arm in arms:
        wanted = seeds
        if wanted is None:
            found = (d.name[len(arm) + len("-seed") :] for d in Path(out).glob(f"{arm}-seed*"))
            wanted = sorted(int(s) for s in found if s.isdigit())
        runs[arm], missing[arm] = [], []
        for seed in wanted:
            name = run_name(arm, seed)
            r = run_record(Path(out) / name)
            if r is None:
                missing[arm].append(seed)
                error = failure(Path(out) / name)
                if error is not None:
                    failed[name] = error
            elif metric not in r["before"] or metric not in r["after"]:
                unusable[name] = f"no {metric} in its held-out scores (eval_samples 0?)"
                missing[arm].append(seed)
            else:
                runs[arm].append(r | {"seed": seed})
    return runs, missing, unusable, failed


def git_record(out: Path, runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any] | None:
    """Where `out` is under git: the rule's first commit and whether it precedes every
    committed result (`gear.evidence.preregistered` on each run's summary.json); None
    elsewhere. "blocks" is True where a result was committed before the rule or with it."""
    from gear.evidence import first_commit, git, preregistered

    top = git(out, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        return None
    root = Path(top.stdout.strip()).resolve()
    rule = (Path(out) / RULE_FILE).resolve().relative_to(root)
    checks = [
        preregistered(rule, (Path(out) / r["name"] / "summary.json").resolve().relative_to(root),
                      root)
        for rs in runs.values()
        for r in rs
    ]  # fmt: skip
    committed = [c for c in checks if c["results_commit"] is not None]
    return {
        "rule": str(rule),
        "rule_commit": first_commit(rule, root),
        "results_committed": len(committed),
        "precede": [c["results"] for c in committed if c["precedes"]],
        "blocks": any(not c["precedes"] for c in committed),
    }


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _seeds(arm: str, seeds: Sequence[int]) -> str:
    return f"{arm} seed {seeds[0]}" if len(seeds) == 1 else f"{arm} seeds {list(seeds)}"


def runs_under_another_rule(out: Path, h: str) -> list[str]:
    """The begun runs of the study (finished or not) whose recorded rule hash is not `h`, or
    that recorded none: each is a sign that the rule changed after the first run began."""
    other = []
    for d in begun_runs(out):
        hash_file = d / RUN_HASH
        if not hash_file.is_file() or hash_file.read_text().strip() != h:
            other.append(d.name)
    return other


def report(out: Path, figure: bool = True) -> dict[str, Any]:
    """The study's report from its rule and finished runs: compare.json, compare.md and
    compare.png in `out`; returns what compare.json holds. It trains nothing: it reports what
    exists, naming every run of the rule that has not finished (and those that failed)."""
    from gear.evidence import compare_arms, verdict

    out = Path(out)
    rule = read_rule(out)
    if rule is None:
        raise ValueError(f"{out}: no {RULE_FILE}; `gear compare` writes it before the first run")
    effect = rule["effect"]
    if not (isinstance(effect, int | float) and math.isfinite(effect) and effect > 0):
        raise ValueError(
            f"{out / RULE_FILE}: effect {effect!r} is not a finite gain above 0; give it one "
            "with the study's command and --amend-rule --effect E (the report then calls no "
            "winner)"
        )
    h = rule_hash(rule)
    metric, base = rule["metric"], rule["baseline"]
    runs, missing, unusable, failed = collect(out, rule["arms"], rule["seeds"], metric)
    analysis = compare_arms(
        runs,
        base,
        metric=metric,
        secondary="pass@1" if metric != "pass@1" else None,
        alpha=rule["alpha"],
        effect=effect,
        gate_min_seeds=rule.get("gate_min_seeds", GATE_MIN_SEEDS),
        metric_label=rule.get("metric_label"),
        gate_trend=rule.get("gate_trend", "mean"),  # a rule from before it named one: issue 35's
    )
    other = runs_under_another_rule(out, h)
    reasons = []
    if other:
        reasons.append(
            f"the rule changed after the first run began ({len(other)} run(s) began under "
            "another rule or none)"
        )
    git = git_record(out, runs)
    if git is not None and git["blocks"]:
        reasons.append(
            "a result was committed to git before the rule (gear.evidence.preregistered)"
        )
    no_winner = "; ".join(reasons) or None
    # a winner is called over every seed of the rule: none while its runs or the baseline's
    # are missing (complete pairs alone would pair a failed run away)
    held = {}
    for arm in analysis["comparisons"]:
        gaps = [_seeds(a, missing[a]) for a in (arm, base) if missing[a]]
        if gaps:
            held[arm] = f"{' and '.join(gaps)} did not finish"
    sentence = verdict(analysis, no_winner, held)
    asked = len(rule["arms"]) * len(rule["seeds"])
    not_done = sum(len(v) for v in missing.values())
    if not_done:
        sentence += (
            f"; {not_done} of {asked} runs not finished "
            f"({'; '.join(_seeds(a, v) for a, v in missing.items() if v)}): complete pairs only"
        )
    for name, error in failed.items():
        sentence += f"; {name} failed: {error} (its traceback: {name}/{ERROR_FILE})"
    winners = [] if no_winner else [a for a in analysis["beats_baseline"] if a not in held]
    not_called = {}  # every arm whose family interval lies above 0 but is not called a winner
    for arm, c in analysis["comparisons"].items():
        lo = c["bonferroni"]["ci"][0]
        if arm in winners or not (isinstance(lo, float) and lo > 0):
            continue
        below = analysis["stability"][arm]["below_before"]
        not_called[arm] = (
            "the learning gate failed"
            if not analysis["gate"]["passed"]
            else no_winner or held.get(arm) or f"ended below its start on seed(s) {below}"
        )
    analysis = {k: v for k, v in analysis.items() if k != "beats_baseline"}  # read `winners`
    result = {
        "study": str(out),
        "rule": rule,
        "rule_sha256": h,
        "rule_unchanged": not other,
        "runs_under_another_rule": other,
        "rule_records_config": "config_values" in rule,
        "git": git,
        "missing": {a: s for a, s in missing.items() if s},
        "failed": failed,
        "unusable": unusable,
        "per_seed": {
            arm: [
                {
                    "seed": r["seed"],
                    "before": r["before"][metric],
                    "after": r["after"][metric],
                    "greedy_before": r["before"].get("pass@1"),
                    "greedy_after": r["after"].get("pass@1"),
                    "steps": r["steps"],
                    "reward": r["reward"],
                }
                for r in rs
            ]
            for arm, rs in runs.items()
        },
        **analysis,
        "winners": winners,
        "not_called": not_called,
        "verdict": sentence,
        "machine": machine(),
    }
    result = _finite(result)
    if figure:
        from gear.viz.compare import plot_comparison

        result["figure"] = plot_comparison(result, out / "compare.png").name
    write_text(out / "compare.json", json.dumps(result, indent=1) + "\n")
    write_text(out / "compare.md", markdown(result))
    return result


def plan(
    out: Path,
    methods: Sequence[str] | None = None,
    baseline: str | None = None,
    effect: float | None = None,
    alpha: float | None = None,
) -> dict[str, Any]:
    """Seeds needed to detect a gain of `effect` at 80% power, from the finished pairs in `out`
    (a pilot: every seed found). The arms, baseline, effect and alpha not given are the study
    rule's (else grpo vs gear, +0.05, 0.05); the metric is the rule's, else the mean reward
    where every run has it, else greedy pass@1."""
    from gear.evidence import seeds_to_plan

    rule = read_rule(out)
    arms = list(parse_arms(methods)) if methods else rule["arms"] if rule else ["grpo", "gear"]
    baseline = baseline or (rule["baseline"] if rule else "grpo")
    effect = effect if effect is not None else rule["effect"] if rule else EFFECT
    alpha = alpha if alpha is not None else rule["alpha"] if rule else ALPHA
    if not (math.isfinite(effect) and effect > 0):
        raise ValueError(f"--effect {effect}: the gain to detect, a finite number above 0")
    if baseline not in arms:
        raise ValueError(f"--baseline {baseline}: not one of the arms {arms}")
    metric = rule["metric"] if rule else "mean_reward"
    runs = collect(out, arms, None, metric)[0]
    if rule is None and not any(runs.values()):  # no mean reward: the greedy metric
        metric = "pass@1"
        runs = collect(out, arms, None, metric)[0]
    found = {a: [r["seed"] for r in rs] for a, rs in runs.items()}
    if not runs[baseline] or all(not rs for a, rs in runs.items() if a != baseline):
        raise ValueError(
            f"{out}: no finished pairs of {arms} (runs found: {found}); a pilot "
            f"first: gear compare --seeds 0 --seeds 1 --out {out}"
        )
    result = seeds_to_plan(runs, baseline, effect, metric=metric, alpha=alpha, candidates=arms)
    return _finite(result | {"study": str(out), "metric": metric, "baseline": baseline,
                             "pilot_seeds": found})  # fmt: skip


def plan_text(p: Mapping[str, Any]) -> str:
    k = len(p["candidates"])
    lines = [
        f"plan from the pilot in {p['study']} ({p['metric']}; each method - {p['baseline']}, "
        f"paired by seed): seeds to detect a gain of +{p['effect']:g} with "
        f"{p['power']:.0%} power, two-sided at alpha {p['alpha']:g}/{k} (Bonferroni)",
    ]
    cannot = []
    for arm, c in p["candidates"].items():
        sd = "-" if c["sd"] is None else f"{c['sd']:.4f}"
        if c["seeds"] is not None:
            need = f"{c['seeds']} seeds"
        elif c["pairs"] < 2:
            need = "unknown (fewer than 2 pairs)"
            cannot.append(f"{arm} has {c['pairs']} finished pair(s)")
        elif c["no_spread"]:
            need = "cannot plan (its differences have no spread)"
            cannot.append(
                f"{arm}'s differences from {p['baseline']} are the same on all {c['pairs']} "
                "pairs: an SD of 0 from a pilot is no estimate of the spread"
            )
        else:
            need = "more than 999 seeds"
            cannot.append(f"{arm} needs more than 999 seeds")
        lines.append(f"  {arm}: {c['pairs']} pairs, SD of the differences {sd}: {need}")
    gate = p["gate"]
    if gate["seeds"] is not None:
        lines.append(
            f"  the learning gate ({p['baseline']} after - before {gate['mean']:+.3f}, SD "
            f"{gate['sd']:.4f} over {gate['pairs']} seeds): {gate['seeds']} seeds for its 95% "
            "interval to clear 0"
        )
    elif gate["no_spread"] and gate["mean"] > 0:
        lines.append(
            f"  the learning gate: cannot plan ({p['baseline']} gained the same on all "
            f"{gate['pairs']} seeds: an SD of 0 from a pilot is no estimate of the spread)"
        )
        cannot.append(f"{p['baseline']}'s gain has no spread")
    else:
        lines.append(
            f"  the learning gate: unknown ({p['baseline']} gained nothing in the pilot, or "
            "fewer than 2 seeds): a study cannot be planned before the baseline learns"
        )
        cannot.append(f"{p['baseline']} has not learned in the pilot")
    if p["seeds"] is not None:
        lines.append(
            f"needed: {p['seeds']} seeds (an SD from a few pairs is rough: plan with margin). "
            f"Start the study in a new directory, e.g. gear compare --seeds 0 ... --seeds "
            f"{p['seeds'] - 1} --effect {p['effect']:g} --out <new dir>"
        )
    else:
        lines.append(
            f"cannot plan from this pilot: {'; '.join(cannot)}. Run more pilot seeds (or a "
            "recipe under which the baseline learns) and plan again"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ writing


def _finite(obj: Any) -> Any:
    """`obj` with NaN and infinities as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _num(x: float | None, fmt: str = "+.3f") -> str:
    return "—" if x is None else format(x, fmt)


def _ci(ci: Sequence[float | None]) -> str:
    return "—" if None in ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _ci4(ci: Sequence[float | None]) -> str:
    return "—" if None in ci else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"


def markdown(result: Mapping[str, Any]) -> str:
    """compare.md: the verdict first, then the rule, the gate, the comparisons, stability."""
    rule, base = result["rule"], result["baseline"]
    level = f"{100 * result['level']:.4g}%"
    k = len(result["comparisons"])
    lines = [
        f"# Does a method beat {base} here? ({result['study']})",
        "",
        f"**Verdict:** {result['verdict']}.",
        "",
        "## Rule",
        "",
        f"- `{RULE_FILE}` (sha256 `{result['rule_sha256'][:12]}`), "
        + ("written before the first run" if result["rule_unchanged"] else "**changed after "
           "the first run began** (amended or edited)")
        + f": arms {', '.join(f'`{a}`' for a in rule['arms'])}; baseline `{base}`; seeds "
        f"{rule['seeds']}; metric: {result['metric']}; alpha {rule['alpha']:g} over {k} "
        f"candidate(s) (Bonferroni: {level} intervals); effect +{rule['effect']:g}.",
        "- Every run began under this rule."
        if result["rule_unchanged"]
        else f"- {', '.join(result['runs_under_another_rule'])} began under another rule or "
        "none, so no winner is called.",
        f"- The config (`{rule.get('config') or 'default'}`): its content is in the rule "
        "(`config_values`), so an edit of the file between invocations is a change of the rule."
        if result["rule_records_config"]
        else f"- The config (`{rule.get('config') or 'default'}`) is named in the rule but its "
        "content is not (the rule was recorded before this check existed): an edit of the "
        "file between invocations would not be detected.",
    ]  # fmt: skip
    git = result.get("git")
    if git is not None:
        lines.append(
            f"- git: the rule's first commit {str(git['rule_commit'])[:12]}; "
            f"{git['results_committed']} result(s) committed, "
            + ("one before the rule: no winner." if git["blocks"] else "none before the rule.")
        )
    if result["missing"] or result["unusable"]:
        lines.append(
            "- Not finished (only complete pairs are analysed; no arm is called a winner while "
            "its runs or the baseline's miss a seed): "
            + "; ".join(f"`{a}` seeds {s}" for a, s in result["missing"].items())
            + "".join(f"; `{n}`: {why}" for n, why in result["unusable"].items())
        )
    for name, error in result.get("failed", {}).items():
        lines.append(f"- **`{name}` failed**: {error} (its traceback: `{name}/{ERROR_FILE}`).")
    for arm, why in result.get("not_called", {}).items():
        lines.append(f"- `{arm}`'s interval lies above 0 but it is not called a winner: {why}.")
    g = result["gate"]
    gp, slope = g["paired"], g["reward_slope"]
    per = "per step" if rule.get("gate_trend") == "interval" else "per logged row"
    trend_note = (
        ""
        if "gate_trend" in rule
        else " (the rule was recorded before it named its trend check: issue 35's, the mean "
        "slope per logged row above 0)"
    )
    lines += [
        "",
        f"## 1. Learning gate: does `{base}` learn?",
        "",
        f"After - before training on the metric, paired over {gp['n']} seeds: "
        f"{_num(gp['mean'])} {_ci(gp['ci'])} (95%); training reward slope "
        f"{_num(slope['mean'], '+.4f')} {_ci4(slope['ci'])} {per} (95% over seeds)"
        f"{trend_note}. Checks: "
        + ", ".join(f"{c} {'yes' if ok else '**no**'}" for c, ok in g["checks"].items())
        + f". **{'Passed' if g['passed'] else 'Failed: no method is compared'}.**",
        "",
        f"## 2. Each method - `{base}`, paired by seed",
        "",
        f"| method | pairs | mean after | − {base} | {level} (Bonferroni) | 95% | MDE at 80% "
        f"| power at +{rule['effect']:g} | seeds for +{rule['effect']:g} | greedy pass@1 − "
        f"{base} (95%) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if not g["passed"]:
        lines[-2:-2] = ["The gate failed: these differences decide nothing (for the record).", ""]
    per_seed = result["per_seed"]

    def mean_after(arm: str) -> str:
        v = [r["after"] for r in per_seed[arm]]
        return f"{sum(v) / len(v):.3f}" if v else "—"

    lines.append(f"| {base} | — | {mean_after(base)} | | | | | | | |")
    for arm, c in result["comparisons"].items():
        b, gr = c["bonferroni"], c.get("greedy")
        greedy = f"{_num(gr['mean'])} {_ci(gr['ci'])}" if gr else "—"
        need = c.get("seeds_for_effect")
        lines.append(
            f"| {arm} | {b['n']} | {mean_after(arm)} | {_num(b['mean'])} | {_ci(b['ci'])} | "
            f"{_ci(c['ci95'])} | {_num(c['mde'], '.3f')} | "
            f"{_num(c.get('power_at_effect'), '.2f')} | {need if need else '—'} | {greedy} |"
        )
    lines += [
        "",
        "## 3. Stability",
        "",
        "| arm | seeds | before (mean) | after, per seed | worst seed | seeds ending below "
        "their before |",
        "|---|---|---|---|---|---|",
    ]
    for arm, st in result["stability"].items():
        rs = per_seed[arm]
        before = f"{sum(r['before'] for r in rs) / len(rs):.3f}" if rs else "—"
        worst = f"{st['worst']:.3f} (seed {st['worst_seed']})" if rs else "—"
        afters = ", ".join(f"{r['after']:.3f}" for r in rs) or "—"
        lines.append(
            f"| {arm} | {[r['seed'] for r in rs]} | {before} | {afters} | {worst} | "
            f"{st['below_before'] or 'none'} |"
        )
    m = result["machine"]
    lines += [
        "",
        f"Figure: `{result.get('figure', '—')}` (learning curves; paired differences with their "
        f"intervals). Machine: CPU capability `{m['cpu_capability']}`, torch {m['torch']}"
        + (f", GPU {m['gpu']}" if m["gpu"] else ", no GPU")
        + ". Plan a larger study: `gear compare --plan --effect E` on this directory.",
    ]
    return "\n".join(lines) + "\n"
