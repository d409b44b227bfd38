"""`random_shape`, the shape-matched placebo: a candidate's per-row weights moved to random valid
positions, against a plain loop and as a property (the multiset of each row's weights)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gear.credit import CreditParams, credit_details

SHARP = dict(modulation="exp", beta=2.0, w_min=0.0, w_max=10.0)


def batch(n: int, t: int, seed: int, lengths: list[int] | None = None):
    g = torch.Generator().manual_seed(seed)
    kl = torch.rand(n, t, generator=g, dtype=torch.float64) ** 3
    ent = torch.rand(n, t, generator=g, dtype=torch.float64)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = lengths or [t] * n
    valid = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    return adv, valid, dict(kl=kl, entropy=ent, student_logprobs=logp, teacher_logprobs=logp / 2)


def weights(adv, valid, signals, **params):
    return credit_details(adv, valid, **signals, params=CreditParams(**params)).weights


def loop_random_shape(candidate, valid, seed):
    """Plain loop: the same uniform keys; row i's k-th valid weight (in position order) goes to
    the k-th valid position in the order of the keys."""
    keys = torch.rand(
        valid.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    out = torch.ones_like(candidate)
    for i in range(valid.shape[0]):
        positions = [t for t in range(valid.shape[1]) if valid[i, t]]
        shuffled = sorted(positions, key=lambda t: float(keys[i, t]))
        for src, dst in zip(positions, shuffled, strict=True):
            out[i, dst] = candidate[i, src]
    return out


@pytest.mark.parametrize("method", ["gear", "gear_departure_blame", "rlsd"])
def test_random_shape_equals_a_plain_loop(method):
    adv, valid, sig = batch(6, 11, seed=3, lengths=[11, 4, 0, 9, 1, 11])
    cand = weights(adv, valid, sig, method=method, **SHARP)
    got = weights(adv, valid, sig, method="random_shape", shape_method=method, seed=5, **SHARP)
    torch.testing.assert_close(got, loop_random_shape(cand, valid, seed=5), rtol=0, atol=0)
    assert not torch.equal(got, cand)  # it moved something


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 5),
    t=st.integers(1, 12),
    data_seed=st.integers(0, 10_000),
    seed=st.integers(0, 10_000),
    method=st.sampled_from(["gear", "gear_token", "gear_departure_blame", "grpo", "fixed"]),
    beta=st.floats(0.0, 5.0),
    data=st.data(),
)
def test_each_row_keeps_the_candidates_weights_sorted(n, t, data_seed, seed, method, beta, data):
    """Same multiset of weights per row (so the same concentration, mass and sign-awareness),
    weight 1 at invalid tokens, and so the same per-token advantage mass per row."""
    lengths = data.draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    adv, valid, sig = batch(n, t, data_seed, lengths)
    kw = dict(modulation="exp", beta=beta, w_min=0.0, w_max=10.0)
    cand = weights(adv, valid, sig, method=method, **kw)
    d = credit_details(
        adv, valid, **sig,
        params=CreditParams(method="random_shape", shape_method=method, seed=seed, **kw),
    )  # fmt: skip
    for i in range(n):
        v = valid[i]
        assert torch.equal(d.weights[i][v].sort().values, cand[i][v].sort().values)
        assert torch.all(d.weights[i][~v] == 1)
    mass = d.token_advantages.sum(dim=1)
    torch.testing.assert_close(mass, (adv[:, None] * torch.where(valid, cand, 0.0)).sum(dim=1))


def test_random_shape_of_oar_g_reads_the_influence_alone():
    """OAR-G's weights come from the answer influence, not a teacher: its placebo needs no more."""
    adv, valid, _ = batch(5, 9, seed=2, lengths=[9, 3, 0, 7, 9])
    influence = torch.rand(5, 9, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    # a non-default answer length: the candidate runs with the placebo's own params
    p = CreditParams(method="random_shape", shape_method="oar_g", seed=4, oar_answer_len=3)
    assert p.required_signals == ("influence",)
    cand = credit_details(adv, valid, influence=influence, params=replace(p, method="oar_g"))
    got = credit_details(adv, valid, influence=influence, params=p).weights
    torch.testing.assert_close(got, loop_random_shape(cand.weights, valid, seed=4), rtol=0, atol=0)
    assert not torch.equal(got, cand.weights)
    with pytest.raises(ValueError, match=r"needs \['influence'\]"):
        credit_details(adv, valid, kl=torch.rand(5, 9, dtype=torch.float64), params=p)


def test_random_shape_reads_its_candidates_signals():
    assert CreditParams(method="random_shape", shape_method="rlsd").required_signals == (
        "student_logprobs",
        "teacher_logprobs",
    )
    assert CreditParams(method="random_shape").required_signals == ("kl", "entropy")


def test_random_shape_refuses_a_candidate_it_cannot_move():
    with pytest.raises(ValueError, match="shape_method"):
        CreditParams(method="random_shape", shape_method="random_shape")
    with pytest.raises(ValueError, match="shape_method"):
        CreditParams(shape_method="no_such_method")
