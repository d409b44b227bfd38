"""OAR-G (arXiv 2601.07408): the bi-level reshaping against its loop oracle, its invariants, a
hand-worked row, and the input-gradient influence against a finite difference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gear.credit import CreditParams, credit_details
from gear.credit.attribution import (
    answer_span,
    input_gradient_influence,
    masked_quantile,
    span_logprob,
    span_positions,
)
from gear.testing import oar_row


def oar(adv, valid, influence, **kw):
    return credit_details(
        torch.as_tensor(adv, dtype=torch.float64),
        torch.as_tensor(valid),
        influence=torch.as_tensor(influence, dtype=torch.float64),
        params=CreditParams(method="oar_g", **kw),
    )


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    T=st.integers(1, 24),
    answer_len=st.integers(1, 4),
    quantile=st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]),
    boost=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    floor=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_vectorised_equals_loop_oracle(data, T, answer_len, quantile, boost, floor):
    # heavy ties (a few distinct values) exercise the quantile's order statistics
    value = st.one_of(st.sampled_from([0.0, 0.5, 2.0]), st.floats(0, 50, width=64))
    rows = data.draw(st.integers(1, 3))
    advs = [data.draw(st.sampled_from([-1.5, -0.2, 0.0, 0.4, 1.0])) for _ in range(rows)]
    valid = [data.draw(st.lists(st.booleans(), min_size=T, max_size=T)) for _ in range(rows)]
    infl = [data.draw(st.lists(value, min_size=T, max_size=T)) for _ in range(rows)]
    kw = dict(oar_answer_len=answer_len, oar_quantile=quantile, oar_boost=boost, oar_floor=floor)
    d = oar(advs, valid, infl, **kw)
    for i in range(rows):
        ref = oar_row(advs[i], valid[i], infl[i], **kw)
        assert d.weights[i].tolist() == pytest.approx(ref["weights"], abs=1e-12)
        assert d.token_advantages[i].tolist() == pytest.approx(ref["token_advantages"], abs=1e-12)
        assert d.source[i].tolist() == pytest.approx(ref["source"], abs=1e-12)


def test_masked_quantile_is_numpys_linear_quantile():
    np = pytest.importorskip("numpy")
    g = torch.Generator().manual_seed(0)
    x = torch.rand(5, 17, generator=g, dtype=torch.float64)
    valid = torch.rand(5, 17, generator=g) < 0.7
    for q in (0.0, 0.3, 0.5, 0.9, 1.0):
        got = masked_quantile(x, valid, q)
        for i in range(5):
            ref = np.quantile(x[i][valid[i]].numpy(), q)
            assert float(got[i]) == pytest.approx(float(ref), abs=1e-12)


influence_rows = st.integers(4, 30).flatmap(
    lambda T: st.tuples(
        st.lists(st.floats(0, 20, width=64), min_size=T, max_size=T),
        st.lists(st.booleans(), min_size=T, max_size=T),
    )
)


@settings(max_examples=100, deadline=None)
@given(row=influence_rows, adv=st.sampled_from([-2.0, -0.3, 0.5, 1.0]))
def test_mass_is_preserved(row, adv):
    """Sum_t A_t = n A over the row's valid tokens, exactly (no clip binds: OAR-G has none)."""
    infl, valid = row
    d = oar([adv], [valid], [infl])
    n = sum(valid)
    assert float(d.token_advantages.sum()) == pytest.approx(n * adv, rel=1e-12, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(row=influence_rows, adv=st.sampled_from([-2.0, -0.3, 0.5, 1.0]))
def test_weights_ignore_the_sign_of_the_advantage(row, adv):
    """Not sign-aware (unlike spec §2.7): a pivotal token gets more |A| in a success and in a
    failure alike, so A -> -A flips every token advantage and changes no weight."""
    infl, valid = row
    pos, neg = oar([adv], [valid], [infl]), oar([-adv], [valid], [infl])
    assert torch.equal(pos.weights, neg.weights)
    torch.testing.assert_close(pos.token_advantages, -neg.token_advantages, rtol=0, atol=0)
    assert torch.all(oar([0.0], [valid], [infl]).token_advantages == 0)


@settings(max_examples=60, deadline=None)
@given(row=influence_rows)
def test_larger_influence_never_gets_a_smaller_weight(row):
    infl, valid = row
    d = oar([1.0], [valid], [infl])
    scored = answer_span(torch.tensor([valid]), 2).logical_not() & torch.tensor([valid])
    s, w = d.source[scored], d.weights[scored]
    order = s.argsort()
    assert torch.all(w[order].diff() >= -1e-12)


def test_constant_influence_is_grpo_exactly():
    d = oar([0.7], [[True] * 9], [[3.0] * 9])
    assert torch.equal(d.weights, torch.ones(1, 9, dtype=torch.float64))


def test_hand_worked_row_suppresses_low_and_boosts_pivotal_tokens():
    """Influences e^v - 1 make s = v / 4 after log1p and min-max: s = (0, .25, .5, .75, 1)
    before a 2-token answer span. The median is tau = .5: s = 0 gets the floor .1, s = .25
    gets .5; s = .5, .75, 1 get 1, 1.5, 2 (boost 1). Raw sum 5.1 over 5 tokens: w = raw / 1.02."""
    import math

    infl = [math.expm1(v) for v in (0.0, 1.0, 2.0, 3.0, 4.0)] + [9.0, 0.0]
    d = oar([1.0], [[True] * 7], [infl])
    raw = [0.1, 0.5, 1.0, 1.5, 2.0]
    expected = [r * 5 / 5.1 for r in raw] + [1.0, 1.0]
    assert d.weights[0].tolist() == pytest.approx(expected, abs=1e-12)
    w = d.weights[0]
    assert w[0] < w[1] < 1 < w[3] < w[4]  # suppressed below the median, boosted above
    assert w[5] == w[6] == 1.0  # the answer span is not reshaped


def test_rows_fall_back_on_non_finite_influence():
    d = oar([1.0, 1.0], [[True] * 5] * 2, [[1.0, float("nan"), 2, 3, 4], [1.0, 0, 2, 3, 4]])
    assert d.fallback_rows.tolist() == [True, False]
    assert torch.all(d.weights[0] == 1)


def test_oar_g_needs_its_influence():
    with pytest.raises(ValueError, match=r"needs \['influence'\]"):
        credit_details(
            torch.ones(1), torch.ones(1, 3, dtype=torch.bool), params=CreditParams(method="oar_g")
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [("oar_answer_len", 0), ("oar_quantile", 1.5), ("oar_boost", -1.0), ("oar_floor", 2.0)],
)
def test_invalid_oar_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"CreditParams.{field}"):
        CreditParams(method="oar_g", **{field: value})


# ----------------------------------------------------------------------------- influence


def test_answer_span_and_positions_are_each_rows_last_valid_tokens():
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    span = answer_span(valid, 2)
    assert span.long().tolist() == [[0, 0, 1, 1, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]]
    idx, real = span_positions(span, 2)
    assert idx.tolist() == [[2, 3], [0, 2], [0, 0]]
    assert real.tolist() == [[True, True], [True, True], [False, False]]


def test_influence_is_gradient_times_input_of_the_answer_logprob():
    """On a tiny causal model, each row's influence equals the finite-difference derivative of
    phi(e + h e_t) at h = 0 (the directional derivative along e_t), rows independently."""
    torch.manual_seed(0)
    N, L, H, V = 3, 6, 5, 7
    mix = torch.randn(H, H, dtype=torch.float64)
    head = torch.randn(V, H, dtype=torch.float64)
    targets = torch.randint(0, V, (N, 2))
    real = torch.tensor([[True, True], [True, True], [False, True]])

    def score(e):  # causal: position l sees the mean of e_0..e_l
        h = torch.tanh(e.cumsum(1) / torch.arange(1, L + 1)[:, None] @ mix)
        z = h[:, L - 3 : L - 1] @ head.T  # predicts the last two tokens
        return span_logprob(z, targets, real, temperature=0.7)

    e = torch.randn(N, L, H, dtype=torch.float64)
    got = input_gradient_influence(score, e)
    step = 1e-6
    for t in range(L):
        bump = torch.zeros_like(e)
        bump[:, t] = e[:, t] * step
        fd = (score(e + bump) - score(e - bump)) / (2 * step)
        torch.testing.assert_close(got[:, t], fd.abs().float(), atol=1e-5, rtol=1e-4)
    assert torch.all(got[:, L - 1] == 0)  # the last token influences nothing before it
