"""Who may write the engine's step state, read from the package's source (no processes).

A unit's step state and the buffers it holds are replaced only by the unit's own methods
(unit.py), the root's per-step fields only by the root's (root.py), and the engine's
attributes on torch objects (``_amsp``) are set only by handle.py. The scan walks every
module's AST for assignments, deletions and ``setattr`` calls that break this; the last
test runs the same scan on mutants to show that it can fail."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "amsp_dtensor"

# The unit's step state (``_step``) and the read-only views of what it holds; the names
# the buffers had before they moved into the state are kept so they cannot come back.
UNIT_OWNED = {"_step", "partial_grad", "synced_grad", "pending_update", "stage_in_flight",
              "grad_accum", "grad_synced", "lifecycle", "residuals"}
# root.RootState's per-step fields (its constructor arguments info/collectives/units/
# frozen_units/grad_stream are set once, where the root is made)
ROOT_OWNED = {"requires_grad_sync", "gradient_divide_factor", "backward", "in_flight",
              "in_forward", "unsynced_micro_batches", "optimizer_bound", "overlap",
              "forward_order", "forward_order_known", "unit_grad_observers", "compression",
              "pipeline_grad_scale"}
UNIT, ROOT, HANDLE = "engine/unit.py", "engine/root.py", "engine/handle.py"
OWNER = {**{name: UNIT for name in UNIT_OWNED}, **{name: ROOT for name in ROOT_OWNED}}


def _written_attributes(tree: ast.AST):
    """(line, attribute name) of every attribute assigned, augmented, annotated or deleted,
    and of every setattr / delattr / object.__setattr__ whose name is a string constant or
    a module-level name bound to one."""
    constants = {t.id: node.value.value for node in getattr(tree, "body", [])
                 if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and (
                        sub is target or isinstance(target, (ast.Tuple, ast.List))):
                    yield node.lineno, sub.attr
        if isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("setattr", "__setattr__", "delattr"):
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value
                elif isinstance(arg, ast.Name) and arg.id in constants:
                    yield node.lineno, constants[arg.id]


def scan(source: str, relpath: str) -> list[str]:
    """Every write in ``source`` (the module at ``relpath`` in the package) that the rules
    above forbid, as 'path:line: why'."""
    name = Path(relpath).as_posix()
    found = []
    for line, attr in _written_attributes(ast.parse(source)):
        owner = OWNER.get(attr)
        if owner is not None and name != owner:
            found.append(f"{relpath}:{line}: writes {attr!r}, which only {owner} may write")
        if attr.startswith("_amsp") and name != HANDLE:
            found.append(f"{relpath}:{line}: sets {attr!r} on an object (only {HANDLE} may)")
    return found


def _package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.read_text(), str(path.relative_to(PACKAGE))


def test_owned_state_is_written_only_by_its_owner():
    found = [line for source, relpath in _package_sources() for line in scan(source, relpath)]
    assert not found, "\n".join(found)


def test_the_root_fields_listed_are_the_root_states():
    """ROOT_OWNED is RootState's fields less those set once at construction."""
    from amsp_dtensor.engine.root import RootState

    constructed = {"info", "collectives", "units", "frozen_units", "grad_stream"}
    assert ROOT_OWNED == {f.name for f in dataclasses.fields(RootState)} - constructed


@pytest.mark.parametrize("relpath,owner,source,why", [
    ("engine/optim.py", UNIT, "unit._step = Idle()\n", "'_step', which only engine/unit.py"),
    ("engine/grad.py", UNIT, "unit.grad_synced += g\n", "'grad_synced', which only engine/unit.py"),
    ("observe/memory.py", UNIT, "a, unit._step = 1, 2\n", "'_step', which only engine/unit.py"),
    ("engine/optim.py", ROOT, "self._root.in_flight = []\n", "'in_flight', which only engine/root.py"),
    ("engine/unit.py", ROOT, "self.root.backward = None\n", "'backward', which only engine/root.py"),
    ("engine/shard.py", HANDLE, "del sub._amsp_state\n", "'_amsp_state' on an object"),
    ("engine/shard.py", HANDLE, "setattr(param, '_amsp_unit_of', unit)\n",
     "'_amsp_unit_of' on an object"),
    ("engine/mesh.py", HANDLE, "_INFO_ATTR = '_amsp_mesh_info'\nsetattr(mesh, _INFO_ATTR, i)\n",
     "'_amsp_mesh_info' on an object"),
])
def test_the_scan_finds_each_kind_of_forbidden_write(relpath, owner, source, why):
    found = scan(source, relpath)
    assert len(found) == 1 and why in found[0], found
    assert scan(source, owner) == []  # the owner may
