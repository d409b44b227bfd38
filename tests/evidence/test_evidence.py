"""gear.evidence: intervals against scipy's own t-test, power against published values and a
simulation, bootstrap intervals against a plain loop over the same draws, and the learning
gate's three conditions, each able to fail on its own."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from gear.evidence import (
    bootstrap,
    bootstrap_difference,
    learning_gate,
    mde,
    paired,
    power_at,
    slope,
    t_interval,
)


def test_t_interval_is_scipys_one_sample_interval():
    values = [0.3, -0.1, 0.25, 0.4, 0.05, 0.12]
    ours = t_interval(values)
    ref = stats.ttest_1samp(values, 0.0).confidence_interval(0.95)
    assert ours["ci"] == pytest.approx([ref.low, ref.high], rel=1e-12)
    assert ours["sd"] == pytest.approx(stats.tstd(values))
    assert paired([1.0, 2.0, 4.0], [0.5, 1.0, 1.0])["mean"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="equal lengths"):
        paired([1.0], [1.0, 2.0])


def test_power_matches_the_textbook_value_and_a_simulation():
    # paired t-test, d = 1, n = 10, two-sided alpha 0.05: power 0.8031 (G*Power; Cohen 1988)
    assert power_at(1.0, 1.0, 10) == pytest.approx(0.8031, abs=5e-4)
    rng = random.Random(0)
    hits = 0
    for _ in range(4000):
        x = [rng.gauss(0.5, 1.0) for _ in range(12)]
        hits += stats.ttest_1samp(x, 0.0).pvalue < 0.05
    assert power_at(0.5, 1.0, 12) == pytest.approx(hits / 4000, abs=0.025)
    assert power_at(mde(0.4, 12), 0.4, 12) == pytest.approx(0.8, abs=1e-3)
    assert math.isnan(mde(0.4, 1))


def loop_bootstrap(values, groups, n_boot=2000, seed=0):
    """The grouped percentile bootstrap as a plain loop over the same draws (torch's generator,
    one row of group indices per resample), quantiles by numpy."""
    labels = list(dict.fromkeys(groups))
    draws = torch.randint(
        0, len(labels), (n_boot, len(labels)), generator=torch.Generator().manual_seed(seed)
    )
    means = []
    for draw in draws.tolist():
        rows = [v for k in draw for v, g in zip(values, groups, strict=True) if g == labels[k]]
        means.append(sum(rows) / len(rows))
    return list(np.quantile(means, [0.025, 0.975]))


def test_bootstrap_is_the_plain_loop_over_groups_and_drops_nan():
    rng = random.Random(3)
    values = [rng.gauss(0.4, 1.0) for _ in range(40)]
    groups = [f"prompt{rng.randint(0, 9)}" for _ in values]
    ours = bootstrap([*values, math.nan], [*groups, "prompt0"])
    assert ours["n"] == 40 and ours["mean"] == pytest.approx(sum(values) / 40)
    assert ours["ci"] == pytest.approx(loop_bootstrap(values, groups), rel=1e-9)
    assert bootstrap([math.nan])["n"] == 0


def test_a_grouped_bootstrap_resamples_prompts_not_rows():
    values, groups = [0.0] * 5 + [1.0] * 5, ["a"] * 5 + ["b"] * 5
    assert bootstrap(values, groups)["ci"] == [0.0, 1.0]  # two prompts: any mix of them
    lo, hi = bootstrap(values)["ci"]  # ten independent rows: a narrower interval
    assert 0.1 < lo < 0.5 < hi < 0.9


def test_bootstrap_of_many_normal_values_is_close_to_the_t_interval():
    rng = random.Random(0)
    values = [rng.gauss(1.0, 2.0) for _ in range(400)]
    boot, t = bootstrap(values, n_boot=4000)["ci"], t_interval(values)["ci"]
    assert boot == pytest.approx(t, abs=0.04)  # half-width ~0.2: agreement within 20%


def test_bootstrap_difference_resamples_each_sample_on_its_own():
    a, b = [0.9, 0.5, 0.7, 0.8, 0.6], [0.1, 0.3, 0.2]
    ours = bootstrap_difference(a, b, n_boot=500, seed=4)
    gen = torch.Generator().manual_seed(4)
    draws = [torch.randint(0, len(x), (500, len(x)), generator=gen).tolist() for x in (a, b)]
    diffs = [
        sum(a[i] for i in da) / len(a) - sum(b[i] for i in db) / len(b)
        for da, db in zip(*draws, strict=True)
    ]
    assert ours["mean"] == pytest.approx(0.7 - 0.2)
    assert ours["ci"] == pytest.approx(list(np.quantile(diffs, [0.025, 0.975])), rel=1e-9)


def test_bootstrap_difference_names_an_empty_sample():
    with pytest.raises(ValueError, match="sample b is empty"):
        bootstrap_difference([0.5, 0.7], [])
    with pytest.raises(ValueError, match="sample a is empty"):
        bootstrap_difference([], [0.5])


def test_slope_is_least_squares():
    assert slope([1.0, 3.0, 5.0]) == pytest.approx(2.0)
    assert slope([0.2, 0.1, 0.3, 0.2]) == pytest.approx(
        stats.linregress(range(4), [0.2, 0.1, 0.3, 0.2]).slope
    )


UP = [[0.2, 0.25, 0.3, 0.35]] * 8


def test_the_gate_passes_only_when_all_three_conditions_hold():
    before = [0.30] * 8
    after = [0.40, 0.42, 0.38, 0.45, 0.41, 0.39, 0.43, 0.40]
    ok = learning_gate(before, after, UP)
    assert ok["passed"] and all(ok["checks"].values())
    assert ok["paired"]["n"] == 8 and ok["paired"]["ci"][0] > 0

    few = learning_gate(before[:7], after[:7], UP[:7])  # too few seeds
    assert not few["passed"] and few["checks"] == {
        "n >= 8": False,
        "paired interval above 0": True,
        "training reward trend > 0": True,
    }
    noisy = learning_gate(before, [0.1, 0.6, 0.2, 0.5, 0.3, 0.5, 0.2, 0.6], UP)  # interval holds 0
    assert not noisy["passed"] and not noisy["checks"]["paired interval above 0"]
    flat = learning_gate(before, after, [[0.35, 0.3, 0.25, 0.2]] * 8)  # reward falls
    assert not flat["passed"] and flat["checks"] == {
        "n >= 8": True,
        "paired interval above 0": True,
        "training reward trend > 0": False,
    }
    with pytest.raises(ValueError, match="one entry per seed"):
        learning_gate(before, after, UP[:3])
