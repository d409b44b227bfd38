"""Paired statistics over seeds or problems: t-intervals, power and minimum detectable effect,
and percentile-bootstrap intervals over prompts.

A t-interval is a two-sided Student-t interval of a mean (scipy's t quantiles); power is that
of the two-sided paired t-test, from the noncentral t distribution. A bootstrap interval is the
percentile interval of resampled means, drawn from torch's generator with a fixed seed (the same
call gives the same interval), for means over prompts whose rows are not independent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def t_interval(values: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """{"mean", "ci": [lo, hi], "sd", "n"} of `values`: mean, two-sided t-interval at `level`,
    sample SD (ddof 1). An interval needs two values or more (else NaN)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n if n else math.nan
    if n < 2:
        return {"mean": mean, "ci": [math.nan, math.nan], "sd": math.nan, "n": n}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return {"mean": mean, "ci": [mean - half, mean + half], "sd": sd, "n": n}


def paired(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> dict[str, Any]:
    """`t_interval` of the differences a[i] - b[i] (pairs: same seed, or same problem)."""
    if len(a) != len(b):
        raise ValueError(f"paired: {len(a)} values against {len(b)}; pairs need equal lengths")
    return t_interval([x - y for x, y in zip(a, b, strict=True)], level)


def power_at(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level `alpha` with `n` pairs whose differences
    have SD `sd`, when the true mean difference is `effect`."""
    from scipy import stats

    if n < 2 or sd <= 0:
        return math.nan
    df = n - 1
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    ncp = effect / (sd / math.sqrt(n))
    upper = float(stats.nct.sf(crit, df, ncp))
    lower = float(stats.nct.cdf(-crit, df, ncp))
    # scipy's nct returns NaN deep in a far tail (|ncp| >~ 9): that tail is 0 there
    return (0.0 if math.isnan(upper) else upper) + (0.0 if math.isnan(lower) else lower)


def mde(sd: float, n: int, alpha: float = 0.05, target: float = 0.8) -> float:
    """The smallest true effect that `n` pairs with difference SD `sd` detect with power
    `target` (two-sided paired t-test at `alpha`), by bisection on `power_at`.

    The bracket grows until it holds the answer: with 2 pairs and a Bonferroni alpha the MDE is
    tens of SDs (46 SD at alpha 0.05/4), and a fixed bracket would report its own edge."""
    if n < 2 or sd <= 0:
        return math.nan
    lo, hi = 0.0, 20.0 * sd  # as before where it holds the answer: the same bisection
    while power_at(hi, sd, n, alpha) < target:  # power tends to 1 as the effect grows
        lo, hi = hi, 2 * hi
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power_at(mid, sd, n, alpha) < target else (lo, mid)
    return hi


def n_for_power(
    effect: float, sd: float, alpha: float = 0.05, target: float = 0.8, start: int = 2,
    stop: int = 1000,
) -> int | None:  # fmt: skip
    """The fewest pairs n in [start, stop) whose two-sided paired t-test at `alpha` has power
    `target` against a true mean difference of size |`effect`| (SD `sd`); None if none does."""
    return next(
        (n for n in range(start, stop) if power_at(abs(effect), sd, n, alpha) >= target), None
    )


def bonferroni(k: int, alpha: float = 0.05) -> float:
    """The interval level that keeps the family-wise error of `k` comparisons at `alpha`
    (Bonferroni: each interval at 1 - alpha / k)."""
    if k < 1:
        raise ValueError(f"bonferroni: k is the number of comparisons, at least 1, got {k}")
    return 1 - alpha / k


def bootstrap(
    values: Sequence[float],
    groups: Sequence[Any] | None = None,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, Any]:
    """{"mean", "ci": [lo, hi], "n"} of the finite `values` (NaN ones are dropped first): their
    mean and its percentile bootstrap interval at level 1 - `alpha`, over `n_boot` resamples.

    With `groups` (one label per value), whole groups are resampled (the rows of one prompt are
    not independent) and each resample's mean is over all the rows of the groups drawn; without,
    each value is its own group. With no finite value, mean and ci are NaN and n is 0.
    """
    import torch

    labels = list(range(len(values))) if groups is None else list(groups)
    keep = [(v, g) for v, g in zip(values, labels, strict=True) if math.isfinite(v)]
    if not keep:
        return {"mean": math.nan, "ci": [math.nan, math.nan], "n": 0}
    index = {g: k for k, g in enumerate(dict.fromkeys(g for _, g in keep))}
    sums = torch.zeros(len(index), dtype=torch.float64)  # (G,) per group
    counts = torch.zeros(len(index), dtype=torch.float64)
    for v, g in keep:
        sums[index[g]] += v
        counts[index[g]] += 1
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(index), (n_boot, len(index)), generator=gen)  # (n_boot, G)
    means = sums[idx].sum(dim=1) / counts[idx].sum(dim=1)
    q = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means, q).tolist()
    return {"mean": float(sums.sum() / counts.sum()), "ci": [lo, hi], "n": len(keep)}


def bootstrap_difference(
    a: Sequence[float], b: Sequence[float], n_boot: int = 2000, seed: int = 0, alpha: float = 0.05
) -> dict[str, Any]:
    """{"mean", "ci": [lo, hi]} of mean(a) - mean(b) for two independent samples (e.g. per-prompt
    values on the real prompts and on the placebo's prompts): each is resampled on its own (a's
    draws first, then b's, from one generator seeded `seed`) and the interval is the percentile
    interval of the differences of resampled means, at level 1 - `alpha`. Values must be finite,
    and each sample needs at least one value (a ValueError names the empty one).
    """
    import torch

    for name, values in (("a", a), ("b", b)):
        if len(values) == 0:
            raise ValueError(f"bootstrap_difference: sample {name} is empty; a difference of "
                             "means needs at least one value on each side")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    means = []
    for values in (a, b):
        x = torch.tensor(list(values), dtype=torch.float64)  # (n,)
        idx = torch.randint(0, len(x), (n_boot, len(x)), generator=gen)
        means.append((float(x.mean()), x[idx].mean(dim=1)))
    q = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)
    lo, hi = torch.quantile(means[0][1] - means[1][1], q).tolist()
    return {"mean": means[0][0] - means[1][0], "ci": [lo, hi]}
