"""The comparison of credit methods that `gear compare` and the studies share (issue 49): does a
method beat the baseline on this task, and how sure is that?

A run is a record {"seed", "before", "after", "reward"}: `before` and `after` are the run's
held-out scores before and after training (`gear train`'s summary.json `eval_before` and
`eval_after`: `mean_reward`, the learning metric, the mean reward of k samples per problem on
the same draws for every run; `pass@1`, greedy), `reward` its training reward per step.

The analysis, in the order a referee reads it:
1. the learning gate (`gear.evidence.gate`) on the baseline's runs: does it learn at all?
2. each candidate - baseline on the metric after training, paired by seed over the seeds both
   finished (complete pairs only; the seeds of one side alone are listed): the family interval
   at 1 - alpha/k (Bonferroni over the k candidates) and the 95% one, the MDE at 80% power from
   the observed SD (at alpha/k), the power at the effect the study states and the seeds that
   effect needs at 80% power, and greedy pass@1 as the secondary metric (95%);
3. each arm's worst seed and the seeds that ended below their before-score;
4. a candidate beats the baseline where the gate passed, its family interval lies above 0 and
   none of its seeds ended below its before-score; it is below the baseline where the family
   interval lies below 0. `verdict` says it in one sentence.

Bonferroni, not Holm: the report is intervals, and Holm's step-down procedure adjusts tests, not
intervals (its simultaneous intervals are Bonferroni's); a Bonferroni interval can be checked by
hand, and it is the rule issue 37's study committed to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gear.evidence.gate import learning_gate, slope
from gear.evidence.stats import bonferroni, mde, n_for_power, paired, power_at, t_interval

POWER = 0.8  # the power at which the MDE and the seeds needed are stated
NO_SPREAD = 1e-12  # an SD this small is identical differences, up to float rounding


def by_seed(records: Sequence[Mapping[str, Any]], arm: str = "") -> dict[int, Mapping[str, Any]]:
    """seed -> record; a seed twice is an error (a pair needs one run per arm and seed)."""
    out: dict[int, Mapping[str, Any]] = {}
    for r in records:
        if r["seed"] in out:
            raise ValueError(f"{arm or 'runs'}: seed {r['seed']} has two records")
        out[r["seed"]] = r
    return out


def pairs(
    a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]
) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]], dict[str, list[int]]]:
    """The records of `a` and `b` on the seeds both have (seed order), and the seeds that only
    one side has: {"only_a", "only_b"}."""
    sa, sb = by_seed(a), by_seed(b)
    both = sorted(set(sa) & set(sb))
    unpaired = {"only_a": sorted(set(sa) - set(sb)), "only_b": sorted(set(sb) - set(sa))}
    return [sa[s] for s in both], [sb[s] for s in both], unpaired


def compare_arms(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: str,
    *,
    metric: str = "mean_reward",
    secondary: str | None = "pass@1",
    alpha: float = 0.05,
    effect: float | None = None,
    gate_runs: Sequence[Mapping[str, Any]] | None = None,
    gate_min_seeds: int = 8,
    metric_label: str | None = None,
    gate_trend: str = "mean",
) -> dict[str, Any]:
    """The analysis of `runs` (arm -> finished runs, any seeds) against `baseline`.

    Args:
        metric: the key of the learning metric in each run's `before` / `after`.
        secondary: the key of the secondary metric (None: none).
        alpha: the family-wise error over the candidates (each interval at 1 - alpha/k).
        effect: the gain the study states (power and seeds needed are given for it).
        gate_runs: the baseline runs the gate reads (default: runs[baseline]).
        gate_min_seeds: the gate's least number of seeds.
        gate_trend: the gate's trend check (`gear.evidence.gate.TREND_CHECKS`); "interval"
            reads each record's "steps" (its logged step numbers) for a slope per step.
    Returns {"baseline", "metric", "alpha", "family", "level", "effect", "gate",
    "comparisons" (candidate -> "seeds", "unpaired", "bonferroni", "ci95", "level", "mde",
    "power_at_effect", "seeds_for_effect", "greedy"), "stability" (arm -> "worst_seed",
    "worst", "below_before"), "reward_slope", "beats_baseline", "below_baseline"}.
    """
    if baseline not in runs:
        raise ValueError(f"compare_arms: no runs of the baseline {baseline!r}")
    base = runs[baseline]
    for arm, rs in runs.items():
        by_seed(rs, arm)
    candidates = [a for a in runs if a != baseline]
    k = max(len(candidates), 1)
    level = bonferroni(k, alpha)
    gate_runs = list(base if gate_runs is None else gate_runs)
    gate = learning_gate(
        [r["before"][metric] for r in gate_runs],
        [r["after"][metric] for r in gate_runs],
        [r["reward"] for r in gate_runs],
        seeds=[r["seed"] for r in gate_runs],
        metric=metric_label or metric,
        min_seeds=gate_min_seeds,
        steps=[r["steps"] for r in gate_runs] if gate_trend == "interval" else None,
        trend=gate_trend,
    )

    def after(rs: Sequence[Mapping[str, Any]], key: str = metric) -> list[float]:
        return [r["after"][key] for r in rs]

    comparisons = {}
    for arm in candidates:
        a, b, unpaired = pairs(runs[arm], base)
        d = paired(after(a), after(b), level)
        n = d["n"]
        c = {
            "seeds": [r["seed"] for r in a],
            "unpaired": {arm: unpaired["only_a"], baseline: unpaired["only_b"]},
            "bonferroni": d,
            "ci95": paired(after(a), after(b))["ci"],
            "level": level,
            "mde": mde(d["sd"], n, alpha / k, POWER),
        }
        if effect is not None:
            c["power_at_effect"] = power_at(effect, d["sd"], n, alpha / k)
            c["seeds_for_effect"] = (
                n_for_power(effect, d["sd"], alpha / k, POWER) if d["sd"] > 0 else None
            )
        if secondary is not None:
            c["greedy"] = paired(after(a, secondary), after(b, secondary))
        comparisons[arm] = c
    stability = {
        arm: {
            "worst_seed": min(rs, key=lambda r: r["after"][metric])["seed"] if rs else None,
            "worst": min(after(rs)) if rs else math.nan,
            "below_before": [r["seed"] for r in rs if r["after"][metric] < r["before"][metric]],
        }
        for arm, rs in runs.items()
    }
    beats = [
        arm
        for arm, c in comparisons.items()
        if gate["passed"] and c["bonferroni"]["ci"][0] > 0 and not stability[arm]["below_before"]
    ]
    below = [
        arm for arm, c in comparisons.items() if gate["passed"] and c["bonferroni"]["ci"][1] < 0
    ]
    return {
        "baseline": baseline,
        "metric": metric_label or metric,
        "alpha": alpha,
        "family": f"Bonferroni over {len(candidates)} candidates",
        "level": level,
        "effect": effect,
        "gate": gate,
        "comparisons": comparisons,
        "stability": stability,
        # secondary: each arm's training-reward slope per step (95% over its seeds)
        "reward_slope": {
            arm: t_interval(
                [
                    slope(r["reward"], r["steps"] if gate_trend == "interval" else None)
                    for r in rs
                    if len(r["reward"]) >= 2
                ]
            )
            for arm, rs in runs.items()
        },
        "beats_baseline": sorted(beats, key=lambda a: -comparisons[a]["bonferroni"]["mean"]),
        "below_baseline": below,
    }


def seeds_to_plan(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    baseline: str,
    effect: float,
    *,
    metric: str = "mean_reward",
    alpha: float = 0.05,
    candidates: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Seeds a study needs to detect a gain of `effect` at 80% power (two-sided paired t-test at
    alpha/k, k the candidates), from the SD of each candidate - baseline over the finished
    pairs in `runs` (a pilot), and for the learning gate to pass with 80% power if the
    baseline learns as much as in the pilot (its after - before at 95%). Returns {"effect",
    "alpha", "level", "candidates" (arm -> "pairs", "sd", "mean", "no_spread", "seeds"),
    "gate" ("pairs", "mean", "sd", "no_spread", "seeds"), "seeds" (the most any of them needs;
    None where one cannot be told: fewer than 2 pairs, differences without spread (SD at most
    `NO_SPREAD`), a baseline that did not gain, or more than 999 seeds)}.

    An SD of 0 from a pilot is no estimate of the spread (a handful of pairs that happened to
    agree, or a metric that cannot move): no number of seeds follows from it."""
    if not (math.isfinite(effect) and effect > 0):
        raise ValueError(f"seeds_to_plan: the effect is a finite gain above 0, got {effect}")
    candidates = [a for a in (candidates or runs) if a != baseline]
    k = max(len(candidates), 1)
    out: dict[str, Any] = {}
    for arm in candidates:
        a, b, _ = pairs(runs.get(arm, []), runs.get(baseline, []))
        d = paired([r["after"][metric] for r in a], [r["after"][metric] for r in b])
        sd = d["sd"]
        flat = d["n"] >= 2 and sd <= NO_SPREAD
        seeds = n_for_power(effect, sd, alpha / k, POWER) if d["n"] >= 2 and not flat else None
        out[arm] = {"pairs": d["n"], "sd": sd, "mean": d["mean"], "no_spread": flat, "seeds": seeds}
    # the gate too must pass: the baseline's after - before, at the gate's 95%, powered for
    # the gain the pilot saw (none where it saw no gain)
    base = runs.get(baseline, [])
    g = paired([r["after"][metric] for r in base], [r["before"][metric] for r in base])
    gate_flat = g["n"] >= 2 and g["sd"] <= NO_SPREAD
    gate_seeds = None
    if g["n"] >= 2 and g["mean"] > 0 and not gate_flat:
        gate_seeds = n_for_power(g["mean"], g["sd"], 0.05, POWER)
    gate = {"pairs": g["n"], "mean": g["mean"], "sd": g["sd"], "no_spread": gate_flat,
            "seeds": gate_seeds}  # fmt: skip
    needed = [c["seeds"] for c in out.values()] + [gate_seeds]
    return {
        "effect": effect,
        "alpha": alpha,
        "level": bonferroni(k, alpha),
        "power": POWER,
        "candidates": out,
        "gate": gate,
        "seeds": max(needed) if None not in needed else None,
    }


def _interval(d: Mapping[str, Any]) -> str:
    return f"{d['mean']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]"


def verdict(
    result: Mapping[str, Any],
    no_winner: str | None = None,
    held: Mapping[str, str] | None = None,
) -> str:
    """One sentence a user can act on, from `compare_arms`' result.

    `no_winner`: why no winner may be called even where an interval clears 0 (e.g. the rule
    changed after the first run); it is said whatever the outcome, so a reader of any verdict
    learns it. `held`: arm -> why that arm is not called a winner though its family interval
    clears 0 (e.g. its runs, or the baseline's, for some of the rule's seeds are missing)."""
    base = result["baseline"]
    prefix = f"no winner is called: {no_winner}; " if no_winner else ""
    if not result["gate"]["passed"]:
        return prefix + _gate_failed(result)
    held = dict(held or {})
    comps = result["comparisons"]
    level = f"{100 * result['level']:.4g}%"
    short = [a for a, c in comps.items() if c["bonferroni"]["n"] < 2]
    beats = [a for a in result["beats_baseline"] if a not in held]
    above = [a for a, c in comps.items() if c["bonferroni"]["ci"][0] > 0]  # NaN: not above
    parts = []
    if beats:
        wins = "; ".join(f"{a} beats {base} by {_interval(comps[a]['bonferroni'])}" for a in beats)
        n = min(comps[a]["bonferroni"]["n"] for a in beats)
        parts.append(f"{wins} ({level} intervals, n = {n} paired seeds)")
        if no_winner:
            parts[-1] = f"no winner is called: {no_winner} (the intervals: {parts[-1]})"
            prefix = ""
    elif above:
        parts.append(f"no method is called a winner over {base}")
    else:
        compared = [c for c in comps.values() if c["bonferroni"]["n"] >= 2]
        ns = sorted({c["bonferroni"]["n"] for c in compared})
        mdes = [c["mde"] for c in compared if math.isfinite(c["mde"])]
        if ns:
            n_text = f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]}-{ns[-1]}"
            found = (
                f"; a gain of +{max(mdes):.3f} or more would have been found with {POWER:.0%} "
                "power, smaller ones are not ruled out"
                if mdes
                else ""
            )
            parts.append(f"no method beats {base} on this task ({n_text} paired seeds){found}")
    for a in result["below_baseline"]:
        parts.append(f"{a} is below {base}: {_interval(comps[a]['bonferroni'])}")
    for a in above:  # an interval above 0 that a check held back
        c = comps[a]
        seeds = result["stability"][a]["below_before"]
        if a in held:
            parts.append(
                f"{a} is above {base} ({_interval(c['bonferroni'])}, {level}, n = "
                f"{c['bonferroni']['n']} paired seeds) but {held[a]}: not called a winner"
            )
        elif seeds:
            parts.append(
                f"{a} is above {base} ({_interval(c['bonferroni'])}) but ended below its "
                f"start on seed(s) {seeds}: not called a winner"
            )
    if short:
        parts.append(f"fewer than 2 complete pairs for {', '.join(short)}: not compared")
    return prefix + "; ".join(parts)


def _gate_failed(result: Mapping[str, Any]) -> str:
    """The verdict where the learning gate failed. "did not learn" only where the data exclude
    a gain (the 95% interval of after - before at or below 0); an interval that holds 0, or no
    interval at all, cannot tell."""
    base, gate = result["baseline"], result["gate"]
    g = gate["paired"]
    failed = ", ".join(c for c, ok in gate["checks"].items() if not ok)
    if g["n"] >= 2:
        learned = f"after - before {_interval(g)}, 95%, n = {g['n']} seeds"
    else:
        learned = f"{g['n']} seed(s): no interval"
    why = f"({learned}; failed: {failed}): no comparison"
    if g["n"] >= 2 and g["ci"][1] <= 0:
        return f"{base} did not learn here {why}"
    if g["n"] >= 2 and g["ci"][0] > 0:
        return f"{base} gained on the metric but its learning gate failed {why}"
    return f"cannot tell whether {base} learns here {why}"
