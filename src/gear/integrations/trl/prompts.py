"""Teacher prompts of a TRL batch (spec §4): `gear.teacher` with TRL's rendering.

Each row's prompt is rendered exactly as TRL renders generation prompts (tokenizer, chat
template, `chat_template_kwargs`, the row's tool schemas: the trainer's tools, or the tools of
the row's environment); `gear.teacher.build_teacher_prompts` adds the hint and cuts it to the
budget. The teacher input is that prompt, left-padded, followed by the student's completion ids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from trl.trainer.utils import pad

from gear.teacher import TeacherPrompts, build_teacher_prompts, hint_template

if TYPE_CHECKING:
    from gear.integrations.trl.trainer import GEARTrainer


def trainer_hint_template(trainer: GEARTrainer) -> str:
    """The configured hint template ('auto': 'tool' with tools or an environment)."""
    a = trainer.args
    uses_tools = bool(trainer.tools) or trainer.environment_factories is not None
    return hint_template(a.hint_kind, uses_tools, a.math_hint_template, a.tool_hint_template)


def render_prompt(trainer: GEARTrainer, prompt: Any, tools: list | None) -> list[int]:
    """Prompt -> ids exactly as TRL renders generation prompts (template, tools, kwargs)."""
    if isinstance(prompt, str):
        return list(trainer.processing_class(text=prompt)["input_ids"])
    ids = trainer.processing_class.apply_chat_template(
        conversation=prompt,
        tools=tools or None,  # as TRL: some templates render tool boilerplate for tools=[]
        chat_template=trainer.chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **trainer.chat_template_kwargs,
    )["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def teacher_prompts(trainer: GEARTrainer, prompts: list, ground_truths: list) -> TeacherPrompts:
    """Teacher prompt ids per row (spec §4, `gear.teacher`), rendered like generation's."""
    tok = trainer._tokenizer

    def render(i: int, prompt: Any) -> list[int]:
        if trainer.environment_factories is not None:
            tools = trainer._env_tools[trainer._batch_environments[i]]
            return render_prompt(trainer, prompt, tools)
        return render_prompt(trainer, prompt, trainer.tools)

    return build_teacher_prompts(
        prompts,
        ground_truths,
        render,
        trainer_hint_template(trainer),
        max_tokens=trainer.args.teacher_max_prompt_length,
        tokenize=lambda s: tok(s, add_special_tokens=False)["input_ids"],
        detokenize=lambda ids: tok.decode(ids),
        text_hint_position=trainer.args.text_hint_position,
    )


def teacher_inputs(
    built: TeacherPrompts, output: dict[str, Any], pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Teacher prompt (left-padded) + the student's completion ids: ids and mask, (B, P_T + T),
    and (B,) bool, whether the row has a hint (a ground truth)."""
    device = output["completion_ids"].device
    ids = pad(
        [torch.tensor(r, dtype=torch.long) for r in built.ids],
        padding_value=pad_token_id,
        padding_side="left",
    ).to(device)
    mask = pad(
        [torch.ones(len(r), dtype=torch.long) for r in built.ids],
        padding_value=0,
        padding_side="left",
    ).to(device)
    return (
        torch.cat([ids, output["completion_ids"]], dim=1),
        torch.cat([mask, output["completion_mask"]], dim=1),
        torch.tensor(built.has_hint, dtype=torch.bool, device=device),
    )


def eval_datasets(eval_dataset: Any) -> list:
    """The evaluation datasets (one, a dict of them, or none) as a list."""
    if eval_dataset is None:
        return []
    return list(eval_dataset.values()) if isinstance(eval_dataset, dict) else [eval_dataset]


def require_column(column: str, present: list[str]) -> None:
    """The clear error of a missing ground-truth column, naming the columns present."""
    if column not in present:
        raise ValueError(
            f"ground_truth_column: the teacher hint needs column {column!r}, which the dataset does not have; "
            f"columns present: {sorted(present)}. Set GEARConfig.ground_truth_column to one of them "
            "(and keep remove_unused_columns=False)."
        )


def ground_truths_of(inputs: list[dict[str, Any]], column: str) -> list[Any]:
    """Each row's ground truth (None allowed: no hint); a missing column is an error."""
    for row in inputs:
        if column not in row:
            require_column(column, list(row))
    return [row[column] for row in inputs]
