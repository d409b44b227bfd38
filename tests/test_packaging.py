"""The recipes `gear train` needs ship in the package (so a wheel installed anywhere finds them),
and every shipped recipe passes the strict config checks. scripts/check_wheel.sh (run by CI)
goes further: it installs the wheel in a fresh venv and runs `gear train --dry-run` elsewhere."""

from __future__ import annotations

import fnmatch
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import gear
from gear.run import CONFIG_DIR, config_path, recipe_names, resolve_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(gear.__file__).resolve().parent


def test_recipes_live_in_the_package_and_resolve_by_name():
    assert CONFIG_DIR == PACKAGE / "configs"
    assert {"default", "study"} <= set(recipe_names())
    for name in recipe_names():
        assert config_path(name).parent == CONFIG_DIR
        cfg = resolve_config(name)  # every value checked against its field's type
        assert cfg.trainer["bf16"] == "auto"
    with pytest.raises(
        ValueError, match=r"not one of gear's recipes: \['default', 'paper', 'study'"
    ):
        config_path("nope")


def test_package_data_patterns_cover_every_recipe():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["gear"]
    for recipe in CONFIG_DIR.iterdir():
        relative = recipe.relative_to(PACKAGE).as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative


def _setuptools_77() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 77


@pytest.mark.skipif(not _setuptools_77(), reason="needs setuptools>=77 in the venv (no download)")
def test_the_wheel_contains_the_recipes_and_gear_testing(tmp_path):
    # build from a copy: no build/ left in the checkout, no stale build/lib file in the wheel
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", "pyproject.toml", "README.md", "src"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    tree = tmp_path / "tree"
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(tree)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("gear_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in recipe_names():
        assert f"gear/configs/{recipe}.yaml" in names
    assert "gear/testing.py" in names and "gear/precision.py" in names
