"""A study's report (`gear.app.compare`): the analysis of its finished pairs under its rule
(compare.json, compare.md, compare.png) and the plan of a larger study from a pilot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gear.app.compare.rule import (
    ALPHA,
    EFFECT,
    GATE_MIN_SEEDS,
    RULE_FILE,
    parse_arms,
    read_rule,
    rule_hash,
    runs_under_another_rule,
)
from gear.app.compare.runs import ERROR_FILE, collect
from gear.app.rundir import SUMMARY_FILE
from gear.io import write_text


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
        preregistered(rule, (Path(out) / r["name"] / SUMMARY_FILE).resolve().relative_to(root),
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
