"""The package's layout, read from its source (no imports run): no import cycle, and
the dependencies that show the architecture hold.

- ``engine/`` (what runs in a step) imports neither torchtitan, nor the integration
  (``titan/``), nor the cost model (``plan/cost/``), nor the reports (``observe/``, which
  read the engine; the recorder the engine emits into is its own);
- ``plan/cost/`` (the pure model) imports nothing of the engine or the integration;
- ``plan/`` (the plan and the cost model, the lowest floor) imports nothing of the package
  outside ``plan/``, nor torchtitan: the commands that drive the engine live in
  ``harness/``, and plan/'s entries for them import nothing;
- the two torchtitan integrations stay apart: ``titan/v03/`` (torchtitan 0.3) imports none
  of ``titan/``'s 0.2.2-only modules (they import 0.2.2's names at module level), and
  nothing under ``titan/`` outside ``v03/`` imports ``v03/``; both share ``titan/``'s
  version-neutral modules (plan checks, units, optimizer state, step).

Imports inside functions count (a function-level import that only hides a cycle or a
layering break is still one), and so does the subpackage ``__init__`` that importing one
of its modules runs first (``from .engine.recorder import x`` runs engine/__init__.py).
The top package's ``__init__`` is the public entry point that imports everything, so it
is not counted as such an edge."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "amsp_dtensor"


def _absolute(node: ast.ImportFrom, package: str) -> str | None:
    if node.level == 0:
        return node.module
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(trees: dict[str, tuple[ast.Module, bool]], prefixes=("amsp_dtensor",)):
    """{module: the modules it imports (those starting with ``prefixes``)};
    ``trees``: {module name: (parsed source, is a package __init__)}."""
    graph = {}
    for name, (tree, is_package) in trees.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                if base and base.startswith(prefixes):
                    if node.module:  # "from .x import y": x (y may be a submodule too)
                        deps.add(base)
                    deps.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith(prefixes))
        # importing a.b.c runs a.b's __init__ first (below the top package, and unless
        # a.b is this module's own package, whose __init__ is already running)
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        deps.update(p for d in list(deps) for i in range(2, d.count(".") + 1)
                    if (p := ".".join(d.split(".")[:i])) not in own_packages)
        graph[name] = deps
    return graph


def find_cycle(graph) -> list[str] | None:
    inside = {k: {d for d in v if d in graph and d != k} for k, v in graph.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(inside[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(inside):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def breaks(graph, prefix: str, forbidden: list[str]) -> list[str]:
    """'<module> imports <name>' for each import of a ``forbidden`` name by a module
    under ``prefix``."""
    return sorted(f"{m} imports {d}" for m, deps in graph.items()
                  if m == prefix or m.startswith(prefix + ".")
                  for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))


def _package_graph(package_dir: Path = PACKAGE):
    trees = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        trees[name] = (ast.parse(path.read_text()), rel.name == "__init__")
    return import_graph(trees, prefixes=("amsp_dtensor", "torchtitan"))


def test_no_import_cycle_inside_the_package():
    cycle = find_cycle(_package_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_engine_imports_no_integration_no_cost_model_and_no_report():
    graph = _package_graph()
    assert any(m.startswith("amsp_dtensor.engine.") for m in graph), "no engine modules found"
    assert breaks(graph, "amsp_dtensor.engine",
                  ["torchtitan", "amsp_dtensor.titan", "amsp_dtensor.plan.cost",
                   "amsp_dtensor.observe"]) == []


def test_the_cost_model_imports_no_engine():
    graph = _package_graph()
    assert any(m.startswith("amsp_dtensor.plan.cost.") for m in graph), "no cost modules found"
    assert breaks(graph, "amsp_dtensor.plan.cost",
                  ["amsp_dtensor.engine", "amsp_dtensor.titan", "torchtitan"]) == []


def plan_breaks(package_dir: Path = PACKAGE) -> list[str]:
    """Imports of ``amsp_dtensor/plan/`` (under ``package_dir``) that leave the plan: any
    amsp_dtensor module outside amsp_dtensor.plan (the package root included), or
    torchtitan."""
    graph = _package_graph(package_dir)
    assert any(m.startswith("amsp_dtensor.plan.") for m in graph), "no plan modules found"
    return sorted(line for line in breaks(graph, "amsp_dtensor.plan", ["amsp_dtensor", "torchtitan"])
                  if not _inside_plan(line.rsplit(" imports ", 1)[1]))


def _inside_plan(name: str) -> bool:
    return name == "amsp_dtensor.plan" or name.startswith("amsp_dtensor.plan.")


def test_the_plan_imports_nothing_above_it():
    assert plan_breaks() == []


TITAN_022_ONLY = ["amsp_dtensor.titan._v022", "amsp_dtensor.titan.specs",
                  "amsp_dtensor.titan.parallelize", "amsp_dtensor.titan.optimizer",
                  "amsp_dtensor.titan.trainer", "amsp_dtensor.titan.dataloader"]


def test_the_two_torchtitan_integrations_stay_apart():
    graph = _package_graph()
    assert any(m.startswith("amsp_dtensor.titan.v03.") for m in graph), "no v03 modules found"
    assert breaks(graph, "amsp_dtensor.titan.v03", TITAN_022_ONLY) == []
    shared = {m: deps for m, deps in graph.items() if not m.startswith("amsp_dtensor.titan.v03")}
    assert breaks(shared, "amsp_dtensor.titan", ["amsp_dtensor.titan.v03"]) == []


def test_the_checks_can_fail():
    """A cycle through a function-level import, and a rule broken by one import inside a
    function, are found."""
    parse = ast.parse
    trees = {"pkg": (parse(""), True),
             "pkg.a": (parse("from . import b\n"), False),
             "pkg.b": (parse("from .c import x\n"), False),
             "pkg.c": (parse("def f():\n    import pkg.a\n"), False)}
    assert find_cycle(import_graph(trees, prefixes=("pkg",))) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    trees = {"amsp_dtensor.engine": (parse(""), True),
             "amsp_dtensor.engine.grad": (parse("def f():\n    from ..titan import trainer\n"), False)}
    graph = import_graph(trees)
    assert breaks(graph, "amsp_dtensor.engine", ["amsp_dtensor.titan"]) == [
        "amsp_dtensor.engine.grad imports amsp_dtensor.titan",
        "amsp_dtensor.engine.grad imports amsp_dtensor.titan.trainer"]
    trees = {"amsp_dtensor.plan": (parse(""), True),
             "amsp_dtensor.plan.profile": (parse("from .. import compat\n"), False),
             "amsp_dtensor.plan.simulate": (parse("def f():\n    import amsp_dtensor as amsp\n"
                                                  "    from torchtitan.models import llama3\n"
                                                  "    from amsp_dtensor.plan import cost\n"), False)}
    graph = import_graph(trees, prefixes=("amsp_dtensor", "torchtitan"))
    left = [line for line in breaks(graph, "amsp_dtensor.plan", ["amsp_dtensor", "torchtitan"])
            if not _inside_plan(line.rsplit(" imports ", 1)[1])]
    assert left == ["amsp_dtensor.plan.profile imports amsp_dtensor.compat",
                    "amsp_dtensor.plan.simulate imports amsp_dtensor",
                    "amsp_dtensor.plan.simulate imports torchtitan.models",
                    "amsp_dtensor.plan.simulate imports torchtitan.models.llama3"]
