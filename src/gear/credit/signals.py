"""Per-token signals of spec §1: reverse KL(student || teacher), student entropy, and the
log-probabilities of the sampled tokens, computed chunk by chunk so that at most one chunk of
(chunk_size, V) logits per model exists at a time.

Four entry points share one chunk loop (`gear.credit.chunk.run_chunks`):
- `signals_from_logits`: the caller already has (N, T, V) logits of both models.
- `signals_from_hidden`: the caller has (N, T, H) final hidden states and the LM head; logits
  are formed per chunk and never for the whole batch. Without a teacher (`teacher_hidden=None`)
  only the student's entropy and log-probs are computed (methods such as `entropy_top`).
- `signals_from_teacher_logprobs`: the student's hidden states and the teacher's log-probs only
  (a teacher scored by another engine, vLLM's prompt log-probs): estimators k1, k3 and topk.
- `reverse_kl_from_hidden` (`gear.credit.distill`): the differentiable KL(student || detached
  teacher) of the self-distillation loss, one checkpointed chunk at a time.

Final-logit softcapping (`softcap=c`, Gemma 2/3) is applied to the LM head's output exactly as
those models do, c * tanh(logits / c), before the temperature.

Estimators of the KL (`estimator=`):
- "full": sum over the vocabulary, exact (default).
- "k1": log pi_S(y_t) - log pi_T(y_t) at the sampled token (unbiased, can be negative).
- "k3": r - 1 - log r with r = pi_T(y_t) / pi_S(y_t) (unbiased, >= 0; Schulman 2020).
- "topk": exact on the student's top-k tokens plus one bucket holding the remaining mass.
The entropy is always the full-vocabulary entropy of the student.

Two kernels compute `signals_from_hidden` (`kernel=`): "chunk", `gear.credit.chunk` (the CPU's:
fastest there), and "fold", `gear.credit.fold` (the GPU's: one fused read of each float32 tile,
a Triton kernel where Triton runs); "auto" picks by device and estimator. This module holds the
entry points and their checks; every name it had before the kernels got their own modules is
still importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gear.credit.chunk import (
    DEFAULT_CHUNK,
    ESTIMATORS,
    bucket_kl,
    check_options,
    check_softcap,
    chunk_rows,
    log_softmax_,
    mask_positions,
    run_chunks,
    scaled_float32,
)
from gear.credit.distill import reverse_kl_from_hidden
from gear.credit.registry import TEACHER_SIGNALS

KERNELS = ("auto", "chunk", "fold")

# importable from here, as before the kernels had their own modules
__all__ = [
    "DEFAULT_CHUNK",
    "ESTIMATORS",
    "KERNELS",
    "LOGPROB_ESTIMATORS",
    "TEACHER_SIGNALS",
    "TokenSignals",
    "reverse_kl_from_hidden",
    "signals_from_hidden",
    "signals_from_logits",
    "signals_from_teacher_logprobs",
    "use_fold",
    "without_teacher",
]


@dataclass
class TokenSignals:
    """Per-token signals, each (N, T) float32 without gradient; `kl` and `teacher_logprobs` are
    None when no teacher was given."""

    kl: Tensor | None
    entropy: Tensor
    student_logprobs: Tensor
    teacher_logprobs: Tensor | None


def without_teacher(
    signals: Mapping[str, Tensor | None], has_teacher: Tensor
) -> dict[str, Tensor | None]:
    """Spec §4: the teacher signals (`TEACHER_SIGNALS`) of rows without a teacher become NaN.

    A row without ground truth gets the student's prompt as its teacher, so its KL is numerical
    noise between two identical prompts; NaN makes `credit_details` give the row weight 1
    (plain GRPO) and count it in `fallback_rows`, instead of min-max stretching that noise.

    Args:
        signals: signal name (gear.credit names) -> (N, T) tensor or None; other names and None
            values pass through unchanged.
        has_teacher: (N,) bool, False for rows without a teacher.
    """
    none = ~has_teacher.to(torch.bool)[:, None]
    return {
        k: v.masked_fill(none, torch.nan) if k in TEACHER_SIGNALS and v is not None else v
        for k, v in signals.items()
    }


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
    check_options(estimator, temperature, chunk_size)
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError(
            f"teacher_logits: expected the student's (N, T, V) shape {tuple(student_logits.shape)}, "
            f"got {tuple(teacher_logits.shape)}"
        )
    N, T, V = student_logits.shape
    if tuple(token_ids.shape) != (N, T):
        raise ValueError(f"token_ids: expected shape {(N, T)}, got {tuple(token_ids.shape)}")
    s_flat, t_flat = student_logits.reshape(N * T, V), teacher_logits.reshape(N * T, V)
    return TokenSignals(
        *run_chunks(
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
    )


@torch.no_grad()
def signals_from_hidden(
    student_hidden: Tensor,
    teacher_hidden: Tensor | None,
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
    softcap: float | None = None,
    kernel: str = "auto",
) -> TokenSignals:
    """Signals from final hidden states and the LM head; logits exist one chunk at a time.

    Args:
        student_hidden: (N, T, H); teacher_hidden: (N, T, H_t), or None for the student's
            entropy and log-probs only (`kl` and `teacher_logprobs` are then None);
            position t predicts token_ids[:, t].
        lm_head_weight: (V, H). lm_head_bias: (V,) or None.
        teacher_lm_head_weight: (V, H_t) of a separate teacher (frozen / EMA copy, another
            model of the same vocabulary), or None to share the student's head.
        teacher_lm_head_bias: (V,) or None; used only with teacher_lm_head_weight.
        token_ids: (N, T) long.
        temperature, estimator, topk, chunk_size, mask: as in `signals_from_logits`.
        softcap: the model's final-logit softcap c (logits <- c * tanh(logits / c), applied
            before the temperature as Gemma 2/3 do), or None.
        kernel: "chunk" (the chunk loop: `chunk_size` rows of logits at a time), "fold"
            (`gear.credit.fold`: large float32 tiles folded online; estimators full, k1, k3), or
            "auto": "fold" on a CUDA device for those estimators, else "chunk".
    Returns:
        `TokenSignals`, each (N, T) float32.
    """
    check_options(estimator, temperature, chunk_size)
    check_softcap(softcap)
    N, T, H, V = _student_shapes(student_hidden, lm_head_weight, token_ids)
    if teacher_hidden is not None:
        if teacher_hidden.dim() != 3 or teacher_hidden.shape[:2] != (N, T):
            raise ValueError(
                f"teacher_hidden: expected (N, T, H_t) with the student's (N, T) = {(N, T)}, "
                f"got {tuple(teacher_hidden.shape)}"
            )
        H_t = teacher_hidden.shape[2]
        if teacher_lm_head_weight is None:
            teacher_lm_head_weight, teacher_lm_head_bias = lm_head_weight, lm_head_bias
        if tuple(teacher_lm_head_weight.shape) != (V, H_t):
            raise ValueError(
                f"teacher_lm_head_weight: expected shape ({V}, {H_t}) (same vocabulary as the "
                f"student), got {tuple(teacher_lm_head_weight.shape)}"
            )
    if use_fold(kernel, estimator, student_hidden.device):
        return _fold_signals(
            student_hidden, teacher_hidden, lm_head_weight, lm_head_bias, teacher_lm_head_weight,
            teacher_lm_head_bias, token_ids, temperature, estimator, mask, softcap,
        )  # fmt: skip
    if teacher_hidden is None:
        return _student_signals(
            student_hidden, lm_head_weight, lm_head_bias, token_ids, temperature, chunk_size,
            mask, softcap,
        )  # fmt: skip
    hs, ht = student_hidden.reshape(N * T, H), teacher_hidden.reshape(N * T, H_t)
    w_s = lm_head_weight.to(hs.dtype)
    w_t = w_s if teacher_lm_head_weight is lm_head_weight else teacher_lm_head_weight.to(ht.dtype)

    def logits(rows: Tensor | slice) -> tuple[Tensor, Tensor]:
        s = torch.nn.functional.linear(hs[rows], w_s, lm_head_bias)
        t = torch.nn.functional.linear(ht[rows], w_t, teacher_lm_head_bias)
        return s, t

    return TokenSignals(
        *run_chunks(
            (N, T),
            logits,
            token_ids,
            mask,
            temperature,
            estimator,
            topk,
            chunk_size,
            owned=True,
            softcap=softcap,
        )
    )


def use_fold(kernel: str, estimator: str, device: torch.device) -> bool:
    """Whether `signals_from_hidden` runs the fold (`gear.credit.fold`) for this request."""
    from gear.credit.fold import FOLD_ESTIMATORS

    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {list(KERNELS)}, got {kernel!r}")
    if kernel == "fold" and estimator not in FOLD_ESTIMATORS:
        raise ValueError(
            f"kernel='fold' computes the estimators {list(FOLD_ESTIMATORS)}, got "
            f"estimator={estimator!r}; use kernel='chunk' or 'auto'"
        )
    if kernel == "auto":
        return device.type == "cuda" and estimator in FOLD_ESTIMATORS
    return kernel == "fold"


def _student_shapes(
    student_hidden: Tensor, lm_head_weight: Tensor, token_ids: Tensor
) -> tuple[int, int, int, int]:
    """(N, T, H, V) after checking (N, T, H) hidden states, a (V, H) head and (N, T) ids."""
    if student_hidden.dim() != 3:
        raise ValueError(f"student_hidden: expected (N, T, H), got {tuple(student_hidden.shape)}")
    N, T, H = student_hidden.shape
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != H:
        raise ValueError(
            f"lm_head_weight: expected shape (V, {H}), got {tuple(lm_head_weight.shape)}"
        )
    if tuple(token_ids.shape) != (N, T):
        raise ValueError(f"token_ids: expected shape {(N, T)}, got {tuple(token_ids.shape)}")
    return N, T, H, lm_head_weight.shape[0]


def _fold_signals(
    student_hidden: Tensor,
    teacher_hidden: Tensor | None,
    lm_head_weight: Tensor,
    lm_head_bias: Tensor | None,
    teacher_lm_head_weight: Tensor | None,
    teacher_lm_head_bias: Tensor | None,
    token_ids: Tensor,
    temperature: float,
    estimator: str,
    mask: Tensor | None,
    softcap: float | None,
) -> TokenSignals:
    """`signals_from_hidden` by `gear.credit.fold.fold_signals`, at the `mask` positions (the
    shapes checked by the caller; a teacher head given whenever teacher states are)."""
    from gear.credit.fold import fold_signals

    N, T, H = student_hidden.shape
    hs = student_hidden.reshape(N * T, H)
    # H_t given, not -1: reshape cannot infer it for a batch of no rows
    ht = None if teacher_hidden is None else teacher_hidden.reshape(N * T, teacher_hidden.shape[2])
    ids = token_ids.reshape(-1)
    positions = mask_positions(mask, (N, T))
    if positions is not None:
        hs, ids = hs[positions], ids[positions]
        ht = None if ht is None else ht[positions]
    kl, entropy, lp_s, lp_t = fold_signals(
        hs, ht, lm_head_weight, lm_head_bias, teacher_lm_head_weight, teacher_lm_head_bias, ids,
        temperature=temperature, estimator=estimator, softcap=softcap,
    )  # fmt: skip

    def full(v: Tensor | None) -> Tensor | None:
        if v is None or positions is None:
            return None if v is None else v.view(N, T)
        return (
            torch.zeros(N * T, dtype=v.dtype, device=v.device)
            .index_copy_(0, positions, v)
            .view(N, T)
        )

    return TokenSignals(
        kl=full(kl), entropy=full(entropy), student_logprobs=full(lp_s), teacher_logprobs=full(lp_t)
    )


def _student_signals(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    lm_head_bias: Tensor | None,
    token_ids: Tensor,
    temperature: float,
    chunk_size: int,
    mask: Tensor | None,
    softcap: float | None,
) -> TokenSignals:
    """Entropy and log-probs of the student alone (no teacher forward needed)."""
    N, T, H, _ = _student_shapes(student_hidden, lm_head_weight, token_ids)
    hs = student_hidden.reshape(N * T, H)
    w_s = lm_head_weight.to(hs.dtype)
    return TokenSignals(
        *run_chunks(
            (N, T),
            lambda rows: (F.linear(hs[rows], w_s, lm_head_bias), None),
            token_ids,
            mask,
            temperature,
            "full",
            1,
            chunk_size,
            owned=True,
            softcap=softcap,
            teacher=False,
        )
    )


#: the estimators `signals_from_teacher_logprobs` computes from a teacher's log-probs alone
LOGPROB_ESTIMATORS = ("k1", "k3", "topk")


@torch.no_grad()
def signals_from_teacher_logprobs(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    token_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    teacher_topk_ids: Tensor | None = None,
    teacher_topk_logprobs: Tensor | None = None,
    student_logprobs: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    estimator: str = "k1",
    chunk_size: int = DEFAULT_CHUNK,
    mask: Tensor | None = None,
    softcap: float | None = None,
) -> TokenSignals:
    """Signals from the student's final hidden states and the teacher's log-probs (a teacher
    scored by another engine, e.g. vLLM's prompt log-probs), with the estimators of
    `signals_from_hidden` that need no teacher logits: "k1", "k3" and "topk".

    Given the same teacher log-probs the results equal `signals_from_hidden`'s: k1 / k3 from the
    sampled token's; topk exact on the k given tokens, the teacher's tail mass being
    1 - sum(their probabilities) (`signals_from_hidden` gives the student's top-k; an engine
    that returns the teacher's top-k gives those). The teacher's log-probs must be at the same
    temperature as the student's softmax(logits / `temperature`).

    Args:
        student_hidden: (N, T, H); position t predicts token_ids[:, t].
        lm_head_weight: (V, H); lm_head_bias: (V,) or None.
        token_ids: (N, T) long, the sampled tokens y_t.
        teacher_logprobs: (N, T) log pi_T(y_t).
        teacher_topk_ids, teacher_topk_logprobs: (N, T, k) long / float, the tokens of the topk
            estimator's exact part and the teacher's log-probs there; "topk" only.
        student_logprobs: (N, T) log pi_S(y_t) to compare with the teacher in place of the
            ones from `student_hidden` (the engine that scored the teacher also sampled the
            tokens: its numerics then cancel in k1 / k3), or None. The entropy always comes
            from `student_hidden`.
        temperature, chunk_size, mask, softcap: as in `signals_from_hidden`.
    Returns:
        `TokenSignals`, each (N, T) float32, 0 outside `mask`; `student_logprobs` and
        `teacher_logprobs` are the ones the KL compared.
    """
    if estimator not in LOGPROB_ESTIMATORS:
        raise ValueError(
            f"estimator: expected one of {list(LOGPROB_ESTIMATORS)} with teacher log-probs "
            f"only ('full' needs the teacher's whole distribution), got {estimator!r}"
        )
    check_options(estimator, temperature, chunk_size)
    check_softcap(softcap)
    N, T = token_ids.shape
    for name, value in (
        ("teacher_logprobs", teacher_logprobs),
        ("student_logprobs", student_logprobs),
    ):
        if value is not None and tuple(value.shape) != (N, T):
            raise ValueError(f"{name}: expected shape {(N, T)}, got {tuple(value.shape)}")
    topk = estimator == "topk"
    if topk and (
        teacher_topk_ids is None
        or teacher_topk_logprobs is None
        or teacher_topk_ids.shape[:2] != (N, T)
        or teacher_topk_ids.shape != teacher_topk_logprobs.shape
    ):
        raise ValueError(
            f"teacher_topk_ids / teacher_topk_logprobs: estimator 'topk' needs both, of one "
            f"shape (N, T, k) = ({N}, {T}, k), got "
            f"{None if teacher_topk_ids is None else tuple(teacher_topk_ids.shape)} and "
            f"{None if teacher_topk_logprobs is None else tuple(teacher_topk_logprobs.shape)}"
        )
    base = _student_signals(
        student_hidden, lm_head_weight, lm_head_bias, token_ids, temperature, chunk_size, mask,
        softcap,
    )  # fmt: skip
    keep = torch.ones(N, T, dtype=torch.bool, device=token_ids.device) if mask is None else mask
    lp_t = torch.where(keep, teacher_logprobs.float(), 0.0)
    lp_s = base.student_logprobs if student_logprobs is None else student_logprobs.float()
    lp_s = torch.where(keep, lp_s, 0.0)
    if estimator == "k1":
        kl = lp_s - lp_t
    elif estimator == "k3":
        log_ratio = lp_t - lp_s
        kl = log_ratio.exp() - 1.0 - log_ratio
    else:
        kl = _bucket_kl_from_hidden(
            student_hidden, lm_head_weight, lm_head_bias, teacher_topk_ids,
            teacher_topk_logprobs, temperature, chunk_size, mask, softcap,
        )  # fmt: skip
    return TokenSignals(kl=kl, entropy=base.entropy, student_logprobs=lp_s, teacher_logprobs=lp_t)


def _bucket_kl_from_hidden(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    lm_head_bias: Tensor | None,
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    temperature: float,
    chunk_size: int,
    mask: Tensor | None,
    softcap: float | None,
) -> Tensor:
    """(N, T) `bucket_kl` of the student's softmax (logits one chunk at a time) against the
    teacher's log-probs at the (N, T, k) `topk_ids`; 0 outside `mask`."""
    N, T, H = student_hidden.shape
    k = topk_ids.shape[2]
    hs = student_hidden.reshape(N * T, H)
    w = lm_head_weight.to(hs.dtype)
    ids, logq = topk_ids.reshape(N * T, k), topk_logprobs.reshape(N * T, k).float()
    positions = mask_positions(mask, (N, T))
    total = N * T if positions is None else positions.numel()
    kl = torch.zeros(N * T, dtype=torch.float32, device=hs.device)
    for rows in chunk_rows(total, chunk_size, positions):
        logp_s = scaled_float32(F.linear(hs[rows], w, lm_head_bias), temperature, True, softcap)
        log_softmax_(logp_s, scratch=torch.empty_like(logp_s))
        top = logq[rows]
        # log(1 - sum of the top-k probabilities): the teacher's mass outside them
        tail_logq = torch.log(-torch.expm1(top.logsumexp(1).clamp(max=0.0)))
        kl[rows] = bucket_kl(logp_s, ids[rows], top, tail_logq)
    return kl.view(N, T)
