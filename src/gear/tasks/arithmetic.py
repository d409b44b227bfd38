"""Procedural arithmetic: seeded problems at three difficulty levels, exact-answer reward.

Levels: ``1digit`` (a + b, a - b with one-digit numbers), ``2digit`` (a + b, a - b with two-digit
numbers), ``multistep`` (a + b - c, a - b + c, a * b + c, a * b - c with small numbers), ``chain``
(three additions or subtractions in a row, a + b - c + d, solved in three steps, so an error can
fall mid-solution). Results, intermediate ones included, are never negative. ``mix`` sets the level weights (default 1digit 0.5, 2digit 0.3,
multistep 0.2: SmolLM2-135M-Instruct starts well below 50% sampled accuracy on it).
``error_span`` sets what the step checker of ``credit_method="first_error"`` blames in a failed
solution: ``token`` (the default), the first wrong digit of its first wrong step, or ``step``,
that whole step (``22 - 9 = 14``); see `gear.tasks.steps`.

Train and test are disjoint by construction: every problem (its expression string) belongs to
exactly one split through a hash (20% test), and each split samples only its own problems, from its
own seed stream. The prompt asks for "Answer: <number>"; parsing is lenient (``\\boxed{}`` or
"answer is N" or else the last number). The ground truth is a short worked solution.
"""

from __future__ import annotations

import random

from datasets import Dataset, Features, Value

from gear.tasks.base import (
    PROMPT_FEATURE,
    Task,
    check_n,
    check_split,
    final_answer,
    final_answer_span,
    make_dataset,
    numbers_equal,
    parse_mix,
    stable_fraction,
    to_number,
)
from gear.tasks.steps import StepChecker, first_wrong_equation_span, first_wrong_token_span

LEVELS = ("1digit", "2digit", "multistep", "chain")
STEP_LEVELS = (
    "multistep",
    "chain",
)  # solved in several equations: a step checker can place an error
CHAIN_STEPS = 3
DEFAULT_MIX = {"1digit": 0.5, "2digit": 0.3, "multistep": 0.2}
#: what `step_checker` blames (`error_span`): the first wrong token, or the whole wrong step
ERROR_SPANS: dict[str, StepChecker] = {
    "token": first_wrong_token_span,
    "step": first_wrong_equation_span,
}
TEST_FRACTION = 0.2
DEFAULT_SIZE = {"train": 5000, "test": 500}
FEATURES = Features(
    {
        "prompt": PROMPT_FEATURE,
        "ground_truth": Value("string"),
        "answer": Value("string"),
        "level": Value("string"),
    }
)
PROMPT = 'What is {expr}? Give the final answer as "Answer: <number>".'


def make_problem(level: str, rng: random.Random) -> tuple[str, int, str]:
    """One problem of ``level``: (expression, value, worked solution)."""
    if level in ("1digit", "2digit"):
        lo, hi = (0, 9) if level == "1digit" else (10, 99)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if rng.random() < 0.5:
            expr, value = f"{a} + {b}", a + b
        else:
            a, b = max(a, b), min(a, b)
            expr, value = f"{a} - {b}", a - b
        return expr, value, f"{expr} = {value}. The answer is {value}."
    if level == "chain":
        return make_chain(rng)
    form = rng.choice(["a+b-c", "a-b+c", "a*b+c", "a*b-c"])
    if form.startswith("a*b"):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        first, op1 = a * b, "*"
        c = rng.randint(1, 20) if form == "a*b+c" else rng.randint(1, a * b)
    else:
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        op1 = form[1]
        if op1 == "-":
            a, b = max(a, b), min(a, b)
        first = a + b if op1 == "+" else a - b
        c = rng.randint(1, first) if form[3] == "-" else rng.randint(1, 30)
    op2 = form[3]
    value = first + c if op2 == "+" else first - c
    expr = f"{a} {op1} {b} {op2} {c}"
    solution = f"{a} {op1} {b} = {first}, then {first} {op2} {c} = {value}. The answer is {value}."
    return expr, value, solution


def make_chain(rng: random.Random, steps: int = CHAIN_STEPS) -> tuple[str, int, str]:
    """a op b op c ... with `steps` additions/subtractions of 2..30, one worked step each."""
    value = rng.randint(2, 30)
    expr, clauses = str(value), []
    for _ in range(steps):
        n = rng.randint(2, 30)
        op = "-" if n <= value and rng.random() < 0.5 else "+"  # never below zero
        new = value - n if op == "-" else value + n
        clauses.append(f"{value} {op} {n} = {new}")
        expr, value = f"{expr} {op} {n}", new
    return expr, value, f"{', then '.join(clauses)}. The answer is {value}."


def split_of(expr: str) -> str:
    """The split a problem belongs to (fixed by a hash of its expression)."""
    return "test" if stable_fraction("arithmetic:" + expr) < TEST_FRACTION else "train"


class ArithmeticTask(Task):
    """Procedural arithmetic with difficulty levels; reward 1.0 iff the final number is right."""

    name = "arithmetic"
    hint_kind = "math"

    def __init__(self, mix: str | dict[str, float] | None = None, error_span: str = "token"):
        self.mix = parse_mix(mix if mix is not None else DEFAULT_MIX, LEVELS, "arithmetic level")
        if error_span not in ERROR_SPANS:
            raise ValueError(
                f"arithmetic: error_span must be one of {list(ERROR_SPANS)} (the first wrong "
                f"token, or the whole wrong step), got {error_span!r}"
            )
        self.error_span = error_span

    def dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """``n`` problems (default 5000 train / 500 test) from ``split``; same seed, same rows.
        Test rows avoid repeats while the level still has unseen test problems."""
        check_split(split)
        n = DEFAULT_SIZE[split] if check_n(n) is None else n
        rng = random.Random(f"arithmetic/{split}/{seed}")
        levels, weights = list(self.mix), list(self.mix.values())
        rows, seen = [], set()
        for _ in range(n):
            level = rng.choices(levels, weights)[0]
            for attempt in range(200):
                expr, value, solution = make_problem(level, rng)
                if split_of(expr) != split:
                    continue
                if split == "train" or expr not in seen or attempt >= 100:
                    break
            else:
                raise RuntimeError(f"no {split} problem found for level {level}")
            seen.add(expr)
            rows.append(
                {
                    "prompt": [{"role": "user", "content": PROMPT.format(expr=expr)}],
                    "ground_truth": solution,
                    "answer": str(value),
                    "level": level,
                }
            )
        return make_dataset(rows, FEATURES)

    def is_correct(self, completion_text: str, answer: str) -> bool:
        """The completion's final number equals ``answer``."""
        return numbers_equal(to_number(final_answer(completion_text)), to_number(answer))

    def answer_span(self, completion_text: str) -> tuple[int, int] | None:
        """Where `is_correct` reads the final number (`final_answer_span`)."""
        return final_answer_span(completion_text)

    def step_checker(self) -> StepChecker | None:
        """Where the first arithmetically wrong step goes wrong, as `error_span` says: its first
        wrong token (`first_wrong_token_span`, the default) or the whole step
        (`first_wrong_equation_span`). It has one when every level of the mix is solved in steps
        (`STEP_LEVELS`); None when a one-equation level is in it, where the first wrong step
        would be the answer itself."""
        if set(self.mix) <= set(STEP_LEVELS):
            return ERROR_SPANS[self.error_span]
        return None
