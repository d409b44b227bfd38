"""The fold kernel (`gear.credit.fold`, the GPU path of `signals_from_hidden`) equals the chunk
kernel, the CPU's, for every estimator it computes, temperature, softcap, bias, a separate
teacher head, a mask, tiles smaller than the vocabulary, strided token ids and an empty batch;
the Triton kernel too, under `TRITON_INTERPRET=1` where Triton is installed."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from gear.credit.fold import FOLD_ESTIMATORS, fold_signals
from gear.credit.signals import signals_from_hidden, use_fold

N, T, H, H_T, V = 3, 7, 16, 12, 101


def _case(seed: int, separate: bool, bias: bool):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(N, T, H, generator=g)
    ht = torch.randn(N, T, H_T if separate else H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.8
    wt = torch.randn(V, H_T, generator=g) * 0.8 if separate else None
    b = torch.randn(V, generator=g) if bias else None
    bt = torch.randn(V, generator=g) if bias and separate else None
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = torch.rand(N, T, generator=g) > 0.3
    return hs, ht, w, wt, b, bt, ids, mask


def _both(estimator, temperature, softcap, separate, bias, with_mask, teacher=True, seed=0):
    hs, ht, w, wt, b, bt, ids, mask = _case(seed, separate, bias)
    kwargs = dict(
        lm_head_bias=b,
        teacher_lm_head_weight=wt,
        teacher_lm_head_bias=bt,
        temperature=temperature,
        estimator=estimator,
        mask=mask if with_mask else None,
        softcap=softcap,
        chunk_size=5,
    )
    ht = ht if teacher else None
    chunk = signals_from_hidden(hs, ht, w, ids, kernel="chunk", **kwargs)
    fold = signals_from_hidden(hs, ht, w, ids, kernel="fold", **kwargs)
    return chunk, fold


def _assert_equal(chunk, fold):
    for name in ("kl", "entropy", "student_logprobs", "teacher_logprobs"):
        a, b = getattr(chunk, name), getattr(fold, name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("estimator", FOLD_ESTIMATORS)
@pytest.mark.parametrize(
    ("temperature", "softcap", "separate", "bias", "with_mask"),
    [
        (1.0, None, False, False, False),
        (0.7, None, False, True, True),
        (1.3, 4.0, True, True, True),
        (0.5, 2.5, True, False, False),
    ],
)
def test_fold_equals_chunk_kernel(estimator, temperature, softcap, separate, bias, with_mask):
    chunk, fold = _both(estimator, temperature, softcap, separate, bias, with_mask)
    _assert_equal(chunk, fold)
    if with_mask:  # positions outside the mask are 0, as the chunk kernel leaves them
        _, _, _, _, _, _, _, mask = _case(0, separate, bias)
        assert bool((fold.entropy[~mask] == 0).all())


def test_fold_student_only_equals_chunk_kernel():
    chunk, fold = _both("full", 0.8, None, False, True, True, teacher=False)
    assert fold.kl is None and fold.teacher_logprobs is None
    _assert_equal(chunk, fold)


def test_tiles_smaller_than_vocabulary_and_tokens_fold_the_same():
    hs, ht, w, _, b, _, ids, _ = _case(3, False, True)
    M = N * T
    args = (hs.reshape(M, H), ht.reshape(M, H), w, b, w, b, ids.reshape(M))
    whole = fold_signals(*args, temperature=0.9, use_triton=False)
    tiled = fold_signals(*args, temperature=0.9, token_tile=4, vocab_tile=10, use_triton=False)
    for a, c in zip(whole, tiled, strict=True):
        torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)


def _check_strided_ids_and_empty_batch():
    """The fold equals the chunk kernel on (N, T) token ids given as a strided view (every other
    column of a wider tensor: the Triton kernel reads ids by row index) and on a batch of no
    rows, with a teacher and without."""
    hs, ht, w, _, b, _, ids, mask = _case(2, False, True)
    wide = torch.zeros(N, 2 * T, dtype=ids.dtype)
    wide[:, ::2] = ids
    strided = wide[:, ::2]
    for estimator in FOLD_ESTIMATORS:
        for m in (None, mask):
            kw = dict(lm_head_bias=b, estimator=estimator, mask=m)
            chunk = signals_from_hidden(hs, ht, w, ids, kernel="chunk", **kw)
            _assert_equal(chunk, signals_from_hidden(hs, ht, w, strided, kernel="fold", **kw))
    for teacher in (ht[:0], None):
        chunk = signals_from_hidden(hs[:0], teacher, w, ids[:0], kernel="chunk", lm_head_bias=b)
        fold = signals_from_hidden(hs[:0], teacher, w, ids[:0], kernel="fold", lm_head_bias=b)
        assert fold.entropy.shape == (0, T)
        _assert_equal(chunk, fold)


def test_strided_token_ids_and_an_empty_batch_fold_like_the_chunk_kernel():
    """The torch fold here; the Triton kernel in the interpreter test below."""
    _check_strided_ids_and_empty_batch()


def test_bf16_inputs_fold_in_float32():
    """bf16 hidden states and head (a bf16 run): the fold agrees with the chunk kernel on the
    same bf16 inputs to bf16 rounding of the logits (the chunk kernel rounds them; the fold
    does not)."""
    chunk, fold = _both("full", 1.0, None, False, False, False)
    hs, ht, w, _, _, _, ids, _ = _case(0, False, False)
    lo = [x.to(torch.bfloat16) for x in (hs, ht, w)]
    fold = signals_from_hidden(lo[0], lo[1], lo[2], ids, kernel="fold")
    chunk = signals_from_hidden(lo[0], lo[1], lo[2], ids, kernel="chunk")
    torch.testing.assert_close(fold.kl, chunk.kl, atol=0.05, rtol=0.05)
    torch.testing.assert_close(fold.entropy, chunk.entropy, atol=0.05, rtol=0.05)


def test_kernel_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_fold("auto", "full", cpu)
    assert use_fold("auto", "full", cuda) and use_fold("auto", "k3", cuda)
    assert not use_fold("auto", "topk", cuda)  # the student's top-k: chunk kernel
    assert use_fold("fold", "k1", cpu) and not use_fold("chunk", "full", cuda)
    with pytest.raises(ValueError, match="kernel='fold' computes"):
        use_fold("fold", "topk", cpu)
    with pytest.raises(ValueError, match="kernel: expected one of"):
        use_fold("fast", "full", cpu)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_triton_kernel_equals_chunk_kernel_interpreted():
    """The Triton kernel itself, run by Triton's interpreter on the CPU (a fresh process: the
    variable must be set before triton is imported)."""
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import torch, test_fold as t\n"
        "from gear.credit import fold\n"
        "assert fold.triton_available(torch.device('cpu'))\n"
        "for est, temp, cap, sep, bias in [('full', 0.7, None, False, True),"
        " ('k3', 1.3, 4.0, True, True)]:\n"
        "    hs, ht, w, wt, b, bt, ids, _ = t._case(1, sep, bias)\n"
        "    M = t.N * t.T\n"
        "    args = (hs.reshape(M, -1), ht.reshape(M, -1), w, b, w if wt is None else wt,"
        " b if wt is None else bt, ids.reshape(M))\n"
        "    kw = dict(temperature=temp, estimator=est, softcap=cap, vocab_tile=64)\n"
        "    a = fold.fold_signals(*args, use_triton=True, **kw)\n"
        "    c = fold.fold_signals(*args, use_triton=False, **kw)\n"
        "    for x, y in zip(a, c):\n"
        "        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)\n"
        "t._check_strided_ids_and_empty_batch()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
