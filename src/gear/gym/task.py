"""The gym's task: running sums mod 10 written step by step; outcome-only reward; a checker that
knows the first wrong step of any rollout.

A problem is a start digit and `length` operand digits, ``3+4+8+1+6>``. The one right solution
writes one step per operand, ``p+x=r;`` (the previous result, the operand, the new result mod 10),
so ``3+4=7;7+8=5;5+1=6;6+6=2;``: every completion has exactly ``6 * length`` tokens, step k owns
tokens ``6k .. 6k+5``. The reward is outcome-only: 1 iff the last step's result is the true sum
mod 10. Because the right solution is unique, the first wrong *token* of a rollout is the first
token that differs from it, and the first wrong *step* is the step that holds that token.

The teacher sees the ground truth as a hint before the prompt (spec §4, plain-text prompts).
What the hint holds is the task's `hint` (the teacher context): ``all_steps`` (the default) lists
every reference result, ``7562:3+4+8+1+6>``, so the teacher can check each step;
``answer_only`` holds the final result alone, ``2:3+4+8+1+6>``, as a teacher shown only the
final answer of a real task. Vocabulary: the ten digits and five symbols (`VOCAB`), no tokenizer
library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

VOCAB = [str(d) for d in range(10)] + ["+", "=", ";", ">", ":", "<bos>"]
ID = {tok: i for i, tok in enumerate(VOCAB)}
BOS = ID["<bos>"]
STEP_LEN = 6  # tokens of one step, "p+x=r;"
RESULT_OFFSET = 4  # position of the result digit inside a step
#: what the teacher's hint holds: every intermediate result, or the final one alone
HINTS = ("all_steps", "answer_only")


@dataclass(frozen=True)
class ChainTask:
    """Running sums mod 10 of `length` one-digit operands (the chain length is the knob);
    `hint`: what the teacher is shown (`HINTS`)."""

    length: int = 4
    hint: str = "all_steps"

    def __post_init__(self) -> None:
        if not 1 <= self.length <= 12:
            raise ValueError(f"ChainTask.length: expected an integer in [1, 12], got {self.length}")
        if self.hint not in HINTS:
            raise ValueError(f"ChainTask.hint: expected one of {list(HINTS)}, got {self.hint!r}")

    @property
    def completion_len(self) -> int:
        return STEP_LEN * self.length

    def problems(self, n: int, generator: torch.Generator, split: str = "train") -> Tensor:
        """(n, length + 1) digits, the start value and the operands, all from `split`.

        Train and test are disjoint by construction: a problem is a test problem iff a hash of
        its digits falls in the first `TEST_FRACTION` (about 20%)."""
        if split not in ("train", "test"):
            raise ValueError(f"split: expected 'train' or 'test', got {split!r}")
        out = torch.empty(0, self.length + 1, dtype=torch.long)
        while out.shape[0] < n:
            draw = torch.randint(0, 10, (2 * n + 16, self.length + 1), generator=generator)
            out = torch.cat([out, draw[self.is_test(draw) == (split == "test")]])
        return out[:n]

    def is_test(self, problems: Tensor) -> Tensor:
        """(n,) bool: the problem belongs to the held-out split (a multiplicative hash)."""
        powers = 10 ** torch.arange(problems.shape[1] - 1, -1, -1, dtype=torch.long)
        key = (problems * powers).sum(dim=1)
        return (key % 1_000_003) * 40_503 % 1_000_003 % 5 == 0

    def results(self, problems: Tensor) -> Tensor:
        """(n, length) the true running sums mod 10 after each operand."""
        return problems.cumsum(dim=1)[:, 1:] % 10

    def prompts(self, problems: Tensor) -> Tensor:
        """(n, 2 * length + 3) student prompt ids: <bos> s0 + x1 + ... + xL >."""
        n = problems.shape[0]
        ids = torch.full((n, 2 * self.length + 3), ID["+"], dtype=torch.long)
        ids[:, 0] = BOS
        ids[:, 1:-1:2] = problems
        ids[:, -1] = ID[">"]
        return ids

    @property
    def hint_len(self) -> int:
        """Digits in the teacher's hint: `length` (all_steps) or 1 (answer_only)."""
        return self.length if self.hint == "all_steps" else 1

    def hint_digits(self, problems: Tensor) -> Tensor:
        """(n, hint_len) the digits the teacher is shown: r1 ... rL, or rL alone."""
        return self.results(problems)[:, -self.hint_len :]

    def teacher_prompts(self, problems: Tensor) -> Tensor:
        """(n, 2 * length + hint_len + 4) teacher prompt ids: <bos> hint : s0 + x1 + ... + xL >,
        the hint being r1 ... rL (all_steps) or rL (answer_only)."""
        return self._hinted(problems, self.hint_digits(problems))

    def contrast_teacher_prompts(self, problems: Tensor) -> Tensor:
        """Teacher prompt ids with a wrong ground truth: every hint digit shifted by 5 mod 10,
        so the hint is wrong at every step it shows (the contrast teacher of `contrast=true`),
        in the same format as `teacher_prompts`."""
        return self._hinted(problems, (self.hint_digits(problems) + 5) % 10)

    def _hinted(self, problems: Tensor, digits: Tensor) -> Tensor:
        student = self.prompts(problems)
        hint = torch.cat([digits, torch.full_like(problems[:, :1], ID[":"])], 1)
        return torch.cat([student[:, :1], hint, student[:, 1:]], dim=1)

    def references(self, problems: Tensor) -> Tensor:
        """(n, 6 * length) ids of the one right solution."""
        n, L = problems.shape[0], self.length
        res = self.results(problems)
        prev = torch.cat([problems[:, :1], res[:, :-1]], dim=1)
        steps = torch.empty(n, L, STEP_LEN, dtype=torch.long)
        steps[:, :, 0] = prev
        steps[:, :, 1] = ID["+"]
        steps[:, :, 2] = problems[:, 1:]
        steps[:, :, 3] = ID["="]
        steps[:, :, 4] = res
        steps[:, :, 5] = ID[";"]
        return steps.view(n, L * STEP_LEN)

    def rewards(self, problems: Tensor, completions: Tensor) -> Tensor:
        """(n,) float outcome reward: 1 iff the last step's result digit is the true answer."""
        final = completions[:, -STEP_LEN + RESULT_OFFSET]
        return (final == self.results(problems)[:, -1]).float()

    def first_error(self, problems: Tensor, completions: Tensor) -> Tensor:
        """(n,) long index of the first token that differs from the right solution; -1 if none."""
        wrong = completions != self.references(problems)
        first = wrong.to(torch.long).argmax(dim=1)
        return torch.where(wrong.any(dim=1), first, -1)

    def first_wrong_step(self, problems: Tensor, completions: Tensor) -> Tensor:
        """(n,) long index of the first wrong step (0-based), -1 for a flawless rollout."""
        tok = self.first_error(problems, completions)
        return torch.where(tok >= 0, tok // STEP_LEN, -1)

    def step_mask(self, steps: Tensor) -> Tensor:
        """(n, 6 * length) bool: the tokens of step `steps[i]` (no token where it is -1)."""
        pos = torch.arange(self.completion_len)
        return (pos[None, :] // STEP_LEN == steps[:, None]) & (steps[:, None] >= 0)

    def decode(self, ids: Tensor | list[int]) -> str:
        return "".join("" if int(i) == BOS else VOCAB[int(i)] for i in ids)
