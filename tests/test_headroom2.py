"""Issue 67's headroom rule as code: the regime choice from the implicit-credit table
(`studies.implicit_credit.choose_regime`) and the runs' commands (`studies.headroom2`)."""

from __future__ import annotations

import pytest

from studies import headroom2
from studies import implicit_credit as ic


def regime(branch_rows=40, mixed=0.7, pass_rate=0.4, after=0.5, gap=4.0) -> dict:
    return {"mixed_groups": mixed, "pass_rate": pass_rate,
            "grpo": {"gear/branch_rows": branch_rows, "gear/branch_error_after": after,
                     "gear/branch_to_error_tokens": gap}}  # fmt: skip


def table(**regs) -> dict:
    base = {n: regime(after=0.1) for n in ic.CANDIDATES}
    return {"regimes": base | regs}


def test_the_largest_excess_blame_among_eligible_regimes_wins():
    got = ic.choose_regime(table(**{"sft32-T0.7": regime(after=0.9, gap=5.0)}))
    assert got["regime"] == "sft32-T0.7" and ic.excess_blame(regime(after=0.9, gap=5.0)) == 4.5


@pytest.mark.parametrize(
    "bad", [dict(branch_rows=29), dict(mixed=0.49), dict(pass_rate=0.9), dict(pass_rate=0.1)]
)
def test_an_ineligible_regime_is_not_chosen_however_high_its_score(bad):
    got = ic.choose_regime(table(**{"sft32-T0.7": regime(after=0.9, gap=9.0, **bad)}))
    assert got["regime"] != "sft32-T0.7"


def test_within_ten_percent_t1_then_the_earlier_step_wins():
    near = {"sft32-T0.7": regime(gap=4.0), "sft32-T1.0": regime(gap=3.7),
            "sft16-T1.0": regime(gap=3.8)}  # fmt: skip
    assert ic.choose_regime(table(**near))["regime"] == "sft16-T1.0"
    far = {"sft32-T0.7": regime(gap=4.0), "sft16-T1.0": regime(gap=3.5)}
    assert ic.choose_regime(table(**far))["regime"] == "sft32-T0.7"


def test_with_none_eligible_the_most_mixed_regime_is_said_as_such():
    regs = {n: regime(branch_rows=0, mixed=0.3 + 0.1 * k) for k, n in enumerate(ic.CANDIDATES)}
    got = ic.choose_regime({"regimes": regs})
    assert got["regime"] == ic.CANDIDATES[-1] and got["eligible"] == [] and "none" in got["why"]


def test_every_run_reads_the_frozen_recipe_the_regimes_temperature_and_the_rate(monkeypatch):
    monkeypatch.setattr(headroom2, "regime", lambda: {"model": "runs/x", "temperature": 1.0})
    cmd = headroom2.command(headroom2.RUNS / "pilot", ("grpo", "oracle"), [100], "grpo", 3e-4)
    text = " ".join(cmd)
    assert "--config studies/headroom2_recipe.yaml" in text and "--model runs/x" in text
    assert "temperature=1" in text and "learning_rate=0.0003" in text
    assert "--only grpo" in text and text.count("--methods") == 2
    assert headroom2.ARMS["oracle"].startswith("oracle=first_error@")
