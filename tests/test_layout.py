"""The package's layout, read from its source (no imports run): the dependencies that
show the architecture hold, and there is no import cycle.

- ``engine/`` (what runs in a step) imports neither torchtitan, nor the integration
  (``titan/``), nor the cost model (``plan/cost/``);
- ``plan/cost/`` (the pure model) imports nothing of the engine;
- no module-level import cycle anywhere in the package.
Module-level imports only: an import inside a function runs when it is called."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "amsp_dtensor"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """Modules ``name`` imports at module level (absolute names; a ``from x import y``
    of a submodule y counts as y, not x)."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(module)
    return found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: modules it imports}; ``sources``: {module: (source, is_package)}."""
    modules = set(sources)
    return {name: module_imports(src, name, pkg, modules) - {name}
            for name, (src, pkg) in sources.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles among the graph's own modules."""
    state, stack, found = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for other in sorted(graph[module] & graph.keys()):
            if state.get(other) == "open":
                found.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def _package_graph():
    sources = {_name(p): (p.read_text(), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")}
    return import_graph(sources)


def _imports_of(graph, prefix):
    return {m: graph[m] for m in graph if m == prefix or m.startswith(prefix + ".")}


def _outside_rule(graph, prefix, forbidden):
    return sorted(f"{m} imports {i}" for m, imports in _imports_of(graph, prefix).items()
                  for i in imports if any(i == f or i.startswith(f + ".") for f in forbidden))


def test_no_import_cycle():
    assert cycles(_package_graph()) == []


def test_the_engine_imports_no_integration_and_no_cost_model():
    graph = _package_graph()
    assert _imports_of(graph, "amsp_dtensor.engine"), "no engine modules found"
    assert _outside_rule(graph, "amsp_dtensor.engine",
                         ["torchtitan", "amsp_dtensor.titan", "amsp_dtensor.plan.cost"]) == []


def test_the_cost_model_imports_no_engine():
    graph = _package_graph()
    assert _imports_of(graph, "amsp_dtensor.plan.cost"), "no cost modules found"
    assert _outside_rule(graph, "amsp_dtensor.plan.cost",
                         ["amsp_dtensor.engine", "amsp_dtensor.titan", "torchtitan"]) == []


def test_the_checks_can_fail():
    """A cycle, and a rule broken by one line, are found."""
    sources = {"pkg": ("", True),
               "pkg.a": ("from . import b\n", False),
               "pkg.b": ("from .c import x\n", False),
               "pkg.c": ("import pkg.a\n", False)}
    assert cycles(import_graph(sources)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    graph = {"amsp_dtensor.engine.grad": {"amsp_dtensor.titan.trainer", "torch"}}
    assert _outside_rule(graph, "amsp_dtensor.engine", ["amsp_dtensor.titan"]) == [
        "amsp_dtensor.engine.grad imports amsp_dtensor.titan.trainer"]
