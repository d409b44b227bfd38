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


def test_a_piece_of_some_seeds_names_them_and_resumes_only_its_own(tmp_path, monkeypatch):
    """Two pieces of one arm (placebo seeds 0 and 1, one core each): neither may list the
    other's run, in progress beside it, as one it resumes, nor share its id."""
    import sys

    from gear.evidence import RecordStore
    from studies import headroom

    monkeypatch.setattr(headroom2, "regime", lambda: {"model": "runs/x", "temperature": 1.0})
    cmd = headroom2.command(headroom2.RUNS / "study", ("grpo", "placebo"), [0, 1, 2], "placebo",
                            1e-4, [0, 2])  # fmt: skip
    assert " ".join(cmd).endswith("--only placebo --only-seed 0 --only-seed 2")
    for seed in (0, 1):  # both begun, neither finished
        (tmp_path / f"placebo-seed{seed}").mkdir()
        (tmp_path / f"placebo-seed{seed}" / "config.yaml").write_text("seed: 0\n")
    store = RecordStore(tmp_path / "records")
    noop = [sys.executable, "-c", "pass"]
    pieces = [
        headroom.run_piece(noop, tmp_path, "placebo", 1, tmp_path / "log", store, seeds)
        for seeds in ([0], [1], None)
    ]
    assert [p["resumes"] for p in pieces] == [["placebo-seed0"], ["placebo-seed1"],
                                              ["placebo-seed0", "placebo-seed1"]]  # fmt: skip
    assert [p.get("seeds") for p in pieces] == [[0], [1], None]
    assert len({p["id"] for p in store.get("pieces")}) == 3 and all(p["exit"] == 0 for p in pieces)


# ----------------------------------------------------------------- the plan, stage A, stage B


def run(before: float, after: float, rising: bool = True) -> dict:
    """A finished run's record as `headroom.finished` gives it (held-out metrics, the training
    reward per logged step)."""
    reward = [0.2 + (0.02 * k if rising else 0.0) + 0.01 * (k % 2) for k in range(8)]
    return {"before": {"mean_reward": before, "pass@1": before},
            "after": {"mean_reward": after, "pass@1": after},
            "reward": reward, "steps": list(range(1, 9))}  # fmt: skip


@pytest.fixture
def store(tmp_path, monkeypatch):
    from gear.evidence import RecordStore

    s = RecordStore(tmp_path)
    monkeypatch.setattr(headroom2, "records", lambda: s)
    s.put("lr", {"chosen": 1e-4})
    return s


def pieces(study: str, arms: tuple, hours: float) -> list[dict]:
    return [{"id": f"{study}-{a}", "study": study, "arm": a, "wall_s": hours * 3600,
             "threads": 1} for a in arms]  # fmt: skip


def test_plan_takes_n80_capped_by_the_budget_and_at_least_three(store, monkeypatch):
    pilot = {"grpo": {s: run(0.3, 0.32) for s in headroom2.PILOT_SEEDS},
             "oracle": {s: run(0.3, 0.32 + 0.06 + 0.02 * k)
                        for k, s in enumerate(headroom2.PILOT_SEEDS)}}  # fmt: skip
    monkeypatch.setattr(headroom2.headroom, "finished", lambda out, st=None: pilot)
    # each pilot arm: 3 runs in 2.4 core-hours -> c = 0.8; used = 4.8 + 3.0 (the rate's runs)
    store.put(
        "pieces", pieces("pilot", ("grpo", "oracle"), 2.4) + pieces("lr0.0001", ("grpo",), 3.0)
    )
    p = headroom2.plan()
    assert p["core_hours_per_run"] == pytest.approx(0.8)
    assert p["used_core_hours"] == pytest.approx(7.8)
    assert p["n_cap"] == int((24 - 7.8) // (6.3 * 0.8)) == 3
    assert p["oracle_minus_grpo"]["sd"] == pytest.approx(0.02)
    assert p["n80"] is not None and p["n"] == max(3, min(p["n80"], 3)) == 3
    assert p["seeds"] == [0, 1, 2] and store.get("plan") == p
    store.put("plan", p | {"n": 99})  # kept once: a second call reads the record
    assert headroom2.plan()["n"] == 99


def test_plan_refuses_an_unfinished_pilot(store, monkeypatch):
    monkeypatch.setattr(headroom2.headroom, "finished", lambda out, st=None: {
        "grpo": {100: run(0.3, 0.3)}, "oracle": {100: run(0.3, 0.3)}})  # fmt: skip
    with pytest.raises(SystemExit, match="1 of 3 pairs"):
        headroom2.plan()


def study_runs(oracle_gain: float, grpo_learns: bool = True) -> dict:
    g = [0.30, 0.33, 0.31] if grpo_learns else [0.30, 0.29, 0.31]
    b = 0.25 if grpo_learns else 0.30  # GRPO's held-out before: flat means no gain
    return {"grpo": {s: run(b, g[s], grpo_learns) for s in range(3)},
            "oracle": {s: run(0.25, g[s] + oracle_gain + 0.01 * s) for s in range(3)},
            "placebo": {s: run(0.25, g[s] + 0.005 * s) for s in range(3)},
            "lambda_grpo": {s: run(0.25, g[s] + 0.02 + 0.01 * s) for s in range(3)}}  # fmt: skip


def test_headroom_needs_the_gate_and_the_oracles_interval_above_zero(store):
    plan = {"seeds": [0, 1, 2]}
    store.put("pieces", pieces("study", headroom2.STAGE_A, 2.4))
    yes = headroom2.decide(study_runs(0.08), plan, "interval")
    assert yes["stage_a"]["gate"]["passed"] and yes["stage_a"]["headroom"]
    assert yes["stage_a"]["oracle_minus_grpo"]["ci"][0] > 0
    assert "oracle_minus_placebo" in yes["stage_a"] and "stop" not in yes
    # stage A: 9 runs in 7.2 core-hours (0.8 a run); left 16.8: lambda_grpo 2.4, lead 2.64, gear
    # 2.64 all fit; stage B reads the arms that ran (lambda_grpo here), at 98.33%
    budget = yes["stage_b_budget"]
    assert budget["core_hours_per_run"] == pytest.approx(0.8) and budget["run"] == list(
        headroom2.STAGE_B
    )
    assert yes["stage_b"]["level"] == pytest.approx(1 - 0.05 / 3)
    assert yes["stage_b"]["lambda_grpo"]["seeds"] == [0, 1, 2]
    assert yes["stage_b"]["lead"]["missing"] == [0, 1, 2]
    no = headroom2.decide(study_runs(0.0), plan, "interval")
    assert not no["stage_a"]["headroom"] and no["stop"].startswith("no headroom")
    flat = headroom2.decide(study_runs(0.08, grpo_learns=False), plan, "interval")
    assert not flat["stage_a"]["gate"]["passed"] and flat["stop"].startswith("the gate failed")
    part = study_runs(0.08)
    del part["placebo"][2]
    assert headroom2.decide(part, plan, "interval")["stop"].startswith("stage A is not complete")


def test_stage_b_runs_its_arms_in_order_while_they_fit(store):
    store.put("pieces", pieces("study", headroom2.STAGE_A, 6.0) + pieces("x", ("a",), 10.0))
    # used 18 + 10 = 28 > 24: nothing fits; then with less used, lambda_grpo (n c = 6) only
    assert headroom2.stage_b_budget(3)["not_run"] == list(headroom2.STAGE_B)
    (store.root / "stage_b_budget.json").unlink()
    store.put("pieces", pieces("study", headroom2.STAGE_A, 2.4))
    store.put("pieces", store.get("pieces") + pieces("x", ("a",), 8.0))  # left: 24 - 15.2
    got = headroom2.stage_b_budget(3)  # c 0.8: lambda_grpo 2.4, lead 2.64, gear 2.64 -> 7.68
    assert got["run"] == list(headroom2.STAGE_B) and got["needs"] == pytest.approx(7.68)
    (store.root / "stage_b_budget.json").unlink()
    store.put("pieces", store.get("pieces") + pieces("y", ("a",), 3.0))  # left: 5.8
    assert headroom2.stage_b_budget(3)["run"] == ["lambda_grpo", "lead"]
    assert headroom2.study_arms() == (*headroom2.STAGE_A, "lambda_grpo", "lead")
