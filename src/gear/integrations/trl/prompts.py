"""Teacher prompts of a TRL batch (spec §4): `gear.teacher` with TRL's rendering.

Each row's prompt is rendered exactly as TRL renders generation prompts (tokenizer, chat
template, `chat_template_kwargs`, the row's tool schemas: the trainer's tools, or the tools of
the row's environment); `gear.teacher.build_teacher_prompts` adds the hint and cuts it to the
budget. The teacher input is that prompt, left-padded, followed by the student's completion ids.

Ground truth comes from the dataset column `ground_truth_column` or, when an environment owns
the data (`environment_factory=`), from the environment: each rollout's instance exposes an
attribute (or property) of that name after `reset()`, read once, before the first model turn
(`environment_ground_truths`); a value there wins over the row's column. Under the answer
teacher contexts ('answer_only', 'contrast') the hint reads `answer_column` the same way
(`GEARConfig.hint_column`); 'contrast' also builds a second set of prompts whose hint is a wrong
answer (`contrast_answers`).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from trl.trainer.utils import pad

from gear.teacher import (
    TeacherPrompts,
    WrongAnswer,
    build_teacher_prompts,
    check_wrong_answers,
    context_hint_template,
    ground_truth_text,
    wrong_answers,
)

if TYPE_CHECKING:
    from trl import GRPOTrainer


def trainer_hint_template(trainer: GRPOTrainer) -> str:
    """The configured hint template: the teacher context's (`gear.teacher.context_hint_template`;
    'auto': 'tool' with tools or an environment)."""
    a = trainer.args
    uses_tools = bool(trainer.tools) or trainer.environment_factories is not None
    return context_hint_template(
        a.teacher_context,
        a.hint_kind,
        uses_tools,
        a.math_hint_template,
        a.tool_hint_template,
        a.answer_hint_template,
    )


def render_prompt(trainer: GRPOTrainer, prompt: Any, tools: list | None) -> list[int]:
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


def teacher_prompts(trainer: GRPOTrainer, prompts: list, ground_truths: list) -> TeacherPrompts:
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


def column_setting(args: Any) -> str:
    """The config field that names the hint's column, as an error message names it:
    'ground_truth_column', or 'answer_column' (with the teacher context that reads it)."""
    if args.hint_column == args.ground_truth_column:
        return "ground_truth_column"
    return f"answer_column (teacher_context={args.teacher_context!r})"


def require_column(column: str, present: list[str], setting: str = "ground_truth_column") -> None:
    """The clear error of a missing hint column, naming the setting and the columns present."""
    if column not in present:
        field = setting.split(" ")[0]
        raise ValueError(
            f"{setting}: the teacher hint needs column {column!r}, which the dataset does not have; "
            f"columns present: {sorted(present)}. Set GEARConfig.{field} to one of them "
            "(and keep remove_unused_columns=False)."
        )


def ground_truths_of(
    inputs: list[dict[str, Any]], column: str, setting: str = "ground_truth_column"
) -> list[Any]:
    """Each row's ground truth (None allowed: no hint); a missing column is an error."""
    for row in inputs:
        if column not in row:
            require_column(column, list(row), setting)
    return [row[column] for row in inputs]


def contrast_pool(
    train_dataset: Any, column: str, wrong_answer: WrongAnswer, seed: int
) -> list[str]:
    """Start-up check of teacher_context='contrast' (`gear.teacher.check_wrong_answers`): every
    answer of the training dataset's `column` gets a wrong one. Returns its distinct answers,
    the pool a row draws another answer from where `wrong_answer` gives None (none: a dataset
    without that column, or one that cannot be read up front; the batch's answers remain)."""
    columns = getattr(train_dataset, "column_names", None)
    if columns is None or column not in columns:
        return []
    return check_wrong_answers(train_dataset[column], wrong_answer, seed)


def contrast_answers(
    answers: list[Any], rng: Any, wrong_answer: WrongAnswer, pool: list[str]
) -> list[str | None]:
    """The contrast teacher's (wrong) answer of each row (`gear.teacher.wrong_answers`)."""
    return wrong_answers(answers, rng, wrong_answer, pool)


# ----------------------------------------------------------------------------- environments


def _code_objects(member: Any) -> Iterator[types.CodeType]:
    """The code objects of a class member (function, static / class method, property), nested
    functions included."""
    if isinstance(member, staticmethod | classmethod):
        member = member.__func__
    if isinstance(member, property):
        for f in (member.fget, member.fset, member.fdel):
            yield from _code_objects(f)
        return
    stack = [member.__code__] if isinstance(member, types.FunctionType) else []
    while stack:
        code = stack.pop()
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def can_supply_ground_truth(environment: Any, name: str) -> bool:
    """Whether an environment can ever hold a ground truth under attribute `name`: its class
    defines or annotates it (a class attribute, a property, a dataclass field), the instance has
    it once constructed, or a method of the class names it (`self.ground_truth = ...` in
    `reset()` or a helper it calls). Read off the instance TRL probes at construction, without
    calling `reset()` (which needs an episode's kwargs and may have side effects)."""
    if name in getattr(environment, "__dict__", {}):
        return True
    for klass in type(environment).__mro__[:-1]:  # not `object`
        own = vars(klass)
        if name in own or name in own.get("__annotations__", {}):
            return True
        if any(name in c.co_names for m in own.values() for c in _code_objects(m)):
            return True
    return False


def _refuse_method(environment_class: type, name: str) -> None:
    """A callable `ground_truth` would be a tool: TRL exposes every public method of an
    environment to the model, so the student could call it and read the answer."""
    raise ValueError(
        f"environment {environment_class.__name__}: {name!r} must be an attribute or a "
        f"@property holding the episode's ground truth, not a method: TRL exposes an "
        f"environment's public methods as tools, so the student could call it and read the "
        f"answer. Set `self.{name} = ...` in reset()."
    )


def check_ground_truth_sources(trainer: GRPOTrainer, train_dataset: Any, eval_dataset: Any) -> None:
    """Start-up check that episodes can have a ground truth (methods that need the teacher).

    The column is `GEARConfig.hint_column` (`answer_column` under the answer teacher contexts),
    and errors name its setting. Without an environment every dataset needs it. With one, a row's
    ground truth comes from its dataset column or from its environment
    (`can_supply_ground_truth`). If no episode can ever have one (a dataset, or TRL's
    placeholder when the environment owns the data, lacks the column and no environment can
    supply it), one error says how to give it; if only some environments can, the rows of the
    others get weight 1 (plain GRPO), counted in `gear/rows_without_ground_truth`, and one
    warning names them.
    """
    column, setting = trainer.args.hint_column, column_setting(trainer.args)
    datasets = [train_dataset, *eval_datasets(eval_dataset)]
    if trainer.environment_factories is None:
        for ds in datasets:
            columns = getattr(ds, "column_names", None)
            if columns is not None:
                require_column(column, list(columns), setting)
        return
    # TRL probed one instance of each environment at construction; it stays in its pool
    probes = {name: pool[0] for name, pool in trainer._environment_pool.items()}
    for instance in probes.values():
        if callable(getattr(type(instance), column, None)):
            _refuse_method(type(instance), column)
    supplying = {n for n, e in probes.items() if can_supply_ground_truth(e, column)}
    # the columns of datasets without the ground-truth column; with no train_dataset (the
    # environment owns the data) TRL trains on a placeholder that has a "prompt" column only
    lacking = [["prompt"]] if train_dataset is None else []
    for ds in datasets:
        columns = getattr(ds, "column_names", None)
        if columns is not None and column not in columns:
            lacking.append(list(columns))
    if not lacking or supplying == set(probes):
        return
    names = sorted(type(probes[n]).__name__ for n in set(probes) - supplying)
    if not supplying:
        raise ValueError(
            f"{setting}: no episode can have a ground truth for the teacher hint: the "
            f"dataset has no column {column!r} (columns present: {sorted(lacking[0])}) and the "
            f"environment ({', '.join(names)}) has no attribute {column!r}. Let the environment "
            f"supply each episode's ground truth: set `self.{column} = ...` in reset() (declare "
            f"`{column}: str | None = None` on the class); or add a {column!r} column to the "
            "dataset; or use a credit method without a teacher ('grpo', 'entropy_top', 'oar_g', "
            "'oar_p')."
        )
    warnings.warn(
        f"GEARTrainer: environment(s) {', '.join(names)} have no attribute {column!r} and the "
        f"dataset has no column {column!r}: their rows have no ground truth, get weight 1 (plain "
        "GRPO) and are counted in gear/rows_without_ground_truth",
        stacklevel=3,
    )


def environment_ground_truths(environments: list, name: str) -> list[Any]:
    """Each rollout's ground truth as its environment holds it after `reset()` (None where the
    environment has no attribute `name`)."""
    values = []
    for environment in environments:
        value = getattr(environment, name, None)
        if callable(value):
            _refuse_method(type(environment), name)
        values.append(value)
    return values


def batch_ground_truths(
    inputs: list[dict[str, Any]], column: str, from_environments: list[Any] | None
) -> list[Any]:
    """Each row's ground truth: without environments, the dataset column (a missing column is
    an error); with them, the environment's value where it has one, else the row's column
    (None where neither: no hint, weight 1)."""
    if from_environments is None:
        return ground_truths_of(inputs, column)
    return [
        env if ground_truth_text(env) is not None else row.get(column)
        for row, env in zip(inputs, from_environments, strict=True)
    ]
