"""Competition math (MATH, AIME, DAPO-Math-17k style) from local JSONL or parquet files.

Option ``path``: a ``.jsonl`` or ``.parquet`` file, used as is for whichever split is asked, or
a directory holding ``train.jsonl`` / ``train.parquet`` and ``test.jsonl`` / ``test.parquet``
(the split picks the file). Nothing is downloaded.

A row holds a problem and a reference answer, found by field name; a dotted name reaches into a
nested field (``reward_model.ground_truth``):

- problem (``problem_key``; default the first of ``problem``, ``question``, ``prompt`` the row
  has): text, put into ``prompt_template``, or a chat (a list of ``{role, content}`` messages,
  DAPO-Math-17k's ``prompt``), used as is since it carries its own instructions;
- answer (``answer_key``; default ``answer``, else ``reward_model.ground_truth``): text or a
  number;
- solution (``solution_key``; default ``solution``, optional): a worked solution (MATH). A row
  with no answer takes its solution's last ``\\boxed{...}`` (nested braces allowed).

A name set by an option is the only one looked for, and every row must have it. A missing or
malformed field is an `InputError` naming the file and the row (in a JSONL file, its line).

Columns: ``prompt``, ``ground_truth`` (the solution where the row has one, else the answer:
what the teacher's hint shows, as in gsm8k), ``answer``, ``index`` (the row's position in its
file). Reward: the completion's final answer (its last ``\\boxed{...}``, else what follows its
last "Answer:" / "answer is") equals the reference by math-verify.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path
from typing import Any

from datasets import Dataset

from gear.io import InputError, read_text
from gear.tasks.base import FILE_FEATURES, Task, check_n, check_split, make_dataset
from gear.tasks.gsm8k import math_verify_equal

# The usual instruction of MATH-style evaluations (chosen): the reward reads the last \boxed{}.
PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
PROBLEM_KEYS = ("problem", "question", "prompt")
ANSWER_KEYS = ("answer", "reward_model.ground_truth")
SOLUTION_KEYS = ("solution",)
SUFFIXES = (".jsonl", ".parquet")
FEATURES = FILE_FEATURES


# ---------------------------------------------------------------- \boxed{} and final answers

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # \boxed5 too, never \boxedsymbol
# A trailing percent sign, TeX's or plain, with the spaces before it: dropped from both sides
_PERCENT = re.compile(r"\s*\\?%\s*$")
_MARKER = re.compile(r"\banswer(?:\s+is\b|\s*:)[ \t]*:?", re.IGNORECASE)


def boxed_spans(text: str) -> list[tuple[int, int] | None]:
    """One entry per ``\\boxed`` / ``\\fbox`` in ``text``, in order: ``(start, end)`` of its
    content (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``, braces counted, ``\\{`` / ``\\}``
    literal), or None where its braces never close (a completion cut short). ``\\boxed 5`` and
    ``\\boxed5`` (no braces) box the text up to the next space or ``$``."""
    spans: list[tuple[int, int] | None] = []
    for match in _BOXED.finditer(text):
        i = match.end()
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] != "{":  # \boxed 5, \boxed5
            end = i + re.match(r"[^\s$]*", text[i:]).end()
            spans.append((i, end) if end > i else None)
            continue
        if i >= len(text) or text[i] != "{":
            spans.append(None)
            continue
        start, depth, i = i + 1, 1, i + 1
        while i < len(text) and depth:
            if text[i] == "\\":
                i += 1  # an escaped character (\{, \}, \\) is never a group brace
            elif text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        spans.append((start, i - 1) if depth == 0 else None)
    return spans


def last_boxed(text: str) -> str | None:
    """The content of ``text``'s last ``\\boxed{...}``, stripped, or None where there is none
    or it never closes (the answer of a MATH solution)."""
    spans = boxed_spans(text)
    if not spans or spans[-1] is None:
        return None
    return text[spans[-1][0] : spans[-1][1]].strip() or None


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    """``(start, end)`` narrowed past spaces, a final full stop and wrappers ($, **, \\( \\))."""
    while True:
        before = (start, end)
        while start < end and text[start].isspace():
            start += 1
        while end > start and (text[end - 1].isspace() or text[end - 1] == "."):
            end -= 1
        for left, right in (("$", "$"), ("**", "**"), ("\\(", "\\)"), ("\\[", "\\]")):
            inner = text[start:end]
            if (
                len(inner) >= len(left) + len(right)
                and inner.startswith(left)
                and inner.endswith(right)
            ):
                start, end = start + len(left), end - len(right)
        if (start, end) == before:
            return start, end


def math_answer_span(text: str) -> tuple[int, int] | None:
    """``(start, end)``: the final answer of a completion, or None. The last ``\\boxed{...}``'s
    content (None where it never closes: a completion cut short gave no final answer, whatever it
    boxed before); else the rest of the line after the last "Answer:" / "answer is" (DAPO's
    prompts ask for "Answer: $Answer"). Spaces, a final full stop and ``$`` / ``**`` wrappers
    are left out."""
    boxed = boxed_spans(text)
    if boxed:
        start, end = _trim(text, *boxed[-1]) if boxed[-1] is not None else (0, 0)
        return (start, end) if end > start else None
    for match in reversed(list(_MARKER.finditer(text))):
        line_end = text.find("\n", match.end())
        start, end = _trim(text, match.end(), len(text) if line_end < 0 else line_end)
        if end > start:
            return start, end
    return None


def answers_equal(answer: str, predicted: str) -> bool:
    """Whether ``predicted`` (a final answer's text) is ``answer``: the same text up to spaces,
    or equivalent by math-verify with both read as ``\\boxed{...}`` (a bare ``\\frac{1}{2}``
    is no LaTeX math-verify finds). A trailing percent sign (``\\%`` or ``%``) on either side
    is dropped first, never read as /100: ``10\\%`` = ``10`` = ``10%``, and ``10\\%`` is not
    ``0.1`` (MATH writes the number of percent in the box, and asks for it so)."""
    answer, predicted = _PERCENT.sub("", answer), _PERCENT.sub("", predicted)
    if re.sub(r"\s+", "", answer) == re.sub(r"\s+", "", predicted):
        return True
    return math_verify_equal(f"\\boxed{{{answer}}}", f"\\boxed{{{predicted}}}")


# ---------------------------------------------------------------- reading files

_MISSING = object()


def field_value(row: dict, key: str) -> Any:
    """``row[key]``, else the dotted path ``key`` into nested dicts; ``_MISSING`` where absent
    or None (a parquet column a row does not fill)."""
    value: Any = row.get(key, _MISSING)
    if value is _MISSING and "." in key:
        value = row
        for part in key.split("."):
            value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
    return _MISSING if value is None else value


def filled(row: dict) -> list[str]:
    """The names of a row's fields that hold a value (a parquet row has every column)."""
    return sorted(k for k, v in row.items() if v is not None)


def read_rows(path: Path) -> list[tuple[str, dict]]:
    """``(where, row)`` for every row of a JSONL or parquet file; ``where`` names the row in
    errors ("line 3" in JSONL, "row 2" in parquet, counting from 0). An `InputError` when the
    file is missing, unreadable, malformed or holds no rows."""
    todo = "correct it, or give path= another .jsonl or .parquet file"
    if path.suffix == ".jsonl":
        rows = []
        for lineno, line in enumerate(read_text(path, todo).splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(
                    path, f"line {lineno} is not valid JSON ({e.msg})", "correct or remove it"
                ) from e
            if not isinstance(row, dict):
                raise InputError(
                    path,
                    f"line {lineno} is a JSON {type(row).__name__}, expected an object",
                    'write one {"problem": ..., "answer": ...} object per line',
                )
            rows.append((f"line {lineno}", row))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not path.is_file():
            raise InputError(path, "missing", todo)
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise InputError(path, f"not a readable parquet file ({e})", todo) from e
        rows = [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]
    else:
        raise InputError(path, f"unknown file type {path.suffix!r}, expected one of {SUFFIXES}")
    if not rows:
        raise InputError(path, "holds no rows", "give path= a file with problems")
    return rows


# ---------------------------------------------------------------- the task


class MathTask(Task):
    """Math problems with a reference answer (MATH, AIME, DAPO-Math-17k layouts), graded by
    math-verify on the completion's last ``\\boxed{}`` or "Answer:"."""

    name = "math"
    hint_kind = "math"
    #: how `is_correct` grades, as a number: part of the key of cached before-training scores
    #: (`gear.app.evaluate.eval_cache_key`), so scores graded before a change are not reused.
    #: 2: `\\boxed5` read, a trailing percent sign ignored (issue 69).
    grading_version = 2

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        problem_key: str | None = None,
        answer_key: str | None = None,
        solution_key: str | None = None,
        prompt_template: str = PROMPT,
    ):
        if not isinstance(prompt_template, str) or "{problem}" not in prompt_template:
            raise ValueError(
                f"math: prompt_template needs a '{{problem}}' placeholder, got {prompt_template!r}"
            )
        for option, key in (
            ("problem_key", problem_key),
            ("answer_key", answer_key),
            ("solution_key", solution_key),
        ):
            if key is not None and (not isinstance(key, str) or not key.strip()):
                raise ValueError(f"math: {option} must be a field name, got {key!r}")
        self.path = None if path is None else str(path)
        self.problem_key, self.answer_key, self.solution_key = problem_key, answer_key, solution_key
        self.prompt_template = prompt_template

    def data_file(self, split: str) -> Path:
        """The file that holds ``split``: ``path`` itself, or ``<split>.jsonl`` /
        ``<split>.parquet`` in the directory ``path``."""
        if self.path is None:
            raise ValueError(
                "math needs the option path=...: a .jsonl or .parquet file, or a directory with "
                "train.jsonl / test.jsonl (or .parquet)"
            )
        path = Path(self.path).expanduser()
        if not path.exists() and path.suffix not in SUFFIXES:  # a directory not there
            raise InputError(
                path,
                "missing: no such file or directory",
                "give path= a .jsonl or .parquet file, or a directory with train and test files",
            )
        if not path.is_dir():
            return path
        found = [path / f"{split}{s}" for s in SUFFIXES if (path / f"{split}{s}").is_file()]
        if len(found) != 1:
            names = " and ".join(p.name for p in found) if found else "neither"
            raise InputError(
                path,
                f"holds {names} of {split}.jsonl, {split}.parquet; the {split} split needs one",
                "give path= one file, or keep one of them",
            )
        return found[0]

    def _lookup(
        self, row: dict, option: str, keys: tuple[str, ...], where: str, file: Path
    ) -> tuple[str | None, Any]:
        """``(key, value)``: the first key of ``keys`` the row has (the option's key alone when
        set) and its value; ``(None, _MISSING)`` where it has none and the option was not set,
        else an `InputError`."""
        chosen = getattr(self, option)
        for key in (chosen,) if chosen is not None else keys:
            value = field_value(row, key)
            if value is not _MISSING:
                return key, value
        if chosen is not None:
            raise InputError(
                file,
                f"{where} has no field {chosen!r} ({option}); its fields: {filled(row)}",
                f"fill it, or set {option} to the field that holds it",
            )
        return None, _MISSING

    def parse_row(self, row: dict, where: str, file: Path) -> dict:
        """A dataset row (prompt, ground_truth, answer) from one raw row of ``file``."""

        def bad(problem: str, todo: str) -> InputError:
            return InputError(file, f"{where}: {problem}", todo)

        key, problem = self._lookup(row, "problem_key", PROBLEM_KEYS, where, file)
        if problem is _MISSING:
            raise bad(
                f"no problem (looked for {list(PROBLEM_KEYS)}); its fields: {filled(row)}",
                "set problem_key to the field that holds it",
            )
        prompt = self._prompt(problem)
        if prompt is None:
            raise bad(
                f"{key!r} is {type(problem).__name__} {repr(problem)[:60]}, expected text or a "
                "chat (a list of {role, content} messages with a user message)",
                "correct the row, or set problem_key to another field",
            )
        solution_field, solution = self._lookup(row, "solution_key", SOLUTION_KEYS, where, file)
        if solution is not _MISSING and (not isinstance(solution, str) or not solution.strip()):
            raise bad(
                f"{solution_field!r} is {solution!r}, expected the text of a worked solution",
                "correct the row, or set solution_key to another field",
            )
        answer_field, answer = self._lookup(row, "answer_key", ANSWER_KEYS, where, file)
        if answer is _MISSING:
            if solution is _MISSING:
                raise bad(
                    f"no answer (looked for {list(ANSWER_KEYS)} and a solution's \\boxed{{}}); "
                    f"its fields: {filled(row)}",
                    "set answer_key or solution_key to the field that holds it",
                )
            answer = last_boxed(solution)
            if answer is None:
                raise bad(
                    f"no answer field, and its {solution_field!r} has no closed \\boxed{{...}} "
                    f"at its end: ...{solution[-60:]!r}",
                    "box the final answer in the solution, or set answer_key",
                )
        elif isinstance(answer, int | float) and not isinstance(answer, bool):
            if not math.isfinite(answer):  # JSON's NaN / Infinity, a parquet NaN
                raise bad(
                    f"{answer_field!r} is {answer!r}, expected the answer as text or a finite "
                    "number",
                    "correct the row, or set answer_key to another field",
                )
            answer = str(answer)
        elif not isinstance(answer, str) or not answer.strip():
            raise bad(
                f"{answer_field!r} is {answer!r}, expected the answer as text or a number",
                "correct the row, or set answer_key to another field",
            )
        answer = answer.strip()
        return {
            "prompt": prompt,
            "ground_truth": solution if solution is not _MISSING else answer,
            "answer": answer,
        }

    def _prompt(self, problem: Any) -> list[dict] | None:
        """The chat prompt of a problem (text or chat), or None where it is neither."""
        if isinstance(problem, str):
            if not problem.strip():
                return None
            return [{"role": "user", "content": self.prompt_template.replace("{problem}", problem)}]
        if not isinstance(problem, list) or not problem:
            return None
        if not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in problem
        ):
            return None
        if not any(m["role"] == "user" and m["content"].strip() for m in problem):
            return None
        return [{"role": m["role"], "content": m["content"]} for m in problem]

    def dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows of ``split`` shuffled by ``seed``, the first ``n`` (all if None). Every row of
        the file is checked, not only the ones taken."""
        check_split(split)
        check_n(n)
        file = self.data_file(split)
        rows = [self.parse_row(row, where, file) for where, row in read_rows(file)]
        for i, row in enumerate(rows):
            row["index"] = i
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        return make_dataset([rows[i] for i in order[:n]], FEATURES)

    def is_correct(self, completion_text: str, answer: str) -> bool:
        """The completion's final answer (`answer_span`) equals ``answer`` by math-verify."""
        span = math_answer_span(completion_text)
        return span is not None and answers_equal(answer, completion_text[span[0] : span[1]])

    def answer_span(self, completion_text: str) -> tuple[int, int] | None:
        """Where `is_correct` reads the final answer (`math_answer_span`)."""
        return math_answer_span(completion_text)
