"""The real-LM comparison's machinery (studies/lm_learning.py, issue 37): the arms' keys, the
round-by-round schedule with the rule's reused runs, the choice of the context arm, and the
rule's analysis on synthetic records. No training runs."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest

from studies import lm_learning as ll


def fake(arm: str, seed: int, after: float, before: float = 0.3) -> dict:
    return {
        "name": f"{arm}-seed{seed}",
        "seed": seed,
        "before": {"mean_reward": before},
        "after": {"mean_reward": after, "pass@1": after},
        "reward": [0.2, 0.3, 0.4],
        "step_seconds": [60.0],
        "resumed": False,
        "wall_s": 1800.0,
        "capability": "AVX2",
        "config": {"trainer": {"max_steps": 16}},
    }


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """Empty record folders for both studies, and no teacher-context result."""
    monkeypatch.setattr(ll, "RECORDS", tmp_path / "lm_learning_runs")
    monkeypatch.setattr(ll.lm_recipe, "RECORDS", tmp_path / "lm_recipe_runs")
    monkeypatch.setattr(ll, "RESULTS", tmp_path)
    monkeypatch.setattr(ll, "best_context", lambda path=None: None)
    (tmp_path / "lm_recipe_runs").mkdir()
    return tmp_path


def test_every_arm_is_the_default_recipe_with_keys_gear_train_accepts():
    from gear.app.config import resolve_config
    from gear.integrations.trl import GEARConfig

    for arm, keys in ll.ARMS.items():
        keys = {**keys, "teacher_context": "contrast"} if "teacher_context" in keys else keys
        cfg = resolve_config(None, keys)
        GEARConfig(output_dir="/tmp/x", **{**cfg.trainer, "bf16": False, "use_cpu": True})
        if arm == "gear":
            assert cfg.trainer["credit_method"] == "gear" and cfg.trainer["kl_estimator"] == "full"


def test_schedule_goes_round_by_round_and_reads_the_reused_runs(dirs):
    for s in range(8):  # issue 35's gate runs are the grpo arm's seeds 0-7
        path = dirs / "lm_recipe_runs" / f"gate-lora16_lr5e-4-grpo-seed{s}.json"
        path.write_text(json.dumps(fake("grpo", s, 0.7)))
    for s in range(5):  # and the main job's runs gear's seeds 0-4
        path = dirs / "lm_recipe_runs" / f"main-default-default-seed{s}.json"
        path.write_text(json.dumps(fake("gear", s, 0.7)))
    jobs = ll.schedule(6)
    # seed 0 of every runnable arm before any seed 1; grpo and gear reused; the context arm waits
    assert [a for a, s in jobs if s == 0] == ["gear_k1", "rlsd", "departure_blame_k1", "oar_g"]
    assert jobs.index(("oar_g", 0)) < jobs.index(("gear_k1", 1))
    assert ("gear", 5) in jobs and not any(a == "gear" and s < 5 for a, s in jobs)
    assert all(a != "grpo" for a, _ in jobs)
    assert ll.record("grpo", 3)["reused_from"].endswith("gate-lora16_lr5e-4-grpo-seed3.json")
    assert ll.record("grpo", 8) is None


def test_context_arm_takes_the_larger_corrected_L_under_k1_and_waits_while_partial(tmp_path):
    def result(partial: bool, ao: float, co: float) -> Path:
        def ctx(v):
            return {"k1": {"methods": {"gear": {"L": {"corrected": v}}}}}

        path = tmp_path / "tc.json"
        path.write_text(
            json.dumps(
                {"partial": partial, "contexts": {"answer_only": ctx(ao), "contrast": ctx(co)}}
            )
        )
        return path

    assert ll.best_context(result(True, 0.3, 0.1)) is None
    assert ll.best_context(result(False, 0.3, 0.1)) == "answer_only"
    assert ll.best_context(result(False, 0.1, 0.3)) == "contrast"
    assert ll.best_context(tmp_path / "missing.json") is None


def runs_with(gains: dict[str, list[float]], base: list[float]) -> dict[str, list[dict]]:
    runs = {"grpo": [fake("grpo", s, a) for s, a in enumerate(base)]}
    for arm in ll.CANDIDATES:
        g = gains.get(arm, [0.0] * len(base))
        runs[arm] = [fake(arm, s, a + d) for s, (a, d) in enumerate(zip(base, g, strict=True))]
    return runs


BASE = [0.62, 0.70, 0.66, 0.74, 0.68, 0.71, 0.65, 0.69]  # after; before 0.3 (the gate passes)


def test_analysis_picks_only_a_stable_candidate_whose_bonferroni_interval_clears_zero():
    clear = [0.10, 0.12, 0.11, 0.09, 0.10, 0.13, 0.11, 0.10]
    noisy = [0.2, -0.15, 0.25, -0.1, 0.3, -0.05, 0.2, -0.1]  # mean > 0, interval spans 0
    out = ll.analyse(runs_with({"gear_k1": clear, "rlsd": noisy}, BASE))
    assert out["gate"]["passed"]
    assert out["beats_baseline"] == ["gear_k1"] and out["winner"] == "gear_k1"
    assert out["comparisons"]["gear_k1"]["level"] == pytest.approx(1 - 0.05 / 6)
    # the Bonferroni interval is wider than the 95% one
    c = out["comparisons"]["rlsd"]
    assert c["bonferroni"]["ci"][0] < c["ci95"][0]
    # the same clear gain on an arm with one seed below its warm start: unstable, not chosen
    runs = runs_with({"oar_g": clear}, BASE)
    runs["oar_g"][3]["after"]["mean_reward"] = 0.25
    out = ll.analyse(runs)
    assert out["stability"]["oar_g"]["below_before"] == [3]
    assert "oar_g" not in out["beats_baseline"]


def test_no_comparison_when_the_baseline_does_not_learn():
    flat = [0.31, 0.29, 0.30, 0.28, 0.32, 0.29, 0.30, 0.31]  # grpo does not beat before (0.3)
    out = ll.analyse(runs_with({"gear": [0.2] * 8}, flat))
    assert not out["gate"]["passed"]
    assert out["winner"] is None and out["beats_baseline"] == []


def assert_close(mine, theirs, where: str) -> None:
    """Equal structure and values, floats to 1e-9 relative (JSON keeps 17 digits)."""
    if isinstance(theirs, dict):
        assert set(mine) == set(theirs), where
        for k in theirs:
            assert_close(mine[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list):
        assert len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_close(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert mine == pytest.approx(theirs, rel=1e-9), where
    else:
        assert mine == theirs, where


def test_the_committed_comparisons_are_reproduced_through_the_shared_analysis():
    """studies/results/lm_learning.json's analysis, from its committed records (issue 37's
    own and issue 35's reused ones) through `gear.evidence.compare_arms`, the analysis `gear
    compare` runs: the gate, every interval, power and MDE, stability and the decision."""
    committed = json.loads((ll.RESULTS / "lm_learning.json").read_text())
    seeds = committed["seeds"]
    runs = {arm: [ll.record(arm, s) for s in seeds] for arm in ll.ARMS}
    grid = range(committed["seeds_asked"])
    gate_runs = [r for s in grid if (r := ll.record(ll.BASELINE, s)) is not None]
    out = ll.analyse(runs, gate_runs)
    for key in ("gate", "stability", "beats_baseline", "winner", "grpo_beats_gear",
                "reward_slope"):  # fmt: skip
        assert_close(out[key], committed[key], key)
    assert set(out["comparisons"]) == set(committed["comparisons"])
    for arm, c in committed["comparisons"].items():
        mine = {k: out["comparisons"][arm][k] for k in c}  # the shared analysis adds keys
        assert_close(mine, c, arm)
        assert out["comparisons"][arm]["seeds"] == seeds
    assert ll.decision(committed | out) == committed["decision"]


def test_every_candidate_has_a_placebo_gear_train_accepts():
    from gear.app.config import resolve_config
    from gear.integrations.trl import GEARConfig

    for arm in ll.CANDIDATES:
        if arm == "gear_k1_context":
            continue  # C* comes from issue 36's result; its keys are gear_k1's plus a context
        keys = ll.placebo_keys(arm)
        assert keys["credit_method"] == "random_shape"
        assert keys["credit_shape_method"] == ll.ARMS[arm].get("credit_method", "gear")
        assert {k: v for k, v in keys.items() if not k.startswith("credit_")} == {
            k: v for k, v in ll.ARMS[arm].items() if not k.startswith("credit_")
        }
        cfg = resolve_config(None, keys)
        GEARConfig(output_dir="/tmp/x", **{**cfg.trainer, "bf16": False, "use_cpu": True})


def write_grid(dirs: Path, after: dict[str, list[float]]) -> None:
    (dirs / "lm_learning_runs").mkdir(exist_ok=True)
    for arm, values in after.items():
        for s, a in enumerate(values):
            path = dirs / "lm_learning_runs" / f"{arm}-seed{s}.json"
            path.write_text(json.dumps(fake(arm, s, a)))


@pytest.fixture
def study(dirs, monkeypatch):
    """`dirs` with no reused runs, C* fixed, and the rule's commit stubbed; n = 8 seeds."""
    monkeypatch.setattr(ll, "REUSED", {})
    monkeypatch.setattr(ll, "SEEDS", 8)
    monkeypatch.setattr("gear.evidence.first_commit", lambda *a: "abc")
    monkeypatch.setattr(ll, "keys_of", lambda arm: dict(ll.ARMS[arm]))
    return dirs


GAIN = [0.10, 0.12, 0.11, 0.09, 0.10, 0.13, 0.11, 0.10]


def grid_won_by(dirs: Path, winner: str) -> None:
    """Eight rounds where every arm scores as grpo but `winner`, which gains GAIN."""
    after = {arm: BASE for arm in ll.ARMS}
    after[winner] = [b + g for b, g in zip(BASE, GAIN, strict=True)]
    write_grid(dirs, after)


def test_report_waits_for_every_round_unless_the_budget_ended(study, monkeypatch):
    dirs = study
    monkeypatch.setattr(ll, "SEEDS", 4)
    monkeypatch.setattr(ll, "DISCARDED", [{"run": "x", "wall_s": 1800.0}])
    # three complete rounds, seed 3 done by grpo alone (an incomplete round)
    after = {arm: [b + 0.01 for b in BASE[:3]] for arm in ll.ARMS}
    after["grpo"] = BASE[:4]
    write_grid(dirs, after)
    with pytest.raises(SystemExit, match="3 of 4 rounds complete"):
        ll.report(4, dirs / "out.json", figure=dirs / "fig.png")
    # 11.5 core-hours used by 22 runs: round 3's six missing runs (3.1) still fit 24
    with pytest.raises(SystemExit, match="still fits round 3"):
        ll.report(4, dirs / "out.json", final=True, figure=dirs / "fig.png")
    assert not (dirs / "out.json").exists()
    monkeypatch.setattr(ll, "BUDGET_CORE_HOURS", 12.0)  # they do not fit 12
    result = ll.report(4, dirs / "out.json", final=True, figure=dirs / "fig.png")
    assert result["seeds"] == [0, 1, 2] and not result["complete"]
    assert json.loads((dirs / "out.json").read_text())["decision"] == result["decision"]
    assert "3 of 4 rounds" in result["decision"]
    for key in ("arms", "seeds", "steps", "metric", "gate", "paired", "power", "rule_commit",
                "decision", "machine", "budget"):  # fmt: skip
        assert key in result, key
    # the gate reads all four grpo runs, the comparisons the three complete rounds
    assert result["gate"]["seeds"] == [0, 1, 2, 3]
    assert result["comparisons"]["gear"]["bonferroni"]["n"] == 3
    # every new run's wall time counts against the budget (7 arms x 3 + 1, 30 min each), and
    # so does every discarded piece
    assert result["budget"]["new_runs"] == 22
    assert result["budget"]["core_hours_used"] == pytest.approx(11.5)
    # the analysis runs once: more rounds later, or another n, are refused
    for arm in ll.ARMS:  # round 3 completes after the analysis ran at round 3
        path = dirs / "lm_learning_runs" / f"{arm}-seed3.json"
        path.write_text(json.dumps(fake(arm, 3, 0.7)))
    with pytest.raises(SystemExit, match="analyses once"):
        ll.report(4, dirs / "out.json", final=True, figure=dirs / "fig.png")
    with pytest.raises(SystemExit, match="the rule's n is 4"):
        ll.report(3, dirs / "other.json", final=True, figure=dirs / "fig.png")
    assert (dirs / "fig.png").stat().st_size > 10_000


def test_a_round_starts_only_if_it_ends_within_the_budget(study, monkeypatch, capsys):
    dirs = study  # 8 seeds asked, 7 arms
    monkeypatch.setattr(ll, "DISCARDED", [{"run": "x", "wall_s": 3600.0}])
    after = {arm: BASE[:2] for arm in ll.ARMS}  # rounds 0-1: 14 runs x 0.5 h + 1 h = 8 h
    after["gear"] = BASE[:3]  # and one run of round 2: 15 runs, 8.5 h, 0.567 h per run
    write_grid(dirs, after)
    b = ll.budget(8)
    assert b["core_hours_used"] == pytest.approx(8.5)
    assert b["core_hours_per_run"] == pytest.approx(8.5 / 15)
    # round 2 lacks 6 runs (3.4 h -> 11.9), rounds 3.. 7 each (4.0 h): 15.9, 19.8, 23.8, 27.7
    assert b["rounds_in_budget"] == 6
    ll.status(8)
    assert "rounds 0-5 fit the budget: run `grid --seeds 6` (round 6 would end past 24)" in (
        capsys.readouterr().out
    )
    # once spent, the complete rounds still count as in the budget and nothing more fits
    monkeypatch.setattr(ll, "BUDGET_CORE_HOURS", 5.0)
    assert ll.budget(8)["rounds_in_budget"] == 2


def test_a_winner_becomes_the_default_only_if_it_beats_its_placebo(study):
    dirs = study
    grid_won_by(dirs, "gear_k1")
    out, fig = dirs / "out.json", dirs / "fig.png"
    result = ll.report(8, out, figure=fig)
    assert result["winner"] == "gear_k1" and "placebo runs next" in result["decision"]
    assert result["placebo"]["keys"]["credit_shape_method"] == "gear"
    # README's lines come from the JSON: every candidate with its Bonferroni interval
    text = ll.readme_summary(result)
    for arm in ll.CANDIDATES:
        b = result["comparisons"][arm]["bonferroni"]
        assert f"`{arm}` {b['mean']:+.3f} [{b['ci'][0]:+.3f}, {b['ci'][1]:+.3f}]" in text
    assert result["decision"] in text
    for s, b in enumerate(BASE):  # the placebo does as well as the winner: not a real win
        path = dirs / "lm_learning_runs" / f"placebo-gear_k1-seed{s}.json"
        path.write_text(json.dumps(fake("gear_k1", s, b + GAIN[s] + 0.01 * (s % 2))))
    result = ll.report(8, out, figure=fig)
    assert not result["placebo"]["passed"] and "keeps the paper's GEAR" in result["decision"]
    for s, b in enumerate(BASE):  # a placebo at GRPO's level: the winner's placement matters
        path = dirs / "lm_learning_runs" / f"placebo-gear_k1-seed{s}.json"
        path.write_text(json.dumps(fake("gear_k1", s, b + 0.005 * (s % 3))))
    result = ll.report(8, out, figure=fig)
    assert result["placebo"]["passed"] and "becomes gear train's default" in result["decision"]
    # placebo records are not grid runs: they do not enter the grid's budget
    assert result["budget"]["new_runs"] == 8 * len(ll.ARMS)


def test_an_oar_g_winner_is_reported_with_its_placebo_to_run(study):
    grid_won_by(study, "oar_g")
    result = ll.report(8, study / "out.json", figure=study / "fig.png")
    assert result["winner"] == "oar_g" and result["placebo"]["runs"] == 0
    assert result["placebo"]["keys"]["credit_shape_method"] == "oar_g"
    assert "placebo runs next" in result["decision"]


def test_readme_lines_compare_nothing_when_the_gate_fails():
    flat = [0.31, 0.29, 0.30, 0.28, 0.32, 0.29, 0.30, 0.31]
    result = {"seeds": list(range(8)), "before": 0.3, "power": {"alpha": 0.05 / 6}}
    result |= ll.analyse(runs_with({"gear": [-0.2] * 8}, flat))
    result["decision"] = ll.decision(result | {"seeds_asked": 11})
    text = ll.readme_summary(result)
    assert "gate failed" in text and "`gear`" not in text
    assert not result["grpo_beats_gear"]  # step 5 needs the gate too


def steps_of(rewards: list[float]) -> list[dict]:
    return [{"reward": r, "loss": 0.1, "grad_norm": 0.2, "gear/kl_mean": None} for r in rewards]


@pytest.fixture
def pipeline(study, monkeypatch):
    """The placebo's pipeline check with stubbed runs: `pipeline[tree]` is what the run from
    each tree logs ('grid', 'head'); `pipeline["runs"]` lists the runs made. rlsd seed 0's grid
    record logged rewards [0.2, 0.3, 0.4] on AVX2, the CPU class of this stubbed machine."""
    logs = {"grid": steps_of([0.2, 0.3, 0.4]), "head": steps_of([0.2, 0.3, 0.4]), "runs": []}

    def first_steps(keys, seed, n, run_dir, src):
        logs["runs"].append(run_dir.name)
        return logs[run_dir.name.split("-")[-1]]

    monkeypatch.setattr(ll, "first_steps", first_steps)
    monkeypatch.setattr(ll, "grid_tree", lambda: nullcontext(study / "grid_tree"))
    monkeypatch.setattr(ll, "uncommitted", lambda *a: "")
    monkeypatch.setattr("torch.backends.cpu.get_cpu_capability", lambda: "AVX2")
    (study / "lm_learning_runs").mkdir()
    (study / "lm_learning_runs" / "rlsd-seed0.json").write_text(json.dumps(fake("rlsd", 0, 0.5)))
    return logs


def test_placebo_refuses_to_run_when_the_pipeline_changed_since_the_grid(
    study, pipeline, monkeypatch
):
    ran = []
    monkeypatch.setattr(ll.lm_recipe, "train", lambda name, *a: ran.append(name))
    pipeline["head"] = steps_of([0.2, 0.3, 0.4375])
    with pytest.raises(RuntimeError, match="differ"):
        ll.placebo("rlsd", 3, workers=1)
    assert ran == []
    check = json.loads((study / "lm_learning_placebo_check.json").read_text())
    assert check["arm"] == "rlsd" and not check["equal"]
    assert {d["key"] for d in check["differ"]} == {"reward"}


def test_pipeline_check_compares_with_the_grids_record_on_its_cpu_class(study, pipeline):
    # today's two trees agree, but not with what the grid logged on this CPU class
    pipeline["grid"] = pipeline["head"] = steps_of([0.2, 0.3, 0.5])
    check = ll.pipeline_check("rlsd")
    assert not check["equal"] and check["differ"] == [
        {"step": 3, "key": "reward", "record": 0.4, "head": 0.5}
    ]
    # a record from another CPU class cannot be matched digit for digit: the trees are compared
    path = study / "lm_learning_runs" / "rlsd-seed0.json"
    path.write_text(json.dumps(fake("rlsd", 0, 0.5) | {"capability": "AVX512"}))
    check = ll.pipeline_check("rlsd", out=study / "other.json")
    assert check["equal"] and not check["against_record"]


def test_pipeline_check_is_reused_only_for_the_same_arm_keys_and_code(study, pipeline, monkeypatch):
    first = ll.pipeline_check("rlsd")
    assert first["equal"] and first["against_record"]
    assert ll.pipeline_check("rlsd") == first and len(pipeline["runs"]) == 2  # reused
    keys = dict(ll.ARMS["rlsd"])
    monkeypatch.setattr(ll, "keys_of", lambda arm: keys | {"credit_rlsd_lambda": 0.3})
    ll.pipeline_check("rlsd")
    assert len(pipeline["runs"]) == 4  # other keys: run again
    monkeypatch.setattr(ll, "uncommitted", lambda *a: " M src/gear/run.py")
    with pytest.raises(RuntimeError, match="commit the code first"):
        ll.pipeline_check("rlsd")


def test_placebo_runs_the_winners_missing_seeds_under_random_shape(study, pipeline, monkeypatch):
    ran = []
    monkeypatch.setattr(ll.lm_recipe, "ensure_before", lambda *a: None)
    monkeypatch.setattr(
        ll.lm_recipe,
        "train",
        lambda name, keys, *a: ran.append((name, keys)) or {"name": name, "wall_s": 1.0},
    )
    (study / "lm_learning_runs" / "placebo-rlsd-seed1.json").write_text("{}")
    ll.placebo("rlsd", 3, workers=1)
    assert json.loads((study / "lm_learning_placebo_check.json").read_text())["equal"]
    assert [n for n, _ in ran] == ["placebo-rlsd-seed0", "placebo-rlsd-seed2"]
    assert all(
        k["credit_method"] == "random_shape" and k["credit_shape_method"] == "rlsd" for _, k in ran
    )
    # every placebo run kept: nothing to run, so no check either
    for s in (0, 2):
        (study / "lm_learning_runs" / f"placebo-rlsd-seed{s}.json").write_text("{}")
    (study / "lm_learning_placebo_check.json").unlink()
    ll.placebo("rlsd", 3, workers=1)
    assert len(pipeline["runs"]) == 2 and not (study / "lm_learning_placebo_check.json").exists()


# ----------------------------------------------------------------------------- post-hoc (53)


def test_the_post_hoc_arms_are_keys_gear_train_accepts():
    from gear.app.config import resolve_config
    from gear.integrations.trl import GEARConfig

    for keys in ll.POST_HOC.values():
        cfg = resolve_config(None, keys)
        GEARConfig(output_dir="/tmp/x", **{**cfg.trainer, "bf16": False, "use_cpu": True})
    assert ll.POST_HOC[ll.POST_HOC_ARM]["credit_oar_span"] == "answer"
    assert not set(ll.POST_HOC) & set(ll.ARMS)  # beside the rule's arms, never one of them


@pytest.fixture
def analysed(study, pipeline, monkeypatch):
    """The rule's result over seeds 0-2 (grpo and oar_g recorded), with runs stubbed: each
    post-hoc run writes a record whose score is 0.1 above grpo's."""
    monkeypatch.setattr(ll, "RUNS", study / "runs")
    monkeypatch.setattr(ll.lm_recipe, "ensure_before", lambda *a: None)
    for s, after in enumerate([0.60, 0.70, 0.65]):
        for arm, a in (("grpo", after), ("oar_g", after - 0.02)):
            path = study / "lm_learning_runs" / f"{arm}-seed{s}.json"
            path.write_text(json.dumps(fake(arm, s, a)))
    out = study / "lm_learning.json"
    out.write_text(json.dumps({"seeds": [0, 1, 2], "comparisons": {"oar_g": {"x": 1}}}, indent=1))
    ran = []

    def train(name, keys, seed, meta, runs, records):
        ran.append(name)
        grpo = json.loads((records / f"grpo-seed{seed}.json").read_text())
        r = fake(meta["arm"], seed, grpo["after"]["mean_reward"] + 0.1) | {"name": name, **meta}
        (records / f"{name}.json").write_text(json.dumps(r))
        return r

    monkeypatch.setattr(ll.lm_recipe, "train", train)
    return out, ran


def test_posthoc_runs_the_analysed_seeds_and_reports_beside_the_rule(analysed):
    out, ran = analysed
    before = json.loads(out.read_text())
    spent = ll.budget(3)
    ll.posthoc(out, workers=1)
    assert ran == [f"posthoc-oar_g_answer_span-seed{s}" for s in range(3)]
    result = json.loads(out.read_text())
    assert {k: v for k, v in result.items() if k != "post_hoc"} == before  # the rule's, as it was
    section = result["post_hoc"]["oar_g_answer_span"]
    assert section["label"].startswith("post-hoc (issue 53)")
    assert section["vs_grpo"]["n"] == 3 and section["vs_grpo"]["mean"] == pytest.approx(0.1)
    assert section["vs_preregistered_oar_g"]["mean"] == pytest.approx(0.12)
    assert section["baseline"].startswith("grpo: the grid's") and section["same_cpu_class"]
    assert section["pipeline_check"]["equal"] and section["pipeline_check"]["arm"] == "grpo"
    assert ll.budget(3)["new_runs"] == spent["new_runs"]  # post-hoc runs are not the rule's
    ll.posthoc(out, workers=1)  # resumable: every record kept, nothing runs again
    assert len(ran) == 3


def test_posthoc_dry_run_prints_the_runs_and_runs_nothing(analysed, capsys):
    out, ran = analysed
    ll.posthoc(out, workers=1, baseline=True, dry_run=True)
    printed = capsys.readouterr().out
    assert ran == [] and "post-hoc: 6 runs to go" in printed
    assert "posthoc-oar_g_answer_span-seed2" in printed and "posthoc-grpo_here-seed0" in printed
    assert "credit_oar_span=answer" in printed and "post_hoc" not in json.loads(out.read_text())


def test_posthoc_refuses_to_run_when_grpos_pipeline_changed_since_the_grid(analysed, pipeline):
    out, ran = analysed
    pipeline["head"] = steps_of([0.2, 0.3, 0.4375])
    with pytest.raises(RuntimeError, match="differ"):
        ll.posthoc(out, workers=1)
    assert ran == []


def test_a_failed_run_does_not_cancel_the_runs_not_yet_started():
    """Executor.map cancelled every queued run once it reached a failed one (an OOM-killed run
    stopped the post-hoc grid after two runs); in_parallel runs them all, then raises."""
    import threading

    from studies.lm_recipe import in_parallel

    ran, lock = [], threading.Lock()

    def job(k):
        with lock:
            ran.append(k)
        if k == 1:
            raise RuntimeError("killed")
        return k * 10

    with pytest.raises(RuntimeError, match=r"1 of 6 jobs failed .*1: killed"):
        in_parallel(job, list(range(6)), 2)
    assert sorted(ran) == list(range(6))
    assert in_parallel(job, [0, 2, 3], 2) == [0, 20, 30]


def test_eval_size_reads_each_runs_first_problems_and_counts_intervals_above_zero():
    """Issue 61's check of a smaller held-out set for the main job: per size, each run's paired
    interval over its first n problems; a run that learned only on the later problems is above 0
    at 200 and not at 100."""
    from studies.lm_recipe import eval_size

    def run(seed, after):
        before = [0.25, 0.5] * 100
        return {"seed": seed,
                "before": {"per_problem": {"mean_reward": before, "greedy": before}},
                "after": {"per_problem": {"mean_reward": after, "greedy": after}}}  # fmt: skip

    learned = [0.75, 1.0] * 100
    late = [0.25, 0.5] * 50 + [0.75, 1.0] * 50  # no change on the first 100 problems
    out = eval_size([run(0, learned), run(1, late)], sizes=(200, 100))
    assert out["seeds"] == [0, 1]
    assert out["sizes"]["200"]["mean_reward"]["above_0"] == 2
    assert out["sizes"]["100"]["mean_reward"]["above_0"] == 1
    first = out["sizes"]["100"]["greedy"]["runs"][0]
    assert first["seed"] == 0 and first["mean"] == pytest.approx(0.5)


def test_a_tagged_main_run_is_named_apart_and_kept_out_of_the_rules_main_job(tmp_path, monkeypatch):
    """Issue 61 re-runs the main job as shipped now (`main --tag eval100`): its runs and
    records carry the tag, and the report and `eval-size` keep reading the rule's runs."""
    from gear.evidence import RecordStore
    from studies import lm_recipe

    jobs = []
    monkeypatch.setattr(lm_recipe, "run_all", lambda js, workers: jobs.extend(js) or [])
    monkeypatch.setattr(lm_recipe, "report", lambda *a: None)
    lm_recipe.main(["main", "--tag", "eval100", "--seeds", "0", "1"])
    assert jobs == [("main", "eval100", "default", 0), ("main", "eval100", "default", 1)]
    assert lm_recipe.run_name(*jobs[0]) == "main-eval100-default-seed0"
    assert lm_recipe.settings_of(*jobs[0][:3]) == {}  # gear train's recipe as shipped
    monkeypatch.setattr(lm_recipe, "RECORDS", tmp_path)
    store = RecordStore(tmp_path)
    store.put("main-default-default-seed0", {"setting": "default", "seed": 0})
    store.put("main-eval100-default-seed0", {"setting": "eval100", "seed": 0})
    assert [r["setting"] for r in lm_recipe.records("main", "default")] == ["default"]
