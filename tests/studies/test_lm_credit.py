"""The retired real-LM credit study (issue 28), tiny: pairing, the oracle's weights, an update,
resume. Runs `studies/archive/lm_credit.py` on a tiny random model (no download) for one or two
steps: an archived study's code still runs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from studies.archive import lm_credit as lc

TINY = lc.LMConfig(
    steps=1, prompts=2, group=4, max_new_tokens=8, eval_n=4, tiny=True, warm_steps=1, warm_batch=2
)


def run_files(path):
    """The finished runs' files (not the seeds' step-0 evaluations)."""
    return [p for p in path.glob("*.json") if not p.name.startswith("base-")]


@pytest.fixture
def every_other_right(monkeypatch):
    """A reward that varies within each group (a tiny random model is never right), so GRPO
    has advantages to work with."""
    from gear.tasks.arithmetic import ArithmeticTask

    calls = {"n": 0}

    def is_correct(self, text, answer):
        calls["n"] += 1
        return calls["n"] % 2 == 0

    monkeypatch.setattr(ArithmeticTask, "is_correct", is_correct)


def test_two_arms_of_one_seed_see_the_same_prompts_and_samples(every_other_right):
    a = lc.train_arm("grpo", 3, TINY, log=lambda *a, **k: None)
    b = lc.train_arm("oracle_sharp", 3, TINY, log=lambda *a, **k: None)
    assert a["seen"] == b["seen"]  # prompts and the first rollout of step 1
    c = lc.train_arm("grpo", 4, TINY, log=lambda *a, **k: None)
    assert c["seen"][0]["prompts"] != a["seen"][0]["prompts"]  # another seed, other prompts


def test_the_oracle_puts_a_failed_rows_weight_on_the_checkers_first_wrong_equation():
    from gear.credit import token_advantages
    from gear.tasks.arithmetic import ArithmeticTask

    _, tok = lc.load(tiny=True)
    task = ArithmeticTask(mix={"chain": 1.0})
    text = "12 + 5 = 18, then 18 + 3 = 21. The answer is 21."
    ids = lc.onpolicy.completion_ids(tok, text)
    mask = lc.first_error_mask(tok, text, ids, task, answer="20")
    marked = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert marked.strip() == "18"  # the first wrong equation's result, and nothing else
    params, _, oracle = lc.arm_params("oracle_sharp")
    assert oracle
    kl = torch.tensor([mask], dtype=torch.float32)
    w = -token_advantages(torch.tensor([-1.0]), torch.ones(1, len(ids), dtype=torch.bool),
                          kl=kl, entropy=kl, params=params)[0]  # fmt: skip
    on = torch.tensor(mask)
    assert float(w[on].sum() / w.sum()) > 0.9 and float(w[on].min()) > float(w[~on].max())


@pytest.mark.parametrize("arm", ["gear_departure_blame@estimator=k1", lc.ERROR_ONLY])
def test_a_step_changes_the_parameters(every_other_right, arm):
    model, tok = lc.load(tiny=True)
    task, train, _ = lc.task_rows(TINY)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rows = lc.step_prompts(train, 0, 1, TINY.prompts)
    out = lc.rl_step(model, tok, opt, task, rows, arm, TINY, 0)
    assert out["updated"] == 1.0
    assert any(not torch.equal(x, y) for x, y in zip(before, model.parameters(), strict=True))


def test_a_rerun_reads_finished_runs_back(tmp_path):
    cfg = replace(TINY, eval_n=2)
    first = lc.run(["grpo", "oracle_sharp"], [0], cfg, runs=tmp_path)
    again = lc.run(["grpo", "oracle_sharp"], [0], cfg, runs=tmp_path)
    assert first["reused_runs"] == [] and again["reused_runs"] == [
        "grpo/seed0",
        "oracle_sharp/seed0",
    ]
    assert again["final"] == first["final"]
    table = lc.status(["grpo", "oracle_sharp", "rlsd"], [0, 1], cfg, tmp_path).splitlines()
    assert table[1].split() == ["0", "x", "x", "."] and table[2].split() == ["1", ".", ".", "."]
    assert table[-1].startswith("2 of 6 runs kept")
    cap = str(torch.backends.cpu.get_cpu_capability())
    assert again["run_machines"] == {"grpo/seed0": cap, "oracle_sharp/seed0": cap}
    assert {"arms", "seeds", "steps", "eval_n", "metric", "paired", "wall_s", "machine"} <= set(
        again
    )


def test_arms_of_a_seed_share_one_step0_evaluation_and_read_the_metric_where_asked(
    tmp_path, every_other_right
):
    cfg = replace(TINY, steps=2, eval_n=2, read_at=(1,))
    out = lc.run(["grpo", "oracle_sharp"], [0], cfg, runs=tmp_path)
    assert len(list(tmp_path.glob("base-*.json"))) == 1  # computed once for the seed
    runs = [json.loads(p.read_text()) for p in run_files(tmp_path)]
    assert runs[0]["curve"][0] == runs[1]["curve"][0]
    assert [[c["step"] for c in r["curve"]] for r in runs] == [[0, 1, 2]] * 2
    assert set(runs[0]["curve"][1]) == {"step", "logp", "prob", "logp_each"}  # no pass@1
    assert set(out["paired_at_step"]["oracle_sharp-grpo"]) == {"1"}


def test_the_warm_start_trains_and_is_read_back_identically(tmp_path):
    cold, _ = lc.load(tiny=True)
    warm, _ = lc.warm_model(TINY, runs=tmp_path, log=lambda *a, **k: None)
    assert len(list(tmp_path.glob("warm-*.pt"))) == 1
    assert any(
        not torch.equal(a, b) for a, b in zip(cold.parameters(), warm.parameters(), strict=True)
    )
    again, _ = lc.warm_model(TINY, runs=tmp_path, log=lambda *a, **k: None)
    assert all(
        torch.equal(a, b) for a, b in zip(warm.parameters(), again.parameters(), strict=True)
    )


def test_power_is_alpha_at_no_effect_and_the_mde_is_what_n_detects():
    assert abs(lc.power_at(0.0, 1.0, 12) - 0.05) < 1e-9
    m = lc.mde(1.0, 12)
    assert abs(lc.power_at(m, 1.0, 12) - 0.8) < 1e-6
    assert lc.power(1.0, m * 1.01) == 12 < lc.power(1.0, m * 0.95)
    # far past scipy's NaN tail (noncentrality ~55): power is 1, and 3 seeds already suffice
    assert lc.power_at(16.0, 1.0, 12) == pytest.approx(1.0) and lc.power(1.0, 16.0) == 3
    # the issue-28 pilot (BENCHMARKS): mean 0.1743, SD 0.4325 -> 51 seeds, 0.25 at 12
    planned = lc.power_table({}, planned=(0.1743, 0.4325), n=12)["planned"]
    assert planned["n_for_80"] == 51 and round(planned["power"], 2) == 0.25
    assert round(planned["mde_80"], 3) == 0.384


def test_two_workers_give_the_numbers_of_one(tmp_path):
    # the real checker (a monkeypatched reward would not reach spawned workers); seeds differ in
    # their sampled pass@1 seeds and prompts, so a run filed under the wrong seed would show
    cfg = replace(TINY, eval_n=2, steps=2, read_at=(1,))
    one = lc.run(["grpo", "oracle_sharp"], [0, 1], cfg, runs=tmp_path / "one")
    two = lc.run(["grpo", "oracle_sharp"], [0, 1], cfg, runs=tmp_path / "two", workers=2)
    assert two["final"] == one["final"] and two["reused_runs"] == []
    assert len(list((tmp_path / "two").glob("base-*.json"))) == 2
    runs = [json.loads(p.read_text()) for p in run_files(tmp_path / "two")]
    assert sorted((r["arm"], r["seed"]) for r in runs) == sorted(
        (a, s) for a in ("grpo", "oracle_sharp") for s in (0, 1)
    )
    lc.plot(two, tmp_path / "paired.png")
    assert (tmp_path / "paired.png").stat().st_size > 10_000


def test_the_error_only_oracle_keeps_a_failed_rows_advantage_on_its_wrong_result_only():
    a = torch.tensor([-1.0, -1.0, 2.0])
    grpo = a[:, None].expand(3, 4).clone()
    flagged = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    out = lc.error_only_advantages(grpo, a, flagged)
    assert out[0].tolist() == [0.0, -1.0, -1.0, 0.0]  # the wrong result only
    assert out[1].tolist() == [-1.0] * 4  # no checked error: GRPO
    assert out[2].tolist() == [2.0] * 4  # a correct row is never touched
    params, _, oracle = lc.arm_params(lc.ERROR_ONLY)
    assert oracle and params.method == "grpo"


def test_the_run_key_follows_the_training_code_not_the_analysis(monkeypatch):
    before = lc.run_key("grpo", 0, TINY)
    # an edit of the analysis (the power table, the figure, the CLI) keeps finished runs
    monkeypatch.setattr(lc, "power_table", lambda paired, primary="logp": {})
    lc.code_digest.cache_clear()
    assert lc.run_key("grpo", 0, TINY) == before
    # an edit of the RL step reruns them

    def rl_step(*args, **kwargs):  # a different source
        return {}

    monkeypatch.setattr(lc, "rl_step", rl_step)
    lc.code_digest.cache_clear()
    assert lc.run_key("grpo", 0, TINY) != before
    monkeypatch.undo()
    lc.code_digest.cache_clear()
    assert lc.run_key("grpo", 0, TINY) == before


def test_the_registered_primary_metric_drives_the_power_table(tmp_path, every_other_right):
    cfg = replace(TINY, eval_n=2)
    out = lc.run(["grpo", "oracle_error_only"], [0], cfg, runs=tmp_path, primary="prob")
    assert out["primary"] == "prob" and out["metric"].startswith(lc.METRICS["prob"])
    pair = out["paired"]["oracle_error_only-grpo"]
    assert set(pair) == {"mean", "ci", "logp", "prob", "pass1"}
    # the issue's {"mean", "ci"} are the registered primary's
    assert (pair["mean"], pair["ci"]) == (pair["prob"]["mean"], pair["prob"]["ci"])
    paired = {"a-grpo": {"logp": {"mean": 1.0, "sd": 1.0, "n": 12},
                         "prob": {"mean": 0.1, "sd": 0.2, "n": 12}}}  # fmt: skip
    assert lc.power_table(paired, "prob")["a-grpo"]["sd"] == 0.2
    assert lc.power_table(paired)["a-grpo"]["sd"] == 1.0
    with pytest.raises(ValueError, match="primary"):
        lc.run(["grpo"], [0], cfg, runs=tmp_path, primary="pass1")
    with pytest.raises(ValueError, match="gate"):
        lc.run(["grpo"], [0], cfg, runs=tmp_path, gate="oracle_sharp")
    with pytest.raises(SystemExit):
        lc.main(["--tiny", "--arms", "grpo", "--primary", "accuracy"])
    with pytest.raises(SystemExit):
        lc.main(["--tiny", "--arms", "grpo", "--gate", "grpo"])
    with pytest.raises(SystemExit):
        lc.main(["--tiny", "--arms", "grpo", "--seeds", "3", "3"])
    with pytest.raises(ValueError, match="seeds"):
        lc.run(["grpo"], [0, 0], cfg, runs=tmp_path)


def test_the_command_writes_the_issues_schema_and_prints_every_metric(tmp_path, capsys):
    out = tmp_path / "lm.json"
    args = ["--tiny", "--arms", "grpo", "oracle_error_only", "--seeds", "0", "1", "--steps", "1",
            "--prompts", "1", "--group", "2", "--eval-n", "2", "--warm-steps", "1",
            "--runs", str(tmp_path / "runs"), "--out", str(out), "--plot", str(tmp_path / "p.png"),
            "--gate", "oracle_error_only", "--planned", "0.1743", "0.4325"]  # fmt: skip
    assert lc.main(args) == 0
    result = json.loads(out.read_text())
    pair = result["paired"]["oracle_error_only-grpo"]
    assert (pair["mean"], pair["ci"]) == (pair["logp"]["mean"], pair["logp"]["ci"])
    assert {"arms", "seeds", "steps", "eval_n", "metric", "power", "wall_s", "machine"} <= set(
        result
    )
    assert result["power"]["planned"]["n"] == 2 and result["power"]["planned"]["n_for_80"] == 51
    assert result["seeds_on_two_cpu_classes"] == [] and result["runs_wall_s"] > 0
    gate = result["gate"]
    assert (gate["arm"], gate["metric"], gate["ci"]) == ("oracle_error_only", "logp", pair["ci"])
    assert gate["passed"] == (pair["ci"][0] > 0)
    printed = capsys.readouterr().out
    assert "gate (oracle_error_only - grpo, logp)" in printed
    assert "oracle_error_only-grpo" in printed and all(m in printed for m in ("prob", "pass1"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_a_grid_over_two_cpu_classes_gives_each_classs_intervals_and_names_mixed_seeds(tmp_path):
    """BENCHMARKS' rule for a grid spread over sessions on two CPU classes: the intervals over
    every seed, and beside them over each class's own seeds; a seed run on both is in neither."""
    cfg = replace(TINY, prompts=1, group=2, eval_n=2)
    arms, seeds = ["grpo", "oracle_error_only"], [0, 1, 2, 3, 4]
    first = lc.run(arms, seeds, cfg, runs=tmp_path)
    other = {("grpo", 2), ("oracle_error_only", 2), ("grpo", 3), ("oracle_error_only", 3),
             ("grpo", 4)}  # fmt: skip
    for arm, seed in other:  # as if these ran in a later session on the other class
        path = tmp_path / f"{lc.run_key(arm, seed, cfg)}.json"
        kept = json.loads(path.read_text())
        kept["machine"]["cpu_capability"] = "OTHER"
        path.write_text(json.dumps(kept))
    out = lc.run(arms, seeds, cfg, runs=tmp_path)
    assert out["paired"] == first["paired"] and out["seeds_on_two_cpu_classes"] == [4]
    cap = str(torch.backends.cpu.get_cpu_capability())
    by = out["paired_by_cpu_class"]
    assert {c: v["seeds"] for c, v in by.items()} == {cap: [0, 1], "OTHER": [2, 3]}
    for v in by.values():
        d = [out["final"][f"oracle_error_only/seed{s}"]["prob"]
             - out["final"][f"grpo/seed{s}"]["prob"] for s in v["seeds"]]  # fmt: skip
        got = v["paired"]["oracle_error_only-grpo"]["prob"]
        assert got["n"] == 2 and got["mean"] == pytest.approx(sum(d) / 2)
