"""Chunked signals equal a naive full-logits computation (spec §1)."""

from __future__ import annotations

import pytest
import torch

from gear.credit.signals import signals_from_hidden, signals_from_logits


def naive(s_logits, t_logits, ids, temperature=1.0):
    logp_s = torch.log_softmax(s_logits.double() / temperature, -1)
    logp_t = torch.log_softmax(t_logits.double() / temperature, -1)
    p_s = logp_s.exp()
    kl = (p_s * (logp_s - logp_t)).sum(-1)
    ent = -(p_s * logp_s).sum(-1)
    lp_s = logp_s.gather(-1, ids[..., None]).squeeze(-1)
    lp_t = logp_t.gather(-1, ids[..., None]).squeeze(-1)
    return kl, ent, lp_s, lp_t


def make(N=3, T=17, H=24, V=301, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, T, H, generator=g)
    ht = hs + 0.5 * torch.randn(N, T, H, generator=g)
    W = torch.randn(V, H, generator=g) * scale / H**0.5
    ids = torch.randint(0, V, (N, T), generator=g)
    return hs, ht, W, ids


@pytest.mark.parametrize("chunk_size", [1, 5, 256])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logits_equal_naive(chunk_size, temperature):
    hs, ht, W, ids = make()
    s, t = hs @ W.T, ht @ W.T
    sig = signals_from_logits(s, t, ids, temperature=temperature, chunk_size=chunk_size)
    kl, ent, lp_s, lp_t = naive(s, t, ids, temperature)
    for got, want in [
        (sig.kl, kl),
        (sig.entropy, ent),
        (sig.student_logprobs, lp_s),
        (sig.teacher_logprobs, lp_t),
    ]:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert (sig.kl >= -1e-6).all()


@pytest.mark.parametrize("bias", [False, True])
def test_hidden_state_path_equals_naive(bias):
    hs, ht, W, ids = make(seed=1)
    b = torch.randn(W.shape[0]) if bias else None
    sig = signals_from_hidden(hs, ht, W, ids, lm_head_bias=b, chunk_size=7)
    s = torch.nn.functional.linear(hs, W, b)
    t = torch.nn.functional.linear(ht, W, b)
    kl, ent, _lp_s, lp_t = naive(s, t, ids)
    torch.testing.assert_close(sig.kl.double(), kl, atol=1e-5, rtol=0)
    torch.testing.assert_close(sig.entropy.double(), ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(sig.teacher_logprobs.double(), lp_t, atol=1e-5, rtol=0)


def test_a_separate_teacher_head_of_another_width_equals_naive():
    hs, _, W, ids = make(seed=5)
    g = torch.Generator().manual_seed(9)
    ht = torch.randn(*hs.shape[:2], 40, generator=g)
    W_t, b_t = (
        torch.randn(W.shape[0], 40, generator=g) / 40**0.5,
        torch.randn(W.shape[0], generator=g),
    )
    sig = signals_from_hidden(
        hs, ht, W, ids, teacher_lm_head_weight=W_t, teacher_lm_head_bias=b_t, chunk_size=11
    )
    kl, ent, _, lp_t = naive(hs @ W.T, ht @ W_t.T + b_t, ids)
    torch.testing.assert_close(sig.kl.double(), kl, atol=1e-5, rtol=0)
    torch.testing.assert_close(sig.entropy.double(), ent, atol=1e-5, rtol=0)
    torch.testing.assert_close(sig.teacher_logprobs.double(), lp_t, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="teacher_lm_head_weight"):
        signals_from_hidden(hs, ht, W, ids, teacher_lm_head_weight=W_t[:-1])


def test_bfloat16_inputs_accumulate_in_float32():
    hs, ht, W, ids = make(seed=2)
    s, t = (hs @ W.T).bfloat16(), (ht @ W.T).bfloat16()
    sig = signals_from_logits(s, t, ids, chunk_size=8)
    kl, ent, *_ = naive(s.float(), t.float(), ids)  # same bf16-rounded logits, exact maths
    assert sig.kl.dtype == torch.float32
    torch.testing.assert_close(sig.kl.double(), kl, atol=1e-5, rtol=0)
    torch.testing.assert_close(sig.entropy.double(), ent, atol=1e-5, rtol=0)
    sig_h = signals_from_hidden(hs.bfloat16(), ht.bfloat16(), W.bfloat16(), ids)
    assert torch.isfinite(sig_h.kl).all() and sig_h.kl.dtype == torch.float32


def test_sampled_token_estimators():
    hs, ht, W, ids = make(seed=3)
    s, t = hs @ W.T, ht @ W.T
    _, _, lp_s, lp_t = naive(s, t, ids)
    k1 = signals_from_logits(s, t, ids, estimator="k1").kl
    k3 = signals_from_logits(s, t, ids, estimator="k3").kl
    torch.testing.assert_close(k1.double(), lp_s - lp_t, atol=1e-5, rtol=0)
    r = (lp_t - lp_s).exp()
    torch.testing.assert_close(k3.double(), r - 1 - (lp_t - lp_s), atol=1e-5, rtol=1e-5)
    assert (k3 >= 0).all()


def test_topk_estimator_is_exact_with_the_whole_vocabulary_and_close_with_most_of_it():
    hs, ht, W, ids = make(seed=4, scale=6.0)  # peaked distributions
    s, t = hs @ W.T, ht @ W.T
    kl, *_ = naive(s, t, ids)
    full_k = signals_from_logits(s, t, ids, estimator="topk", topk=W.shape[0]).kl
    torch.testing.assert_close(full_k.double(), kl, atol=1e-5, rtol=0)
    approx = signals_from_logits(s, t, ids, estimator="topk", topk=64).kl
    assert (approx >= -1e-6).all()  # the tail bucket keeps it a KL of two distributions
    assert float((approx.double() - kl).abs().mean()) < 0.1 * float(kl.mean())


def test_no_gradient_flows():
    hs, ht, W, ids = make()
    W.requires_grad_(True)
    sig = signals_from_hidden(hs, ht, W, ids)
    assert not sig.kl.requires_grad


@pytest.mark.parametrize("estimator", ["full", "topk", "k3"])
@pytest.mark.parametrize("chunk_size", [1, 4, 256])
def test_a_mask_computes_only_its_positions_and_zeros_the_rest(estimator, chunk_size):
    hs, ht, W, ids = make(seed=3)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[0] = False  # a row with nothing to compute
    everything = signals_from_hidden(hs, ht, W, ids, estimator=estimator, topk=8)
    for sig in (
        signals_from_hidden(
            hs, ht, W, ids, estimator=estimator, topk=8, chunk_size=chunk_size, mask=mask
        ),
        signals_from_logits(
            hs @ W.T, ht @ W.T, ids, estimator=estimator, topk=8, chunk_size=chunk_size, mask=mask
        ),
    ):
        for name in ("kl", "entropy", "student_logprobs", "teacher_logprobs"):
            got, want = getattr(sig, name), getattr(everything, name)
            torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
            assert (got[~mask] == 0).all(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("masked", [False, True])
def test_the_callers_logits_are_left_untouched(dtype, temperature, masked):
    hs, ht, W, ids = make(seed=4)
    s, t = (hs @ W.T).to(dtype), (ht @ W.T).to(dtype)
    s0, t0 = s.clone(), t.clone()
    mask = torch.ones(ids.shape, dtype=torch.bool) if masked else None
    sig = signals_from_logits(s, t, ids, temperature=temperature, chunk_size=5, mask=mask)
    assert torch.equal(s, s0) and torch.equal(t, t0)
    kl = naive(s.float(), t.float(), ids, temperature)[0]
    torch.testing.assert_close(sig.kl.double(), kl, atol=1e-5, rtol=0)


def test_a_bad_mask_is_named():
    hs, ht, W, ids = make()
    with pytest.raises(ValueError, match="mask"):
        signals_from_hidden(hs, ht, W, ids, mask=torch.ones(ids.shape))  # not bool
    with pytest.raises(ValueError, match="mask"):
        signals_from_hidden(hs, ht, W, ids, mask=torch.ones(ids.shape, dtype=torch.bool)[:, 1:])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(estimator="k2"), "estimator"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    hs, ht, W, ids = make()
    with pytest.raises(ValueError, match=match):
        signals_from_hidden(hs, ht, W, ids, **kwargs)


def test_shape_mismatches_are_named():
    hs, ht, W, ids = make()
    with pytest.raises(ValueError, match="teacher_hidden"):
        signals_from_hidden(hs, ht[:, :-1], W, ids)
    with pytest.raises(ValueError, match="lm_head_weight"):
        signals_from_hidden(hs, ht, W[:, :-1], ids)
    with pytest.raises(ValueError, match="token_ids"):
        signals_from_logits(hs @ W.T, ht @ W.T, ids[:, :-1])
