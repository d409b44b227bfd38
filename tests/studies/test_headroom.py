"""Issue 58's analysis (`studies.headroom`) on synthetic runs: the gate and headroom of stage A,
stage B's Bonferroni intervals and share of the oracle's gain, the rule's n formula."""

from __future__ import annotations

import pytest

from gear.evidence import paired
from studies import headroom


def _ci95(r: dict, arm: str) -> list[float]:
    seeds = sorted(r[arm])
    return paired([r[arm][s]["after"]["mean_reward"] for s in seeds],
                  [r["grpo"][s]["after"]["mean_reward"] for s in seeds])["ci"]  # fmt: skip


def run(after: float, before: float = 0.40) -> dict:
    return {"before": {"mean_reward": before, "pass@1": before},
            "after": {"mean_reward": after, "pass@1": after}, "reward": [0.3, 0.4, 0.5],
            "steps": [1, 2, 3]}  # fmt: skip


GRPO = [0.50, 0.52, 0.47, 0.55, 0.49]


def runs(**deltas: list[float]) -> dict:
    out = {"grpo": {s: run(a) for s, a in enumerate(GRPO)}}
    for arm, ds in deltas.items():
        out[arm] = {s: run(GRPO[s] + d) for s, d in enumerate(ds)}
    return out


def test_headroom_needs_the_oracles_interval_above_zero_and_the_gate():
    seeds = list(range(5))
    win = headroom.stage_a(runs(oracle=[0.08, 0.10, 0.09, 0.11, 0.07]), seeds)
    assert win["gate"]["passed"] and win["headroom"] and win["missing"] == []
    null = headroom.stage_a(runs(oracle=[0.05, -0.06, 0.02, -0.01, 0.0]), seeds)
    assert null["gate"]["passed"] and not null["headroom"]
    assert null["oracle_minus_grpo"]["ci"][0] < 0 < null["oracle_minus_grpo"]["ci"][1]
    partial = headroom.stage_a(runs(oracle=[0.08, 0.10, 0.09]), seeds)
    assert partial["seeds"] == [0, 1, 2] and partial["missing"] == [3, 4]


def test_stage_b_reads_each_arm_at_bonferroni_and_its_share_of_the_oracles_gain():
    r = runs(
        oracle=[0.10] * 5, lead=[0.04, 0.06, 0.05, 0.05, 0.05], gear=[0.0, 0.01, -0.01, 0.0, 0.0]
    )
    b = headroom.stage_b(r, list(range(5)))
    assert b["level"] == pytest.approx(0.975)
    assert b["lead"]["wins"] and not b["gear"]["wins"]
    share = b["lead"]["share_of_oracle_gain"]
    assert share["share"] == pytest.approx(0.5) and share["ci95"][0] <= 0.5 <= share["ci95"][1]
    lo, hi = b["lead"]["lead_minus_grpo"]["ci"]
    assert 0 < lo < 0.05 < hi  # a 97.5% interval: wider than the 95% one
    assert (hi - lo) > (lambda c: c[1] - c[0])(_ci95(r, "lead"))


def test_finished_runs_are_kept_and_restored_for_a_later_session(tmp_path, monkeypatch):
    """keep() copies the rule and each finished run's record files (no checkpoints); restore()
    puts them back into an empty work tree, where gear compare finds the runs finished."""
    import json

    from gear.app import compare as study

    studies, copies = tmp_path / "runs", tmp_path / "copies"
    pilot = studies / "pilot"
    run = pilot / "grpo-seed100"
    (run / "checkpoint-8").mkdir(parents=True)
    (pilot / "rule.json").write_text(json.dumps({"arms": ["grpo"], "seeds": [100]}))
    (run / "summary.json").write_text(json.dumps(
        {"seed": 100, "method": "grpo", "eval_before": {"mean_reward": 0.4},
         "eval_after": {"mean_reward": 0.5}}))  # fmt: skip
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.3}\n')
    (run / "rule.sha256").write_text("abc\n")
    headroom.keep(pilot, copies / "pilot", {"grpo": {100: {}}})
    assert (copies / "pilot" / "grpo-seed100" / "summary.json").is_file()
    assert not (copies / "pilot" / "grpo-seed100" / "checkpoint-8").exists()
    monkeypatch.setattr(headroom, "COPIES", copies)
    monkeypatch.setattr(headroom, "PILOT", tmp_path / "new" / "pilot")
    monkeypatch.setattr(headroom, "STUDY", tmp_path / "new" / "study")
    monkeypatch.setattr(headroom, "RUNS", tmp_path / "new")
    monkeypatch.setattr(headroom, "records", lambda: type("R", (), {"get": lambda self, k: None})())
    restored = headroom.restore()
    assert restored == [str(tmp_path / "new" / "pilot" / "grpo-seed100")]
    assert (
        study.run_record(tmp_path / "new" / "pilot" / "grpo-seed100")["after"]["mean_reward"] == 0.5
    )


def test_the_rate_is_chosen_on_grpos_own_gain_and_moves_the_pilot(tmp_path, monkeypatch):
    """Amendment 1: the candidate with the larger GRPO gain is every arm's rate (ties: the larger
    rate); until it is chosen the rule's 5e-4 and its first pilot stand."""
    from gear.evidence import RecordStore

    monkeypatch.setattr(headroom, "records", lambda: RecordStore(tmp_path))
    assert headroom.learning_rate() == 5e-4 and headroom.pilot_dir() == headroom.PILOT
    gains = {1e-4: 0.05, 3e-5: 0.08}
    monkeypatch.setattr(headroom, "finished", lambda out: {"grpo": {200: run(
        0.40 + next(g for lr, g in gains.items() if headroom.lr_dir(lr) == out))}})  # fmt: skip
    chosen = headroom.choose_lr()
    assert chosen["chosen"] == 3e-5 and chosen["learns"]
    assert headroom.learning_rate() == 3e-5 and headroom.pilot_dir().name == "pilot2"
    gains[3e-5] = 0.05  # a tie goes to the larger rate
    assert headroom.choose_lr()["chosen"] == 1e-4
    cmd = headroom.compare_command(headroom.pilot_dir(), headroom.STAGE_A, [100], "grpo", 1e-4)
    assert cmd[cmd.index("learning_rate=0.0001") - 1] == "--set"
    first = headroom.compare_command(headroom.PILOT, headroom.STAGE_A, [100], "grpo")
    assert not any(x.startswith("learning_rate=") for x in first)  # the first pilot's command


def test_choosing_the_rate_waits_for_every_candidate(tmp_path, monkeypatch):
    from gear.evidence import RecordStore

    monkeypatch.setattr(headroom, "records", lambda: RecordStore(tmp_path))
    monkeypatch.setattr(headroom, "finished", lambda out: {})
    with pytest.raises(SystemExit, match=r"0\.0001: GRPO seed 200 has not finished"):
        headroom.choose_lr()
    assert headroom.learning_rate() == 5e-4


def test_a_piece_is_kept_with_its_wall_time_and_exit_code(tmp_path, monkeypatch, capsys):
    """launch() records the piece before it runs (kept if killed) and again with its wall time
    and exit code, then says so (it raised a KeyError there once, after the piece had run)."""
    from gear.evidence import RecordStore

    monkeypatch.setattr(headroom, "records", lambda: RecordStore(tmp_path / "records"))
    monkeypatch.setattr(headroom, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(headroom, "ROOT", tmp_path)
    (tmp_path / "runs" / "sft-seed0").mkdir(parents=True)
    (tmp_path / "runs" / "sft-seed0" / "adapter_config.json").write_text("{}")
    monkeypatch.setattr(headroom, "head_commit", lambda root: "abc")
    monkeypatch.setattr(headroom.subprocess, "call", lambda *a, **k: 0)
    headroom.launch(tmp_path / "runs" / "pilot2", headroom.STAGE_A, [100], "grpo", 1, 3e-5)
    (piece,) = headroom.records().get("pieces")
    assert piece["exit"] == 0 and piece["wall_s"] >= 0 and piece["study"] == "pilot2"
    assert "learning_rate=3e-05" in piece["command"]
    assert "pilot2 grpo: exit 0 after" in capsys.readouterr().out


def test_the_32_step_clause_fires_once_on_grpos_own_gain_and_stage_a_trains_32(
    tmp_path, monkeypatch
):
    """The rule: if the pilot's GRPO gains < +0.02 on average, every run trains 32 steps. The
    rule also re-ran the pilot at 32; amendment 3 dropped that re-run, so `plan` keeps reading
    `pilot2` (never firing again) and stage A's command trains 32 steps."""
    from gear.evidence import RecordStore

    store = RecordStore(tmp_path)
    monkeypatch.setattr(headroom, "records", lambda: store)
    store.put("lr", {"chosen": 3e-5})
    store.put("pieces", [{"study": "pilot2", "wall_s": 3600.0, "threads": 1} for _ in range(6)])
    gains = [0.01, -0.01, 0.02]

    def finished(out):
        assert out.name == "pilot2"
        return {"grpo": {s: run(0.40 + gains[i]) for i, s in enumerate(headroom.PILOT_SEEDS)},
                "oracle": {s: run(0.45) for s in headroom.PILOT_SEEDS}}  # fmt: skip

    monkeypatch.setattr(headroom, "finished", finished)
    assert headroom.steps() == 16 and headroom.pilot_dir().name == "pilot2"
    first = headroom.plan()
    assert first["longer"] and first["steps"] == 16 and "32-step clause fired" in first["next"]
    assert headroom.steps() == 32 and headroom.pilot_dir().name == "pilot2"
    assert store.get("longer")["pilot"] == "pilot2"
    cmd = headroom.compare_command(headroom.STUDY, headroom.STAGE_A, [0], "grpo", 3e-5)
    assert cmd[cmd.index("--steps") + 1] == "32" and cmd[cmd.index("--out") + 1].endswith("study")
    # amendment 2: runs after pilot2 pin the rule's held-out set and share the loss pass's prompts
    assert {"eval_n=200", "eval_samples=8", "loss_prefix_sharing=true"} <= set(cmd)
    # amendment 3: the study's recipe is its own frozen file, not the shipped default.yaml
    assert cmd[cmd.index("--config") + 1] == "studies/headroom_recipe.yaml"
    before = headroom.compare_command(headroom.PILOT2, headroom.STAGE_A, [100], "grpo", 3e-5)
    assert not any(x.startswith(("eval_n=", "loss_prefix_sharing=")) for x in before)
    again = headroom.plan()
    assert again["pilot"] == "pilot2" and again["steps"] == 32 and "next" not in again
    assert again["n"] == 3 and store.get("longer")["pilot"] == "pilot2"


@pytest.mark.parametrize("study_hours, fits", [(6 * 0.8, True), (6 * 1.0, False)])
def test_stage_b_runs_only_if_its_runs_fit_what_is_left_of_the_budget(
    tmp_path, monkeypatch, study_hours, fits
):
    """The rule: with n = 3 forced, stage B runs only if the budget then allows its 2n runs,
    at stage A's measured cost per run (+5% for the teacher); decided once, then kept."""
    from gear.evidence import RecordStore

    store = RecordStore(tmp_path)
    monkeypatch.setattr(headroom, "records", lambda: store)
    # 13 core-hours before stage A, then stage A's 6 runs: left = 24 - 13 - study_hours
    store.put("pieces", [{"study": "pilot2", "wall_s": 13 * 3600.0, "threads": 1},
                         {"study": "study", "wall_s": study_hours * 3600.0, "threads": 1}])  # fmt: skip
    got = headroom.fits_stage_b(3)
    per_run = study_hours / 6
    assert got["core_hours_per_run"] == pytest.approx(per_run)
    assert got["needs"] == pytest.approx(6 * per_run * 1.05)
    assert got["left"] == pytest.approx(24 - 13 - study_hours) and got["fits"] is fits
    store.put("pieces", [])  # decided once: later pieces do not change it
    assert headroom.fits_stage_b(3) == got
    store.put("plan", {"pilot": "pilot2", "n": 3})
    store.put("lr", {"chosen": 3e-5})
    monkeypatch.setattr(headroom, "launch", lambda *a, **k: "launched")
    if not fits:
        with pytest.raises(SystemExit, match="stage B"):
            headroom.main(["study", "--arm", "lead"])
    else:
        headroom.main(["study", "--arm", "lead"])


def test_the_mde_is_the_smallest_effect_with_80_percent_power_and_stage_a_reports_its_own():
    from gear.evidence import power_at

    mde = headroom.min_detectable(0.02, 3)
    assert power_at(mde, 0.02, 3) >= 0.8 > power_at(mde - 0.001, 0.02, 3)
    a = headroom.stage_a(runs(oracle=[0.08, 0.10, 0.09, 0.11, 0.07]), list(range(5)))
    sd = a["oracle_minus_grpo"]["sd"]
    assert a["mde_at_own_sd_descriptive"] == headroom.min_detectable(sd, 5)
    assert headroom.stage_a(runs(oracle=[0.05]), [0])["mde_at_own_sd_descriptive"] is None
