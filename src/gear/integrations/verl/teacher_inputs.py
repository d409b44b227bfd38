"""Teacher inputs for verl rows (spec §4): ground truth lookup, teacher prompt ids, padded batches.

The teacher prompt is the row's chat (verl's ``raw_prompt``) with the hint appended to the last
user message, built by `gear.teacher` (the one teacher-prompt module of every integration) and
rendered by the same renderer that built the rollout prompt (verl's
Continuous Token builder: the tokenizer's chat template, ``data.apply_chat_template_kwargs`` and,
for the tool agent loop, the same tool schemas). The teacher input is that prompt followed by
exactly the rollout's response ids, observation tokens included.

Pure Python / PyTorch: nothing here imports verl.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gear.integrations.verl.config import GearConfigError, GearVerlConfig
from gear.teacher import TeacherPrompts, hint_template
from gear.teacher import build_teacher_prompts as build_prompts

Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], Sequence[int]]

#: verl's tool agent loop (``@register("tool_agent")`` in verl.experimental.agent_loop).
TOOL_AGENT = "tool_agent"


class MissingGroundTruthError(GearConfigError):
    """A row has no field at `gear.ground_truth_field`."""


def _keys(node: Any) -> list[str]:
    if isinstance(node, Mapping):
        return sorted(str(k) for k in node)
    return sorted(k for k in dir(node) if not k.startswith("_")) if node is not None else []


def get_field(row: Mapping[str, Any], path: str) -> Any:
    """row["a"]["b"] for path "a.b" (dicts, or objects with attributes).

    Raises:
        MissingGroundTruthError: naming the field and the keys present where the lookup stopped.
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
            raise MissingGroundTruthError(
                f"gear.ground_truth_field={path!r}: {where} has no field {part!r}; fields present: "
                f"{_keys(node)}. Set gear.ground_truth_field to the field holding the reference solution."
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
) -> TeacherPrompts:
    """Teacher prompt ids for each row (`gear.teacher.build_teacher_prompts` on verl's rows).

    Args:
        rows: per row a mapping with at least ``raw_prompt`` and the ground-truth field's root.
        student_prompts: the rollout prompt ids of each row (used as is where there is no hint).
        cfg: GEAR's settings (ground-truth field, hint kind and templates, budget).
        render: (messages, tools) -> prompt ids, exactly as the rollout rendered its prompt.
        tools_for_row: the tool schemas the rollout showed for this row (None: no tools).
        tokenize / detokenize: plain text <-> ids, to cut an over-long ground truth.
        skip: rows that get the student's prompt unchanged (verl's synthetic padding rows).
    Raises:
        MissingGroundTruthError: a row lacks the field (a value of None is allowed: no hint).
    """
    skipped = [bool(skip[i]) if skip is not None else False for i in range(len(rows))]
    truths = [
        None if skipped[i] else get_field(row, cfg.ground_truth_field) for i, row in enumerate(rows)
    ]
    tools = [None if skipped[i] else tools_for_row(row) for i, row in enumerate(rows)]
    templates = [
        hint_template(cfg.hint_kind, t is not None, cfg.math_hint_template, cfg.tool_hint_template)
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


@dataclass
class PaddedBatch:
    """Prompt ⊕ response rows in verl's layout: prompts left-padded, responses right-padded."""

    input_ids: Tensor  # (B, P + R)
    attention_mask: Tensor  # (B, P + R) long
    position_ids: Tensor  # (B, P + R)
    responses: Tensor  # (B, R), pad_token_id after each row's response
    response_lengths: Tensor  # (B,)


def left_pad_batch(
    prompts: Sequence[Tensor | Sequence[int]],
    responses: Sequence[Tensor | Sequence[int]],
    pad_token_id: int,
    response_width: int | None = None,
) -> PaddedBatch:
    """Pad like verl's rollout batch: every response starts at the same column P.

    With this layout the logits that predict response token j sit at column P - 1 + j for every
    row, so a forward with ``logits_to_keep = R + 1`` returns only what the signals need.
    """
    if len(prompts) != len(responses):
        raise ValueError(
            f"responses: expected {len(prompts)} rows (one per prompt), got {len(responses)}"
        )
    ps = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    rs = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in responses]
    b = len(ps)
    p_max = max((p.numel() for p in ps), default=0)
    r_max = max((r.numel() for r in rs), default=0) if response_width is None else response_width
    ids = torch.full((b, p_max + r_max), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, p_max + r_max), dtype=torch.long)
    for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
        if r.numel() > r_max:
            raise ValueError(
                f"responses: row {i} has {r.numel()} tokens, more than the width {r_max}"
            )
        ids[i, p_max - p.numel() : p_max] = p
        ids[i, p_max : p_max + r.numel()] = r
        mask[i, p_max - p.numel() : p_max + r.numel()] = 1
    position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return PaddedBatch(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        responses=ids[:, p_max:],
        response_lengths=torch.tensor([r.numel() for r in rs], dtype=torch.long),
    )


def teacher_input_ids(
    teacher_prompts: Sequence[Sequence[int]], responses: Sequence[Tensor | Sequence[int]]
) -> list[Tensor]:
    """Teacher input of each row: teacher prompt ⊕ exactly the response ids (unpadded)."""
    return [
        torch.cat(
            [torch.as_tensor(p, dtype=torch.long), torch.as_tensor(r, dtype=torch.long).reshape(-1)]
        )
        for p, r in zip(teacher_prompts, responses, strict=True)
    ]
