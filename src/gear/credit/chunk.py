"""The chunk kernel of the per-token signals (`gear.credit.signals`): the logits of at most
`chunk_size` positions exist at a time, (chunk_size, V) per model, and a few in-place float32
passes over them give the KL, the student's entropy and the sampled tokens' log-probabilities
(the CPU's kernel: fastest there; the GPU's is the online fold, `gear.credit.fold`).

`run_chunks` is the loop every chunked entry point shares; `chunk_signals` the kernel on one
chunk; `bucket_kl` the "topk" estimator's coarse-grained KL. The estimators are those of
`gear.credit.signals` (`ESTIMATORS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

ESTIMATORS = ("full", "topk", "k1", "k3")
DEFAULT_CHUNK = 256


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product of two (M, V) tensors without an (M, V) temporary. -> (M,)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def scaled_float32(
    logits: Tensor, temperature: float, owned: bool, softcap: float | None = None
) -> Tensor:
    """softcap(logits) / temperature in float32: in place when the logits are ours to spend,
    else a copy."""
    if logits.dtype != torch.float32:
        logits, owned = logits.float(), True  # a fresh float32 copy
    if softcap is not None:  # as Gemma 2/3: logits / c, tanh, * c
        logits = logits.div_(softcap) if owned else logits / softcap
        owned = True
        logits.tanh_().mul_(softcap)
    if not owned:
        return logits * (1.0 / temperature)  # a fresh tensor; the caller's stays intact
    return logits if temperature == 1.0 else logits.mul_(1.0 / temperature)


def log_softmax_(x: Tensor, scratch: Tensor) -> Tensor:
    """x <- log_softmax(x) in place and scratch <- softmax(x); both (M, V) float32.

    Unlike `torch.logsumexp`, allocates no (M, V) temporary."""
    x.sub_(x.amax(dim=1, keepdim=True))
    torch.exp(x, out=scratch)
    total = scratch.sum(dim=1, keepdim=True)
    scratch.div_(total)
    return x.sub_(total.log_())


def chunk_signals(
    s_logits: Tensor,
    t_logits: Tensor | None,
    ids: Tensor,
    temperature: float,
    estimator: str,
    topk: int,
    owned: bool = False,
    softcap: float | None = None,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """Kernel on one chunk. s_logits, t_logits: (M, V) any float dtype (t_logits None: student
    only); ids: (M,) long. `owned`: the logits are temporaries of ours and may be overwritten.

    Returns kl, entropy, student log-prob, teacher log-prob, each (M,) float32 (kl and teacher
    log-prob None without a teacher).
    Holds three (M, V) float32 tensors at its peak: the two log-softmaxes (in the logits' own
    storage when they are owned float32) and the student's probabilities.
    """
    logp_s = scaled_float32(s_logits, temperature, owned, softcap)
    p_s = torch.empty_like(logp_s)
    logp_t = None
    if t_logits is not None:
        logp_t = scaled_float32(t_logits, temperature, owned, softcap)
        log_softmax_(logp_t, scratch=p_s)
    log_softmax_(logp_s, scratch=p_s)  # p_s now holds the student's probabilities
    lp_s = logp_s.gather(1, ids[:, None]).squeeze(1)
    if logp_t is None:
        return None, _entropy(p_s, logp_s), lp_s, None
    lp_t = logp_t.gather(1, ids[:, None]).squeeze(1)
    if estimator == "full":
        logp_t.neg_().add_(logp_s)  # log pi_S - log pi_T, in place
        # a token of student probability 0 (a -inf logit: a masked or padded vocabulary) adds
        # 0 whatever the teacher gives it: its -inf, or NaN (-inf - -inf), becomes 0; the +inf
        # of a token the teacher alone masks stays (no NaN arises otherwise: a NaN logit makes
        # the model's whole row NaN, the teacher's kept below)
        logp_t.nan_to_num_(nan=0.0, posinf=math.inf, neginf=0.0)
        kl = _dot(p_s, logp_t)
        kl = torch.where(lp_t.isnan(), lp_t, kl)
    elif estimator == "k1":
        kl = lp_s - lp_t
    elif estimator == "k3":
        log_ratio = lp_t - lp_s
        kl = log_ratio.exp() - 1.0 - log_ratio
    else:  # topk: exact on the student's k most likely tokens, one bucket for the rest
        idx = logp_s.topk(min(topk, logp_s.shape[1]), dim=1).indices
        # the teacher's tail mass from its remaining logits (1 - sum(top) loses all precision
        # when tiny)
        tail_logq = logp_t.scatter(1, idx, -torch.inf).logsumexp(1)
        kl = bucket_kl(logp_s, idx, logp_t.gather(1, idx), tail_logq)
    return kl, _entropy(p_s, logp_s), lp_s, lp_t


def _entropy(p: Tensor, logp: Tensor) -> Tensor:
    """(M,) -sum p log p of (M, V) probabilities and their log-probabilities; overwrites `logp`
    (the last use of it). A token of probability 0 (a -inf log-probability: a masked or padded
    vocabulary) adds 0, not 0 * -inf = NaN: its log-probability becomes the least float, in
    place, and 0 times it is 0."""
    logp.clamp_(min=torch.finfo(logp.dtype).min)  # NaN stays NaN
    return (-_dot(p, logp)).clamp(min=0.0)


def bucket_kl(logp_s: Tensor, idx: Tensor, top_logq: Tensor, tail_logq: Tensor) -> Tensor:
    """KL(pi_S || pi_T) of both distributions coarse-grained to the k tokens `idx` and one bucket
    holding the rest (a lower bound of the full KL, exact when the bucket is empty).

    logp_s: (M, V) float32 student log-probs; idx: (M, k) long; top_logq: (M, k) teacher
    log-probs at idx; tail_logq: (M,) log of the teacher's mass outside idx. -> (M,)."""
    top_logp = logp_s.gather(1, idx)
    # a top token of student probability 0 (masked: k above the unmasked count) adds 0
    kl = torch.where(top_logp == -torch.inf, 0.0, top_logp.exp() * (top_logp - top_logq)).sum(1)
    tail_logp = logp_s.scatter(1, idx, -torch.inf).logsumexp(1)
    tail = torch.where(tail_logp > -torch.inf, tail_logp.exp() * (tail_logp - tail_logq), 0.0)
    return kl + tail


def check_options(estimator: str, temperature: float, chunk_size: int) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {list(ESTIMATORS)}, got {estimator!r}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0, got {temperature!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: expected None or a number > 0, got {softcap!r}")


def mask_positions(mask: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
    """Flat indices of the positions to compute, or None for all of them."""
    if mask is None:
        return None
    if tuple(mask.shape) != shape or mask.dtype != torch.bool:
        raise ValueError(
            f"mask: expected a bool tensor of shape {shape}, got {mask.dtype} {tuple(mask.shape)}"
        )
    return mask.reshape(-1).nonzero().squeeze(1)


def chunk_rows(total: int, chunk_size: int, positions: Tensor | None) -> Iterator[Tensor | slice]:
    """The rows of each chunk: slices of [0, total), or of `positions` when given."""
    for start in range(0, total, chunk_size):
        stop = min(start + chunk_size, total)
        yield slice(start, stop) if positions is None else positions[start:stop]


def run_chunks(
    shape: tuple[int, int],
    make_logits: Callable[[Tensor | slice], tuple[Tensor, Tensor | None]],  # rows -> (M, V)s
    token_ids: Tensor,
    mask: Tensor | None,
    temperature: float,
    estimator: str,
    topk: int,
    chunk_size: int,
    owned: bool,
    softcap: float | None = None,
    teacher: bool = True,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """The chunk loop: `make_logits(rows)` gives the (M, V) logits of the student and the teacher
    (None: student only) of one chunk's rows, at most `chunk_size` of the N * T positions (the
    `mask`'s only, when given), and `chunk_signals` turns them into that chunk's signals.

    Returns kl, entropy, student log-prob, teacher log-prob, each (N, T) float32 (0 outside
    `mask`); kl and teacher log-prob are None without a teacher."""
    N, T = shape
    ids = token_ids.reshape(-1)
    positions = mask_positions(mask, shape)
    total = N * T if positions is None else positions.numel()
    out = torch.zeros(4, N * T, dtype=torch.float32, device=ids.device)
    for rows in chunk_rows(total, chunk_size, positions):
        s, t = make_logits(rows)
        signals = chunk_signals(s, t, ids[rows], temperature, estimator, topk, owned, softcap)
        del s, t  # before the next chunk's logits exist
        for i, v in enumerate(signals):
            if v is not None:
                out[i, rows] = v
    kl, ent, lp_s, lp_t = (v.view(N, T) for v in out)
    if not teacher:
        return None, ent, lp_s, None
    return kl, ent, lp_s, lp_t
