"""The learning gate: before any comparison of credit methods on a real LM, the baseline must
learn. A method can only be told apart from GRPO where GRPO itself improves held-out accuracy.

Rule (issue 35, fixed before the gate's runs): the gate passes when
1. at least `min_seeds` seeds ran (default 8),
2. the 95% paired t-interval of (held-out metric after training - before), over seeds, lies
   above 0, and
3. the training reward's trend is positive: the mean over seeds of each run's least-squares
   slope of reward against step is above 0 (its interval is reported beside it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gear.evidence.stats import paired, t_interval


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of `values` against their index (per step)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"slope: needs two values or more, got {n}")
    mx, my = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sxx


def learning_gate(
    before: Sequence[float],
    after: Sequence[float],
    rewards: Sequence[Sequence[float]],
    *,
    seeds: Sequence[int] | None = None,
    metric: str = "held-out mean reward",
    min_seeds: int = 8,
    level: float = 0.95,
) -> dict[str, Any]:
    """The gate's verdict for one recipe's baseline runs, one entry per seed.

    Args:
        before, after: the held-out metric of each seed's run before and after training.
        rewards: each seed's training reward per step (for the trend; a run of one step has
            none, and the trend check fails).
    Returns {"seeds", "metric", "paired" (mean, ci, sd, n of after - before), "reward_slope"
    (t_interval of the per-seed slopes), "checks" (each condition), "passed"}.
    """
    if not (len(before) == len(after) == len(rewards)):
        raise ValueError(
            f"learning_gate: before ({len(before)}), after ({len(after)}) and rewards "
            f"({len(rewards)}) need one entry per seed"
        )
    diff = paired(after, before, level)
    # a run of one step has no trend: the check then fails (it is not skipped)
    slopes = t_interval([slope(r) for r in rewards if len(r) >= 2], level)
    checks = {
        f"n >= {min_seeds}": len(before) >= min_seeds,
        "paired interval above 0": diff["n"] >= 2 and diff["ci"][0] > 0,
        "training reward trend > 0": 1 <= slopes["n"] == len(rewards) and slopes["mean"] > 0,
    }
    return {
        "seeds": list(seeds) if seeds is not None else list(range(len(before))),
        "metric": metric,
        "paired": diff,
        "reward_slope": slopes,
        "checks": checks,
        "passed": all(checks.values()),
    }
