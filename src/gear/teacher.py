"""The teacher's prompt (spec §4), shared by every integration (TRL, verl).

The teacher is the student's prompt plus a ground-truth hint, rendered with the same tokenizer,
chat template and tool schemas as the student's prompt:

- chat prompts: the hint is appended to the last user message;
- plain-text prompts: the hint goes *before* the prompt by default, so the prompt still ends
  exactly as the student's did (e.g. with "Answer:") and the completion continues it
  (`text_hint_position="after"` appends it instead);
- a row without ground truth (None or empty) keeps the student's prompt and gets no hint; the
  caller must give it weight 1 (plain GRPO), never weights from noise;
- a prompt over the token budget loses the middle of its ground truth, not its own text.

`hint_template` chooses the template of a hint kind; `build_teacher_prompts` builds a batch.

Teacher contexts (`TEACHER_CONTEXTS`, the setting `teacher_context`) say what fills the hint:
`worked_solution` (default) the ground truth (a reference solution, or tool calls) in the hint
kind's template; `answer_only` the final answer alone, in `ANSWER_HINT_TEMPLATE`; `contrast` the
answer-only teacher plus a second teacher shown a *wrong* answer in the same template
(`wrong_answers`), whose KL the credit subtracts (RLCSD, arXiv 2606.11709).
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gear.constraints import Check

PLACEHOLDER = "{ground_truth}"
HINT_TEMPLATES = {
    "math": (
        "Here is a reference solution:\n{ground_truth}\n\n"
        "Use it to check your own reasoning, then solve the problem yourself."
    ),
    "tool": "Reference tool calls: {ground_truth}",
}
ANSWER_HINT_TEMPLATE = "The final answer is {ground_truth}."
HINT_KINDS = ("auto", "math", "tool")  # auto: "tool" when the rollout shows tools, else "math"
TEACHERS = ("current", "frozen", "ema")
TEXT_HINT_POSITIONS = ("before", "after")
#: what the teacher is shown: a worked solution (the ground truth), the final answer only, or the
#: final answer contrasted with a wrong one (docs/spec.md, "Teacher contexts")
TEACHER_CONTEXTS = ("worked_solution", "answer_only", "contrast")
#: what a hint template is; checked by every config (gear.settings) and by `hint_text`
HINT_TEMPLATE = Check(
    test=lambda t: isinstance(t, str) and PLACEHOLDER in t,
    expect=f"a template with a '{PLACEHOLDER}' placeholder",
)
ELLIPSIS = " [...] "

Prompt = str | list[dict[str, Any]]


def hint_template(
    kind: str, uses_tools: bool, math_template: str | None = None, tool_template: str | None = None
) -> str:
    """The hint template of `kind` ("auto" picks "tool" when the rollout uses tools).

    Args:
        kind: one of `HINT_KINDS`.
        uses_tools: whether the row's rollout shows tools (or an environment).
        math_template / tool_template: the configured templates (default `HINT_TEMPLATES`).
    """
    if kind not in HINT_KINDS:
        raise ValueError(f"hint_kind: expected one of {list(HINT_KINDS)}, got {kind!r}")
    if kind == "auto":
        kind = "tool" if uses_tools else "math"
    if kind == "tool":
        return tool_template if tool_template is not None else HINT_TEMPLATES["tool"]
    return math_template if math_template is not None else HINT_TEMPLATES["math"]


def uses_answer(context: str) -> bool:
    """Whether teacher context `context` fills the hint with the final answer (the answer
    column / field) instead of the ground truth (a worked solution)."""
    if context not in TEACHER_CONTEXTS:
        raise ValueError(
            f"teacher_context: expected one of {list(TEACHER_CONTEXTS)}, got {context!r}"
        )
    return context != "worked_solution"


def context_hint_template(
    context: str,
    kind: str,
    uses_tools: bool,
    math_template: str | None = None,
    tool_template: str | None = None,
    answer_template: str | None = None,
) -> str:
    """The hint template of a row under teacher context `context`: the hint kind's template
    (`hint_template`) for `worked_solution`, else the answer template (default
    `ANSWER_HINT_TEMPLATE`), which the contrast teacher shares with the right-answer one."""
    if uses_answer(context):
        return answer_template if answer_template is not None else ANSWER_HINT_TEMPLATE
    return hint_template(kind, uses_tools, math_template, tool_template)


_NUMBER = re.compile(r"\s*(-?)(\d+)(?:\.(\d+))?\s*")
#: offsets of `offset_answer`: nonzero, small, either sign
ANSWER_OFFSETS = (-3, -2, -1, 1, 2, 3)


def offset_answer(answer: str, rng: random.Random) -> str | None:
    """A wrong answer for a numeric `answer` ("19", "-4", "2.50", "1,000"): the number plus a
    nonzero offset drawn from `ANSWER_OFFSETS` (exact: decimal arithmetic, the answer's
    decimals kept); None when
    `answer` is not a plain number (the default `Task.wrong_answer`)."""
    match = _NUMBER.fullmatch(str(answer).replace(",", ""))
    if match is None:
        return None
    return str(Decimal(match.group(0).strip()) + rng.choice(ANSWER_OFFSETS))


WrongAnswer = Callable[[str, random.Random], str | None]


def wrong_answers(
    answers: Sequence[Any],
    rng: random.Random,
    wrong_answer: WrongAnswer = offset_answer,
    pool: Sequence[str] = (),
) -> list[str | None]:
    """The contrast teacher's answer of each row: `wrong_answer(answer, rng)` (a task's hook,
    default `offset_answer`), else, where that gives None, another answer drawn from `pool`
    (the dataset's answers) and the batch's own. A row without an answer (None or blank) gets
    None: no hint, like its right-answer teacher.

    Raises:
        ValueError: naming `teacher_context`, when a row gets no wrong answer (the hook gave
            None and no other answer exists) or the hook returned the right answer.
    """
    texts = [ground_truth_text(a) for a in answers]
    others = sorted({*map(str, pool), *(t for t in texts if t is not None)})
    out: list[str | None] = []
    for text in texts:
        if text is None:
            out.append(None)
            continue
        wrong = wrong_answer(text, rng)
        if wrong is None:
            candidates = [o for o in others if o.strip() != text.strip()]
            if not candidates:
                raise ValueError(
                    f"teacher_context='contrast': no wrong answer for answer {text!r}: the "
                    "wrong-answer hook gave None (not a number) and the dataset and batch hold no "
                    "other answer; give a `wrong_answer(answer, rng)` hook (the task's "
                    "`Task.wrong_answer`) or use teacher_context='answer_only'"
                )
            wrong = rng.choice(candidates)
        if str(wrong).strip() == text.strip():
            raise ValueError(
                f"teacher_context='contrast': the wrong-answer hook returned the right answer "
                f"{text!r}; it must return a different one"
            )
        out.append(str(wrong))
    return out


def check_wrong_answers(
    answers: Sequence[Any], wrong_answer: WrongAnswer = offset_answer, seed: int = 0
) -> list[str]:
    """Start-up check of `teacher_context='contrast'`: every answer in `answers` (a dataset's)
    gets a wrong one (`wrong_answers` with the others as the pool). Returns the distinct
    answers, the pool of later batches. Raises the `ValueError` of `wrong_answers`."""
    pool = sorted({t for t in map(ground_truth_text, answers) if t is not None})
    wrong_answers(pool, random.Random(seed), wrong_answer, pool)
    return pool


def ground_truth_text(value: Any) -> str | None:
    """A dataset's ground truth as hint text: None or blank -> None (no hint); a one-string list
    -> that string; other lists / dicts -> JSON; anything else -> str."""
    if value is None:
        return None
    if hasattr(value, "tolist"):  # numpy / torch values as stored by verl
        value = value.tolist()
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, list | tuple) and len(value) == 1 and isinstance(value[0], str):
        return value[0] if value[0].strip() else None
    if isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def hint_text(ground_truth: str, template: str) -> str:
    """The hint for one row: `template` with `{ground_truth}` filled in."""
    if not HINT_TEMPLATE.ok(template):
        raise ValueError(f"hint template: got {template!r}, expected {HINT_TEMPLATE.describe()}")
    return template.replace(PLACEHOLDER, str(ground_truth))


def teacher_prompt(
    prompt: Prompt, ground_truth: str, template: str, text_hint_position: str = "before"
) -> Prompt:
    """The student's prompt with the hint (a copy).

    Args:
        prompt: a chat (list of {"role", "content"} messages) or a plain string.
        ground_truth: the reference solution or calls, as text.
        template: hint template with a `{ground_truth}` placeholder.
        text_hint_position: for a plain string, "before" (default: the prompt keeps its end,
            so the completion continues it) or "after" the prompt. Chats always get the hint
            at the end of their last user message.
    """
    if text_hint_position not in TEXT_HINT_POSITIONS:
        raise ValueError(
            f"text_hint_position: expected one of {list(TEXT_HINT_POSITIONS)}, "
            f"got {text_hint_position!r}"
        )
    hint = hint_text(ground_truth, template)
    if isinstance(prompt, str):
        return f"{hint}\n\n{prompt}" if text_hint_position == "before" else f"{prompt}\n\n{hint}"
    messages = copy.deepcopy(list(prompt))
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):  # multimodal-style content parts
                content.append({"type": "text", "text": f"\n\n{hint}"})
            else:
                message["content"] = f"{content}\n\n{hint}"
            return messages
    roles = [m.get("role") for m in messages]
    raise ValueError(
        f"prompt: expected at least one 'user' message for the teacher hint, got roles {roles}"
    )


def fit_teacher_prompt(
    render: Callable[[Prompt], Sequence[int]],
    prompt: Prompt,
    ground_truth: str,
    template: str,
    max_tokens: int | None,
    tokenize: Callable[[str], Sequence[int]],
    detokenize: Callable[[Sequence[int]], str],
    text_hint_position: str = "before",
) -> tuple[list[int], bool]:
    """Render the teacher prompt; if it exceeds `max_tokens`, cut the ground truth's middle.

    Args:
        render: prompt -> token ids, with the same chat template (and tools) as generation.
        tokenize / detokenize: plain text <-> ids, for cutting the ground truth.
        max_tokens: budget for the teacher prompt, or None for no limit.
        text_hint_position: as in `teacher_prompt`.
    Returns:
        (teacher prompt ids, whether the hint was truncated). If even an empty ground truth does
        not fit, the prompt with the shortest hint is returned and marked truncated.
    """

    def ids_of(gt: str) -> list[int]:
        return list(render(teacher_prompt(prompt, gt, template, text_hint_position)))

    ids = ids_of(ground_truth)
    if max_tokens is None or len(ids) <= max_tokens:
        return ids, False
    gt_ids = list(tokenize(str(ground_truth)))
    keep = max(len(gt_ids) - (len(ids) - max_tokens), 0)
    while True:
        head, tail = (
            gt_ids[: (keep + 1) // 2],
            gt_ids[len(gt_ids) - keep // 2 :] if keep > 1 else [],
        )
        ids = ids_of(detokenize(head) + ELLIPSIS + detokenize(tail))
        if len(ids) <= max_tokens or keep == 0:
            return ids, True
        keep = max(keep - max(len(ids) - max_tokens, 1), 0)


@dataclass
class TeacherPrompts:
    """Teacher prompt ids of a batch plus what to log.

    `has_hint[i]` is False for rows without ground truth (and skipped rows): their teacher is
    the student, and their signals must not weight the row."""

    ids: list[list[int]] = field(default_factory=list)
    has_hint: list[bool] = field(default_factory=list)
    truncated: int = 0
    without_ground_truth: int = 0


def build_teacher_prompts(
    prompts: Sequence[Prompt],
    ground_truths: Sequence[Any],
    render: Callable[[int, Prompt], Sequence[int]],
    templates: str | Sequence[str],
    *,
    max_tokens: int | None = None,
    tokenize: Callable[[str], Sequence[int]] | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
    student_prompt_ids: Sequence[Sequence[int]] | None = None,
    skip: Sequence[bool] | None = None,
    text_hint_position: str = "before",
) -> TeacherPrompts:
    """Teacher prompt ids for each row of a batch (spec §4).

    Args:
        prompts: each row's student prompt (chat or plain text).
        ground_truths: each row's ground truth (any value; `ground_truth_text` makes the hint
            text; None or blank: no hint).
        render: (row index, prompt) -> ids, exactly as the student's prompt was rendered
            (template, tools of that row, template kwargs).
        templates: one hint template for every row, or one per row.
        max_tokens: token budget of a teacher prompt (None: no limit); needs tokenize and
            detokenize to cut the ground truth.
        student_prompt_ids: the student's prompt ids, used as is for rows without a hint
            (default: `render` of the student's prompt).
        skip: rows that get the student's prompt unchanged and are not counted (padding rows).
        text_hint_position: where a plain-text prompt gets its hint ("before" / "after").
    Returns:
        `TeacherPrompts`: ids, which rows have a hint, and the truncated / no-hint counts.
    """
    if len(ground_truths) != len(prompts):
        raise ValueError(
            f"ground_truths: expected {len(prompts)} values (one per prompt), got "
            f"{len(ground_truths)}"
        )
    if max_tokens is not None and (tokenize is None or detokenize is None):
        raise ValueError("teacher_max_prompt_length: needs tokenize / detokenize to cut the hint")
    out = TeacherPrompts()
    for i, (prompt, value) in enumerate(zip(prompts, ground_truths, strict=True)):
        gt = None if skip is not None and skip[i] else ground_truth_text(value)
        if gt is None:  # no reference: the teacher sees the student's prompt
            student = student_prompt_ids[i] if student_prompt_ids is not None else None
            out.ids.append(list(student if student is not None else render(i, prompt)))
            out.has_hint.append(False)
            out.without_ground_truth += not (skip is not None and skip[i])
            continue
        template = templates if isinstance(templates, str) else templates[i]
        ids, cut = fit_teacher_prompt(
            lambda p, i=i: render(i, p),
            prompt,
            gt,
            template,
            max_tokens,
            tokenize=tokenize or (lambda s: []),
            detokenize=detokenize or (lambda ids: ""),
            text_hint_position=text_hint_position,
        )
        out.ids.append(ids)
        out.has_hint.append(True)
        out.truncated += int(cut)
    return out
