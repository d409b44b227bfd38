"""Names that moved to another module keep their old import for a while, with a warning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(old: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for module `old`: a name in `homes` (name -> the module it
    moved to) is returned from its new home with a DeprecationWarning that names the new import;
    any other name is an AttributeError, as without it."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(
            f"{old}.{name} moved to {home}: import it as `from {home} import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__
