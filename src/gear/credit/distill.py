"""The differentiable reverse KL of the self-distillation (OPSD) loss: KL(pi_S || sg(pi_T)) from
final hidden states and the LM heads, one checkpointed chunk of logits at a time (the signals
without gradient are `gear.credit.signals`')."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from gear.credit.chunk import DEFAULT_CHUNK, check_options, check_softcap, chunk_rows


def _head_logp(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, softcap: float | None
) -> Tensor:
    """(M, V) float32 log pi from hidden states: head, softcap, temperature (differentiable)."""
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return (logits / temperature).log_softmax(-1)


def _kl_chunk(
    hs: Tensor,
    ht: Tensor,
    ws: Tensor,
    bs: Tensor | None,
    wt: Tensor,
    bt: Tensor | None,
    temperature: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """KL(pi_S || pi_T) with gradient through the student, and the student entropy (detached)."""
    logp_s = _head_logp(hs, ws, bs, temperature, softcap)
    with torch.no_grad():
        logp_t = _head_logp(ht, wt, bt, temperature, softcap)
    p_s = logp_s.exp()
    kl = (p_s * (logp_s - logp_t)).sum(-1)
    entropy = -(p_s * logp_s).sum(-1)
    return kl, entropy.detach()


def reverse_kl_from_hidden(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight: Tensor,
    *,
    lm_head_bias: Tensor | None = None,
    teacher_lm_head_weight: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Full-vocabulary KL(pi_S || sg(pi_T)) at M positions, differentiable in the student.

    The self-distillation (OPSD) loss. Logits exist one chunk at a time: each chunk runs under
    activation checkpointing, so the backward recomputes its (chunk, V) logits instead of
    keeping them.

    Args:
        student_hidden: (M, H), with gradient. teacher_hidden: (M, H_t) (detached here).
        lm_head_weight: (V, H); lm_head_bias: (V,) or None (gradient flows into both).
        teacher_lm_head_weight / teacher_lm_head_bias: a separate teacher head (V, H_t) / (V,),
            or None to share the student's (detached for the teacher).
        temperature, chunk_size, softcap: as in `signals_from_hidden`.
    Returns:
        (kl, entropy), each (M,) float32; the entropy is detached.
    """
    check_options("full", temperature, chunk_size)
    check_softcap(softcap)
    if student_hidden.dim() != 2 or teacher_hidden.dim() != 2:
        raise ValueError(
            f"student_hidden / teacher_hidden: expected (M, H) and (M, H_t), got "
            f"{tuple(student_hidden.shape)} and {tuple(teacher_hidden.shape)}"
        )
    if teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(
            f"teacher_hidden: expected {student_hidden.shape[0]} rows (the student's), got "
            f"{teacher_hidden.shape[0]}"
        )
    if teacher_lm_head_weight is None:
        teacher_lm_head_weight, teacher_lm_head_bias = lm_head_weight, lm_head_bias
    wt = teacher_lm_head_weight.detach()
    bt = None if teacher_lm_head_bias is None else teacher_lm_head_bias.detach()
    ht = teacher_hidden.detach()
    kls, entropies = [], []
    for rows in chunk_rows(student_hidden.shape[0], chunk_size, None):
        kl, entropy = checkpoint(
            _kl_chunk,
            student_hidden[rows],
            ht[rows],
            lm_head_weight,
            lm_head_bias,
            wt,
            bt,
            temperature,
            softcap,
            use_reentrant=False,
        )
        kls.append(kl)
        entropies.append(entropy)
    if not kls:
        empty = student_hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(kls), torch.cat(entropies)
