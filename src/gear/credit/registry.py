"""The credit registry: the per-token signals, declared once, and the credit methods.

`SIGNAL_SPECS` declares every per-token signal the credit core takes (`credit_details`'
keywords, `CreditInputs`' fields) with what the rest of the package needs to know of it: whether
it compares with the teacher, whether the signal pass computes it, whether it is a mask, whether
a method may read it. Every list of signal names is derived from it: `SIGNALS` (what a method
may `require`), `PASS_SIGNALS` (`gear.credit.signals.TokenSignals`), `TEACHER_SIGNALS`, and the
trainers' batch fields (TRL, verl).

`METHODS` holds the credit methods, one `Method` per name, filled by `register_method`;
`gear.credit.methods` registers the built-in ones, and importing any module of `gear.credit`
imports it (the package's `__init__` does), so every built-in is registered before a
`CreditParams` checks a name. This module imports neither `params` nor `methods`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from gear.credit import segments as seg


@dataclass(frozen=True)
class Signal:
    """One per-token (N, T) input of the credit core.

    Attributes:
        name: its keyword of `credit_details` and its field of `CreditInputs`.
        teacher: it compares with the teacher shown the ground truth, so a row without one has
            none (`gear.credit.signals.without_teacher` makes it NaN: weight 1).
        signal_pass: the signal pass computes it (`gear.credit.signals`, a `TokenSignals` field).
        mask: a 0/1 mask (bool or 0/1 integers), carried as float 0/1 with the other signals.
        method: a method may read it (`register_method(requires=...)`). `contrast_kl` is not:
            `CreditParams.contrast` asks for it and subtracts it from `kl`.
    """

    name: str
    teacher: bool = False
    signal_pass: bool = False
    mask: bool = False
    method: bool = True


#: the contrast teacher's KL (a teacher shown a wrong answer, `CreditParams.contrast`)
CONTRAST_KL = "contrast_kl"

SIGNAL_SPECS: tuple[Signal, ...] = (
    Signal("kl", teacher=True, signal_pass=True),  # reverse KL(student || teacher)
    Signal("entropy", signal_pass=True),  # the student's entropy
    Signal("student_logprobs", signal_pass=True),  # log pi_S(y_t)
    Signal("teacher_logprobs", teacher=True, signal_pass=True),  # log pi_T(y_t)
    Signal(CONTRAST_KL, method=False),
    Signal("influence"),  # OAR-G, `gear.credit.attribution`
    Signal("perturbation"),  # OAR-P, `gear.credit.attribution.perturbation_influence`
    Signal("error_mask", mask=True),  # a step checker's first wrong step (`first_error`)
    Signal("prefix_count"),  # the group prefix tree (`gear.credit.implicit`, `lambda_grpo`)
)
#: every per-token signal keyword of `credit_details`
CREDIT_SIGNALS = tuple(s.name for s in SIGNAL_SPECS)
#: the signals a method may read (`register_method(requires=...)`)
SIGNALS = tuple(s.name for s in SIGNAL_SPECS if s.method)
#: the signals the signal pass computes: the fields of `gear.credit.signals.TokenSignals`
PASS_SIGNALS = tuple(s.name for s in SIGNAL_SPECS if s.signal_pass)
#: the signals that compare with the teacher (a row without ground truth has no teacher)
TEACHER_SIGNALS = tuple(s.name for s in SIGNAL_SPECS if s.teacher)
#: the signals that are 0/1 masks
MASK_SIGNALS = tuple(s.name for s in SIGNAL_SPECS if s.mask)
#: which rows' signals a method reads: those with a non-zero advantage, or all of them
ROWS = ("advantaged", "all")


@dataclass
class CreditInputs:
    """Validated inputs of one batch, in float64 on one device.

    Attributes:
        advantages: (N,) sequence advantage A_i.
        valid: (N, T) bool response mask.
        kl, entropy, student_logprobs, teacher_logprobs: (N, T) float or None.
        influence: (N, T) float or None, a token's influence on the final answer (OAR-G,
            `gear.credit.attribution`).
        perturbation: (N, T) float or None, how far the final answer moves when the token is
            masked (OAR-P, `gear.credit.attribution.perturbation_influence`).
        error_mask: (N, T) float 0/1 or None, the tokens of each row's first wrong step as a
            step checker marks them (`first_error`; all 0 where it found none).
        prefix_count: (N, T) float or None, how many rows of the row's group share its prefix
            through each token (`gear.credit.implicit.prefix_counts`; `lambda_grpo`).
        answer_mask: (N, T) bool or None, the final answer's tokens in the completion (OAR-G's
            and OAR-P's span; None: each row's last `oar_answer_len` valid tokens).
        turn_starts: (N, T) bool or None.
    """

    advantages: Tensor
    valid: Tensor
    kl: Tensor | None = None
    entropy: Tensor | None = None
    student_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None
    influence: Tensor | None = None
    perturbation: Tensor | None = None
    error_mask: Tensor | None = None
    prefix_count: Tensor | None = None
    answer_mask: Tensor | None = None
    turn_starts: Tensor | None = None

    @cached_property
    def cont_start(self) -> Tensor:
        """(N, T) bool, spec §2.1."""
        return seg.continuation_starts(self.valid, self.turn_starts)

    @cached_property
    def kl_norm(self) -> Tensor:
        """(N, T) normalised KL d~, spec §2.2."""
        assert self.kl is not None
        return seg.minmax_normalise(self.kl, self.valid)

    @cached_property
    def entropy_norm(self) -> Tensor:
        """(N, T) normalised entropy H~, spec §2.2."""
        assert self.entropy is not None
        return seg.minmax_normalise(self.entropy, self.valid)

    @cached_property
    def sign(self) -> Tensor:
        """(N, 1) sigma = sign(A_i)."""
        return torch.sign(self.advantages)[:, None]


@dataclass
class MethodOutput:
    """What a method returns. All (N, T).

    weights: w_t (1 at invalid tokens). source: a_t or None. onsets: bool or None.
    segment_ids: long (-1 = no segment) or None.
    """

    weights: Tensor
    source: Tensor | None = None
    onsets: Tensor | None = None
    segment_ids: Tensor | None = None


#: a credit method: (inputs, `gear.credit.params.CreditParams`) -> output; the params are typed
#: where the methods are written (`gear.credit.methods`), which keeps this module below params
MethodFn = Callable[[CreditInputs, Any], MethodOutput]


@dataclass(frozen=True)
class Method:
    name: str
    fn: MethodFn
    requires: tuple[str, ...]
    rows: str = "all"


METHODS: dict[str, Method] = {}


def register_method(
    name: str, requires: tuple[str, ...] = (), rows: str = "all"
) -> Callable[[MethodFn], MethodFn]:
    """Register `fn` as credit method `name`, reading the signals `requires` of the rows `rows`
    (`ROWS`); a second, different function under one name is an error."""
    unknown = set(requires) - set(SIGNALS)
    if unknown:
        raise ValueError(
            f"register_method({name!r}): unknown signals {sorted(unknown)}; valid: {SIGNALS}"
        )
    if rows not in ROWS:
        raise ValueError(f"register_method({name!r}): rows: expected one of {ROWS}, got {rows!r}")

    def decorator(fn: MethodFn) -> MethodFn:
        old = METHODS.get(name)
        same = old is not None and (old.fn.__module__, old.fn.__qualname__) == (
            fn.__module__,
            fn.__qualname__,
        )
        if old is not None and not same:
            raise ValueError(
                f"credit method {name!r} is already registered to {old.fn.__qualname__}"
            )
        METHODS[name] = Method(name, fn, tuple(requires), rows)
        return fn

    return decorator
