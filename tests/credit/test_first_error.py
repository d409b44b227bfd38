"""`credit_method="first_error"` (issue 58): credit from a step checker. Its weights are issue
51's oracle weights, mass is preserved, correct and unplaced rows keep GRPO's advantage, tasks
without a checker are refused before any work, and it trains through TRL and `gear train`."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from _trl_helpers import byte_tokenizer, make_trainer, parameters
from gear.credit import CreditParams, credit_details
from gear.spans import error_token_mask
from gear.tasks import get_task
from gear.tasks.steps import first_wrong_equation_span, first_wrong_token_span
from studies import localization, onpolicy

SHARP = dict(modulation="exp", beta=5.0, w_min=0.0, w_max=100.0)  # the credit gym's winning form

TEXTS = [  # failed chain solutions: the first wrong equation is the second, first, third
    "12 + 5 = 17, then 17 - 3 = 15, then 15 + 9 = 24. The answer is 24.",
    "8 + 7 = 14, then 14 + 2 = 16, then 16 - 4 = 12. The answer is 12.",
    "20 - 6 = 14, then 14 + 11 = 25, then 25 - 8 = 18. Answer: 18",
    "3 + 4 = 7, then 7 + 10 = 17, then 17 + 1 = 19 so the answer is 19",
]


@st.composite
def batches(draw):
    n, t = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    valid = torch.tensor([[j < k for j in range(t)] for k in lengths])
    bits = draw(st.lists(st.booleans(), min_size=n * t, max_size=n * t))
    mask = torch.tensor(bits).view(n, t)
    adv = torch.tensor(
        draw(st.lists(st.floats(-2, 2), min_size=n, max_size=n)), dtype=torch.float64
    )
    return adv, valid, mask


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from([{}, SHARP]))
def test_mass_is_preserved_and_only_failed_placed_rows_move(batch, params):
    adv, valid, mask = batch
    d = credit_details(
        adv, valid, error_mask=mask, params=CreditParams(method="first_error", **params)
    )
    mass = torch.where(valid, d.token_advantages.double(), 0.0).sum(1)
    torch.testing.assert_close(mass, adv.double() * valid.sum(1), atol=1e-9, rtol=1e-9)
    placed = (mask & valid).any(1) & (adv < 0)
    plain = torch.where(valid, d.weights, 1.0)
    assert bool((plain[~placed] == 1).all())  # correct, tied and unplaced rows: GRPO
    for i in placed.nonzero().flatten().tolist():  # blamed tokens carry more weight than others
        on, off = d.weights[i][mask[i] & valid[i]], d.weights[i][~mask[i] & valid[i]]
        assert off.numel() == 0 or float(on.min()) > float(off.max())


def test_the_weights_are_issue_51s_oracle_weights_on_its_rows():
    """Rows built as issue 51 built them (the study's checker, its cumulative-decode offsets,
    `localization.natural_weights(..., "oracle")`) against first_error through the trainer's
    route (gear's checker, the tokenizer's offsets, `error_token_mask`). Issue 51's oracle
    blamed the whole wrong equation: the checker's `error_span="step"`."""
    tok = byte_tokenizer()
    task = get_task("arithmetic", mix="chain:1", error_span="step")
    recs, ids = [], []
    for text in TEXTS:
        row_ids = tok(text, add_special_tokens=False)["input_ids"]
        error = onpolicy.check_rollout(text, "999", task)["error"]
        step = onpolicy.char_to_token_span(onpolicy.token_offsets(tok, row_ids), *error["step"])
        recs.append({"ids": row_ids, "step": list(step), "kl": [0.0] * len(row_ids),
                     "entropy": [0.0] * len(row_ids), "lp_s": [0.0] * len(row_ids),
                     "lp_t": [0.0] * len(row_ids)})  # fmt: skip
        ids.append(row_ids)
    oracle = localization.natural_weights(recs, "oracle", "full", seed=0)
    T = max(map(len, ids))
    completion = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in ids])
    valid = torch.tensor([[j < len(r) for j in range(T)] for r in ids])
    mask = error_token_mask(tok, completion, valid.long(), task.step_checker(), [None] * len(ids))
    d = credit_details(
        -torch.ones(len(ids)), valid, error_mask=mask, params=CreditParams(method="first_error")
    )
    for i, w in enumerate(oracle):
        torch.testing.assert_close(d.weights[i, : len(ids[i])].double(), w, atol=1e-6, rtol=0)
        assert mask[i].nonzero().flatten().tolist() == list(range(*recs[i]["step"]))


def test_the_default_checker_blames_issue_51s_first_wrong_character_alone():
    """arithmetic's default (`error_span="token"`) marks one token of each failed row, the
    stated result's first wrong character that issue 51's study recorded (`error_char`)."""
    tok = byte_tokenizer()
    task = get_task("arithmetic", mix="chain:1")
    for text in TEXTS:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        mask = error_token_mask(tok, ids, torch.ones_like(ids), task.step_checker(), [None])
        error = onpolicy.check_rollout(text, "999", task)["error"]
        assert mask[0].nonzero().flatten().tolist() == [error["error_char"]]


def test_the_arithmetic_checker_places_the_first_wrong_equation():
    text = TEXTS[0]
    start, end = first_wrong_equation_span(text)
    assert text[start:end] == "17 - 3 = 15"
    assert first_wrong_equation_span("12 + 5 = 17, then 17 - 3 = 14. The answer is 14.") is None
    assert first_wrong_equation_span("no equations here") is None


def test_tasks_declare_their_checker_and_others_are_refused_before_any_work():
    from gear.app.config import check_task_method, resolve_config

    assert get_task("arithmetic", mix="chain:1").step_checker() is first_wrong_token_span
    assert get_task("arithmetic", mix="multistep:1,chain:1").step_checker() is not None
    assert get_task("arithmetic").step_checker() is None  # 1digit and 2digit: one equation
    cfg = resolve_config(None, {"credit_method": "first_error"})
    with pytest.raises(ValueError, match=r"task 'arithmetic'.*1digit.*has none"):
        check_task_method(cfg, get_task("arithmetic"))
    ok = resolve_config(None, {"credit_method": "first_error", "task_options": {"mix": "chain:1"}})
    check_task_method(ok, get_task("arithmetic", mix="chain:1"))


def test_the_trainer_needs_a_step_checker(tmp_path):
    with pytest.raises(ValueError, match="step_checker"):
        make_trainer(tmp_path, credit_method="first_error")


def test_a_trl_step_blames_the_checkers_span_and_changes_parameters(tmp_path):
    """A user's verifier: the first 3 characters of every completion are its 'wrong step'. The
    failed rows' token advantages are larger in size on those tokens; parameters change."""
    tok = byte_tokenizer()
    seen = []

    def checker(text, ground_truth):
        seen.append(ground_truth)
        return (0, min(3, len(text))) if text else None

    trainer = make_trainer(
        tmp_path, tok, step_checker=checker, credit_method="first_error", **SHARP_CONFIG
    )
    captured = {}
    original = trainer._credit

    def spy(*args, **kwargs):
        details = original(*args, **kwargs)
        captured["details"], captured["mask"] = details, kwargs["error_mask"]
        return details

    trainer._credit = spy
    before = parameters(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in parameters(trainer.model).items())
    assert seen and all(isinstance(g, str) and "The answer is" in g for g in seen)
    d, mask = captured["details"], captured["mask"]
    failed = (d.token_advantages.sum(1) < 0) & mask.any(1)
    assert bool(failed.any())
    for i in failed.nonzero().flatten().tolist():
        on, off = d.weights[i][mask[i] & d.valid[i]], d.weights[i][~mask[i] & d.valid[i]]
        assert float(on.min()) > float(off.max()) if off.numel() else True
    logged = trainer.state.log_history[0]
    assert logged["gear/first_error_placed"] + logged["gear/first_error_unplaced"] > 0


SHARP_CONFIG = {f"credit_{k}": v for k, v in SHARP.items()}


# ------------------------------------------------------------------------------ the CLI

TINY = ["--set", "max_completion_length=8", "--set", "per_device_train_batch_size=4",
        "--set", "num_generations=4", "--set", "eval_n=4", "--set", "eval_max_new_tokens=8",
        "--set", "save_steps=2", "--set", "eval_samples=2"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from gear.models import tiny_model_and_tokenizer

    path = tmp_path_factory.mktemp("tiny")
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_gear_train_refuses_a_task_without_a_checker_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from gear.app.cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--method", "first_error", "--output-dir", str(out), "--steps", "1"]
    )
    assert result.exit_code == 2
    assert "task 'arithmetic'" in " ".join(result.output.split())
    assert not out.exists()


def test_gear_compare_trains_arms_with_their_own_settings(tiny_dir, tmp_path):
    """`gear compare` arms as '[name=]method@key=value,...': each run trains under its arm's
    settings, the rule keeps them, and first_error trains through `gear train` on chain."""
    import json

    import yaml
    from typer.testing import CliRunner

    from gear.app.cli import app

    out = tmp_path / "study"
    args = ["compare", "--methods", "grpo",
            "--methods", "oracle=first_error@credit_modulation=exp,credit_beta=5",
            "--seeds", "0", "--seeds", "1", "--steps", "2", "--out", str(out),
            "--model", str(tiny_dir), "--set", "task_options={mix: 'chain:1'}", *TINY]  # fmt: skip
    first = CliRunner().invoke(app, [*args, "--only", "oracle"])  # one arm now, the rule whole
    assert first.exit_code == 0, first.output
    assert (out / "oracle-seed1" / "summary.json").is_file() and not (out / "grpo-seed0").exists()
    assert json.loads((out / "compare.json").read_text())["missing"]["grpo"] == [0, 1]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("skipped") == 2
    rule = json.loads((out / "rule.json").read_text())
    assert rule["arms"] == ["grpo", "oracle"]
    assert rule["arm_settings"]["oracle"] == {
        "credit_method": "first_error", "credit_modulation": "exp", "credit_beta": 5,
    }  # fmt: skip
    config = yaml.safe_load((out / "oracle-seed1" / "config.yaml").read_text())
    assert config["trainer"]["credit_method"] == "first_error"
    assert config["trainer"]["credit_modulation"] == "exp"
    plain = yaml.safe_load((out / "grpo-seed1" / "config.yaml").read_text())
    assert "credit_modulation" not in plain["trainer"]
    report = json.loads((out / "compare.json").read_text())
    assert report["comparisons"]["oracle"]["seeds"] == [0, 1]
    metrics = (out / "oracle-seed0" / "metrics.jsonl").read_text()
    assert "gear/first_error_placed" in metrics
