"""Tasks: datasets of chat prompts with verifiable rewards (see docs/contracts.md).

    from gear.tasks import get_task, TASKS
    task = get_task("arithmetic", mix="1digit")
    ds = task.dataset("train", n=100, seed=0)   # prompt, ground_truth, answer (+ tools)
    rewards = task.reward(prompts, completions, answer=ds["answer"])

Tasks: ``arithmetic`` (procedural), ``gsm8k`` (JSONL), ``math`` (MATH / AIME / DAPO-style JSONL or
parquet), ``bfcl`` (BFCL v4 function calling),
``tools`` (multi-turn calculator/stock lookup through TRL's ``environment_factory``).
"""

from __future__ import annotations

import inspect
from typing import Any

from gear.tasks.arithmetic import ArithmeticTask
from gear.tasks.base import SPLITS, Task, completion_text, final_answer
from gear.tasks.bfcl import BFCLTask
from gear.tasks.gsm8k import GSM8KTask
from gear.tasks.math import MathTask
from gear.tasks.tools import ToolEnv, ToolsTask

TASKS: dict[str, type[Task]] = {
    "arithmetic": ArithmeticTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    "bfcl": BFCLTask,
    "tools": ToolsTask,
}


def get_task(name: str, **options: Any) -> Task:
    """The task ``name`` built with ``options``; ValueError for an unknown name or option."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}")
    cls = TASKS[name]
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {name!r}; valid options: {valid}")
    return cls(**options)


__all__ = [
    "SPLITS",
    "TASKS",
    "ArithmeticTask",
    "BFCLTask",
    "GSM8KTask",
    "MathTask",
    "Task",
    "ToolEnv",
    "ToolsTask",
    "completion_text",
    "final_answer",
    "get_task",
]
