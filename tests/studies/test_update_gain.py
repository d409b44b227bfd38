"""studies/archive/update_gain.py: the per-token influence is the exact directional derivative, the
shared-prompt version equals the plain one, an arm's gain equals grad J . g_arm computed by
autograd, and the decision rule applies its gates. Tiny random models, no download."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gear.testing import byte_tokenizer, tiny_model
from studies.archive import update_gain as ug


@pytest.fixture(scope="module")
def setup():
    tok = byte_tokenizer()
    model = tiny_model(tok, seed=3, hidden=32, layers=2)
    model.set_attn_implementation("eager")
    model.eval()
    gen = torch.Generator().manual_seed(0)
    v = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    prompt = list(torch.randint(3, 250, (7,), generator=gen))
    rows = [list(torch.randint(3, 250, (n,), generator=gen)) for n in (5, 3, 6)]
    return tok, model, v, [int(x) for x in prompt], [[int(x) for x in r] for r in rows]


def autograd_directional(model, tok, prompt, row, v) -> torch.Tensor:
    """(T,) v . grad log pi(row[t]) by one backward per token (the plain oracle)."""
    ids, mask = ug._padded([prompt + row], tok.pad_token_id)
    out = []
    for t in range(len(row)):
        model.zero_grad(set_to_none=True)
        lp = ug.token_logprobs(model, ids, mask)[0, len(prompt) - 1 + t]
        lp.backward()
        out.append(sum((p.grad * v[n]).sum() for n, p in model.named_parameters()))
    model.zero_grad(set_to_none=True)
    return torch.stack(out).detach()


def test_influence_is_the_directional_derivative_of_each_token_logprob(setup):
    tok, model, v, prompt, rows = setup
    s = ug.influence(model, tok, [(prompt + r, len(prompt)) for r in rows], v)
    for got, r in zip(s, rows, strict=True):
        torch.testing.assert_close(got, autograd_directional(model, tok, prompt, r, v),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


def test_shared_prompt_influence_equals_the_plain_one(setup):
    tok, model, v, prompt, rows = setup
    plain = ug.influence(model, tok, [(prompt + r, len(prompt)) for r in rows], v)
    shared = ug.group_influence(model, prompt, rows, v, tok.pad_token_id)
    for a, b in zip(plain, shared, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arm", ["grpo", "gear", "gear_k1", "rlsd", "sft"])
def test_arm_gain_equals_held_out_gradient_dot_arm_gradient(setup, arm):
    """G_arm from the cached influence equals grad J . grad(dapo objective) by autograd."""
    tok, model, v, prompt, rows = setup
    gen = torch.Generator().manual_seed(1)
    s = ug.group_influence(model, prompt, rows, v, tok.pad_token_id)
    recs = [
        {
            "ids": r,
            "kl": torch.rand(len(r), generator=gen).tolist(),
            "entropy": torch.rand(len(r), generator=gen).tolist(),
            "lp_s": (-torch.rand(len(r), generator=gen)).tolist(),
            "lp_t": (-torch.rand(len(r), generator=gen)).tolist(),
            "s": x.tolist(),
        }
        for r, x in zip(rows, s, strict=True)
    ]
    batch = {"batch": 0, "groups": [{"rewards": [1.0, 0.0, 0.0], "rows": recs}],
             "ref_s": [x.tolist() for x in s]}  # fmt: skip
    got = ug.arm_gain(arm, batch)
    # autograd: objective = sum_{i,t} A_hat * log pi / n_tokens (sft: A_hat = 1)
    if arm == "sft":
        adv = [torch.ones(len(r), dtype=torch.float64) for r in rows]
    else:
        tok_adv, _ = ug.arm_token_advantages(arm, batch)
        adv = [tok_adv[i, : len(r)] for i, r in enumerate(rows)]
    model.zero_grad(set_to_none=True)
    n_tok = sum(len(r) for r in rows)
    for r, a in zip(rows, adv, strict=True):
        ids, mask = ug._padded([prompt + r], tok.pad_token_id)
        lp = ug.token_logprobs(model, ids, mask)[0, len(prompt) - 1 :]
        ((lp.double() * a).sum() / n_tok).backward()
    want = float(sum((p.grad.double() * v[n]).sum() for n, p in model.named_parameters()))
    model.zero_grad(set_to_none=True)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
    if arm == "gear":  # and gear's weights really differ from grpo's here
        assert got != pytest.approx(ug.arm_gain("grpo", batch), rel=1e-3)


def test_group_advantages_are_trl_group_scaled():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    a = ug.group_advantages(r)
    torch.testing.assert_close(a.sum(1), torch.zeros(2, dtype=torch.float64))
    assert a[1, 3] == pytest.approx(0.75 / (0.5 + 1e-4))


def _gains(**means):
    rng = np.random.default_rng(0)
    base = {a: rng.normal(0.0, 0.01, 60) for a in ug.ARMS}
    base["grpo"] = base["grpo"] + 1.0
    base["sft"] = base["sft"] + 5.0
    for k, m in means.items():
        base[k] = base[k] + m
    return base


LOC_UP = {"decision_input": {"failed_rows": 400, "d_loc": {"ci": [0.05, 0.2]}}}


def test_decision_rule_switches_only_when_both_conditions_and_gates_hold():
    g = _gains(gear=1.0, gear_k1=1.0)
    assert ug.decide(g, LOC_UP)["decision"] == "k1"
    # update benchmark says k1 is worse than gear by more than epsilon (0.1 * |G(grpo)| = 0.1)
    assert ug.decide(_gains(gear=1.0, gear_k1=0.5), LOC_UP)["decision"] == "full"
    loc_flat = {"decision_input": {"failed_rows": 400, "d_loc": {"ci": [-0.05, 0.2]}}}
    assert ug.decide(g, loc_flat)["decision"] == "full"
    # gates: too few failed rows; a placebo that gains; no localisation at all
    few = {"decision_input": {"failed_rows": 299, "d_loc": {"ci": [0.05, 0.2]}}}
    assert ug.decide(g, few)["decision"].startswith("undecided")
    assert ug.decide(_gains(gear=1.0, gear_k1=1.0, shuffled=0.5), LOC_UP)["decision"].startswith(
        "undecided"
    )
    assert ug.decide(g, None)["default"] == "full"
