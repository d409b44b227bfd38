"""studies/archive/learning_study.py: the aggregation (bootstrap, paired differences) on synthetic runs.
Training itself is exercised by the study; these tests need no model (one builds the config of a
run through `gear train`'s recipe)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from studies.archive import learning_study as ls


def test_bootstrap_mean_is_exact_without_spread_and_brackets_the_mean_with_it():
    rng = np.random.default_rng(0)
    flat = np.full((3, 50), 0.4)
    mean, ci = ls.bootstrap_mean(flat, rng, 200)
    assert mean == pytest.approx(0.4) and ci == pytest.approx([0.4, 0.4])
    x = (rng.random((5, 300)) < 0.3).astype(float)
    mean, (lo, hi) = ls.bootstrap_mean(x, rng, 500)
    assert mean == pytest.approx(x.mean())
    assert lo < mean < hi and hi - lo < 0.2


def _write_study(root: Path, n: int = 40) -> tuple[list[int], dict]:
    rng = np.random.default_rng(1)
    before = (rng.random(n) < 0.2).astype(int).tolist()
    root.mkdir()
    (root / "before.json").write_text(
        json.dumps(
            {
                "task": "arithmetic",
                "task_options": {"mix": "2digit"},
                "n": n,
                "acc": float(np.mean(before)),
                "correct": before,
            }
        )
    )
    runs = {}
    for seed in (0, 1, 2):
        grpo = (rng.random(n) < 0.3).astype(int)
        gear = grpo.copy()
        gear[: seed + 1] = 1 - gear[: seed + 1]  # a known per-seed difference
        gear[10 : 10 + seed] = 1
        for method, after in (("grpo", grpo), ("gear", gear)):
            mid = (rng.random(n) < 0.25).astype(int)
            evals = [
                {"step": 2, "acc": float(mid.mean()), "correct": mid.tolist()},
                {"step": 4, "acc": float(after.mean()), "correct": after.tolist()},
            ]
            data = {
                "method": method,
                "seed": seed,
                "model": "smollm2",
                "steps": 4,
                "evals": evals,
                "metrics": [{"step": 1, "seconds": 3.0, "reward": 0.5}],
                "env": {"cpu_capability": "AVX2"},
            }
            (root / f"{method}-seed{seed}.json").write_text(json.dumps(data))
            runs[(method, seed)] = after
    return before, runs


def test_aggregate_pairs_methods_per_seed_and_problem(tmp_path):
    before, runs = _write_study(tmp_path / "study")
    args = argparse.Namespace(
        results=tmp_path / "study", methods=["grpo", "gear"], seeds=[0, 1, 2, 3], reps=300
    )
    res = ls.aggregate(args)
    assert res["runs_finished"] == 6 and res["runs_planned"] == 8 and not res["complete"]
    assert [(r["method"], r["seed"]) for r in res["runs"]][:2] == [("grpo", 0), ("gear", 0)]
    run = res["runs"][1]
    assert run["curve"][0] == [0, pytest.approx(np.mean(before))]
    assert run["curve"][-1] == [4, pytest.approx(runs[("gear", 0)].mean())]
    paired = res["paired"]["gear - grpo"]["after"]
    expected = [float((runs[("gear", s)] - runs[("grpo", s)]).mean()) for s in (0, 1, 2)]
    assert paired["per_seed"] == pytest.approx(expected)
    assert paired["diff"] == pytest.approx(np.mean(expected))
    assert paired["ci95"][0] <= paired["diff"] <= paired["ci95"][1]
    gear_after = res["methods"]["gear"]["after"]
    assert gear_after["per_seed"] == pytest.approx([runs[("gear", s)].mean() for s in (0, 1, 2)])
    assert gear_after["gain"] == pytest.approx(
        np.mean([runs[("gear", s)].mean() for s in (0, 1, 2)]) - np.mean(before)
    )
    # a trial study writes next to its runs, never over the committed files
    assert (tmp_path / "study" / "aggregate.json").is_file()
    assert "**partial**" in (tmp_path / "study" / "aggregate.md").read_text()


def test_run_refuses_to_mix_a_changed_setup_into_finished_runs(tmp_path):
    cfg = ls.load_config(ls.CONFIG)
    done = {"method": "grpo", "seed": 0, "trainer": cfg["trainer"], "eval_n": 300}
    done["task_options"] = cfg["task_options"]
    (tmp_path / "grpo-seed0.json").write_text(json.dumps(done))
    args = argparse.Namespace(results=tmp_path, eval_n=300, config=ls.CONFIG)
    ls.check_same_setup(cfg, args)  # the same setup passes
    changed = cfg | {"trainer": cfg["trainer"] | {"learning_rate": 2e-5}}
    with pytest.raises(SystemExit, match="learning_rate"):
        ls.check_same_setup(changed, args)
    with pytest.raises(SystemExit, match="eval_n"):
        ls.check_same_setup(cfg, argparse.Namespace(**{**vars(args), "eval_n": 100}))


def test_resume_skips_a_checkpoint_cut_off_mid_save_and_forgets_later_steps(tmp_path):
    for step, complete in ((10, True), (20, True), (30, False)):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "model.safetensors").write_text("x")
        if complete:
            (ckpt / "trainer_state.json").write_text("{}")
            (ckpt / "rng_state.pth").write_text("x")
    assert ls.last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-20"
    assert not (tmp_path / "checkpoint-30").exists()  # would be picked as the latest, and fail
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in range(1, 26))
    )
    (tmp_path / "evals").mkdir()
    for s in (20, 25):
        (tmp_path / "evals" / f"step-{s:04d}.json").write_text("{}")
    ls.forget_after(tmp_path, 20)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))
    assert [p.name for p in (tmp_path / "evals").iterdir()] == ["step-0020.json"]
    assert ls.last_complete_checkpoint(tmp_path / "nothing") is None


def test_one_process_per_method_aggregates_the_whole_study(tmp_path):
    """`run --methods gear` and `run --methods grpo` share one results folder; either one's
    aggregate reports both methods, pairs them, and counts the plan over both."""
    _write_study(tmp_path / "study")
    args = argparse.Namespace(
        results=tmp_path / "study", methods=["gear"], seeds=[0, 1, 2], reps=50
    )
    res = ls.aggregate(args)
    assert list(res["methods"]) == ["grpo", "gear"]
    assert res["runs_planned"] == 6 and res["complete"]
    assert res["paired"]["gear - grpo"]["seeds"] == [0, 1, 2]
    assert [(r["method"], r["seed"]) for r in res["runs"]][:2] == [("grpo", 0), ("gear", 0)]


def test_an_optional_arm_with_fewer_seeds_is_paired_but_leaves_the_core_study_complete(tmp_path):
    """`gear_token` (the issue's "if the budget allows") on seed 1 only: it is reported and
    paired on that seed with grpo and with gear, and the grpo-vs-gear study stays complete."""
    _, runs = _write_study(tmp_path / "study")
    token = 1 - runs[("grpo", 1)]
    data = json.loads((tmp_path / "study" / "gear-seed1.json").read_text())
    data["method"] = "gear_token"
    data["evals"][-1] = {"step": 4, "acc": float(token.mean()), "correct": token.tolist()}
    (tmp_path / "study" / "gear_token-seed1.json").write_text(json.dumps(data))
    args = argparse.Namespace(
        results=tmp_path / "study", methods=["gear_token"], seeds=[0, 1, 2], reps=50
    )
    res = ls.aggregate(args)
    assert res["complete"] and res["runs_finished"] == 6 and res["runs_planned"] == 6
    assert res["optional_arms"] == {"gear_token": [1]}
    assert list(res["methods"]) == ["grpo", "gear", "gear_token"]
    vs_grpo = res["paired"]["gear_token - grpo"]
    assert vs_grpo["seeds"] == [1]
    assert vs_grpo["after"]["diff"] == pytest.approx(float((token - runs[("grpo", 1)]).mean()))
    vs_gear = res["paired"]["gear - gear_token"]["after"]
    assert vs_gear["diff"] == pytest.approx(float((runs[("gear", 1)] - token).mean()))
    md = (tmp_path / "study" / "aggregate.md").read_text()
    assert "Optional arm `gear_token`: seeds 1 only" in md and "**partial**" not in md


def test_the_study_trains_with_the_config_its_yaml_asks_for_through_gear_trains_recipe(tmp_path):
    """`gear train`'s GEARConfig for a study run (its defaults under the study's yaml) equals the
    one the study asks for: the yaml's trainer section plus the run's output_dir, seed, credit
    method, the task's hint kind and the device; nothing of `gear train`'s own defaults leaks."""
    import torch

    from gear.app.config import trainer_args
    from gear.integrations.trl import GEARConfig
    from gear.tasks import get_task

    cfg = ls.load_config(ls.CONFIG)
    run_dir = tmp_path / "gear-seed3"
    run = ls.run_config(cfg, "gear", 3, run_dir)
    task = get_task(run.task, **run.task_options)
    assert (run.model, run.train_size, run.seed) == (cfg["model"], cfg["train_size"], 3)
    got = trainer_args(run, run_dir, hint_kind=task.hint_kind).to_dict()
    asked = dict(cfg["trainer"])
    asked["activation_checkpointing"] = asked.pop("gradient_checkpointing")  # the same setting
    want = GEARConfig(
        **asked,
        output_dir=str(run_dir),
        seed=3,
        credit_method="gear",
        hint_kind=task.hint_kind,
        use_cpu=not torch.cuda.is_available(),
    ).to_dict()
    assert got.pop("logging_dir", None) == want.pop("logging_dir", None)
    assert got == want
    assert (got["credit_method"], got["save_total_limit"], got["bf16"]) == ("gear", 1, False)


def test_a_tiny_study_trains_each_run_through_the_recipe_and_writes_its_results(
    tmp_path, monkeypatch
):
    """`run` end to end on a saved tiny model: both methods train their steps (checkpoints on
    the way, removed at the end), evaluate mid-run and after, and the aggregate pairs them."""
    import torch
    import yaml

    from gear.testing import save_tiny_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = save_tiny_model(tmp_path / "model")
    trainer = dict(
        max_steps=2, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
        learning_rate=1e-3, bf16=False, save_strategy="steps", save_steps=1, save_total_limit=1,
        report_to="none", logging_steps=1, disable_tqdm=True, credit_log_steps=0,
    )  # fmt: skip
    config = tmp_path / "study.yaml"
    config.write_text(
        yaml.safe_dump(
            {"model": str(model), "task": "arithmetic", "train_size": 16, "trainer": trainer}
        )
    )
    results, work = tmp_path / "results", tmp_path / "work"
    argv = ["run", "--config", str(config), "--methods", "grpo", "gear", "--seeds", "0"]
    argv += ["--eval-n", "4", "--eval-steps", "1", "--eval-max-new-tokens", "4"]
    argv += ["--work", str(work), "--results", str(results), "--reps", "10"]
    assert ls.main(argv) == 0
    for method in ("grpo", "gear"):
        run = json.loads((results / f"{method}-seed0.json").read_text())
        assert [e["step"] for e in run["evals"]] == [1, 2] and run["eval_n"] == 4
        assert [m["step"] for m in run["metrics"]] == [1, 2]
        assert (run["method"], run["resumed_from"]) == (method, None)
        assert not list((work / f"{method}-seed0").glob("checkpoint-*"))
    assert json.loads((results / "aggregate.json").read_text())["complete"]
