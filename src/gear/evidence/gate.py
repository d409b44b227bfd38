"""The learning gate: before any comparison of credit methods on a real LM, the baseline must
learn. A method can only be told apart from GRPO where GRPO itself improves held-out accuracy.

Rule (issue 35, fixed before the gate's runs): the gate passes when
1. at least `min_seeds` seeds ran (default 8),
2. the 95% paired t-interval of (held-out metric after training - before), over seeds, lies
   above 0, and
3. the training reward's trend is positive: the mean over seeds of each run's least-squares
   slope of reward against step is above 0 (its interval is reported beside it).

`trend="interval"` (the rule `gear compare` studies record since issue 59) makes check 3 a
test: each run's slope is taken against its logged step numbers (per step, not per logged row),
and the 95% interval of those slopes over the seeds must lie above 0. A mean slope above 0 is
what one noisy seed can give; an interval says the seeds agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gear.evidence.stats import paired, t_interval


def slope(values: Sequence[float], x: Sequence[float] | None = None) -> float:
    """Least-squares slope of `values` against `x` (default their index: per logged row)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"slope: needs two values or more, got {n}")
    if x is None:
        mx, my = (n - 1) / 2, sum(values) / n
        sxx = sum((i - mx) ** 2 for i in range(n))
        return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sxx
    if len(x) != n:
        raise ValueError(f"slope: {n} values against {len(x)} x; one x per value")
    mx, my = sum(x) / n, sum(values) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    if sxx == 0:
        raise ValueError("slope: every x is the same; a slope needs two x or more")
    return sum((xi - mx) * (v - my) for xi, v in zip(x, values, strict=True)) / sxx


#: the gate's trend checks: "mean" (issue 35's rule) and "interval" (gear compare since issue 59)
TREND_CHECKS = {
    "mean": "training reward trend > 0",
    "interval": "training reward slope per step: 95% interval above 0",
}


def learning_gate(
    before: Sequence[float],
    after: Sequence[float],
    rewards: Sequence[Sequence[float]],
    *,
    seeds: Sequence[int] | None = None,
    metric: str = "held-out mean reward",
    min_seeds: int = 8,
    level: float = 0.95,
    steps: Sequence[Sequence[float]] | None = None,
    trend: str = "mean",
) -> dict[str, Any]:
    """The gate's verdict for one recipe's baseline runs, one entry per seed.

    Args:
        before, after: the held-out metric of each seed's run before and after training.
        rewards: each seed's training reward per logged row (for the trend; a run of one row
            has none, and the trend check fails).
        steps: each seed's step number per row of `rewards` (the slope is then per step;
            default: per row).
        trend: "mean" (the mean of the per-seed slopes above 0) or "interval" (their `level`
            interval above 0; `TREND_CHECKS`).
    Returns {"seeds", "metric", "paired" (mean, ci, sd, n of after - before), "reward_slope"
    (t_interval of the per-seed slopes), "checks" (each condition, the trend's named by
    `TREND_CHECKS`), "passed"}.
    """
    if not (len(before) == len(after) == len(rewards)):
        raise ValueError(
            f"learning_gate: before ({len(before)}), after ({len(after)}) and rewards "
            f"({len(rewards)}) need one entry per seed"
        )
    if trend not in TREND_CHECKS:
        raise ValueError(f"learning_gate: trend is one of {list(TREND_CHECKS)}, got {trend!r}")
    diff = paired(after, before, level)
    xs = steps if steps is not None else [None] * len(rewards)
    # a run of one step has no trend: the check then fails (it is not skipped)
    slopes = t_interval(
        [slope(r, x) for r, x in zip(rewards, xs, strict=True) if len(r) >= 2], level
    )
    every = 1 <= slopes["n"] == len(rewards)
    trend_ok = slopes["mean"] > 0 if trend == "mean" else slopes["n"] >= 2 and slopes["ci"][0] > 0
    checks = {
        f"n >= {min_seeds}": len(before) >= min_seeds,
        "paired interval above 0": diff["n"] >= 2 and diff["ci"][0] > 0,
        TREND_CHECKS[trend]: every and trend_ok,
    }
    return {
        "seeds": list(seeds) if seeds is not None else list(range(len(before))),
        "metric": metric,
        "paired": diff,
        "reward_slope": slopes,
        "checks": checks,
        "passed": all(checks.values()),
    }
