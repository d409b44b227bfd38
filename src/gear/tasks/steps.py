"""Step checkers: where a completion's first wrong step lies (`credit_method="first_error"`).

A step checker is a callable `(completion_text, ground_truth) -> (start, end) | None`: the
characters of the completion's first error, or None where it finds none (a correct completion,
or one it cannot parse). The trainer maps the characters to tokens through the tokenizer's
offsets (`gear.spans.error_token_mask`). A task declares its checker with `Task.step_checker`; a
TRL user passes their own to `GEARTrainer(step_checker=...)`.

Arithmetic's checkers read chains ``e0 = e1 = e2 ...``: e0 is an expression with at least one
operator, each later side a number or an expression. Operators are + - * / x × · ``\\times`` and
the Unicode minus −, which is also a sign. Numbers are decimals; they may have leading zeros
(``07``), a sign and a ``$``. Any blank (a no-break or a thin space too) or line break may
separate tokens, except a line break right before an operator: a "- " or "* " bullet opening a
line is no operator. Values are exact fractions; two agree within 1e-6; a division by 0 ends the
chain unchecked.

A chain is checked link by link. Link k, ``e(k-1) = ek``, is right when ek has e(k-1)'s value:
a rewrite, or a running total (``17 - 3 + 7 = 14 + 7``). It is a continuation when ek is an
expression that starts from e(k-1)'s value (``3 + 4 = 7 + 2``): the writer carries on from the
result, and ek starts the next step. Any other link is wrong. The first wrong link is the
completion's first wrong step, from the first character of e(k-1) to the end of ek; for
``a op b = r``, the whole equation. Its first wrong token is found as follows:

- ek a number: its first character that differs from the right value written the same way
  (an integer when integral, else up to 6 decimals). Leading zeros are skipped, and a wrong sign
  is its minus. A number that runs out first (``1`` for ``17``) is wrong at its last character.
- ek an expression: it is compared with the right form of e(k-1) that has as many numbers:
  e(k-1) with its operations carried out one at a time in evaluation order (the first * or /,
  else the first + or -), until it has as many; ``17 - 3 + 7`` gives ``14 + 7``, and an ek with
  as many numbers as e(k-1) is compared with e(k-1) itself. Its first token (in reading order)
  that differs there is wrong: a number at its first wrong character, as above, or an operator.
  An ek with more numbers than e(k-1) has no such form and is blamed whole.

`first_wrong_token_span` gives the token (`ArithmeticTask(error_span="token")`, the default) and
`first_wrong_equation_span` the step (`error_span="step"`). `EQUATION`, `equation_spans` and
`first_wrong_equation` are the one-equation reading (``a op b ... = r``, ASCII operators) that
issue 51's studies measured with. They are kept as they were.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

#: (completion text, ground truth) -> (start, end) characters of the first error, or None
StepChecker = Callable[[str, Any], "tuple[int, int] | None"]

_NUMBER = r"[-−]?\$?[0-9]+(?:\.[0-9]+)?"
_OPERATOR = r"(?:\\times|[-+*/x×·−])"
_TERM = rf"[^\S\n]*{_OPERATOR}\s*{_NUMBER}"  # no line break before an operator (a bullet)
#: a chain e0 = e1 = ...: e0 has an operator, later sides need none
CHAIN = re.compile(rf"{_NUMBER}(?:{_TERM})+(?:\s*=\s*{_NUMBER}(?:{_TERM})*)+")
_EXPRESSION = re.compile(rf"\s*{_NUMBER}(?:\s*{_OPERATOR}\s*{_NUMBER})*\s*")
_TOKEN = re.compile(r"\\times|[-+*/x×·−]|[0-9]+(?:\.[0-9]+)?")  # a "$" is skipped
_OPS = {"x": "*", "×": "*", "·": "*", "\\times": "*", "−": "-"}
TOLERANCE = 1e-6

#: the one-equation reading of issue 51's studies: operands (group 1), "=", "$", stated result (4)
EQUATION = re.compile(
    r"((?:\d+(?:\.\d+)?\s*[-+*/x×]\s*)+\d+(?:\.\d+)?)\s*(=)\s*(\$?)(-?\d+(?:\.\d+)?)"
)


@dataclass
class Side:
    """One side of a chain: [start, end) characters, its numbers (signs applied) and the
    operators between them (as + - * /). `chars[j]` holds number j's characters as they are
    compared, each with its offset: its minus, then its digits, leading zeros skipped.
    `op_spans[j]` holds operator j's characters."""

    start: int
    end: int
    numbers: list[Fraction]
    ops: list[str]
    chars: list[list[tuple[str, int]]]
    op_spans: list[tuple[int, int]]


@dataclass(frozen=True)
class WrongStep:
    """A completion's first wrong link: [start, end) characters of the step, and of its first
    wrong token."""

    start: int
    end: int
    token: tuple[int, int]


def parse_side(text: str, start: int, end: int) -> Side:
    """The side in `text[start:end]` (a well-formed expression: `CHAIN` matched it)."""
    while text[start].isspace():
        start += 1
    while text[end - 1].isspace():
        end -= 1
    side = Side(start, end, [], [], [], [])
    sign = None
    for t in _TOKEN.finditer(text, start, end):
        s = t.group()
        if s[0].isdigit():
            chars = list(zip(s, range(t.start(), t.end()), strict=True))
            while len(chars) > 1 and chars[0][0] == "0" and chars[1][0].isdigit():
                chars.pop(0)
            value = Fraction(s)
            if sign is not None:
                value, chars = -value, [("-", sign), *chars]
            side.numbers.append(value)
            side.chars.append(chars)
            sign = None
        elif len(side.ops) == len(side.numbers):  # an operator where a number is due: a minus
            sign = t.start()
        else:
            side.ops.append(_OPS.get(s, s))
            side.op_spans.append(t.span())
    return side


def reduce_once(numbers: list[Fraction], ops: list[str]) -> tuple[list[Fraction], list[str]] | None:
    """The form with one operation carried out, in evaluation order: the first * or /, else the
    first + or -. None for a division by 0."""
    i = next((k for k, op in enumerate(ops) if op in "*/"), 0)
    a, b, op = numbers[i], numbers[i + 1], ops[i]
    if op == "/" and b == 0:
        return None
    value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
    return [*numbers[:i], value, *numbers[i + 2 :]], ops[:i] + ops[i + 1 :]


def value_of(numbers: list[Fraction], ops: list[str]) -> Fraction | None:
    """The value of a form, None where it divides by 0."""
    while ops:
        form = reduce_once(numbers, ops)
        if form is None:
            return None
        numbers, ops = form
    return numbers[0]


def evaluate_expression(expr: str) -> float | None:
    """Value of ``3 + 4 * 2`` style expressions (the operators above), None if not computable."""
    if not _EXPRESSION.fullmatch(expr):
        return None
    side = parse_side(expr, 0, len(expr))
    value = value_of(side.numbers, side.ops)
    return None if value is None else float(value)


def written(value: Fraction) -> str:
    """`value` as a result is written: an integer when integral, else up to 6 decimals."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):f}".rstrip("0").rstrip(".")


def wrong_char(chars: list[tuple[str, int]], right: Fraction) -> tuple[int, int]:
    """The first of a stated number's characters that differs from `right` written the same
    way; its last one where it runs out first."""
    want = written(right)
    k = next(
        (j for j, (c, _) in enumerate(chars) if j >= len(want) or c != want[j]), len(chars) - 1
    )
    at = chars[k][1]
    return at, at + 1


def close(a: Fraction, b: Fraction) -> bool:
    return abs(a - b) <= TOLERANCE


def wrong_token(previous: Side, side: Side, right: Fraction) -> tuple[int, int]:
    """The first wrong token of a wrong side whose previous side has the value `right`."""
    if not side.ops:
        return wrong_char(side.chars[0], right)
    numbers, ops = previous.numbers, previous.ops
    while len(numbers) > len(side.numbers):
        form = reduce_once(numbers, ops)
        if form is None:
            break
        numbers, ops = form
    if len(numbers) == len(side.numbers):
        for j, want in enumerate(numbers):
            if not close(side.numbers[j], want):
                return wrong_char(side.chars[j], want)
            if j < len(ops) and side.ops[j] != ops[j]:
                return side.op_spans[j]
    return side.start, side.end


def first_wrong_step(text: str) -> WrongStep | None:
    """The first wrong link of the chains in `text` (module docstring), or None."""
    for m in CHAIN.finditer(text):
        cuts = [m.start() + k for k, c in enumerate(m.group()) if c == "="]
        starts, ends = [m.start(), *(c + 1 for c in cuts)], [*cuts, m.end()]
        sides = [parse_side(text, a, b) for a, b in zip(starts, ends, strict=True)]
        previous, value = sides[0], value_of(sides[0].numbers, sides[0].ops)
        for side in sides[1:]:
            stated = value_of(side.numbers, side.ops)
            if value is None or stated is None:
                break
            continues = bool(side.ops) and close(side.numbers[0], value)
            if not close(stated, value) and not continues:
                return WrongStep(previous.start, side.end, wrong_token(previous, side, value))
            previous, value = side, stated
    return None


def first_wrong_token_span(text: str, ground_truth: Any = None) -> tuple[int, int] | None:
    """A step checker of arithmetic (`StepChecker`), the default: [start, end) characters of the
    first wrong token of the first wrong step (module docstring), e.g. the "4" of
    ``22 - 9 = 14``; None where every step is right or there is none. Needs no ground truth."""
    found = first_wrong_step(text)
    return None if found is None else found.token


def first_wrong_equation_span(text: str, ground_truth: Any = None) -> tuple[int, int] | None:
    """A step checker of arithmetic (`StepChecker`): [start, end) characters of the first wrong
    step, from the first character of its left side to the end of its wrong side (all of
    ``22 - 9 = 14``); None where every step is right or there is none. Needs no ground truth."""
    found = first_wrong_step(text)
    return None if found is None else (found.start, found.end)


def equation_spans(text: str) -> list[tuple[int, int, int]]:
    """(equation start, result start, result end) in characters of every `EQUATION` of `text`."""
    return [(m.start(), *m.span(4)) for m in EQUATION.finditer(text)]


def first_wrong_equation(text: str) -> tuple[int, re.Match[str], float] | None:
    """(index, match, right value) of the first `EQUATION` whose stated result is arithmetically
    wrong, or None (the one-equation reading of issue 51's studies)."""
    for k, m in enumerate(EQUATION.finditer(text)):
        value = evaluate_expression(m.group(1))
        if value is not None and not math.isclose(value, float(m.group(4)), abs_tol=TOLERANCE):
            return k, m, value
    return None
