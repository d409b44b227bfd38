"""Chunked signals equal a naive full-logits computation (spec §1)."""

from __future__ import annotations

from dataclasses import astuple

import pytest
import torch

from gear.credit.signals import (
    reverse_kl_from_hidden,
    signals_from_hidden,
    signals_from_logits,
    signals_from_teacher_logprobs,
)


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


@pytest.mark.parametrize("estimator", ["k1", "k3", "topk"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("masked", [False, True])
def test_teacher_logprobs_give_the_signals_of_the_teacher_hidden_states(
    estimator, temperature, masked
):
    """Fed the teacher log-probs the hidden-state path computes (the sampled token's; for topk
    the teacher's at the student's top-k), the log-prob path (a teacher scored by vLLM) gives
    the same KL, entropy and log-probs; outside the mask everything is 0."""
    hs, ht, W, ids = make(seed=5, scale=4.0)
    mask = (
        torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) < 0.7 if masked else None
    )
    kw = {"temperature": temperature, "estimator": estimator, "chunk_size": 7, "mask": mask}
    want = signals_from_hidden(hs, ht, W, ids, topk=8, **kw)
    logp_s = torch.log_softmax(hs @ W.T / temperature, -1)
    top_ids = logp_s.topk(8, dim=-1).indices
    top_logq = torch.log_softmax(ht @ W.T / temperature, -1).gather(-1, top_ids)
    got = signals_from_teacher_logprobs(
        hs, W, ids, want.teacher_logprobs, teacher_topk_ids=top_ids,
        teacher_topk_logprobs=top_logq, **kw,
    )  # fmt: skip
    for name in ("kl", "entropy", "student_logprobs", "teacher_logprobs"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=2e-6, rtol=1e-5)
    if masked:
        assert (got.kl[~mask] == 0).all() and (got.entropy[~mask] == 0).all()
    assert float(got.kl.abs().max()) > 0.1  # a signal, not zeros on both sides


def test_teacher_logprobs_compare_with_the_given_student_logprobs_and_refuse_the_full_kl():
    """student_logprobs (the sampling engine's) replace the hidden states' in k1 and in what is
    returned; the entropy stays the hidden states'. 'full' cannot be computed from log-probs."""
    hs, _, W, ids = make(seed=6)
    lp_t = torch.randn(ids.shape).clamp(max=0) - 1
    lp_s = torch.randn(ids.shape).clamp(max=0) - 1
    own = signals_from_teacher_logprobs(hs, W, ids, lp_t)
    got = signals_from_teacher_logprobs(hs, W, ids, lp_t, student_logprobs=lp_s)
    torch.testing.assert_close(got.kl, lp_s - lp_t)
    torch.testing.assert_close(got.student_logprobs, lp_s)
    torch.testing.assert_close(got.entropy, own.entropy)
    torch.testing.assert_close(own.kl, own.student_logprobs - lp_t)
    with pytest.raises(ValueError, match=r"estimator: .*'full' needs the teacher's whole"):
        signals_from_teacher_logprobs(hs, W, ids, lp_t, estimator="full")
    with pytest.raises(ValueError, match="teacher_topk_ids / teacher_topk_logprobs"):
        signals_from_teacher_logprobs(hs, W, ids, lp_t, estimator="topk")


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


def test_without_a_teacher_only_the_students_signals_are_computed_and_equal_naive():
    hs, ht, W, ids = make(seed=6)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    alone = signals_from_hidden(hs, None, W, ids, chunk_size=5, temperature=0.8, mask=mask)
    _, ent, lp_s, _ = naive(hs @ W.T, ht @ W.T, ids, temperature=0.8)
    assert alone.kl is None and alone.teacher_logprobs is None
    torch.testing.assert_close(
        alone.entropy.double(), torch.where(mask, ent, 0.0), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        alone.student_logprobs.double(), torch.where(mask, lp_s, 0.0), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_final_logit_softcap_is_applied_before_the_temperature(temperature):
    hs, ht, W, ids = make(seed=7, scale=20.0)  # logits well past the cap
    cap = 5.0
    sig = signals_from_hidden(hs, ht, W, ids, temperature=temperature, softcap=cap, chunk_size=6)
    capped = [torch.tanh(x @ W.T / cap) * cap for x in (hs, ht)]
    for got, want in zip(astuple(sig), naive(*capped, ids, temperature), strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    plain = signals_from_hidden(hs, ht, W, ids, temperature=temperature)
    assert not torch.allclose(plain.kl, sig.kl, atol=1e-3)
    with pytest.raises(ValueError, match="softcap"):
        signals_from_hidden(hs, ht, W, ids, softcap=0.0)


def test_softcapped_signals_equal_a_gemma2_models_own_logits():
    """The kernel applies the softcap exactly as Gemma 2 does: its log-probs of the sampled
    tokens and its entropy equal those of the model's own (softcapped) logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0,
        initializer_range=0.5, attn_implementation="eager",
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :-1]  # final (normed) hidden states predicting ids[:, 1:]
    logits = out.logits[:, :-1]
    assert logits.abs().max() <= 2.0 + 1e-5  # the model capped them
    head = model.get_output_embeddings().weight
    sig = signals_from_hidden(hidden, hidden, head, ids[:, 1:], softcap=2.0, temperature=0.7)
    _, ent, lp_s, _ = naive(logits, logits, ids[:, 1:], temperature=0.7)
    torch.testing.assert_close(sig.student_logprobs.double(), lp_s, atol=1e-5, rtol=0)
    torch.testing.assert_close(sig.entropy.double(), ent, atol=1e-5, rtol=0)
    uncapped = signals_from_hidden(hidden, hidden, head, ids[:, 1:], temperature=0.7)
    assert not torch.allclose(uncapped.student_logprobs.double(), lp_s, atol=1e-3)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("separate_teacher_head", [False, True])
def test_differentiable_reverse_kl_value_and_gradient_equal_naive(softcap, separate_teacher_head):
    hs, ht, W, _ = make(N=1, T=13, seed=8)
    hs, ht = hs[0], ht[0]
    b = torch.randn(W.shape[0])
    W_t = W + 0.1 * torch.randn_like(W) if separate_teacher_head else None

    def leaves():
        return hs.clone().requires_grad_(True), W.clone().requires_grad_(True)

    def cap(x):
        return x if softcap is None else torch.tanh(x / softcap) * softcap

    h1, w1 = leaves()
    kl, ent = reverse_kl_from_hidden(
        h1, ht, w1, lm_head_bias=b, teacher_lm_head_weight=W_t, teacher_lm_head_bias=b,
        temperature=0.7, chunk_size=4,
        softcap=softcap,
    )  # fmt: skip
    (kl * torch.arange(1.0, 14.0)).sum().backward()

    h2, w2 = leaves()
    logp_s = (cap(h2 @ w2.T + b) / 0.7).log_softmax(-1)
    teacher_w = (W_t if separate_teacher_head else w2).detach()
    logp_t = (cap(ht @ teacher_w.T + b) / 0.7).log_softmax(-1)
    want = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    (want * torch.arange(1.0, 14.0)).sum().backward()

    torch.testing.assert_close(kl, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, -(logp_s.exp() * logp_s).sum(-1).detach(), atol=1e-5, rtol=0)
    assert not ent.requires_grad
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)
