"""`lambda_grpo` (Sullivan, arXiv 2509.21154) against a plain re-derivation of its rule: a trie
of the group's completions, each token's loss scaled by 1 / (the rows through its node). And
`first_error`'s sharp form, whose mass is preserved after the clip."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gear.credit import CreditParams, credit_details, token_advantages
from gear.credit.implicit import prefix_counts
from gear.credit.methods import clipped_to_mass

SHARP = dict(modulation="exp", beta=5.0, w_min=0.0, w_max=100.0)


def trie_scales(rows: list[list[int]], groups: list[int]) -> list[list[float]]:
    """The rule re-derived: walk every row's tokens down a trie of its group's completions,
    counting visits per node; a token's scale is 1 / its node's visits."""
    visits: dict[tuple, int] = {}
    for row, g in zip(rows, groups, strict=True):
        for t in range(len(row)):
            key = (g, tuple(row[: t + 1]))
            visits[key] = visits.get(key, 0) + 1
    return [
        [1 / visits[(g, tuple(row[: t + 1]))] for t in range(len(row))]
        for row, g in zip(rows, groups, strict=True)
    ]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.integers(2, 5), st.integers(1, 6), st.data())
def test_token_advantages_are_the_trie_rule(n_groups, size, T, data):
    rows = [
        data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=T))
        for _ in range(n_groups * size)
    ]
    groups = [i // size for i in range(n_groups * size)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[k < len(r) for k in range(width)] for r in rows])
    adv = torch.tensor(
        data.draw(st.lists(st.floats(-2, 2), min_size=len(rows), max_size=len(rows))),
        dtype=torch.float64,
    )
    counts = prefix_counts(ids, mask, torch.tensor(groups))
    got = token_advantages(
        adv, mask, prefix_count=counts, params=CreditParams(method="lambda_grpo")
    )
    for i, scale in enumerate(trie_scales(rows, groups)):
        want = [float(adv[i]) * s for s in scale] + [0.0] * (width - len(scale))
        assert got[i].tolist() == pytest.approx(want, abs=1e-12)


def test_unshared_tokens_are_grpo_and_shared_nodes_move_by_the_mean():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [5, 6, 7]])
    mask = torch.ones(3, 3, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    counts = prefix_counts(ids, mask, torch.zeros(3, dtype=torch.long))
    d = credit_details(adv, mask, prefix_count=counts, params=CreditParams(method="lambda_grpo"))
    assert d.token_advantages[2].tolist() == [0.5, 0.5, 0.5]
    assert d.token_advantages[0].tolist() == [0.5, 0.5, 1.0]
    # the node (1, 2) shared by rows 0 and 1 moves by their mean advantage, 0
    assert float(d.token_advantages[0, 1] + d.token_advantages[1, 1]) == 0.0


def test_counts_below_one_are_refused_before_any_work():
    mask = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="prefix_count: expected >= 1"):
        token_advantages(
            torch.tensor([1.0, -1.0]),
            mask,
            prefix_count=torch.zeros(2, 2),
            params=CreditParams(method="lambda_grpo"),
        )
    with pytest.raises(ValueError, match=r"needs \['prefix_count'\]"):
        token_advantages(torch.tensor([1.0, -1.0]), mask, params=CreditParams(method="lambda_grpo"))


def test_the_sharp_first_error_keeps_a_long_rows_mass():
    """Issue 67: with the spec's order (rescale, then clip) one blamed token of a 400-token row
    took 108.4 before the clip at 100, so the row's mass was -391.6, not -400."""
    n = 400
    mask = torch.ones(1, n, dtype=torch.bool)
    err = torch.zeros(1, n, dtype=torch.bool)
    err[0, 7] = True
    d = credit_details(
        torch.tensor([-1.0], dtype=torch.float64),
        mask,
        error_mask=err,
        params=CreditParams(method="first_error", **SHARP),
    )
    assert float(d.token_advantages.sum()) == pytest.approx(-400.0, abs=1e-9)
    assert float(d.weights[0, 7]) == 100.0  # the blamed token sits at the clip
    assert float(d.weights[0].max()) == 100.0 and float(d.weights[0, 0]) > 0.75


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.floats(0.0, 1.0),
    st.floats(1.0, 50.0),
    st.lists(st.floats(0.01, 200.0), min_size=40, max_size=40),
)
def test_clipped_to_mass_has_mean_one_and_respects_the_clip(n, lo, hi, raws):
    raw = torch.tensor([raws[:n]], dtype=torch.float64)
    valid = torch.ones(1, n, dtype=torch.bool)
    w = clipped_to_mass(raw, valid, lo, hi)
    assert float(w.sum()) == pytest.approx(n, rel=1e-9)
    assert float(w.min()) >= lo - 1e-12 and float(w.max()) <= hi + 1e-12
    order = raw[0].argsort()  # monotone: a larger raw weight never gets less
    assert bool((w[0, order].diff() >= -1e-9).all())


def test_first_error_refuses_a_clip_that_cannot_keep_the_mass():
    with pytest.raises(ValueError, match=r"CreditParams\.w_max: expected w_min <= 1 <= w_max"):
        CreditParams(method="first_error", w_min=0.0, w_max=0.9)


# ------------------------------------------------------------------------------ trainers


def tree_rollout(prompts, trainer):
    """Completions over a 3-token alphabet, so rows of a group share prefixes of every length."""
    tok = trainer.processing_class
    gen = torch.Generator().manual_seed(7)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
    for prompt in prompts:
        ids = tok.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        n = int(torch.randint(2, 7, (1,), generator=gen))
        out["prompt_ids"].append(ids["input_ids"])
        out["completion_ids"].append(torch.randint(60, 63, (n,), generator=gen).tolist())
        out["logprobs"].append([0.0] * n)
    return out


def test_a_trl_step_divides_by_the_groups_shared_rows_and_logs_the_tree(tmp_path, monkeypatch):
    from _trl_helpers import make_trainer, parameters

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = make_trainer(tmp_path, credit_method="lambda_grpo", rollout_func=tree_rollout)
    captured = {}
    original = trainer._credit

    def spy(*args, **kwargs):
        details = original(*args, **kwargs)
        captured.update(kwargs, advantages=args[0], details=details)
        return details

    trainer._credit = spy
    before = parameters(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in parameters(trainer.model).items())
    ids, mask = captured["completion_ids"], captured["completion_mask"].bool()
    G = captured["group_size"]
    rows = [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]
    scales = trie_scales(rows, [i // G for i in range(len(rows))])
    assert any(s < 1 for scale in scales for s in scale)  # some prefix is shared: a real test
    adv, got = captured["advantages"], captured["details"].token_advantages
    for i, scale in enumerate(scales):
        cols = mask[i].nonzero().flatten()
        want = torch.tensor(scale, dtype=got.dtype) * adv[i]
        torch.testing.assert_close(got[i, cols], want)
    logged = trainer.state.log_history[0]
    assert 0 <= logged["gear/prefix_shared_frac"] <= 1 and logged["gear/prefix_rows_mean"] >= 1


def test_the_gym_trains_a_lambda_grpo_arm_and_blames_the_first_wrong_token():
    from gear.gym.task import ChainTask
    from gear.gym.train import error_token_or_step, group_labels, parse_arm

    arm = parse_arm("lambda_grpo")
    assert arm.params(0).required_signals == ("prefix_count",)
    task = ChainTask(length=2)
    problems = torch.tensor([[3, 4, 8], [3, 4, 8], [1, 1, 1]])
    comp = task.references(problems)
    comp[0, 4] = (comp[0, 4] + 1) % 10  # step 0's result is wrong: token 4
    tok = error_token_or_step(task, problems, comp, "token")
    step = error_token_or_step(task, problems, comp, "step")
    assert tok[0].nonzero().flatten().tolist() == [4] and not tok[1:].any()
    assert step[0].nonzero().flatten().tolist() == list(range(6))
    assert group_labels(problems, None).tolist() == [0, 0, 1]
    assert group_labels(problems, 1).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="error_span must be one of"):
        parse_arm("first_error@error_span=word")


def test_gym_arms_lambda_grpo_and_the_precise_first_error_change_the_policy(tmp_path):
    from dataclasses import replace

    from gear.gym.model import ModelConfig, WarmStart, warm_start
    from gear.gym.task import ChainTask
    from gear.gym.train import RLConfig, parse_arm, train_arm

    task, cfg = ChainTask(3), ModelConfig(hidden=16, layers=1, heads=2)
    warm = WarmStart(target=1.0, max_steps=10, check_every=5, eval_n=16, batch=16)
    state, _ = warm_start(task, cfg, warm, cache=tmp_path, log=lambda _: None)
    rl = replace(RLConfig(prompts=4, group=4, eval_every=1, eval_n=16), steps=2, lr=1e-2)
    for spec in ("lambda_grpo", "first_error@error_span=token", "first_error@error_span=step"):
        run = train_arm(parse_arm(spec), 0, task, cfg, state, rl, log=lambda _: None)
        start, end = run["curve"][0]["exact"], run["curve"][-1]["exact"]
        assert end != start, spec


TINY_CLI = ["--set", "max_completion_length=8", "--set", "per_device_train_batch_size=4",
            "--set", "num_generations=4", "--set", "eval_n=4", "--set", "eval_max_new_tokens=8",
            "--set", "save_steps=2", "--set", "eval_samples=2"]  # fmt: skip


def test_gear_compare_runs_a_lambda_grpo_arm(tmp_path):
    import json

    from typer.testing import CliRunner

    from gear.app.cli import app
    from gear.models import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(seed=0)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "study"
    args = ["compare", "--methods", "grpo", "--methods", "lambda_grpo", "--seeds", "0",
            "--steps", "2", "--out", str(out), "--model", str(tmp_path / "tiny"), *TINY_CLI]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "lambda_grpo" in json.dumps(json.loads((out / "rule.json").read_text())["arms"])
    metrics = (out / "lambda_grpo-seed0" / "metrics.jsonl").read_text()
    assert "gear/prefix_shared_frac" in metrics
