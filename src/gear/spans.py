"""OAR-G's answer span on a real tokenizer (docs/spec.md, OAR-G): which tokens phi scores.

`answer_spans` builds what the influence pass reads for one batch under `CreditParams.oar_span`:

- 'answer' (the default): each row's completion is decoded as the reward reads it (special
  tokens skipped), the task's parser gives the character range of its final answer
  (`Task.answer_span`; `gear.tasks.base.final_answer_span` for the math tasks), and the span is
  the policy tokens whose characters overlap that range (`answer_token_mask`, through the
  tokenizer's offset mapping). The end token is not part of it: the authors' phi scores the
  answer's own tokens.
- 'reference' (the authors' way): the reference answer's tokens are appended right after each
  row's completion and are the span; every completion token is before it.
- 'last': each row's last `oar_answer_len` policy tokens (gear before issue 53).

A row whose answer (or reference) is not found falls back to its last `oar_answer_len` tokens;
`AnswerSpans.fallback` marks it (TRL logs their count as `gear/oar_span_fallback`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gear.credit.attribution import answer_span, with_fallback
from gear.credit.params import CreditParams

if TYPE_CHECKING:
    from gear.tasks.steps import StepChecker

#: a task's answer parser: completion text -> (start, end) characters of its final answer, or None
LocateAnswer = Callable[[str], "tuple[int, int] | None"]


@dataclass
class AnswerSpans:
    """What OAR-G's influence pass reads for B rows of T completion columns.

    Attributes:
        completion_ids, completion_mask: (B, T') the completion as the pass reads it: the batch's
            own (T' = T), or with each row's reference appended ('reference', T' >= T).
        span: (B, T') bool, the tokens whose mean log-probability is phi.
        answer_mask: (B, T) bool, the span's tokens inside the completion (none where the
            reference is appended): `gear.credit.credit_details`'s `answer_mask`.
        fallback: (B,) bool, rows whose answer was not found, scored on their last
            `oar_answer_len` tokens instead.
    """

    completion_ids: Tensor
    completion_mask: Tensor
    span: Tensor
    answer_mask: Tensor
    fallback: Tensor


def answer_spans(
    params: CreditParams,
    tokenizer: Any,
    completion_ids: Tensor,
    completion_mask: Tensor,
    valid: Tensor,
    locate: LocateAnswer | None = None,
    references: Sequence[str | None] | None = None,
) -> AnswerSpans:
    """The answer span of each row under `params.oar_span` (module docstring).

    Args:
        tokenizer: the policy's (decodes completions, encodes references).
        completion_ids, completion_mask: (B, T) the sampled completions, right-padded.
        valid: (B, T) bool policy tokens (completion minus tool output).
        locate: 'answer': the task's parser (`Task.answer_span`).
        references: 'reference': each row's reference answer as text (None: not found).
    """
    k = params.oar_answer_len
    last = answer_span(valid, k)
    B, T = valid.shape
    if params.oar_span == "last":
        return AnswerSpans(
            completion_ids, completion_mask, last, last, torch.zeros_like(last[:, 0])
        )
    if params.oar_span == "answer":
        if locate is None:
            raise ValueError("oar_span='answer': needs the task's answer parser (locate)")
        mask = answer_token_mask(tokenizer, completion_ids, completion_mask, locate) & valid
        found = mask.any(dim=1)
        span = with_fallback(found, mask, valid, k)
        return AnswerSpans(completion_ids, completion_mask, span, span, ~found)
    if references is None or len(references) != B:
        got = None if references is None else len(references)
        raise ValueError(f"oar_span='reference': expected {B} reference answers, got {got}")
    extra = [[] if r is None else _encode(tokenizer, r) for r in references]
    found = torch.tensor([len(e) > 0 for e in extra], device=valid.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask, appended = append_tokens(completion_ids, completion_mask, extra, pad)
    width = ids.shape[1]
    span = torch.where(found[:, None], appended, torch.nn.functional.pad(last, (0, width - T)))
    return AnswerSpans(ids, mask, span, last & ~found[:, None], ~found)


def mask_token_id(tokenizer: Any) -> int:
    """The id OAR-P puts in place of a masked token: the tokenizer's pad token, as the authors
    do (SmolLM2's is its end token <|im_end|>, id 2), else its end-of-sequence token."""
    for name in ("pad_token_id", "eos_token_id"):
        if isinstance(getattr(tokenizer, name, None), int):
            return getattr(tokenizer, name)
    raise ValueError(
        "oar_p: the tokenizer has neither a pad nor an end-of-sequence token to mask with"
    )


def answer_token_mask(
    tokenizer: Any, completion_ids: Tensor, completion_mask: Tensor, locate: LocateAnswer
) -> Tensor:
    """(B, T) bool: in each row, the tokens (of those `completion_mask` keeps) whose characters
    overlap the range `locate` finds in the row's text (`token_offsets`); none where it finds
    none or an empty one."""
    return char_span_mask(
        tokenizer, completion_ids, completion_mask, lambda i, text: locate(text), "answer parser"
    )


def error_token_mask(
    tokenizer: Any,
    completion_ids: Tensor,
    completion_mask: Tensor,
    checker: StepChecker,
    ground_truths: Sequence[Any],
) -> Tensor:
    """(B, T) bool: each row's tokens whose characters overlap its first wrong step, as the
    step `checker` places it in the row's text given the row's ground truth (`first_error`);
    none where it finds none."""
    if len(ground_truths) != completion_ids.shape[0]:
        raise ValueError(
            f"step checker: expected {completion_ids.shape[0]} ground truths, got "
            f"{len(ground_truths)}"
        )
    return char_span_mask(
        tokenizer,
        completion_ids,
        completion_mask,
        lambda i, text: checker(text, ground_truths[i]),
        "step checker",
    )


def char_span_mask(
    tokenizer: Any,
    completion_ids: Tensor,
    completion_mask: Tensor,
    locate: Callable[[int, str], tuple[int, int] | None],
    what: str,
) -> Tensor:
    """(B, T) bool: in row i, the tokens (of those `completion_mask` keeps) whose characters
    overlap `locate(i, text)` in the row's text as the reward reads it (`token_offsets`); none
    where it gives None or an empty range. A range outside the text is an error naming `what`."""
    out = torch.zeros(completion_ids.shape, dtype=torch.bool)
    for i in range(completion_ids.shape[0]):
        cols = completion_mask[i].nonzero().flatten().tolist()
        text, offsets = token_offsets(tokenizer, completion_ids[i, cols].tolist())
        found = locate(i, text)
        if found is None:
            continue
        start, end = found
        if not 0 <= start <= end <= len(text):
            raise ValueError(
                f"the {what} gave characters {found!r} of a {len(text)}-character "
                f"completion: expected 0 <= start <= end <= {len(text)} ({text!r})"
            )
        if start == end:  # an empty range overlaps no token, not even one around it
            continue
        for col, (a, b) in zip(cols, offsets, strict=True):
            out[i, col] = a < end and b > start and b > a
    return out.to(completion_ids.device)


def token_offsets(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of `ids` as the reward reads it (special tokens skipped) and each token's
    (start, end) characters in it (a special token: an empty range where it sits).

    The offset mapping of the text re-encoded where that gives back the same tokens (the usual
    case, one encode); else each token ends where the decoded prefix up to it stops agreeing
    with the text (a sampled, non-canonical tokenization: one decode per token)."""
    ids = [int(i) for i in ids]
    text = _decode(tokenizer, ids)
    special = set(tokenizer.all_special_ids)
    plain = [t for t in ids if t not in special]
    offsets: list[tuple[int, int]] = []
    at = 0
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) == plain:
            mapping = iter(enc["offset_mapping"])
            for t in ids:
                a, b = (at, at) if t in special else next(mapping)
                offsets.append((a, b))
                at = max(at, b)
            return text, offsets
    for n in range(1, len(ids) + 1):
        prefix = _decode(tokenizer, ids[:n])
        end = len(prefix) if text.startswith(prefix) else _common_prefix(prefix, text)
        end = max(end, at)
        offsets.append((at, end))
        at = end
    return text, offsets


def append_tokens(
    completion_ids: Tensor, completion_mask: Tensor, extra: Sequence[Sequence[int]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's `extra` ids placed right after its last attended completion token.

    Returns (B, T + m) ids (`pad_id` elsewhere), attention mask, and bool mask of the placed
    tokens; m is the longest `extra`."""
    B, T = completion_ids.shape
    m = max((len(e) for e in extra), default=0)
    ids = torch.full((B, T + m), pad_id, dtype=completion_ids.dtype, device=completion_ids.device)
    mask = torch.zeros(B, T + m, dtype=completion_mask.dtype, device=completion_mask.device)
    ids[:, :T], mask[:, :T] = completion_ids, completion_mask
    placed = torch.zeros(B, T + m, dtype=torch.bool, device=completion_ids.device)
    for i, row in enumerate(extra):
        attended = completion_mask[i].nonzero()
        at = int(attended[-1]) + 1 if len(attended) else 0
        ids[i, at : at + len(row)] = torch.as_tensor(list(row), dtype=ids.dtype)
        mask[i, at : at + len(row)] = 1
        placed[i, at : at + len(row)] = True
    return ids, mask, placed


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
