"""A masked or padded vocabulary (a float32 logit bias of -inf on some tokens, whole vocabulary
tiles of them included) gives the signals a float64 reference gives: a token of probability 0
adds nothing to the KL or the entropy. It gave NaN: 0 * log 0 in the chunk kernel's entropy and
full KL (`gear.credit.chunk`), and in the fold (`gear.credit.fold`) an online max of -inf over a
tile (-inf - -inf) and e^-inf * -inf. Covered: the chunk kernel (`signals_from_logits`,
`signals_from_hidden(kernel="chunk")`, every estimator, with and without a teacher), the fold's
torch arithmetic (`fold_signals(use_triton=False)`, small tiles so that whole tiles are masked,
and `signals_from_hidden(kernel="fold")`), and the fold's Triton kernel under Triton's
interpreter where Triton is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from gear.credit.fold import fold_signals
from gear.credit.signals import signals_from_hidden, signals_from_logits

N, T, H, V = 2, 5, 8, 64
TILE = 16  # the fold's vocabulary tile in these tests: V holds four


def _bias(pattern: str) -> torch.Tensor:
    b = torch.zeros(V)
    if pattern == "tiles":  # the first tile (the fold's max starts at -inf) and a later one
        b[:TILE] = -torch.inf
        b[2 * TILE : 3 * TILE] = -torch.inf
    else:  # scattered tokens inside every tile
        b[3::5] = -torch.inf
    return b


def _case(pattern: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, T, H, generator=g)
    ht = hs + 0.5 * torch.randn(N, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 2.0 / H**0.5
    b = _bias(pattern)
    kept = torch.isfinite(b).nonzero().squeeze(1)
    ids = kept[torch.randint(0, len(kept), (N, T), generator=g)]  # sampled tokens are unmasked
    return hs, ht, w, b, ids


def _reference(hs, ht, w, b, ids):
    """float64, over the unmasked tokens only: kl, entropy, student / teacher log-prob (N, T)."""
    kept = torch.isfinite(b)
    w64, b64 = w.double()[kept], b.double()[kept]
    col = torch.cumsum(kept.long(), 0)[ids] - 1  # a sampled token's column among the kept
    logp_s = torch.log_softmax(hs.double() @ w64.T + b64, -1)
    logp_t = torch.log_softmax(ht.double() @ w64.T + b64, -1)
    p_s = logp_s.exp()
    kl = (p_s * (logp_s - logp_t)).sum(-1)
    entropy = -(p_s * logp_s).sum(-1)
    lp_s = logp_s.gather(-1, col[..., None]).squeeze(-1)
    lp_t = logp_t.gather(-1, col[..., None]).squeeze(-1)
    return kl, entropy, lp_s, lp_t


def _expected_kl(estimator, kl, lp_s, lp_t):
    if estimator == "k1":
        return lp_s - lp_t
    if estimator == "k3":
        return (lp_t - lp_s).exp() - 1.0 - (lp_t - lp_s)
    return kl  # "full", and "topk" with k = V (an empty bucket: exact)


def _assert_matches(got, want):
    names = ("kl", "entropy", "student_logprobs", "teacher_logprobs")
    for name, g, r in zip(names, got, want, strict=True):
        if r is None:
            assert g is None, name
            continue
        assert bool(torch.isfinite(g).all()), f"{name}: {g}"
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("pattern", ["tiles", "scattered"])
@pytest.mark.parametrize("estimator", ["full", "k1", "k3", "topk"])
def test_the_chunk_kernel_on_a_masked_vocabulary_equals_a_float64_reference(pattern, estimator):
    hs, ht, w, b, ids = _case(pattern)
    kl, entropy, lp_s, lp_t = _reference(hs, ht, w, b, ids)
    want = (_expected_kl(estimator, kl, lp_s, lp_t), entropy, lp_s, lp_t)
    got = signals_from_hidden(
        hs, ht, w, ids, lm_head_bias=b, estimator=estimator, topk=V, chunk_size=3, kernel="chunk"
    )
    _assert_matches((got.kl, got.entropy, got.student_logprobs, got.teacher_logprobs), want)
    s_logits, t_logits = hs @ w.T + b, ht @ w.T + b
    got = signals_from_logits(s_logits, t_logits, ids, estimator=estimator, topk=V, chunk_size=4)
    _assert_matches((got.kl, got.entropy, got.student_logprobs, got.teacher_logprobs), want)
    student = signals_from_hidden(hs, None, w, ids, lm_head_bias=b, kernel="chunk")
    _assert_matches(
        (student.kl, student.entropy, student.student_logprobs, student.teacher_logprobs),
        (None, entropy, lp_s, None),
    )


@pytest.mark.parametrize("pattern", ["tiles", "scattered"])
@pytest.mark.parametrize("estimator", ["full", "k1", "k3"])
def test_the_fold_on_a_masked_vocabulary_equals_a_float64_reference(pattern, estimator):
    hs, ht, w, b, ids = _case(pattern)
    kl, entropy, lp_s, lp_t = _reference(hs, ht, w, b, ids)
    want = tuple(
        v.reshape(-1) for v in (_expected_kl(estimator, kl, lp_s, lp_t), entropy, lp_s, lp_t)
    )
    M = N * T
    args = (hs.reshape(M, H), ht.reshape(M, H), w, b, w, b, ids.reshape(M))
    for tiles in ({"vocab_tile": TILE, "token_tile": 4}, {}):  # whole tiles masked; one tile
        got = fold_signals(*args, estimator=estimator, use_triton=False, **tiles)
        _assert_matches(got, want)
    student = fold_signals(
        hs.reshape(M, H), None, w, b, None, None, ids.reshape(M), vocab_tile=TILE, use_triton=False
    )
    _assert_matches(student, (None, want[1], want[2], None))
    got = signals_from_hidden(hs, ht, w, ids, lm_head_bias=b, estimator=estimator, kernel="fold")
    _assert_matches(
        (got.kl, got.entropy, got.student_logprobs, got.teacher_logprobs),
        tuple(v.reshape(N, T) for v in want),
    )


def test_a_nan_logit_still_gives_nan_beside_a_masked_vocabulary():
    """The guard drops the tokens of probability 0, not a NaN: a position whose teacher (or
    student) state is NaN keeps a NaN KL in both kernels, so the credit core falls back on it."""
    hs, ht, w, b, ids = _case("tiles")
    ht[0, 1] = torch.nan
    hs[1, 2] = torch.nan
    chunk = signals_from_hidden(hs, ht, w, ids, lm_head_bias=b, kernel="chunk")
    M = N * T
    fold = fold_signals(
        hs.reshape(M, H), ht.reshape(M, H), w, b, w, b, ids.reshape(M), vocab_tile=TILE,
        use_triton=False,
    )  # fmt: skip
    for kl in (chunk.kl, fold[0].view(N, T)):
        assert bool(kl[0, 1].isnan()) and bool(kl[1, 2].isnan())
        nan = torch.zeros(N, T, dtype=torch.bool)
        nan[0, 1] = nan[1, 2] = True
        assert bool(torch.isfinite(kl[~nan]).all())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_triton_fold_on_a_masked_vocabulary_equals_the_torch_fold_interpreted():
    """The fold's Triton kernel, run by Triton's interpreter on the CPU (a fresh process: the
    variable must be set before triton is imported), against a float64 reference."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import torch, test_masked_vocab as t\n"
        "from gear.credit import fold\n"
        "assert fold.triton_available(torch.device('cpu'))\n"
        "M = t.N * t.T\n"
        "for pattern in ('tiles', 'scattered'):\n"
        "    hs, ht, w, b, ids = t._case(pattern)\n"
        "    kl, ent, lp_s, lp_t = (v.reshape(-1) for v in t._reference(hs, ht, w, b, ids))\n"
        "    for est in ('full', 'k3'):\n"
        "        got = fold.fold_signals(hs.reshape(M, t.H), ht.reshape(M, t.H), w, b, w, b,"
        " ids.reshape(M), estimator=est, vocab_tile=t.TILE, use_triton=True)\n"
        "        t._assert_matches(got, (t._expected_kl(est, kl, lp_s, lp_t), ent, lp_s, lp_t))\n"
        "    got = fold.fold_signals(hs.reshape(M, t.H), None, w, b, None, None, ids.reshape(M),"
        " vocab_tile=t.TILE, use_triton=True)\n"
        "    t._assert_matches(got, (None, ent, lp_s, None))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
