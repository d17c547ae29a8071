"""The engine's one handle on each torch object it touches.

FSDP2 keeps one state object per module (``@contract``'s registry); the engine does the
same with one attribute, ``_amsp``, set only here: on a module, a ``ModuleHandle`` (the
unit it belongs to, or the root state when it is the root); on a parameter, the unit that
owns it; on a DeviceMesh from ``amsp.init_mesh``, its MeshInfo.

[Note: handles live on the objects] DeviceMesh compares and hashes by value (device type,
ranks, dim names), so a registry keyed by mesh would mix up two init_mesh calls with the
same plan and could drop one's info when the other is collected; and FSDP2 replaces a
module's Parameters with its sharded ones, so a registry keyed by parameter would need
updating wherever it does. An attribute is keyed by identity and lives as long as the
object. torch.compile's OptimizedModule forwards attribute reads to the module it wraps,
so a handle set on a block is also found through its wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

# (The types named in quotes are mesh.MeshInfo, root.RootState and unit.AMSPUnit; not
# imported: every one of those modules reaches the handle.)
_ATTR = "_amsp"


@dataclass(eq=False)
class ModuleHandle:
    unit: "AMSPUnit | None" = None  # the unit this module is (one of) the modules of
    root: "RootState | None" = None  # set while the module is the root of its units
    root_hooks: list = field(default_factory=list)  # the root's hook handles
    lands_on_state_dict: bool = False  # state_dict pre-hooks that land updates are set


def _module_handle(module: nn.Module, create: bool = False) -> ModuleHandle | None:
    handle = getattr(module, _ATTR, None)
    if handle is None and create:
        handle = ModuleHandle()
        setattr(module, _ATTR, handle)
    return handle


def unit_of(module: nn.Module) -> "AMSPUnit | None":
    handle = _module_handle(module)
    return handle.unit if handle is not None else None


def set_unit(module: nn.Module, unit: "AMSPUnit") -> None:
    _module_handle(module, create=True).unit = unit


def root_of(module: nn.Module) -> "RootState | None":
    handle = _module_handle(module)
    return handle.root if handle is not None else None


def is_sharded(module: nn.Module) -> bool:
    """A unit's module or a root already."""
    return unit_of(module) is not None or root_of(module) is not None


def set_root(module: nn.Module, root: "RootState", hooks: list) -> None:
    handle = _module_handle(module, create=True)
    handle.root, handle.root_hooks = root, hooks


def clear_root(module: nn.Module) -> None:
    """A former root (a block sharded before its parent) is a root no more."""
    handle = _module_handle(module)
    if handle is None or handle.root is None:
        return
    for hook in handle.root_hooks:
        hook.remove()
    handle.root, handle.root_hooks = None, []


def mark_lands_on_state_dict(module: nn.Module) -> bool:
    """True the first time for ``module`` (its state_dict hooks are to be registered)."""
    handle = _module_handle(module, create=True)
    first = not handle.lands_on_state_dict
    handle.lands_on_state_dict = True
    return first


def param_owner(param) -> "AMSPUnit | None":
    return getattr(param, _ATTR, None)


def set_param_owner(param, unit: "AMSPUnit") -> None:
    setattr(param, _ATTR, unit)


def mesh_info_of(mesh) -> "MeshInfo | None":
    return getattr(mesh, _ATTR, None)


def set_mesh_info(mesh, info: "MeshInfo") -> None:
    setattr(mesh, _ATTR, info)


def root_state(module: nn.Module) -> "RootState":
    """The root state of an AMSP root (the module ``amsp.fully_shard`` was last called on)."""
    root = root_of(module)
    if root is None:
        raise ValueError(
            f"{type(module).__name__} is not an AMSP root: call amsp.fully_shard on each "
            "block and then on the root model, and pass the root here"
        )
    return root
