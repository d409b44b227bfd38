"""The signals of spec §1 as an online fold over large vocabulary tiles: the GPU path.

`gear.credit.signals` forms (chunk, V) logits and runs several in-place passes over them; on a
CPU that wins (BENCHMARKS), on a GPU those passes cost 3-6x the two logit GEMMs. Here each
(tokens, vocab) tile of both models' logits is projected in float32 and folded once into
per-token running statistics (max m, sum of e^(z-m), and the e^(z_S-m)-weighted sums of z_S
and of z_S - z_T, an online logsumexp), after which

    log Z = m + log sum,   H = log Z_S - E_S[z_S],   KL = E_S[z_S - z_T] - log Z_S + log Z_T,

with z = softcap(logits) / temperature; the sampled token's log-probability is its tile
entry minus log Z. Estimators: "full", "k1" and "k3" (they need log Z and the sampled token
only); "topk" needs the student's top-k and stays on the chunk kernel.

The fold runs as a Triton kernel (one program per token, one read of each tile) where Triton
and a CUDA device are there, else as the same arithmetic in torch over the whole tile
(`TRITON_INTERPRET=1` runs the Triton kernel on a CPU, for tests).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

#: the estimators the fold computes (topk needs the student's top-k tokens: chunk kernel)
FOLD_ESTIMATORS = ("full", "k1", "k3")
TOKEN_TILE = 4096
VOCAB_TILE = 32768
_BLOCK = 1024

try:  # Triton ships with CUDA builds of torch on Linux; CPU builds have none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available(device: torch.device) -> bool:
    """Whether the fold can run as a Triton kernel on `device` (CUDA, or any device with
    `TRITON_INTERPRET=1`, which runs the kernel in Python for tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _z(x, inv_t, softcap, HAS_SOFTCAP: tl.constexpr):
        if HAS_SOFTCAP:  # c * tanh(x / c), tanh(y) = 2 sigmoid(2y) - 1
            x = softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)
        return x * inv_t

    @triton.jit
    def _fold_kernel(
        s_ptr,
        t_ptr,
        stride,
        ids_ptr,
        stats_ptr,
        col0,
        n_cols,
        inv_t,
        softcap,
        HAS_TEACHER: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # stats rows: 0 m_S, 1 sum_S, 2 E-sum z_S, 3 E-sum (z_S - z_T), 4 m_T, 5 sum_T, and the
        # sampled token's raw logits 6 (student), 7 (teacher), from the tile holding the token
        row = tl.program_id(0).to(tl.int64)
        n = tl.num_programs(0).to(tl.int64)
        inv_t = tl.cast(inv_t, tl.float32)
        softcap = tl.cast(softcap, tl.float32)
        col = tl.load(ids_ptr + row) - col0
        here = (col >= 0) & (col < n_cols)
        col = tl.where(here, col, 0)
        picked = tl.load(s_ptr + row * stride + col, mask=here, other=0.0)
        tl.store(stats_ptr + 6 * n + row, picked, mask=here)
        if HAS_TEACHER:
            picked = tl.load(t_ptr + row * stride + col, mask=here, other=0.0)
            tl.store(stats_ptr + 7 * n + row, picked, mask=here)
        m_s = tl.load(stats_ptr + row)
        sum_s = tl.load(stats_ptr + n + row)
        zs_sum = tl.load(stats_ptr + 2 * n + row)
        gap_sum = tl.load(stats_ptr + 3 * n + row)
        m_t = tl.load(stats_ptr + 4 * n + row)
        sum_t = tl.load(stats_ptr + 5 * n + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            zs = _z(tl.load(s_ptr + row * stride + cols, mask=inside, other=0.0), inv_t,
                    softcap, HAS_SOFTCAP)  # fmt: skip
            new_m = tl.maximum(m_s, tl.max(tl.where(inside, zs, -float("inf")), axis=0))
            # masked tokens (z = -inf) add 0: shift by a finite max (-inf - -inf is NaN) and
            # drop e^-inf * -inf (NaN), as `_fold_torch` does
            shift = tl.where(new_m == -float("inf"), 0.0, new_m)
            rescale = tl.exp(m_s - shift)
            es = tl.where(inside, tl.exp(zs - shift), 0.0)
            masked = zs == -float("inf")
            sum_s = sum_s * rescale + tl.sum(es, axis=0)
            zs_sum = zs_sum * rescale + tl.sum(tl.where(masked, 0.0, es * zs), axis=0)
            if HAS_TEACHER:
                zt = _z(tl.load(t_ptr + row * stride + cols, mask=inside, other=0.0), inv_t,
                        softcap, HAS_SOFTCAP)  # fmt: skip
                gap = tl.where(masked, 0.0, es * (zs - zt))
                gap_sum = gap_sum * rescale + tl.sum(gap, axis=0)
                new_mt = tl.maximum(m_t, tl.max(tl.where(inside, zt, -float("inf")), axis=0))
                shift_t = tl.where(new_mt == -float("inf"), 0.0, new_mt)
                et = tl.where(inside, tl.exp(zt - shift_t), 0.0)
                sum_t = sum_t * tl.exp(m_t - shift_t) + tl.sum(et, axis=0)
                m_t = new_mt
            m_s = new_m
        tl.store(stats_ptr + row, m_s)
        tl.store(stats_ptr + n + row, sum_s)
        tl.store(stats_ptr + 2 * n + row, zs_sum)
        tl.store(stats_ptr + 3 * n + row, gap_sum)
        tl.store(stats_ptr + 4 * n + row, m_t)
        tl.store(stats_ptr + 5 * n + row, sum_t)


def _z_torch(x: Tensor, inv_t: float, softcap: float | None) -> Tensor:
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x * inv_t


def _fold_torch(
    s: Tensor,
    t: Tensor | None,
    ids: Tensor,
    stats: Tensor,
    col0: int,
    inv_t: float,
    softcap: float | None,
) -> None:
    """`_fold_kernel` in torch over the whole (n, v) tile: stats (8, n) updated in place.

    A masked token (a -inf logit, z = -inf: a masked or padded vocabulary, whole tiles of it
    included) adds nothing: e^(z - m) = 0 and its products with z and z_S - z_T, 0 * -inf and
    0 * NaN, are taken as 0 (a NaN logit still shows: its e^(z - m) makes the sum NaN)."""
    m_s, sum_s, zs_sum, gap_sum, m_t, sum_t, pick_s, pick_t = stats
    here = (ids >= col0) & (ids < col0 + s.shape[1])
    col = torch.where(here, ids - col0, 0)[:, None]
    pick_s.copy_(torch.where(here, s.gather(1, col).squeeze(1), pick_s))
    if t is not None:
        pick_t.copy_(torch.where(here, t.gather(1, col).squeeze(1), pick_t))
    zs = _z_torch(s, inv_t, softcap)
    new_m = torch.maximum(m_s, zs.amax(1))
    shift = _finite(new_m)
    rescale = torch.exp(m_s - shift)
    es = torch.exp(zs - shift[:, None])
    masked = zs == -math.inf
    sum_s.mul_(rescale).add_(es.sum(1))
    zs_sum.mul_(rescale).add_(torch.where(masked, 0.0, es * zs).sum(1))
    if t is not None:
        zt = _z_torch(t, inv_t, softcap)
        gap_sum.mul_(rescale).add_(torch.where(masked, 0.0, es * (zs - zt)).sum(1))
        new_mt = torch.maximum(m_t, zt.amax(1))
        shift_t = _finite(new_mt)
        sum_t.mul_(torch.exp(m_t - shift_t)).add_(torch.exp(zt - shift_t[:, None]).sum(1))
        m_t.copy_(new_mt)
    m_s.copy_(new_m)


def _finite(m: Tensor) -> Tensor:
    """The running max as the shift of e^(z - m): 0 where it is still -inf (every token so far
    masked, z = -inf: a masked or padded vocabulary), where -inf - -inf would be NaN; their
    e^(z - 0) = 0 all the same. NaN stays NaN."""
    return torch.where(m == -math.inf, 0.0, m)


def _project(out: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """out (n, v) float32 <- hidden (n, H) @ weight (v, H).T + bias, without rounding the
    product to a bf16 / fp16 input dtype first (CUDA's out_dtype GEMM)."""
    low = hidden.dtype in (torch.bfloat16, torch.float16) and hidden.dtype == weight.dtype
    if low and out.device.type == "cuda":
        torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
    else:
        torch.mm(hidden.float(), weight.t().float(), out=out)
    if bias is not None:
        out.add_(bias.float())


@torch.no_grad()
def fold_signals(
    student_hidden: Tensor,
    teacher_hidden: Tensor | None,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_weight: Tensor | None,
    teacher_bias: Tensor | None,
    token_ids: Tensor,
    *,
    temperature: float = 1.0,
    estimator: str = "full",
    softcap: float | None = None,
    token_tile: int = TOKEN_TILE,
    vocab_tile: int = VOCAB_TILE,
    use_triton: bool | None = None,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """KL, entropy and the sampled tokens' log-probs at M positions by the online fold.

    Args:
        student_hidden: (M, H); teacher_hidden: (M, H_t) or None (student only).
        student_weight: (V, H), student_bias: (V,) or None; teacher_weight (V, H_t) /
            teacher_bias: the teacher's head (used only with teacher_hidden).
        token_ids: (M,) long, the sampled tokens (any strides).
        temperature, softcap: as in `gear.credit.signals.signals_from_hidden`.
        estimator: "full" | "k1" | "k3".
        token_tile, vocab_tile: the tile of logits formed at a time, (token_tile, vocab_tile)
            float32 per model.
        use_triton: None = where available (`triton_available`).
    Returns:
        kl (M,) or None, entropy (M,), student log-prob (M,), teacher log-prob (M,) or None;
        float32.
    """
    if estimator not in FOLD_ESTIMATORS:
        raise ValueError(f"estimator: the fold computes {list(FOLD_ESTIMATORS)}, got {estimator!r}")
    device = student_hidden.device
    if use_triton is None:
        use_triton = triton_available(device)
    M = student_hidden.shape[0]
    V = student_weight.shape[0]
    token_ids = token_ids.contiguous()  # the Triton kernel reads token `row` at ids_ptr + row
    teacher = teacher_hidden is not None
    inv_t = 1.0 / temperature
    out = torch.zeros(4, M, dtype=torch.float32, device=device)
    rows = min(M, token_tile)
    cols = min(V, vocab_tile)
    s_buf = torch.empty(rows, cols, dtype=torch.float32, device=device)
    t_buf = torch.empty_like(s_buf) if teacher else None
    for a in range(0, M, token_tile):
        b = min(a + token_tile, M)
        n = b - a
        hs = student_hidden[a:b]
        ht = teacher_hidden[a:b] if teacher else None
        ids = token_ids[a:b]
        stats = torch.zeros(8, n, dtype=torch.float32, device=device)
        stats[0].fill_(-math.inf)
        stats[4].fill_(-math.inf)
        for c in range(0, V, vocab_tile):
            d = min(c + vocab_tile, V)
            s = s_buf[:n, : d - c]
            _project(
                s, hs, student_weight[c:d], None if student_bias is None else student_bias[c:d]
            )
            t = None
            if teacher:
                t = t_buf[:n, : d - c]
                _project(t, ht, teacher_weight[c:d], None if teacher_bias is None else teacher_bias[c:d])  # fmt: skip
            if use_triton:
                _fold_kernel[(n,)](
                    s, s if t is None else t, s.stride(0), ids, stats, c, d - c, inv_t,
                    softcap or 1.0, HAS_TEACHER=teacher, HAS_SOFTCAP=softcap is not None,
                    BLOCK=_BLOCK,
                )  # fmt: skip
            else:
                _fold_torch(s, t, ids, stats, c, inv_t, softcap)
        m_s, sum_s, zs_sum, gap_sum, m_t, sum_t, pick_s, pick_t = stats
        log_z_s = m_s + sum_s.log()
        e_zs = zs_sum / sum_s
        out[1, a:b] = (log_z_s - e_zs).clamp(min=0.0)
        out[2, a:b] = _z_torch(pick_s, inv_t, softcap) - log_z_s
        if teacher:
            log_z_t = m_t + sum_t.log()
            out[3, a:b] = _z_torch(pick_t, inv_t, softcap) - log_z_t
            if estimator == "full":
                out[0, a:b] = gap_sum / sum_s - log_z_s + log_z_t
            elif estimator == "k1":
                out[0, a:b] = out[2, a:b] - out[3, a:b]
            else:
                log_ratio = out[3, a:b] - out[2, a:b]
                out[0, a:b] = log_ratio.exp() - 1.0 - log_ratio
    kl, entropy, lp_s, lp_t = out
    return (kl if teacher else None), entropy, lp_s, (lp_t if teacher else None)
