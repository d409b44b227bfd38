"""benchmarks/step.py on a tiny model: every arm trains from a copy of the same weights, GEAR's
arms (built by `gear train`'s recipe) run the teacher pass with prefix sharing as asked, TRL's
GRPO runs none."""

from __future__ import annotations

import argparse

import pytest
import torch
import trl as step_trl

from benchmarks import step
from gear.tasks import get_task
from gear.testing import byte_tokenizer, tiny_model


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("lora", [0, 4])
def test_each_arm_trains_a_copy_and_only_gears_arms_run_the_teacher(
    tmp_path, monkeypatch, cpu_only, lora
):
    """With --lora every arm (TRL's GRPO too) trains an adapter of that rank."""
    from gear.integrations.trl import trainer as gear_trainer

    args = argparse.Namespace(
        model="tiny", steps=2, completions=4, generations=2, completion_length=4, bf16=False,
        seed=0, learning_rate=1e-2, temperature=1.0, lora=lora,
        tie_share=0.0,  # rewards that vary (a tiny model's task reward is 0: every row tied)
    )  # fmt: skip
    tok = byte_tokenizer()
    model0 = tiny_model(tok)
    before = {k: v.clone() for k, v in model0.state_dict().items()}
    data = get_task("arithmetic").dataset("train", n=8, seed=0)
    built = []
    init = gear_trainer.GEARTrainer.__init__

    def spy(self, *a, **kw):
        init(self, *a, **kw)
        built.append(self.args)

    adapters: list = []  # every trainer's adapters: TRL's GRPOTrainer.__init__ runs for all arms
    grpo_init = step_trl.GRPOTrainer.__init__

    def grpo_spy(self, *a, **kw):
        grpo_init(self, *a, **kw)
        adapters.append(getattr(self.model, "peft_config", {}))

    monkeypatch.setattr(step_trl.GRPOTrainer, "__init__", grpo_spy)

    monkeypatch.setattr(gear_trainer.GEARTrainer, "__init__", spy)
    rows = {m: step.run(m, model0, tok, data, args, str(tmp_path / m)) for m in step.METHODS}
    for name, value in model0.state_dict().items():
        assert torch.equal(value, before[name]), name  # the arms trained copies
    for method, result in rows.items():
        assert [r["step"] for r in result] == [1, 2]
        assert all(r["method"] == method and r["wall_s"] > 0 for r in result)
        ran_teacher = [r["teacher_s"] > 0 for r in result]
        assert ran_teacher == [method not in ("grpo", "grpo_shared_loss")] * 2, method
        # only the contrast arm runs (and times) the wrong-answer teacher's pass
        assert [r["contrast_s"] > 0 for r in result] == [method == "gear_contrast"] * 2, method
    # gear, gear_unshared, gear_contrast, gear_before, gear_shared_loss, grpo_shared_loss
    assert [a.prefix_sharing for a in built] == [True, False, True, True, True, True]
    assert [a.teacher_context for a in built] == ["worked_solution"] * 2 + ["contrast"] + [
        "worked_solution"
    ] * 3
    assert [a.skip_zero_advantage_rows for a in built] == [True] * 3 + [False] + [True] * 2
    assert [a.merge_lora_passes for a in built] == [True] * 3 + [False] + [True] * 2
    assert [a.loss_prefix_sharing for a in built] == [False] * 4 + [True] * 2
    assert [a.credit_method for a in built] == ["gear"] * 5 + ["grpo"]
    assert all(a.credit_log_steps == 0 for a in built)
    assert all(a.save_strategy == "no" and a.learning_rate == 1e-2 for a in built)
    assert len(adapters) == 7 and all(
        [c.r for c in a.values()] == ([lora] if lora else []) for a in adapters
    )


def test_oar_arms_train_with_their_credit_method_and_time_their_influence_pass(
    tmp_path, monkeypatch, cpu_only
):
    """benchmarks/oar.py's arms: `gear train`'s trainer with credit_method = the arm, no teacher
    pass, the influence pass timed and taken out of the rest; `summarise` gives per-1k figures."""
    from benchmarks import oar

    args = argparse.Namespace(
        model="tiny", steps=2, completions=4, generations=2, completion_length=4, bf16=False,
        seed=0, learning_rate=1e-2, temperature=1.0, lora=0, tie_share=0.0,
    )  # fmt: skip
    tok = byte_tokenizer()
    data = get_task("arithmetic").dataset("train", n=8, seed=0)
    rows = []
    for arm in oar.ARMS:
        rows += step.run(arm, tiny_model(tok), tok, data, args, str(tmp_path / arm))
    for r in rows:
        assert (r["influence_s"] > 0) == (r["method"] != "grpo") and r["teacher_s"] == 0
        assert r["rest_s"] == pytest.approx(r["wall_s"] - r["generation_s"] - r["signals_s"]
                                            - r["influence_s"] - r["credit_s"])  # fmt: skip
    summary = {s["method"]: s for s in oar.summarise(rows, 4)}
    assert set(summary) == set(oar.ARMS) and all(s["steps"] == 1 for s in summary.values())
    p = summary["oar_p"]
    assert p["wall_s_per_1k"] == pytest.approx(p["wall_s"] / (p["completion_tokens"] / 1000))


def test_oar_passes_time_each_pass_and_the_shared_prefix_changes_no_score():
    from benchmarks import oar

    args = argparse.Namespace(completions=3, completion_length=6, temperature=1.0, seed=0,
                              repeats=1)  # fmt: skip
    tok = byte_tokenizer()
    data = get_task("arithmetic").dataset("train", n=3, seed=0)
    out = oar.passes(tiny_model(tok), tok, data, args)
    assert out["rows"] == 3 and out["masked_tokens"] > 0
    assert all(v > 0 for v in out["cpu_s"].values())
    assert out["max_abs_difference_shared_unshared"] < 1e-5 < out["max_score"]
