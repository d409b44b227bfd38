"""Outcome attribution for OAR-G (arXiv 2601.07408): how much each completion token moves the
log-probability of the final answer, from one input-gradient backward pass.

The *answer span* of a row is the tokens of its final answer: the completion's own, as the task
parses it (`gear.spans` finds them through the tokenizer's offsets), or the reference answer
appended after the completion (the authors' way); a row whose answer is not found falls back to
its last `k` valid tokens (`answer_span`, `with_fallback`). The *influence* of token t is
|<d phi / d e_t, e_t>| (gradient x input on its input embedding e_t), phi the mean
log-probability of the span's tokens given everything before them, from the model's raw
logits (the authors'; no sampling temperature). OAR-G reshapes the tokens before the span
(`tokens_before`). This module takes the model as a callable, so the gym and the trainers share
it and `gear.credit` imports no trainer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def answer_span(valid: Tensor, k: int) -> Tensor:
    """(N, T) bool: the last `k` valid tokens of each row (all of them in a row with <= k)."""
    at_or_after = valid.flip(1).long().cumsum(1).flip(1)  # valid tokens at t or later
    return valid & (at_or_after <= k)


def with_fallback(found: Tensor, span: Tensor, valid: Tensor, k: int) -> Tensor:
    """(N, T) bool: `span` on the rows where the answer was `found` ((N,) bool), the last `k`
    valid tokens (`answer_span`) on the others."""
    return torch.where(found[:, None], span, answer_span(valid, k))


def tokens_before(span: Tensor, valid: Tensor) -> Tensor:
    """(N, T) bool: the valid tokens before each row's first `span` token (all valid tokens of a
    row whose span is empty), the tokens OAR-G reshapes. Tokens after the span cannot move its
    log-probability (causal attention), so they are not scored."""
    return valid & (span.long().cumsum(dim=1) == 0)


def span_positions(span: Tensor, k: int | None = None) -> tuple[Tensor, Tensor]:
    """(N, k) long positions of each row's span tokens, left to right, and (N, k) bool: a real
    span token (False where a row has fewer than k; its position is then 0). `k` defaults to
    the longest row's span (at least 1)."""
    if k is None:
        k = max(int(span.sum(dim=1).max()) if span.numel() else 0, 1)
    pos = torch.arange(span.shape[1], device=span.device).expand_as(span)
    keys = torch.where(span, pos, span.shape[1])  # span tokens first, in order
    idx = keys.sort(dim=1).values[:, :k]
    if idx.shape[1] < k:  # T < k: pad the columns
        idx = torch.nn.functional.pad(idx, (0, k - idx.shape[1]), value=span.shape[1])
    real = idx < span.shape[1]
    return torch.where(real, idx, 0), real


def span_logprob(
    z: Tensor,
    targets: Tensor,
    real: Tensor,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """(N,) phi: the mean log-probability of each row's span tokens (0 for an empty span).

    Args:
        z: (N, k, V) LM-head outputs at the positions that predict the span tokens.
        targets: (N, k) long span token ids. real: (N, k) bool, a real span token.
        temperature, softcap: pi = softmax(softcap(z) / temperature), as the policy samples.
    """
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # bf16 heads: the softmax in fp32
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    logp = torch.where(real, logp, 0.0)
    return logp.sum(dim=1) / real.sum(dim=1).clamp(min=1)


def input_gradient_influence(score: Callable[[Tensor], Tensor], embeds: Tensor) -> Tensor:
    """(N, L) float32 |<d score_n / d e_{n,l}, e_{n,l}>| from one backward pass.

    Args:
        score: (N, L, H) input embeddings -> (N,) per-row score; rows must not interact (no
            batch statistics), so the gradient of the sum is each row's own gradient.
        embeds: (N, L, H) the input embeddings (detached here).
    """
    e = embeds.detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(score(e).sum(), e)  # no parameter gradients
    return (grad.float() * e.detach().float()).sum(dim=-1).abs()


def masked_quantile(x: Tensor, valid: Tensor, q: float) -> Tensor:
    """(N, 1) the q-quantile of each row's valid values, linear interpolation between order
    statistics (numpy's default): position q * (n - 1) of the sorted values; 0 on empty rows.

    Args:
        x: (N, T) float. valid: (N, T) bool.
    """
    n = valid.sum(dim=1, keepdim=True)
    ordered = torch.where(valid, x, torch.inf).sort(dim=1).values
    pos = q * (n - 1).clamp(min=0).to(x.dtype)
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=(n - 1).clamp(min=0))
    a, b = ordered.gather(1, lo), ordered.gather(1, hi)
    frac = pos - lo.to(x.dtype)
    tau = torch.where(frac > 0, a + frac * (b - a), a)
    return torch.where(n > 0, tau, 0.0)
