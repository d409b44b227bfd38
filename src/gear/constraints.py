"""Value constraints of config fields, declared once next to each field and checked up front.

A `Check` says what values a field takes beyond its type (`learning_rate` >= 0, `temperature`
> 0, `loss_type` one of TRL's losses, ...). gear's own dataclass fields carry theirs in field
metadata (`metadata={"help": ..., "check": Check(ge=1)}`; the settings TRL and verl share are
declared once, in `gear.settings`); fields inherited from TRL's `GRPOConfig` get theirs from a
table in `gear.integrations.trl.config`. `gear train` checks every key it is given before it
loads a model or writes a file (`gear.app.config.resolve_config`); `check_fields` checks every
field of `GEARConfig` and of verl's `gear:` section when one is made, so the Python API and a
verl launch refuse the same values with the same message.

Plain dataclasses, no validation library: the checks are a handful of bounds and value sets,
and gear's type checks (YAML-specific lossless conversions, `gear.app.config.check_value`) stay as
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
    """What values a field accepts: bounds (`ge`, `gt`, `le`, `lt`), whole numbers only
    (`integer`), a set of `choices`, or a `test` with its description `expect`; `also`: extra
    accepted values (e.g. `None`, or HF's `-1` meaning "not set"). A field's type is checked
    elsewhere (`gear.app.config.check_value`), except that `integer` refuses 2.5 where no such check
    runs (the Python API, a verl config)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = False
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
        if all(b is None for b in bounds) and not self.integer:
            return True
        if isinstance(value, bool) or not isinstance(value, int if self.integer else int | float):
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
            what = "an integer" if self.integer else "a value"
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
                text = f"{what} in {left}{_num(lo)}, {_num(hi)}{right}"
            else:
                text = f"{what} {low or high}" if low or high else what
        if self.also:
            text += " or " + " or ".join("null" if a is None else repr(a) for a in self.also)
        return text


def checked(default: Any, help: str, check: Check) -> Any:
    """A dataclass field with a default, its help and its `Check` (in the field's metadata)."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check})


def field_checks(cls: type) -> dict[str, Check]:
    """The `Check` in each field's metadata (`metadata={"check": ...}`) of dataclass `cls`."""
    return {
        f.name: f.metadata["check"]
        for f in dataclasses.fields(cls)
        if isinstance(f.metadata.get("check"), Check)
    }


def check_field(
    owner: str, name: str, value: Any, check: Check | None, error: type[ValueError] = ValueError
) -> None:
    """An `error` naming the field, the value and what was expected, when `check` refuses."""
    if check is not None and not check.ok(value):
        raise error(f"{owner}.{name}: got {value!r}, expected {check.describe()}")


def check_fields(
    owner: str, obj: Any, checks: dict[str, Check], error: type[ValueError] = ValueError
) -> None:
    """`check_field` on every attribute of `obj` named in `checks`, in their order: the one
    validation of TRL's `GEARConfig` and of verl's `gear:` section."""
    for name, check in checks.items():
        check_field(owner, name, getattr(obj, name), check, error)
