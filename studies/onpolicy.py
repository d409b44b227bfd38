"""On-policy rollouts for the evidence benchmarks: batched sampling and the arithmetic checker.

`sample_groups` draws a GRPO group of completions for each of many prompts in one `generate`
call (left-padded prompts), which on a CPU is several times faster than one call per prompt.
`check_rollout` grades a completion with the task's own `is_correct` and, for a failed one, finds
the first equation ``a op b ... = r`` whose stated result is arithmetically wrong (the first
checked error); `equation_spans` lists every equation's character spans (the placebo marks one of
a correct rollout's equations as if it were wrong).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import torch

EQUATION = re.compile(
    r"((?:\d+(?:\.\d+)?\s*[-+*/x×]\s*)+\d+(?:\.\d+)?)\s*(=)\s*(\$?)(-?\d+(?:\.\d+)?)"
)


def evaluate_expression(expr: str) -> float | None:
    """Value of ``3 + 4 * 2`` style expressions (digits, + - * / x ×), None if not computable."""
    expr = expr.replace("×", "*").replace("x", "*")
    if not re.fullmatch(r"[\d.\s+\-*/]+", expr):
        return None
    try:
        return float(eval(expr, {"__builtins__": {}}, {}))  # only digits and operators
    except (ArithmeticError, SyntaxError):
        return None


def first_difference(a: str, b: str) -> int:
    """Index of the first character where a and b differ (len of the shorter if a prefix)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def equation_spans(text: str) -> list[tuple[int, int, int]]:
    """(equation start, result start, result end) in characters of every equation of `text`."""
    return [(m.start(), *m.span(4)) for m in EQUATION.finditer(text)]


def first_wrong_equation(text: str) -> tuple[int, re.Match[str], float] | None:
    """(index, match, right value) of the first equation whose stated result is arithmetically
    wrong, or None."""
    for k, m in enumerate(EQUATION.finditer(text)):
        value = evaluate_expression(m.group(1))
        if value is not None and not math.isclose(value, float(m.group(4)), abs_tol=1e-6):
            return k, m, value
    return None


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
