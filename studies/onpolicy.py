"""On-policy rows for the evidence studies: sample, check, score.

`sample_groups` draws a GRPO group of completions for each of many prompts in one `generate`
call (left-padded prompts), which on a CPU is several times faster than one call per prompt.
`check_rollout` grades a completion with the task's own `is_correct` and, for a failed one, finds
the first equation ``a op b ... = r`` whose stated result is arithmetically wrong (the first
checked error); `equation_spans` lists every equation's character spans (the placebo marks one of
a correct rollout's equations as if it were wrong). `prompt_records` turns one prompt's sampled
group into records: each kept row's per-token signals (student and teacher passes, the teacher
prompt from `gear.teacher`), its first error in tokens, or its equations' token spans.

A record is a dict: "case" (`Case` as a dict), "ids" (T,), "kl", "entropy", "lp_s", "lp_t"
(lists, length T); a failed row adds "error" (first wrong token), "error_end" and "step"
([start, end) tokens of the wrong equation); a correct row adds "equations" (per equation
[start, end, result start, result end) in tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gear.evidence import replacing

# the checker is gear's own (`credit_method="first_error"` places the same first wrong equation)
from gear.tasks.steps import (  # noqa: F401  (re-exported: the studies read them from here)
    EQUATION,
    equation_spans,
    evaluate_expression,
    first_wrong_equation,
)

#: the on-policy failures: 2- and 3-step problems
NATURAL_MIX = {"multistep": 0.5, "chain": 0.5}
#: the placebo's extra prompts: one-equation 1- and 2-digit problems the model gets right more
#: often, so their correct rollouts give the placebo enough rows (on NATURAL_MIX it is right 2.5%
#: of the time)
PLACEBO_MIX = {"1digit": 0.5, "2digit": 0.5}


def first_difference(a: str, b: str) -> int:
    """Index of the first character where a and b differ (len of the shorter if a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_rollout(text: str, answer: str, task: Any) -> dict[str, Any]:
    """Grade one completion and locate its first checked error.

    Returns {"correct": bool, "error": None | dict}; the error dict holds the equation's index
    among `equation_spans(text)`, `error_char` (the first wrong character of the stated result),
    `number_end`, `step` = (equation start, result end), the stated and the right result.
    A failed rollout whose equations are all right (a wrong operand, no equation at all) has
    error None: it failed, but the checker cannot say where.
    """
    correct = bool(task.is_correct(text, answer))
    if correct:
        return {"correct": True, "error": None}
    found = first_wrong_equation(text)
    if found is None:
        return {"correct": False, "error": None}
    k, m, value = found
    stated = m.group(4)
    right = str(int(value)) if float(value).is_integer() else f"{value:.6g}"
    # a stated number that is a prefix of the right one ("12" for "123") is wrong from its
    # last character on
    diff = min(first_difference(stated, right), len(stated) - 1)
    error = {
        "equation": k,
        "error_char": m.start(4) + diff,
        "number_end": m.end(4),
        "step": (m.start(), m.end(4)),
        "stated": stated,
        "right": right,
    }
    return {"correct": False, "error": error}


@torch.no_grad()
def sample_groups(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
) -> list[list[list[int]]]:
    """`samples` completions for each prompt, all in one left-padded `generate` call.

    Returns, per prompt, `samples` completion id lists, each cut after its first EOS (kept) or
    at `max_new_tokens` (truncated, no EOS). Sampling is plain (top-k and top-p off), as GRPO's.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompt_ids)
    rows = [list(p) for p in prompt_ids for _ in range(samples)]
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=int(pad),
    )[:, width:].tolist()
    eos = tokenizer.eos_token_id
    cut = [r[: r.index(eos) + 1] if eos in r else r for r in out]
    return [cut[j * samples : (j + 1) * samples] for j in range(len(prompt_ids))]


@dataclass
class Case:
    """One scored completion with its error location in characters of `completion`.

    `error_char` is the first character that differs from the correct text (None for a clean,
    successful row); `number_end` the end of the wrong number; `step` the (start, end) character
    span of the erroneous step (a GSM8K solution line, an arithmetic equation clause).
    """

    source: str  # "gsm8k" | "arithmetic" | "natural"
    group: str  # rows of one group share prompt and reference
    prompt: list[dict[str, str]]
    reference: str
    completion: str
    error_char: int | None = None
    number_end: int | None = None
    step: tuple[int, int] | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def token_offsets(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) characters of each token in ``tokenizer.decode(ids)``, by cumulative decoding
    (works for sampled ids too). Special tokens decode to their text."""
    out, prev = [], 0
    for k in range(1, len(ids) + 1):
        n = len(tokenizer.decode(list(ids[:k])))
        out.append((prev, n))
        prev = n
    return out


def char_to_token_span(offsets: Sequence[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens that overlap characters [lo, hi) (hi > lo)."""
    hit = [k for k, (a, b) in enumerate(offsets) if a < hi and b > lo]
    if not hit:
        raise ValueError(f"no token overlaps characters [{lo}, {hi})")
    return hit[0], hit[-1] + 1


@torch.no_grad()
def completion_hidden(
    model: Any, prompt_ids: Sequence[int], rows: Sequence[Sequence[int]]
) -> Tensor:
    """Final hidden states that predict each completion token, after one shared prompt.

    The prompt is run once; its KV cache is repeated for the B completions (right-padded, so
    padding only follows real tokens and needs no mask).

    Returns:
        (B, T, H) float32: position t predicts rows[b][t]; T = the longest row.
    """
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    p = torch.tensor([list(prompt_ids)])
    out = body(input_ids=p, use_cache=True)
    last = out.last_hidden_state[:, -1:]
    T = max(len(r) for r in rows)
    if T == 1:
        return last.expand(len(rows), 1, -1).clone()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    ids = torch.full((len(rows), T - 1), int(pad), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r) - 1] = torch.tensor(list(r[:-1]), dtype=torch.long)
    cache = out.past_key_values
    cache.batch_repeat_interleave(len(rows))
    rest = body(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
    return torch.cat([last.expand(len(rows), 1, -1), rest], dim=1)


def render(tokenizer: Any, prompt: list[dict[str, str]]) -> list[int]:
    """Prompt -> ids with the chat template and generation prompt, as the TRL trainer does."""
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def teacher_ids(tokenizer: Any, prompt: list[dict[str, str]], reference: str) -> list[int]:
    """Teacher prompt ids: gear.teacher's hint (math template) on the student's prompt."""
    from gear.teacher import HINT_TEMPLATES, fit_teacher_prompt

    ids, _ = fit_teacher_prompt(
        lambda p: render(tokenizer, p),
        prompt,
        reference,
        HINT_TEMPLATES["math"],
        None,
        tokenize=lambda s: tokenizer(s, add_special_tokens=False)["input_ids"],
        detokenize=lambda ids: tokenizer.decode(ids),
    )
    return ids


def completion_ids(tokenizer: Any, text: str) -> list[int]:
    """The completion's ids as the policy would emit them: the text, then EOS."""
    return [*list(tokenizer(text, add_special_tokens=False)["input_ids"]), tokenizer.eos_token_id]


@torch.no_grad()
def group_signals(
    model: Any,
    tokenizer: Any,
    cases: list[Case],
    ids: list[list[int]] | None = None,
    teacher: Callable[[Any, list[dict[str, str]], str], list[int]] = teacher_ids,
) -> list[dict[str, Any]]:
    """Per-token signals of the rows of one group (shared prompt and reference).

    `teacher(tokenizer, prompt, reference)` gives the teacher's prompt ids (default: gear's math
    hint holding the reference). Returns one record per case: ids, kl, entropy, student/teacher
    log-probs (lists, length T_row), the first error token, the error-number token end and the
    step's token span.
    """
    from gear.credit import signals_from_hidden

    prompt, reference = cases[0].prompt, cases[0].reference
    ids = ids or [completion_ids(tokenizer, c.completion) for c in cases]
    hs = completion_hidden(model, render(tokenizer, prompt), ids)
    ht = completion_hidden(model, teacher(tokenizer, prompt, reference), ids)
    T = hs.shape[1]
    tok = torch.zeros(len(ids), T, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for b, r in enumerate(ids):
        tok[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = True
    lm = model.get_output_embeddings()
    sig = signals_from_hidden(
        hs, ht, lm.weight, tok, lm_head_bias=lm.bias, mask=mask, chunk_size=128
    )
    out = []
    for b, (case, r) in enumerate(zip(cases, ids, strict=True)):
        n = len(r)
        rec: dict[str, Any] = {
            "case": asdict(case),
            "ids": list(r),
            "kl": sig.kl[b, :n].tolist(),
            "entropy": sig.entropy[b, :n].tolist(),
            "lp_s": sig.student_logprobs[b, :n].tolist(),
            "lp_t": sig.teacher_logprobs[b, :n].tolist(),
        }
        if case.error_char is not None:
            offsets = token_offsets(tokenizer, r)
            e0, e1 = char_to_token_span(offsets, case.error_char, case.number_end)
            s0, s1 = char_to_token_span(offsets, *case.step)
            rec.update(error=e0, error_end=e1, step=[s0, max(s1, e1)])
        out.append(rec)
    return out


def load_model() -> tuple[Any, Any]:
    from gear.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("smollm2", dtype=torch.float32)
    model.eval()
    return model, tok


def load_cache(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Records per prompt ({group name: [record, ...]}) cached at `path`; {} if none."""
    return torch.load(path, weights_only=False) if path.is_file() else {}


def save_cache(path: Path, data: dict) -> None:
    with replacing(path) as tmp:  # atomic: a stopped study resumes from the last whole cache
        torch.save(data, tmp)


def prompt_records(
    model: Any,
    tok: Any,
    task: Any,
    row: dict[str, Any],
    group: str,
    completions: Sequence[Sequence[int]],
    correct_only: bool = False,
) -> list[dict[str, Any]]:
    """The records of one prompt's sampled `completions` (ids): every failed row with a checked
    first error and every correct row (the placebo's candidates); `correct_only` keeps only the
    correct ones (the placebo set). A failed row without a checked error is dropped."""
    ids, cases = [], []
    for r in completions:
        text = tok.decode(r, skip_special_tokens=True)
        check = check_rollout(text, row["answer"], task)
        if not check["correct"] and (check["error"] is None or correct_only):
            continue  # failed without a checkable first error, or a placebo-set failure
        case = Case("natural", group, row["prompt"], row["ground_truth"], text)
        case.detail = {"level": row["level"], "truncated": tok.eos_token_id not in r}
        if check["error"] is not None:
            e = check["error"]
            case.error_char, case.number_end = e["error_char"], e["number_end"]
            case.step = tuple(e["step"])
            case.detail.update(equation=e["equation"], stated=e["stated"], correct=e["right"])
        else:  # placebo candidates: every equation's (start, result start, result end)
            case.detail["equations"] = equation_spans(text)
        ids.append(r)
        cases.append(case)
    recs = group_signals(model, tok, cases, ids) if cases else []
    for rec, r in zip(recs, ids, strict=True):
        if "equations" in rec["case"]["detail"]:
            offsets = token_offsets(tok, r)
            rec["equations"] = [
                [*char_to_token_span(offsets, a, c), *char_to_token_span(offsets, b, c)]
                for a, b, c in rec["case"]["detail"]["equations"]
            ]  # [step start, step end, result start, result end) in tokens
    return recs
