"""Teacher inputs for verl rows (spec §4): ground truth lookup, teacher prompt ids.

The teacher prompt is the row's chat (verl's ``raw_prompt``) with the hint appended to the last
user message, built by `gear.teacher` (the one teacher-prompt module of every integration) and
rendered by the same renderer that built the rollout prompt (verl's
Continuous Token builder: the tokenizer's chat template, ``data.apply_chat_template_kwargs`` and,
for the tool agent loop, the same tool schemas). The teacher input is that prompt followed by
exactly the rollout's response ids, observation tokens included.

Pure Python: nothing here imports verl. The model inputs (prompt ⊕ response, verl's packed or
right-padded layout) are built on the actor workers (`gear.integrations.verl.teacher_pass`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gear.integrations.verl.config import GearConfigError, GearVerlConfig
from gear.teacher import TeacherPrompts, context_hint_template
from gear.teacher import build_teacher_prompts as build_prompts

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], Sequence[int]]

#: verl's tool agent loop (``@register("tool_agent")`` in verl.experimental.agent_loop).
TOOL_AGENT = "tool_agent"


class MissingGroundTruthError(GearConfigError):
    """A row has no field at `gear.ground_truth_field` (or `gear.answer_field`)."""


def _keys(node: Any) -> list[str]:
    if isinstance(node, Mapping):
        return sorted(str(k) for k in node)
    return sorted(k for k in dir(node) if not k.startswith("_")) if node is not None else []


def get_field(row: Mapping[str, Any], path: str, setting: str = "ground_truth_field") -> Any:
    """row["a"]["b"] for path "a.b" (dicts, or objects with attributes).

    Raises:
        MissingGroundTruthError: naming `gear.<setting>`, the field and the keys present where
            the lookup stopped.
    """
    node: Any = row
    parts = path.split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif not isinstance(node, Mapping) and node is not None and hasattr(node, part):
            node = getattr(node, part)
        else:
            where = ".".join(parts[:depth]) or "the row"
            what = "the final answer" if setting == "answer_field" else "the reference solution"
            raise MissingGroundTruthError(
                f"gear.{setting}={path!r}: {where} has no field {part!r}; fields present: "
                f"{_keys(node)}. Set gear.{setting} to the field holding {what}."
            )
    return node


def as_messages(raw_prompt: Any) -> list[dict[str, Any]]:
    """verl's ``raw_prompt`` (list of messages, possibly a numpy array of dicts) as a list."""
    if hasattr(raw_prompt, "tolist"):
        raw_prompt = raw_prompt.tolist()
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(m) for m in raw_prompt]


def build_teacher_prompts(
    rows: Sequence[Mapping[str, Any]],
    student_prompts: Sequence[Sequence[int]],
    cfg: GearVerlConfig,
    render: Render,
    tools_for_row: Callable[[Mapping[str, Any]], list[dict[str, Any]] | None] = lambda row: None,
    tokenize: Callable[[str], Sequence[int]] | None = None,
    detokenize: Callable[[Sequence[int]], str] | None = None,
    skip: Sequence[bool] | None = None,
    answers: Callable[[list[Any]], list[Any]] | None = None,
) -> TeacherPrompts:
    """Teacher prompt ids for each row (`gear.teacher.build_teacher_prompts` on verl's rows).

    Args:
        rows: per row a mapping with at least ``raw_prompt`` and the ground-truth field's root.
        student_prompts: the rollout prompt ids of each row (used as is where there is no hint).
        cfg: GEAR's settings (teacher context, ground-truth or answer field, hint kind and
            templates, budget).
        render: (messages, tools) -> prompt ids, exactly as the rollout rendered its prompt.
        tools_for_row: the tool schemas the rollout showed for this row (None: no tools).
        tokenize / detokenize: plain text <-> ids, to cut an over-long ground truth.
        skip: rows that get the student's prompt unchanged (verl's synthetic padding rows).
        answers: maps the rows' hint values to the ones shown (the contrast teacher's wrong
            answers, `gear.teacher.wrong_answers`); None: shown as they are.
    Raises:
        MissingGroundTruthError: a row lacks the field (a value of None is allowed: no hint).
    """
    skipped = [bool(skip[i]) if skip is not None else False for i in range(len(rows))]
    truths = [
        None if skipped[i] else get_field(row, cfg.hint_field, cfg.hint_setting)
        for i, row in enumerate(rows)
    ]
    if answers is not None:
        truths = answers(truths)
    tools = [None if skipped[i] else tools_for_row(row) for i, row in enumerate(rows)]
    templates = [
        context_hint_template(
            cfg.teacher_context,
            cfg.hint_kind,
            t is not None,
            cfg.math_hint_template,
            cfg.tool_hint_template,
            cfg.answer_hint_template,
        )
        for t in tools
    ]
    return build_prompts(
        [as_messages(row["raw_prompt"]) if not skipped[i] else [] for i, row in enumerate(rows)],
        truths,
        lambda i, messages: list(render(messages, tools[i])),
        templates,
        max_tokens=cfg.teacher_max_prompt_length,
        tokenize=tokenize,
        detokenize=detokenize,
        student_prompt_ids=student_prompts,
        skip=skip,
    )
