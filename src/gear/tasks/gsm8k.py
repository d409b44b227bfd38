"""GSM8K grade-school math from local JSONL (or, online only, from the Hub).

Option ``path``: a directory holding ``train.jsonl`` / ``test.jsonl`` (the split picks the file),
a single ``.jsonl`` file (used as is for whichever split is asked), or, when no such path exists and
it looks like a Hub name ("openai/gsm8k"), ``datasets.load_dataset(path, "main")`` — never when
``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is set. Rows are ``{"question", "answer"}`` where the
answer is a worked solution ending in ``#### <final answer>``.

Columns: ``prompt`` (the question, asking for "Answer: <number>"), ``ground_truth`` (the worked
solution without the ``<<48/2=24>>`` calculator annotations, its last line "The answer is N."),
``answer`` (the final answer, commas removed). Reward: the completion's final answer (lenient
extraction) equals the reference numerically, or ``math_verify`` says they are equivalent.
"""

from __future__ import annotations

import os
import random
import re
import threading
from pathlib import Path

from datasets import Dataset

from gear.tasks.base import (
    FILE_FEATURES,
    Task,
    check_n,
    check_split,
    final_answer,
    final_answer_span,
    make_dataset,
    numbers_equal,
    read_jsonl,
    to_number,
)

PROMPT = '{question}\nSolve it step by step, then give the final answer as "Answer: <number>".'
FEATURES = FILE_FEATURES
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def split_solution(solution: str) -> tuple[str, str]:
    """(worked solution for the teacher, final answer) from a GSM8K answer field."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '#### <final answer>': {solution[-80:]!r}")
    steps, final = solution.rsplit("####", 1)
    final = final.strip().replace(",", "")
    steps = re.sub(r"<<[^>]*>>", "", steps).strip()
    return f"{steps}\nThe answer is {final}.", final


def _offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def math_verify_equal(answer: str, text: str) -> bool:
    """``math_verify``: is the answer parsed from ``text`` equivalent to ``answer``?"""
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()  # its timeouts need signals
    timeout = 5 if main else None
    try:
        gold = parse(answer, parsing_timeout=timeout)
        pred = parse(text, parsing_timeout=timeout)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
    except Exception:
        return False


class GSM8KTask(Task):
    """GSM8K: chat prompts from the questions, reward on the final numeric answer."""

    name = "gsm8k"
    hint_kind = "math"

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = None if path is None else str(path)

    def _raw_rows(self, split: str) -> list[dict]:
        if self.path is None:
            raise ValueError(
                "gsm8k needs the option path=...: a directory with train.jsonl/test.jsonl, "
                "a .jsonl file, or a Hub dataset name such as 'openai/gsm8k'"
            )
        path = Path(self.path).expanduser()
        if path.is_dir():
            file = path / f"{split}.jsonl"
            if not file.is_file():
                raise FileNotFoundError(
                    f"gsm8k: {file} not found (expected {split}.jsonl in {path})"
                )
            return read_jsonl(file)
        if path.is_file():
            return read_jsonl(path)
        if _HUB_NAME.match(self.path) and not self.path.endswith((".json", ".jsonl")):
            if _offline():
                raise ValueError(f"gsm8k: {self.path!r} is not a local path and the Hub is offline")
            from datasets import load_dataset

            return list(load_dataset(self.path, "main", split=split))
        raise FileNotFoundError(
            f"gsm8k data not found: {path}; give path= a directory with train.jsonl and "
            "test.jsonl, a .jsonl file or a Hub dataset name"
        )

    def dataset(self, split: str, n: int | None = None, seed: int = 0) -> Dataset:
        """Rows of ``split`` shuffled by ``seed``, the first ``n`` (all if None)."""
        check_split(split)
        check_n(n)
        raw = self._raw_rows(split)
        order = list(range(len(raw)))
        random.Random(seed).shuffle(order)
        rows = []
        for i in order[:n]:
            try:
                question, solution = raw[i]["question"], raw[i]["answer"]
                ground_truth, answer = split_solution(solution)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"gsm8k {self.path} row {i}: bad row ({e})") from e
            rows.append(
                {
                    "prompt": [{"role": "user", "content": PROMPT.format(question=question)}],
                    "ground_truth": ground_truth,
                    "answer": answer,
                    "index": i,
                }
            )
        return make_dataset(rows, FEATURES)

    def is_correct(self, completion_text: str, answer: str) -> bool:
        """Final answer equal to ``answer`` (numerically, else by ``math_verify``)."""
        span = final_answer(completion_text)
        if span is not None and numbers_equal(to_number(span), to_number(answer)):
            return True
        if "\\boxed" in completion_text:  # e.g. \boxed{\frac{36}{2}}
            return math_verify_equal(answer, completion_text)
        return span is not None and math_verify_equal(answer, span)

    def answer_span(self, completion_text: str) -> tuple[int, int] | None:
        """Where `is_correct` reads the final answer (`final_answer_span`)."""
        return final_answer_span(completion_text)
