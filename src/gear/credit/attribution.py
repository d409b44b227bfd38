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

OAR-P, the authors' other strategy, measures the same change without a gradient
(`perturbation_influence`): each scored token in turn is replaced by the pad token (attention
kept on it, as the authors do), the model is run on every masked copy, and the score is how far
the final answer moves (`PFINAL_MODES`). Masking token t changes positions >= t only, so the
copies of a row are run in chunks that share the clean prefix before their first masked token.
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
    logp = scaled(z, temperature, softcap).log_softmax(-1).gather(-1, targets[..., None])
    logp = torch.where(real, logp.squeeze(-1), 0.0)
    return logp.sum(dim=1) / real.sum(dim=1).clamp(min=1)


def scaled(z: Tensor, temperature: float = 1.0, softcap: float | None = None) -> Tensor:
    """softcap(z) / temperature, in at least float32 (bf16 heads: the softmax in fp32)."""
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


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


#: OAR-P's score of a masked copy (the authors' `pfinal_mode`): 'answer_joint', |phi - phi_t|
#: with phi the span's mean log-probability (OAR-G's phi); 'answer_mean', KL(p || p_t) of the
#: distributions of the mean logits over the positions that predict the span; 'last', KL(p ||
#: p_t) at the position that predicts the span's first token
PFINAL_MODES = ("answer_joint", "answer_mean", "last")


def perturbation_influence(
    hidden: Callable[[Tensor, int], Tensor],
    head: Callable[[Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    span: Tensor,
    scored: Tensor,
    pad_id: int,
    mode: str = "answer_joint",
    tokens_per_forward: int = 4096,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> Tensor:
    """(B, T) float32 OAR-P influence: how far the final answer moves when a `scored` token is
    replaced by `pad_id` (its attention kept), one masked copy per token (`PFINAL_MODES`); 0
    elsewhere and on rows without a span or a scored token.

    Each row runs without its padding and ends at its last span token (nothing later moves
    phi). Its clean copy and masked copies go in chunks of consecutive masked positions, as many
    as keep copies x suffix within `tokens_per_forward`; a chunk's copies agree up to its first
    masked position, so `hidden` may compute that prefix once (`gear.prefix`). Cost: one forward
    of the suffix per scored token, O(T) forwards a row where OAR-G's is one backward.

    Args:
        hidden: ((b, L') ids, n) -> (b, n, H) final hidden states predicting each row's last n
            tokens; the first L' - n columns are the same in every row.
        head: (..., H) -> (..., V) the LM head.
        input_ids, attention_mask: (B, L) prompt + completion (+ any appended reference), the
            completion in the last T columns.
        span: (B, T) bool, the answer's tokens. scored: (B, T) bool, the tokens to mask, all
            before the row's span (`tokens_before`).
        temperature, softcap: the model's logit conventions (the raw logits: no sampling
            temperature, as the authors score).
    """
    if mode not in PFINAL_MODES:
        raise ValueError(f"mode: expected one of {PFINAL_MODES}, got {mode!r}")
    B, T = span.shape
    L = input_ids.shape[1]
    pos = attention_mask.long().cumsum(1) - 1  # a column's position in its unpadded row
    out = torch.zeros(B, T, dtype=torch.float32, device=span.device)
    for i in range(B):  # rows differ in prefix and length; a row's copies are batched
        cols = scored[i].nonzero().squeeze(1)
        if cols.numel() == 0 or not bool(span[i].any()):
            continue
        where = pos[i, L - T + cols]  # (R,) positions of the masked tokens
        answer = pos[i, L - T :][span[i]]  # (k,) positions of the span's tokens
        row = input_ids[i][attention_mask[i].bool()][: int(answer[-1]) + 1]
        targets = row[answer]
        if mode == "last":
            answer = answer[:1]
        R = cols.numel()
        copies = row.repeat(R + 1, 1)  # copy 0 is the clean row
        copies[torch.arange(1, R + 1, device=row.device), where] = pad_id
        start = torch.cat([where[:1], where]).tolist()  # where each copy leaves the clean row
        base, scores, a = None, [], 0
        while a <= R:  # chunks of copies
            n = row.numel() - start[a]
            b = min(R + 1, a + max(1, tokens_per_forward // n))
            z = scaled(head(hidden(copies[a:b], n)[:, answer - start[a]]), temperature, softcap)
            if mode == "answer_joint":  # phi: the span's mean log-probability, (c,)
                f = z.log_softmax(-1).gather(-1, targets.expand(b - a, -1)[..., None])
                f = f.squeeze(-1).mean(1)
            else:  # log p of the mean logits over the positions read, (c, V)
                f = z.mean(1).log_softmax(-1)
            if base is None:
                base, f = f[0], f[1:]
            if mode == "answer_joint":
                scores.append((base - f).abs())
            else:
                scores.append((base.exp() * (base - f)).sum(-1))
            a = b
        out[i, cols] = torch.cat(scores).float().to(out.device)
    return out
