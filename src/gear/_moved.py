"""Names and modules that moved keep their old import for a while, with a warning.

A name: `moved` makes a module-level `__getattr__` that finds it in its new module. A module:
`MOVED_MODULES` maps its old path to its new one (issue 68 put the program in `gear.app`), and
`SPLIT_MODULES` the names of a module split in two (`gear.inputs`: `gear.io` and
`gear.app.rundir`);
`gear/__init__.py` installs `MovedModules`, so `import gear.cli` gives the module `gear.app.cli`
itself (the same object: a test that patches `gear.run.train` patches `gear.app.train.train`)
with a DeprecationWarning naming the new path, and `python -m gear.cli` runs `gear.app.cli`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

#: old module path -> its new one (one release: a DeprecationWarning names the new path)
MOVED_MODULES = {
    "gear.cli": "gear.app.cli",
    "gear.config": "gear.app.config",
    "gear.run": "gear.app.train",
    "gear.run_callbacks": "gear.app.callbacks",
    "gear.evaluate": "gear.app.evaluate",
    "gear.sampling": "gear.app.sampling",
    "gear.suite": "gear.app.suite",
    "gear.precision": "gear.app.precision",
    "gear.threads": "gear.app.threads",
    "gear.compare": "gear.app.compare",
}

#: an old module split in two: old path -> {name: the module it moved to}. `import gear.inputs`
#: gives a module of its own whose names each come from their new home, with a warning.
_IO = """InputError read_text read_yaml read_json SAFETENSORS_MAX_HEADER check_safetensors
check_torch_file WEIGHT_FILES WEIGHT_INDEXES check_model_files"""
_RUNDIR = """CHECKPOINT checkpoints check_checkpoint checkpoint_problem newest_complete
resume_checkpoint is_run_dir run_config_file _step_of unfinished_note evaluation_target"""
SPLIT_MODULES = {
    "gear.inputs": dict.fromkeys(_IO.split(), "gear.io")
    | dict.fromkeys(_RUNDIR.split(), "gear.app.rundir"),
}


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


def _warn(old: str) -> None:
    new = MOVED_MODULES.get(old) or " and ".join(sorted(set(SPLIT_MODULES[old].values())))
    warnings.warn(f"{old} moved to {new}: import {new}", DeprecationWarning, stacklevel=3)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import system's finder and loader of `MOVED_MODULES` (an old path is the new module)
    and `SPLIT_MODULES` (an old path is a module whose names come from their new homes)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name in SPLIT_MODULES:
            return importlib.util.spec_from_loader(name, self)
        new = MOVED_MODULES.get(name)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        # the new file as origin: `python -m gear.cli` runs it with its own __file__
        return importlib.util.spec_from_loader(
            name, self, origin=real.origin, is_package=real.submodule_search_locations is not None
        )

    def create_module(self, spec: Any) -> ModuleType:
        _warn(spec.name)
        if spec.name in SPLIT_MODULES:
            split = ModuleType(spec.name, f"{spec.name}: moved (`gear._moved.SPLIT_MODULES`)")
            split.__getattr__ = moved(spec.name, SPLIT_MODULES[spec.name])  # type: ignore[method-assign]
            spec.loader_state = None
            return split
        module = importlib.import_module(MOVED_MODULES[spec.name])
        spec.loader_state = module.__spec__  # the import system sets __spec__: put it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__.loader_state is not None:  # executed already, under its new path
            module.__spec__ = module.__spec__.loader_state

    def get_code(self, name: str) -> CodeType | None:
        """For `python -m OLD`: the new module's code (runpy runs it as __main__)."""
        _warn(name)
        real = importlib.util.find_spec(MOVED_MODULES[name])
        return real.loader.get_code(real.name)


def install() -> None:
    """Put `MovedModules` on the import path (once)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
