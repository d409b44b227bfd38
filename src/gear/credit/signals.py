"""Per-token signals of spec §1: reverse KL(student || teacher), student entropy, and the
log-probabilities of the sampled tokens, computed chunk by chunk so that at most one chunk of
(chunk_size, V) logits per model exists at a time.

Two entry points share one kernel:
- `signals_from_logits`: the caller already has (N, T, V) logits of both models.
- `signals_from_hidden`: the caller has (N, T, H) final hidden states and the LM head; logits
  are formed per chunk and never for the whole batch.

Estimators of the KL (`estimator=`):
- "full": sum over the vocabulary, exact (default).
- "k1": log pi_S(y_t) - log pi_T(y_t) at the sampled token (unbiased, can be negative).
- "k3": r - 1 - log r with r = pi_T(y_t) / pi_S(y_t) (unbiased, >= 0; Schulman 2020).
- "topk": exact on the student's top-k tokens plus one bucket holding the remaining mass.
The entropy is always the full-vocabulary entropy of the student.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

ESTIMATORS = ("full", "topk", "k1", "k3")
DEFAULT_CHUNK = 256


@dataclass
class TokenSignals:
    """Per-token signals, each (N, T) float32 without gradient."""

    kl: Tensor
    entropy: Tensor
    student_logprobs: Tensor
    teacher_logprobs: Tensor


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product of two (M, V) tensors without an (M, V) temporary. -> (M,)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _scaled_float32(logits: Tensor, temperature: float, owned: bool) -> Tensor:
    """logits / temperature in float32: in place when the logits are ours to spend, else a copy."""
    if logits.dtype != torch.float32:
        logits, owned = logits.float(), True  # a fresh float32 copy
    if not owned:
        return logits * (1.0 / temperature)  # a fresh tensor; the caller's stays intact
    return logits if temperature == 1.0 else logits.mul_(1.0 / temperature)


def _log_softmax_(x: Tensor, scratch: Tensor) -> Tensor:
    """x <- log_softmax(x) in place and scratch <- softmax(x); both (M, V) float32.

    Unlike `torch.logsumexp`, allocates no (M, V) temporary."""
    x.sub_(x.amax(dim=1, keepdim=True))
    torch.exp(x, out=scratch)
    total = scratch.sum(dim=1, keepdim=True)
    scratch.div_(total)
    return x.sub_(total.log_())


def _chunk_signals(
    s_logits: Tensor,
    t_logits: Tensor,
    ids: Tensor,
    temperature: float,
    estimator: str,
    topk: int,
    owned: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Kernel on one chunk. s_logits, t_logits: (M, V) any float dtype; ids: (M,) long.
    `owned`: the logits are temporaries of ours and may be overwritten.

    Returns kl, entropy, student log-prob, teacher log-prob, each (M,) float32.
    Holds three (M, V) float32 tensors at its peak: the two log-softmaxes (in the logits' own
    storage when they are owned float32) and the student's probabilities.
    """
    logp_s = _scaled_float32(s_logits, temperature, owned)
    logp_t = _scaled_float32(t_logits, temperature, owned)
    p_s = torch.empty_like(logp_s)
    _log_softmax_(logp_t, scratch=p_s)
    _log_softmax_(logp_s, scratch=p_s)  # p_s now holds the student's probabilities
    lp_s = logp_s.gather(1, ids[:, None]).squeeze(1)
    lp_t = logp_t.gather(1, ids[:, None]).squeeze(1)
    entropy = -_dot(p_s, logp_s)
    if estimator == "full":
        logp_t.neg_().add_(logp_s)  # log pi_S - log pi_T, in place
        kl = _dot(p_s, logp_t)
    elif estimator == "k1":
        kl = lp_s - lp_t
    elif estimator == "k3":
        log_ratio = lp_t - lp_s
        kl = log_ratio.exp() - 1.0 - log_ratio
    else:  # topk: exact on the student's k most likely tokens, one bucket for the rest
        idx = logp_s.topk(min(topk, logp_s.shape[1]), dim=1).indices
        top_logp, top_logq = logp_s.gather(1, idx), logp_t.gather(1, idx)
        kl = (top_logp.exp() * (top_logp - top_logq)).sum(1)
        # tail masses from the remaining logits (1 - sum(top) loses all precision when tiny)
        tail_logp = logp_s.scatter(1, idx, -torch.inf).logsumexp(1)
        tail_logq = logp_t.scatter(1, idx, -torch.inf).logsumexp(1)
        tail = torch.where(tail_logp > -torch.inf, tail_logp.exp() * (tail_logp - tail_logq), 0.0)
        kl = kl + tail
    return kl, entropy.clamp(min=0.0), lp_s, lp_t


def _validate(estimator: str, temperature: float, chunk_size: int) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {list(ESTIMATORS)}, got {estimator!r}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")


def _positions(mask: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
    """Flat indices of the positions to compute, or None for all of them."""
    if mask is None:
        return None
    if tuple(mask.shape) != shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask: expected a bool tensor of shape {shape}, got {mask.dtype} {tuple(mask.shape)}"
        )
    return mask.reshape(-1).nonzero().squeeze(1)


def _run(
    shape: tuple[int, int],
    make_logits: Callable[[Tensor | slice], tuple[Tensor, Tensor]],  # flat rows -> 2 x (M, V)
    token_ids: Tensor,
    mask: Tensor | None,
    temperature: float,
    estimator: str,
    topk: int,
    chunk_size: int,
    owned: bool,
) -> TokenSignals:
    N, T = shape
    ids = token_ids.reshape(-1)
    positions = _positions(mask, shape)
    total = N * T if positions is None else positions.numel()
    out = torch.zeros(4, N * T, dtype=torch.float32, device=ids.device)
    for start in range(0, total, chunk_size):
        stop = min(start + chunk_size, total)
        rows = slice(start, stop) if positions is None else positions[start:stop]
        s, t = make_logits(rows)
        signals = _chunk_signals(s, t, ids[rows], temperature, estimator, topk, owned)
        del s, t  # before the next chunk's logits exist
        for i, v in enumerate(signals):
            out[i, rows] = v
    kl, ent, lp_s, lp_t = (v.view(N, T) for v in out)
    return TokenSignals(kl=kl, entropy=ent, student_logprobs=lp_s, teacher_logprobs=lp_t)


@torch.no_grad()
def signals_from_logits(
    student_logits: Tensor,
    teacher_logits: Tensor,
    token_ids: Tensor,
    *,
    temperature: float = 1.0,
    estimator: str = "full",
    topk: int = 64,
    chunk_size: int = DEFAULT_CHUNK,
    mask: Tensor | None = None,
) -> TokenSignals:
    """Signals from two (N, T, V) logits tensors (position t predicts token_ids[:, t]).

    Args:
        student_logits, teacher_logits: (N, T, V), float32 or bfloat16 (accumulated in float32).
        token_ids: (N, T) long, the sampled tokens y_t.
        temperature: sampling temperature; logits are divided by it.
        estimator: "full" | "topk" | "k1" | "k3".
        topk: k of the "topk" estimator.
        chunk_size: tokens per chunk.
        mask: (N, T) bool, or None for all positions: only these positions are computed
            (padding after EOS costs nothing); the others are 0 in every output.
    Returns:
        `TokenSignals`, each (N, T) float32.
    """
    _validate(estimator, temperature, chunk_size)
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError(
            f"teacher_logits: expected the student's (N, T, V) shape {tuple(student_logits.shape)}, "
            f"got {tuple(teacher_logits.shape)}"
        )
    N, T, V = student_logits.shape
    if tuple(token_ids.shape) != (N, T):
        raise ValueError(f"token_ids: expected shape {(N, T)}, got {tuple(token_ids.shape)}")
    s_flat, t_flat = student_logits.reshape(N * T, V), teacher_logits.reshape(N * T, V)
    return _run(
        (N, T),
        lambda rows: (s_flat[rows], t_flat[rows]),
        token_ids,
        mask,
        temperature,
        estimator,
        topk,
        chunk_size,
        owned=mask is not None,  # indexing with the mask's positions copies; slicing does not
    )


@torch.no_grad()
def signals_from_hidden(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    token_ids: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    teacher_lm_head_weight: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    estimator: str = "full",
    topk: int = 64,
    chunk_size: int = DEFAULT_CHUNK,
    mask: Tensor | None = None,
) -> TokenSignals:
    """Signals from final hidden states and the LM head; logits exist one chunk at a time.

    Args:
        student_hidden: (N, T, H); teacher_hidden: (N, T, H_t); position t predicts token_ids[:, t].
        lm_head_weight: (V, H). lm_head_bias: (V,) or None.
        teacher_lm_head_weight: (V, H_t) of a separate teacher (frozen / EMA copy, another
            model of the same vocabulary), or None to share the student's head.
        teacher_lm_head_bias: (V,) or None; used only with teacher_lm_head_weight.
        token_ids: (N, T) long.
        temperature, estimator, topk, chunk_size, mask: as in `signals_from_logits`.
    Returns:
        `TokenSignals`, each (N, T) float32.
    """
    _validate(estimator, temperature, chunk_size)
    if student_hidden.dim() != 3 or teacher_hidden.shape[:2] != student_hidden.shape[:2]:
        raise ValueError(
            f"teacher_hidden: expected (N, T, H_t) with the student's (N, T) = "
            f"{tuple(student_hidden.shape[:2])}, got {tuple(teacher_hidden.shape)}"
        )
    N, T, H = student_hidden.shape
    H_t = teacher_hidden.shape[2]
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != H:
        raise ValueError(
            f"lm_head_weight: expected shape (V, {H}), got {tuple(lm_head_weight.shape)}"
        )
    V = lm_head_weight.shape[0]
    if teacher_lm_head_weight is None:
        teacher_lm_head_weight, teacher_lm_head_bias = lm_head_weight, lm_head_bias
    if tuple(teacher_lm_head_weight.shape) != (V, H_t):
        raise ValueError(
            f"teacher_lm_head_weight: expected shape ({V}, {H_t}) (same vocabulary as the "
            f"student), got {tuple(teacher_lm_head_weight.shape)}"
        )
    if tuple(token_ids.shape) != (N, T):
        raise ValueError(f"token_ids: expected shape {(N, T)}, got {tuple(token_ids.shape)}")
    hs, ht = student_hidden.reshape(N * T, H), teacher_hidden.reshape(N * T, H_t)
    w_s = lm_head_weight.to(hs.dtype)
    w_t = w_s if teacher_lm_head_weight is lm_head_weight else teacher_lm_head_weight.to(ht.dtype)

    def logits(rows: Tensor | slice) -> tuple[Tensor, Tensor]:
        s = torch.nn.functional.linear(hs[rows], w_s, lm_head_bias)
        t = torch.nn.functional.linear(ht[rows], w_t, teacher_lm_head_bias)
        return s, t

    return _run(
        (N, T), logits, token_ids, mask, temperature, estimator, topk, chunk_size, owned=True
    )
