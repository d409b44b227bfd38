"""The layout's rule (issue 68): the program is `gear.app`, and no component imports it.

Every module under src/gear outside gear/app is read with `ast`; every import it holds counts,
at the top or inside a function, under TYPE_CHECKING or not: none may name `gear.app` (or an
old path of a module that moved into it, `gear._moved.MOVED_MODULES`). The studies, the
benchmarks and the scripts may import the application; they are not under src/gear.
"""

from __future__ import annotations

import ast
from pathlib import Path

from gear._moved import MOVED_MODULES

SRC = Path(__file__).resolve().parents[2] / "src"
APP = SRC / "gear" / "app"


def imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`: `from a import b` names `a` and `a.b`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def is_application(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in ("gear.app", *MOVED_MODULES))


def test_no_component_imports_the_application():
    components = [p for p in sorted((SRC / "gear").rglob("*.py")) if APP not in p.parents]
    assert len(components) > 50  # the walk found the package
    offending = [
        f"{path.relative_to(SRC)}:{line}: {module}"
        for path in components
        for line, module in imported_modules(ast.parse(path.read_text(), str(path)))
        if is_application(module)
    ]
    assert offending == []


def test_the_rule_sees_a_function_local_import_of_the_application():
    tree = ast.parse("def f():\n    from gear.app.config import RunConfig\n    import gear.cli\n")
    assert [m for _, m in imported_modules(tree) if is_application(m)] == [
        "gear.app.config",
        "gear.app.config.RunConfig",
        "gear.cli",
    ]
    assert not is_application("gear.application") and not is_application("gear.credit")


ROOT = SRC.parent


def layout_table(path: Path) -> list[str]:
    """The rows of the table under the `## Layout` heading of `path`."""
    section = path.read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|")]


def test_readme_and_contracts_show_one_layout_table_naming_every_module():
    table = layout_table(ROOT / "README.md")
    assert table == layout_table(ROOT / "docs" / "contracts.md")
    text = "\n".join(table)
    top = {p.stem for p in (SRC / "gear").glob("*.py")} | {
        p.name for p in (SRC / "gear").iterdir() if (p / "__init__.py").is_file()
    }
    for name in sorted(top - {"__init__", "_moved"}):
        assert f"`gear.{name}`" in text, name
    for path in APP.iterdir():
        if path.name.startswith("_") or path.name == "__pycache__":
            continue
        assert f"`{path.stem}" in text, path.name  # `compare/`, `configs/`, `cli`, ...
