"""Modules that moved (issue 68: the program into `gear.app`, `gear.inputs` split into `gear.io`
and `gear.app.rundir`) keep their old paths for one release (`gear._moved`): each old path
imports, warns with its new path, and is the new module itself, so a patch through the old
path patches the code that runs. The repository's own code imports the new paths only."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from gear._moved import MOVED_MODULES, SPLIT_MODULES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_MODULES.items()))
def test_an_old_module_path_imports_warns_and_is_the_new_module(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported afresh: it warns again
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}: import {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # its own spec, kept


def test_a_patch_through_an_old_path_patches_the_new_module(monkeypatch):
    import gear.app.train

    monkeypatch.setattr("gear.run.train", "patched")
    assert gear.app.train.train == "patched"


@pytest.mark.parametrize(
    ("name", "home"), sorted(SPLIT_MODULES["gear.inputs"].items()), ids=lambda x: x
)
def test_a_name_of_the_split_inputs_module_comes_from_its_new_home(name, home):
    module = importlib.import_module("gear.inputs")
    with pytest.warns(DeprecationWarning, match=f"import it as `from {home} import {name}`"):
        got = getattr(module, name)
    assert got is getattr(importlib.import_module(home), name)


def test_python_dash_m_an_old_cli_path_runs_the_cli():
    done = subprocess.run(
        [sys.executable, "-m", "gear.cli", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "train" in done.stdout and "compare" in done.stdout


def _old_imports(path: Path) -> list[str]:
    old = set(MOVED_MODULES) | set(SPLIT_MODULES)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n in old]
    return found


def test_the_repository_imports_the_new_paths():
    # this module's own tests of the old paths are left as they are
    skip = {"tests/test_moved.py", "tests/test_moved_names.py"}
    files = [
        p
        for folder in ("src", "tests", "studies", "benchmarks", "scripts")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if str(p.relative_to(ROOT)) not in skip and "results" not in p.parts
    ]
    assert [line for p in files for line in _old_imports(p)] == []
