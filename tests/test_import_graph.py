"""No import circle: the modules under src/gear, read with `ast`, import each other without a cycle.

An edge is an import a module runs when it is imported: a top-level statement (inside `if`,
`try` and `with` blocks too), not one inside a function or under `if TYPE_CHECKING:`. In the
credit core a function's local import and a type checker's import count too: a circle hidden
in a function or behind TYPE_CHECKING is still one.
`from a.b import c` is an edge to `a.b.c` where that is a module, else to `a.b`. Python imports
a module's parent package first; that implicit edge is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the `gear` package."""
    out = {}
    for path in sorted((SRC / "gear").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, local: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs on import (none under TYPE_CHECKING); with `local`
    also those inside its functions and classes and those under TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If):
                if local or not _is_type_checking(node.test):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody):
                    walk(block)
                for handler in node.handlers:
                    walk(handler.body)
            elif isinstance(node, ast.With | ast.For | ast.While) or (
                local and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            ):
                walk(node.body)

    walk(tree.body)
    return found


def import_graph(local: bool = False) -> dict[str, set[str]]:
    """Module -> the `gear` modules it imports at module level (`local`: anywhere)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)), local):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_finds_a_circle_and_passes_a_chain():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_the_credit_core_imports():
    graph = import_graph()
    assert "gear.credit.registry" in graph["gear.credit.methods"]
    assert "gear.credit.registry" in graph["gear.credit.params"]
    # a local import is an edge of the local graph only
    assert "gear.credit.fold" in import_graph(local=True)["gear.credit.signals"]
    assert "gear.credit.fold" not in graph["gear.credit.signals"]


def test_no_import_cycle_in_the_credit_core_even_through_a_local_or_type_only_import():
    graph = import_graph(local=True)
    credit = {
        k: {v for v in vs if v.startswith("gear.credit")}
        for k, vs in graph.items()
        if k.startswith("gear.credit")
    }
    assert cycles(credit) == []


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph()) == []
