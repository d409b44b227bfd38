"""Value constraints of config fields, declared once next to each field and checked up front.

A `Check` says what values a field takes beyond its type (`learning_rate` >= 0, `temperature`
> 0, `loss_type` one of TRL's losses, ...). gear's own dataclass fields carry theirs in field
metadata (`metadata={"help": ..., "check": Check(ge=1)}`); fields inherited from TRL's
`GRPOConfig` get theirs from a table in `gear.integrations.trl.config`. `gear train` checks
every key it is given before it loads a model or writes a file (`gear.run.resolve_config`), and
`GEARConfig.__post_init__` checks every field, so the Python API refuses the same values.

Plain dataclasses, no validation library: the checks are a handful of bounds and value sets,
and gear's type checks (YAML-specific lossless conversions, `gear.run.check_value`) stay as
they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


@dataclass(frozen=True)
class Check:
    """What values a field accepts: bounds (`ge`, `gt`, `le`, `lt`), a set of `choices`, or a
    `test` with its description `expect`; `also`: extra accepted values (e.g. `None`, or HF's
    `-1` meaning "not set"). A field's type is checked elsewhere."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    also: tuple[Any, ...] = ()
    test: Callable[[Any], bool] | None = None
    expect: str = ""

    def ok(self, value: Any) -> bool:
        if any(value is a or (value == a and type(value) is type(a)) for a in self.also):
            return True
        if self.choices is not None and value not in self.choices:
            return False
        if self.test is not None:
            try:
                return bool(self.test(value))
            except Exception:
                return False
        bounds = (self.ge, self.gt, self.le, self.lt)
        if all(b is None for b in bounds):
            return True
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if not math.isfinite(value):
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def describe(self) -> str:
        """What is expected, in words: 'a value > 0', 'one of 'grpo', 'dapo'', ..."""
        if self.expect:
            text = self.expect
        elif self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            low = (f">= {_num(self.ge)}" if self.ge is not None else None) or (
                f"> {_num(self.gt)}" if self.gt is not None else None
            )
            high = (f"<= {_num(self.le)}" if self.le is not None else None) or (
                f"< {_num(self.lt)}" if self.lt is not None else None
            )
            if low and high:
                left = "[" if self.ge is not None else "("
                right = "]" if self.le is not None else ")"
                lo = self.ge if self.ge is not None else self.gt
                hi = self.le if self.le is not None else self.lt
                text = f"a value in {left}{_num(lo)}, {_num(hi)}{right}"
            else:
                text = f"a value {low or high}"
        if self.also:
            text += " or " + " or ".join("null" if a is None else repr(a) for a in self.also)
        return text


def field_checks(cls: type) -> dict[str, Check]:
    """The `Check` in each field's metadata (`metadata={"check": ...}`) of dataclass `cls`."""
    return {
        f.name: f.metadata["check"]
        for f in dataclasses.fields(cls)
        if isinstance(f.metadata.get("check"), Check)
    }


def check_field(owner: str, name: str, value: Any, check: Check | None) -> None:
    """A ValueError naming the field, the value and what was expected, when `check` refuses."""
    if check is not None and not check.ok(value):
        raise ValueError(f"{owner}.{name}: got {value!r}, expected {check.describe()}")
