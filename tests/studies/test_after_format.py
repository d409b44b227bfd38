"""Issue 51's study (studies/after_format.py): the rule's "writes its steps", stage 0's SFT that
stops at the band, checks every step of a jump over it, and resumes to the same weights. No real
model: the byte tokenizer and a tiny random Llama."""

from __future__ import annotations

import json

import pytest
import torch

from studies import after_format as af

SOLUTION = "12 + 5 = 17, then 17 - 3 = 14, then 14 + 20 = 34. The answer is 34."


def test_writes_its_steps_needs_three_equations_an_answer_marker_and_an_end():
    assert af.writes_steps(SOLUTION, ended=True)
    assert af.writes_steps("12 + 5 = 18, then 18 - 3 = 15, then 15 + 20 = 35. Answer: 35", True)
    assert not af.writes_steps(SOLUTION, ended=False)  # cut at the token budget
    assert not af.writes_steps("12 + 5 = 17, then 17 - 3 = 14. The answer is 14.", True)
    assert not af.writes_steps("12 + 5 = 17, then 17 - 3 = 14, then 14 + 20 = 34.", True)
    assert not af.writes_steps("The answer is 34. 12 + 5 = 17, 17 - 3 = 14, 14 + 20 = 34", True)


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """Stage 0 on a tiny model with a small schedule, writing under tmp_path."""
    from peft import LoraConfig, get_peft_model

    from gear.models import tiny_model_and_tokenizer

    def lora_model(seed):
        model, tok = tiny_model_and_tokenizer("bytes", seed=0)
        torch.manual_seed(seed)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
        return get_peft_model(model, cfg), tok

    monkeypatch.setattr(af, "lora_model", lora_model)
    monkeypatch.setattr(af, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(af, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(af, "ROOT", tmp_path)
    monkeypatch.setattr(af, "ROWS_PER_STEP", 2)
    monkeypatch.setattr(af, "CHECK_PROBLEMS", 2)
    monkeypatch.setattr(af, "CHECK_SAMPLES", 2)
    monkeypatch.setattr(af, "MAX_NEW_TOKENS", 6)
    return tmp_path


def adapter(tmp_path, step):
    return torch.load(tmp_path / "runs" / "sft-seed0" / f"step-{step}" / "state.pt")["model"]


def test_sft_resumed_after_a_stop_reaches_the_same_weights(tiny, monkeypatch):
    monkeypatch.setattr(af, "CHECK_STEPS", (1, 2, 3))
    whole = af.sft(0)
    assert whole["done"] and whole["chosen"] is None  # a random model writes no steps
    assert [c["step"] for c in whole["checks"]] == [1, 2, 3]
    final = adapter(tiny, 3)
    for p in (tiny / "runs", tiny / "records"):
        __import__("shutil").rmtree(p)

    real, calls = af.check, []

    def stopping(model, tok):  # the session ends during step 3's check
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, tok)

    monkeypatch.setattr(af, "check", stopping)
    with pytest.raises(KeyboardInterrupt):
        af.sft(0)
    monkeypatch.setattr(af, "check", real)
    resumed = af.sft(0)
    assert resumed["loss"] == whole["loss"] and len(resumed["loss"]) == 3
    assert [c["step"] for c in resumed["checks"]] == [1, 2, 3]
    for k, v in final.items():
        torch.testing.assert_close(adapter(tiny, 3)[k], v, rtol=0, atol=0)


def test_a_jump_over_the_band_checks_every_step_between_and_takes_the_earliest(tiny, monkeypatch):
    monkeypatch.setattr(af, "CHECK_STEPS", (2, 5, 8))
    rates = {2: 0.1, 3: 0.2, 4: 0.45, 5: 0.7}  # step 5 jumps over [0.3, 0.6] from step 2

    def fake_check(model, tok):
        step = len(record_steps) + 1
        record_steps.append(step)
        return {"pass_rate": rates[checked_steps[step - 1]], "writes_steps": 0.95,
                "mean_length": 30.0, "completions": 4}  # fmt: skip

    # the checks happen in this order of SFT steps: 2, 5 (jump), then 3, 4 after the resume
    checked_steps, record_steps = [2, 5, 3, 4], []
    monkeypatch.setattr(af, "check", fake_check)
    r = af.sft(0)
    assert r["extra_checks"] == [3, 4]
    assert [c["step"] for c in r["checks"]] == [2, 3, 4]  # step 5's check was withdrawn
    assert r["chosen"]["step"] == 4
    saved = json.loads((tiny / "records" / "sft-seed0.json").read_text())
    assert saved["chosen"] == r["chosen"] and len(saved["loss"]) == 4


def test_a_checkpoint_qualifies_only_inside_the_band_and_writing_its_steps():
    assert af.qualifies({"pass_rate": 0.3, "writes_steps": 0.9})
    assert af.qualifies({"pass_rate": 0.6, "writes_steps": 1.0})
    assert not af.qualifies({"pass_rate": 0.61, "writes_steps": 1.0})
    assert not af.qualifies({"pass_rate": 0.45, "writes_steps": 0.89})


def test_step0_is_read_on_the_checkpoints_prompts_only(monkeypatch, tmp_path):
    """Step 0 may be sampled ahead of the checkpoint (`rows --step0 --prompts N`); the analysis
    reads both models on the same problems, so step 0's extra prompts are left out."""
    from studies import onpolicy
    from studies import teacher_contexts as tc

    monkeypatch.setattr(af, "RUNS", tmp_path)
    fake = lambda n: {f"natural-{j}": [{"j": j}] for j in range(n)}  # noqa: E731
    for step0, n in ((False, 2), (True, 5)):
        for name in ("natural", *tc.TEACHERS):
            onpolicy.save_cache(af.rows_dir(step0) / f"{name}.pt", fake(n))
    assert list(af.teacher_sets(True)["worked_solution"]) == ["natural-0", "natural-1"]
    assert len(af.teacher_sets(False)["worked_solution"]) == 2


def test_every_stage1_piece_is_kept_with_its_commit_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(af, "RECORDS", tmp_path)
    af.log_piece("rows-x", "abc", wall_s=3.0, prompts=40)
    af.log_piece("rows-x", "def", wall_s=1.0, prompts=80)
    pieces = af.records().get("rows-x")["pieces"]
    assert [p["prompts"] for p in pieces] == [40, 80]
    assert all(p["capability"] == str(torch.backends.cpu.get_cpu_capability()) for p in pieces)
    assert [p["commit"] for p in pieces] == ["abc", "def"]


def test_the_figure_draws_both_models_and_names_the_cpu(tmp_path, monkeypatch):
    from studies import teacher_contexts as tc

    band = {b: {"fraction": 0.2, "count": 1, "ci": [0.1, 0.3]} for b in tc.ONSET_BANDS}
    contexts = {c: {e: {"first_onset": band} for e in tc.ESTIMATORS} for c in tc.CONTEXT_TEACHERS}
    cells = {f"{c}/{e}": {"corrected_L": 0.1, "ci": [-0.05, 0.2], "above_0": False}
             for c in tc.CONTEXT_TEACHERS for e in tc.ESTIMATORS}  # fmt: skip
    out = {"capability": "AVX2", "checkpoint": {"contexts": contexts}, "step0": None,
           "threshold": {"level": 0.9917, "cells": cells}}  # fmt: skip
    monkeypatch.setattr(af, "FIGURE", tmp_path / "f.png")  # where localise() writes it
    af.figure(out)
    assert (tmp_path / "f.png").stat().st_size > 10_000


def _rec(group, equations, error_equation=None):
    r = {"case": {"group": group, "detail": {}}, "equations": equations, "ids": [len(group)]}
    if error_equation is not None:
        r["error"], r["case"]["detail"]["equation"] = 99, error_equation
    return r


def test_the_all_correct_placebo_takes_every_correct_rollout_at_a_real_errors_index():
    """Amendment 2 (a secondary since amendment 3): a prompt with a failed row puts the pseudo-error on its first failed row's
    equation (the rule's same-prompt placebo, unchanged); an all-correct prompt on an index drawn
    from the failed rows' own, the same every time; a failed row is never a placebo row."""
    from studies import localization as loc

    eqs = [[0, 4, 2, 4], [5, 9, 7, 9], [10, 14, 12, 14]]  # (start, result start, result end)
    rows = {
        "natural-0": [_rec("natural-0", eqs, error_equation=1), _rec("natural-0", eqs)],
        "natural-1": [_rec("natural-1", eqs), _rec("natural-1", eqs)],
        "natural-2": [_rec("natural-2", eqs, error_equation=2)],
    }
    got = af.all_correct_placebo(rows)
    assert len(got) == 3 and all(r["placebo"] for r in got)
    assert got[0] == loc.placebo_rows(rows)[0] and got[0]["step"] == [5, 9]
    drawn = {r["step"][0] for r in got[1:]}
    assert len(drawn) == 1 and drawn <= {5, 10}  # one index for the prompt, a real error's
    assert af.all_correct_placebo(rows) == got
    assert (
        af.all_correct_placebo({"natural-0": [_rec("natural-0", eqs)]}) == []
    )  # nothing to follow
    # the rule's placebo (amendment 3) is the same-prompt one, and it sets when sampling stops
    assert af.placebo(rows) == loc.placebo_rows(rows) == got[:1]
    assert af.counts(rows) == (2, 1)


def test_the_budget_counts_every_piece_lost_ones_included():
    out = {"sft": {"seed0": {"pieces": [{"wall_s_approx": 1800}, {"resumed_at_step": 20},
                                        {"wall_s": 1800}]}},
           "stage1_pieces": {"rows-a": [{"wall_s": 3600}], "signals-a": [{"wall_s": 1800}]}}  # fmt: skip
    assert af.budget(out) == {"stage0": 1.0, "stage1": 1.5, "total": 2.5, "limit": 16.0}


def test_the_positive_control_localises_where_the_placebo_cannot():
    """The checker's oracle marks the real first wrong equation and nothing on a placebo row, so
    its placebo-corrected L is high; a pipeline that could not see localisation would give ~0."""
    from studies import teacher_contexts as tc

    def rec(group, error=None):
        n = 12
        r = {"case": {"group": group, "detail": {}}, "ids": list(range(n)), "kl": [0.0] * n,
             "entropy": [0.0] * n, "lp_s": [0.0] * n, "lp_t": [0.0] * n,
             "equations": [[0, 4, 2, 4], [5, 9, 7, 9]]}  # fmt: skip
        if error is not None:
            r.update(error=7, error_end=9, step=[5, 9])
            r["case"]["detail"]["equation"] = 1
        return r

    rows = {f"natural-{j}": [rec(f"natural-{j}", error=1), rec(f"natural-{j}")] for j in range(6)}
    sets = {"worked_solution": rows, **{t: rows for t in tc.TEACHERS}}
    got = af.positive_control(sets)
    assert got["level"] == pytest.approx(1 - 0.05 / 6)
    assert got["real"] == 1.0 and got["placebo"] < 0.5 and got["ci"][0] > 0
