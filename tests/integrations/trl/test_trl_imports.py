"""The TRL integration's modules depend on each other in one direction: `trainer.py` wires the
others and is the only one that knows `GEARTrainer` (issue 22). Read from the source (ast), so
imports under `TYPE_CHECKING` and inside functions count too."""

import ast
from pathlib import Path

import gear.integrations.trl as package

PACKAGE = "gear.integrations.trl"
ROOT = Path(package.__file__).parent


def _trees() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in sorted(ROOT.glob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """The package's modules a module imports (`from gear.integrations.trl.x import ...`,
    `import gear.integrations.trl.x`, `from gear.integrations.trl import x`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PACKAGE + "."):
                found.add(node.module.split(".")[3])
            elif node.module == PACKAGE:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(
                a.name.split(".")[3] for a in node.names if a.name.startswith(PACKAGE + ".")
            )
    return found


def _graph() -> dict[str, set[str]]:
    trees = _trees()
    return {name: _imports(tree) & set(trees) - {name} for name, tree in trees.items()}


def _names_gear_trainer(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "GEARTrainer":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "GEARTrainer":
            return True
        if isinstance(node, ast.alias) and node.name.split(".")[-1] == "GEARTrainer":
            return True
        if isinstance(node, ast.Constant) and node.value == "GEARTrainer":  # "GEARTrainer" hint
            return True
    return False


def test_the_trl_package_imports_form_no_cycle():
    graph = _graph()
    assert graph["trainer"], "the ast walk found no import at all"
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise AssertionError(f"import cycle in {PACKAGE}: {cycle}")
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        done.add(name)

    for module in graph:
        visit(module, [])


def test_only_the_trainer_module_knows_gear_trainer():
    trees = _trees()
    knowing = sorted(
        name for name, tree in trees.items() if name != "__init__" and _names_gear_trainer(tree)
    )
    assert knowing == ["trainer"]
    importers = sorted(n for n, targets in _graph().items() if "trainer" in targets)
    assert importers == ["__init__"]  # the package's public face re-exports it, nothing else
