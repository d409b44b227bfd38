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
from gear.app.config import CONFIG_DIR, config_path, recipe_names, resolve_config

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(gear.__file__).resolve().parent


def test_recipes_live_in_the_package_and_resolve_by_name():
    assert CONFIG_DIR == PACKAGE / "app" / "configs"
    assert {"default", "study"} <= set(recipe_names())
    for name in recipe_names():
        assert config_path(name).parent == CONFIG_DIR
        cfg = resolve_config(name)  # every value checked against its field's type
        assert cfg.trainer["bf16"] == "auto"
    with pytest.raises(
        ValueError,
        match=r"not one of gear's recipes: \['default', 'departure', 'paper', 'qwen3_4b_math', 'study'",
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
def test_the_wheel_holds_the_recipes_and_gear_testing_and_only_gear(tmp_path):
    # build from a copy: no build/ left in the checkout, no stale build/lib file in the wheel
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", "pyproject.toml", "README.md", "src"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    files += ["studies/__init__.py", "benchmarks/__init__.py"]  # packages that must not ship
    tree = tmp_path / "tree"
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(tree)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("gear_rl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in recipe_names():
        assert f"gear/app/configs/{recipe}.yaml" in names
    assert "gear/testing.py" in names and "gear/app/precision.py" in names
    # only gear ships: the studies and benchmarks are run from a checkout
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"gear"}


def test_a_recipe_extends_another_key_by_key(tmp_path):
    default, departure = resolve_config("default"), resolve_config("departure")
    assert default.trainer["credit_method"] == "gear"  # the paper's GEAR (issue 35)
    assert departure.trainer["credit_method"] == "gear_departure_blame"
    assert departure.trainer["kl_estimator"] == "k1"
    # everything else is the default's, trainer keys included
    assert departure.lora_r == default.lora_r and departure.eval_n == default.eval_n
    assert departure.trainer["learning_rate"] == default.trainer["learning_rate"]
    assert resolve_config("paper") == default
    (tmp_path / "a.yaml").write_text("extends: b.yaml\nseed: 3\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ValueError, match="circle"):
        resolve_config(str(tmp_path / "a.yaml"))
    (tmp_path / "b.yaml").write_text("extends: default\ntrainer: {max_steps: 2}\n")
    mine = resolve_config(str(tmp_path / "a.yaml"))  # b.yaml found beside a.yaml
    assert mine.seed == 3 and mine.trainer["max_steps"] == 2 and mine.lora_r == default.lora_r
