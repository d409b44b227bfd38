"""The settings every integration has (teacher, hint, KL estimator, chunking, credit records),
each declared once: its default, its help and its value constraint (`gear.constraints.Check`).

`GEARSettings` is that declaration. TRL's `GEARConfig` and verl's `gear:` section
(`GearVerlConfig`) take each of these fields with `setting(name)`, as `GEARConfig` mirrors
`CreditParams` (the credit method's own parameters, declared once in `gear.credit`), and both
check them with `gear.constraints.check_fields`. Where an integration differs it says so at the
field, with `setting(name, default=...)` or `setting(name, check=...)`: verl runs only the
current teacher; TRL writes credit records by default, verl only when asked.

Imports no trainer library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from gear.constraints import Check, checked
from gear.credit.signals import DEFAULT_CHUNK, ESTIMATORS
from gear.teacher import (
    ANSWER_HINT_TEMPLATE,
    HINT_KINDS,
    HINT_TEMPLATE,
    HINT_TEMPLATES,
    TEACHER_CONTEXTS,
    TEACHERS,
)


@dataclass(frozen=True)
class GEARSettings:
    """The settings TRL's and verl's configs share (docs/spec §4 for the teacher and its hint)."""

    teacher: str = checked(
        "current",
        "Teacher weights: 'current': the policy's; 'frozen': the initial weights (or "
        "`teacher_model`); 'ema': an exponential moving average of the policy, updated after "
        "each optimizer step.",
        Check(choices=TEACHERS),
    )
    teacher_context: str = checked(
        "worked_solution",
        "What the teacher is shown (docs/spec.md, 'Teacher contexts'): 'worked_solution': the "
        "ground truth in the hint kind's template; 'answer_only': only the final answer, in "
        "answer_hint_template; 'contrast': the answer-only teacher's KL minus the KL to a "
        "teacher shown a wrong answer in the same template, clamped at 0 (after RLCSD, arXiv "
        "2606.11709; one more teacher pass; needs a credit method that reads the KL).",
        Check(choices=TEACHER_CONTEXTS),
    )
    answer_hint_template: str = checked(
        ANSWER_HINT_TEMPLATE,
        "Teacher hint of the 'answer_only' and 'contrast' contexts; holds {ground_truth}, "
        "filled with the final answer (or, for the contrast teacher, a wrong one).",
        HINT_TEMPLATE,
    )
    hint_kind: str = checked(
        "auto",
        "Which hint template the teacher gets: 'math', 'tool', or 'auto' ('tool' for a rollout "
        "with tools: TRL's trainer with tools or an environment, verl's tool agent loop; else "
        "'math').",
        Check(choices=HINT_KINDS),
    )
    math_hint_template: str = checked(
        HINT_TEMPLATES["math"], "Teacher hint for math; holds {ground_truth}.", HINT_TEMPLATE
    )
    tool_hint_template: str = checked(
        HINT_TEMPLATES["tool"], "Teacher hint for tool use; holds {ground_truth}.", HINT_TEMPLATE
    )
    teacher_max_prompt_length: int | None = checked(
        None,
        "Token budget of a teacher prompt; longer ones lose the middle of the ground truth "
        "(counted as gear/teacher_prompts_truncated). None: no limit.",
        Check(ge=1, integer=True, also=(None,)),
    )
    kl_estimator: str = checked(
        "full", "KL estimator: 'full' (exact), 'topk', 'k1' or 'k3'.", Check(choices=ESTIMATORS)
    )
    kl_topk: int = checked(64, "k of the 'topk' KL estimator.", Check(ge=1, integer=True))
    signal_chunk_size: int = checked(
        DEFAULT_CHUNK,
        "Tokens per chunk of logits formed from the final hidden states, for the signals (and "
        "TRL's self-distill loss): bounds the temporaries, three (chunk, V) float32 tensors.",
        Check(ge=1, integer=True),
    )
    credit_log_steps: int = checked(
        50,
        "Write a credit record (RUN_DIR/credit/step_XXXXXX.jsonl) every this many steps; 0: never.",
        Check(ge=0, integer=True),
    )
    credit_log_rows: int = checked(4, "Rows per credit record.", Check(ge=0, integer=True))


_SETTINGS = {f.name: f for f in dataclasses.fields(GEARSettings)}


def setting(name: str, *, default: Any = dataclasses.MISSING, check: Check | None = None) -> Any:
    """A config field for `GEARSettings.<name>`: its default, help and check, except the
    `default` or `check` an integration gives where it differs."""
    declared = _SETTINGS[name]
    return field(
        default=declared.default if default is dataclasses.MISSING else default,
        metadata={"help": declared.metadata["help"], "check": check or declared.metadata["check"]},
    )


__all__ = ["GEARSettings", "setting"]
