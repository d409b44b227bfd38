"""The Task interface shared by every task, and helpers for reading completions and answers."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from datasets import Dataset, Features, List, Value

from gear.teacher import ground_truth_text, offset_answer

SPLITS = ("train", "test")

PROMPT_FEATURE = List({"role": Value("string"), "content": Value("string")})
#: the rows of a task read from a file: prompt, teacher's ground truth, answer, the file's row
FILE_FEATURES = Features(
    {
        "prompt": PROMPT_FEATURE,
        "ground_truth": Value("string"),
        "answer": Value("string"),
        "index": Value("int64"),
    }
)

Message = dict[str, Any]
Completion = str | Message | list[Message]


class Task:
    """A task: a dataset of chat prompts plus a verifiable reward.

    ``dataset(split)`` rows have ``prompt`` (chat messages, TRL conversational format),
    ``ground_truth`` (text shown to the teacher in its hint), ``answer`` (reference the reward
    checks) and, for tool tasks, ``tools`` (JSON function schemas). ``reward`` has TRL's
    reward-function signature; ``is_correct`` scores one completion text for evaluation.
    ``prepare_tokenizer`` and ``trainer_kwargs`` let a task adapt the tokenizer (e.g. a chat
    template with tool support) and add ``GRPOTrainer`` arguments (e.g. ``environment_factory``).
    """

    name: ClassVar[str] = ""
    hint_kind: ClassVar[str] = "math"  # "math" | "tool": selects the teacher hint template

    def dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows of ``split`` ("train" | "test"), at most ``n`` of them, order fixed by ``seed``."""
        raise NotImplementedError

    def is_correct(self, completion_text: str, answer: str) -> bool:
        """Whether one completion (plain text) solves the problem whose reference is ``answer``."""
        raise NotImplementedError

    def completion_text(self, completion: Completion) -> str:
        """The text the reward reads from one TRL completion (str or list of messages)."""
        return completion_text(completion)

    def reward(self, prompts: list, completions: list[Completion], **kwargs: Any) -> list[float]:
        """TRL reward function: 1.0 for a correct completion, else 0.0 (uses the ``answer`` column)."""
        if "answer" not in kwargs:
            raise ValueError(
                f"{self.name} reward needs the dataset column 'answer'; got columns {sorted(kwargs)}"
            )
        answers = kwargs["answer"]
        if len(answers) != len(completions):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        return [
            float(self.is_correct(self.completion_text(c), a))
            for c, a in zip(completions, answers, strict=True)
        ]

    def wrong_answer(self, answer: str, rng: random.Random) -> str | None:
        """A wrong final answer for ``answer``, shown to the contrast teacher
        (``teacher_context="contrast"``, docs/spec.md "Teacher contexts"); ``rng`` draws it.

        Default (`gear.teacher.offset_answer`): a number plus a nonzero offset in -3..3; None for
        anything else, and the trainer then shows another answer of the dataset (or of the
        batch), failing at start-up when there is none. Override it where a near miss of another
        form is the natural wrong answer; it must never return ``answer`` itself."""
        return offset_answer(answer, rng)

    def answer_span(self, completion_text: str) -> tuple[int, int] | None:
        """``(start, end)``: the characters of the final answer the reward reads in one
        completion text, or None where there is none. OAR-G scores the log-probability of
        these characters' tokens (``credit_oar_span="answer"``, docs/spec.md); a row with None
        falls back to its last ``oar_answer_len`` tokens. Default: None (no answer parser)."""
        return None

    def step_checker(self) -> Callable[[str, Any], tuple[int, int] | None] | None:
        """The task's step checker (`gear.tasks.steps.StepChecker`): `(completion_text,
        ground_truth) -> (start, end)` characters of a completion's first wrong step, or None
        where it finds none. `credit_method="first_error"` blames those tokens of a failed row.
        Default: None, the task has none (that method is then refused before any work)."""
        return None

    def reference_text(self, answer: Any) -> str | None:
        """The text of a reference ``answer`` (the ``answer`` column) as a completion would
        write it: what OAR-G appends after the completion under ``credit_oar_span="reference"``
        (the authors' way). Default: the value as text (`gear.teacher.ground_truth_text`)."""
        return ground_truth_text(answer)

    def prepare_tokenizer(self, tokenizer: Any) -> Any:
        """Adapt the tokenizer before training (default: unchanged). Returns it."""
        return tokenizer

    def trainer_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for ``trl.GRPOTrainer`` (default: none)."""
        return {}


# ---------------------------------------------------------------- completions


def render_tool_calls(tool_calls: list[dict]) -> str:
    """OpenAI-style ``tool_calls`` of a message as ``<tool_call>`` JSON blocks (Hermes/Qwen style)."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        blocks.append(
            "<tool_call>\n"
            + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
            + "\n</tool_call>"
        )
    return "\n".join(blocks)


def message_text(message: Message) -> str:
    """A message's text content plus its ``tool_calls`` rendered as text."""
    content = message.get("content") or ""
    if isinstance(content, list):  # multimodal blocks
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = message.get("tool_calls")
    if calls:
        content = (content + "\n" if content else "") + render_tool_calls(calls)
    return content


def completion_text(completion: Completion) -> str:
    """Text of a completion: a str as is; for messages, the assistant messages' text joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    parts = [message_text(m) for m in completion if m.get("role", "assistant") == "assistant"]
    return "\n".join(p for p in parts if p)


def last_assistant_text(completion: Completion) -> str:
    """Text of the last assistant message (the final answer of a multi-turn rollout)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    for message in reversed(completion):
        if message.get("role", "assistant") == "assistant":
            return message_text(message)
    return ""


# ---------------------------------------------------------------- answers

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_MARKER = re.compile(r"answer\s*(?:is|:|=)?[ \t]*:?([^\n]*)", re.IGNORECASE)
_MATH_RUN = re.compile(r"[\s\d.,+\-*/×x()=$]*")


def final_answer(text: str) -> str | None:
    """The final answer in a text, as a string (commas in numbers dropped), or None.

    Priority: the last ``\\boxed{...}``; else the number after the last "Answer:"/"answer is"
    marker (after the last "=" if the marker is followed by an equation, "Answer: 12 + 7 = 19");
    else the last number in the text. Where it lies: `final_answer_span`.
    """
    span = final_answer_span(text)
    return None if span is None else text[span[0] : span[1]].replace(",", "")


def final_answer_span(text: str) -> tuple[int, int] | None:
    """``(start, end)``: where `final_answer` reads the final answer in ``text`` (the characters
    ``text[start:end]``, commas included), or None where it finds none. OAR-G's answer span
    (docs/spec.md) is the tokens of these characters."""
    boxed = list(_BOXED.finditer(text))
    if boxed:
        inner, start = boxed[-1].group(1), boxed[-1].start(1)
        start += len(inner) - len(inner.lstrip())
        return start, start + len(inner.strip())
    for match in reversed(list(_MARKER.finditer(text))):
        segment, start = match.group(1), match.start(1)
        run = _MATH_RUN.match(segment).group()
        if "=" in run:
            cut = run.rindex("=") + 1
            segment, start = segment[cut:], start + cut
        number = re.match(r"[\s*$]*(" + _NUMBER + ")", segment)
        if number:
            return start + number.start(1), start + number.end(1)
    numbers = list(re.finditer(_NUMBER, text))
    return numbers[-1].span() if numbers else None


def to_number(text: str | None) -> float | None:
    """``text`` as a float if it is just a number ("1,000", "$18.00", "7." accepted), else None."""
    if text is None:
        return None
    match = re.fullmatch(r"[\s\\$]*(" + _NUMBER + r")\s*\.?\s*", text)
    if not match:
        return None
    try:
        return float(match.group(1).replace(",", ""))
    except ValueError:
        return None


def numbers_equal(a: float | None, b: float | None) -> bool:
    """Equal up to float rounding (relative 1e-9)."""
    return a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


# ---------------------------------------------------------------- misc


def make_dataset(rows: list[dict], features: Features) -> Dataset:
    """A Dataset of ``rows`` with fixed ``features`` (works for zero rows too)."""
    return Dataset.from_dict({k: [row[k] for row in rows] for k in features}, features=features)


def check_split(split: str) -> str:
    """``split`` if valid, else ValueError naming the valid splits."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")
    return split


def check_n(n: int | None) -> int | None:
    """``n`` if None or >= 0, else ValueError."""
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be None or a non-negative int, got {n!r}")
    return n


def stable_fraction(key: str) -> float:
    """A deterministic number in [0, 1) from ``key`` (sha256), for hash-based splits."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16**12


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines file; clear errors naming the path (and line) when unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    rows, lineno = [], 0
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):  # noqa: B007 (lineno is used in the error)
                if line.strip():
                    rows.append(json.loads(line))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: line {lineno} is not valid JSON ({e.msg}); correct or remove that line"
        ) from e
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read data file {path}: {e}") from e
    return rows


def parse_mix(mix: str | dict[str, float], valid: tuple[str, ...], what: str) -> dict[str, float]:
    """Weights from ``{"a": 0.5, ...}``, ``"a:0.5,b:0.5"`` or one name ``"a"``; normalised to sum 1."""
    if isinstance(mix, str):
        items = {}
        for part in mix.split(","):
            name, _, weight = part.partition(":")
            try:
                items[name.strip()] = float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"bad weight in {what} mix {mix!r}") from None
        mix = items
    if not isinstance(mix, dict) or not mix:
        raise ValueError(f"{what} mix must be a non-empty dict or string, got {mix!r}")
    unknown = [k for k in mix if k not in valid]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; valid: {list(valid)}")
    if any(not isinstance(w, int | float) or w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"{what} mix weights must be >= 0 with a positive sum, got {mix!r}")
    total = float(sum(mix.values()))
    return {k: w / total for k, w in mix.items() if w > 0}
