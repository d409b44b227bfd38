"""Step checkers: where a completion's first wrong step lies (`credit_method="first_error"`).

A step checker is a callable `(completion_text, ground_truth) -> (start, end) | None`: the
characters of the completion's first wrong step, or None where it finds none (a correct
completion, or one it cannot parse). The trainer maps the characters to tokens through the
tokenizer's offsets (`gear.spans.error_token_mask`). A task declares its checker with
`Task.step_checker`; a TRL user passes their own to `GEARTrainer(step_checker=...)`.

`first_wrong_equation_span` is arithmetic's: the first equation ``a op b ... = r`` whose stated
result is arithmetically wrong, from its first character to the end of the stated result (the
span issue 51's localisation study calls the wrong step).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

#: (completion text, ground truth) -> (start, end) characters of the first wrong step, or None
StepChecker = Callable[[str, Any], "tuple[int, int] | None"]

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


def first_wrong_equation_span(text: str, ground_truth: Any = None) -> tuple[int, int] | None:
    """The step checker of arithmetic (`StepChecker`): [start, end) characters of the first
    arithmetically wrong equation, from its first operand to the end of its stated result; None
    where every equation is right or there is none. Needs no ground truth."""
    found = first_wrong_equation(text)
    if found is None:
        return None
    m = found[1]
    return m.start(), m.end(4)
