"""Per-unit and per-model engine state (the counterpart of FSDP2's _fsdp_state).

A *unit* is one module passed to ``amsp.fully_shard`` with the parameters it owns (those
not owned by a unit below it). The *model state* is shared by all units under the module
``fully_shard`` was last called on (the root): the no_sync flag, the divide factor and
the queue of in-flight gradient collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .collectives import Collectives, PendingComm
from .layouts import FlatLayout
from .mesh import MeshInfo


@dataclass
class AMSPUnit:
    module: nn.Module
    fqn: str  # for messages; set when the root is known
    info: MeshInfo
    own_params: list[nn.Parameter] | None  # s_p = 1 units; FSDP units read FSDP's (below)
    uses_fsdp: bool  # False when s_p == 1: plain params, our own hooks, no FSDP copy
    global_shapes: list[torch.Size]
    p_layout: FlatLayout  # this rank's P rows of each param (FSDP's padded shard layout)
    g_layout: FlatLayout  # this rank's G rows (P rows split over the "g" dim)
    os_layout: FlatLayout  # this rank's OS rows (P rows split over the OS subgroup)
    state: "AMSPState | None" = None
    # gradient path
    grad_accum: torch.Tensor | None = None  # g_layout flat; partial sums this step
    grad_synced: torch.Tensor | None = None  # os_layout flat; reduced over all ranks
    grads_seen: int = 0  # params of a non-FSDP unit whose grad arrived this backward
    fired: bool = False  # got its gradients in the current backward
    # optimizer-state path
    pending_param_update: "tuple[PendingComm, object] | None" = None

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's params in the order of the flat gradient buffers. For FSDP units,
        FSDP's sharded params, read each time: materialising a meta model (to_empty)
        lets FSDP swap them."""
        if self.uses_fsdp:
            group = self.module._get_fsdp_state()._fsdp_param_group
            return [fp.sharded_param for fp in group.fsdp_params]
        return self.own_params

    def refresh_params(self) -> bool:
        """For s_p = 1 units: pick up Parameter objects that ``module.to_empty`` (materialising
        a meta model) may have replaced. Returns True if any changed (hooks need re-adding)."""
        if self.uses_fsdp:
            return False
        current = [self.module.get_parameter(name) for name in self.param_names]
        changed = any(a is not b for a, b in zip(current, self.own_params))
        self.own_params = current
        return changed

    def local_params(self) -> list[torch.Tensor]:
        """This rank's P rows of each param, as plain tensors sharing the param storage."""
        if self.uses_fsdp:
            return [p.to_local() for p in self.params]
        return [p.data for p in self.params]


@dataclass
class AMSPState:
    info: MeshInfo
    collectives: Collectives
    units: list[AMSPUnit] = field(default_factory=list)
    requires_grad_sync: bool = True
    gradient_divide_factor: float | None = None  # None: world size (mean over ranks)
    callback_queued: bool = False
    reduce_pending: list = field(default_factory=list)  # (PendingComm, continuation)
    sync_pending: list = field(default_factory=list)  # PendingComm
    unsynced_micro_batches: int = 0

    @property
    def divide_factor(self) -> float:
        if self.gradient_divide_factor is None:
            return float(self.info.plan.world_size)
        return self.gradient_divide_factor


def build_layouts(
    info: MeshInfo, global_shapes: list[torch.Size], p_rows: list[int], p_caps: list[int]
) -> tuple[FlatLayout, FlatLayout, FlatLayout]:
    """P, G and OS flat layouts of one unit on this rank (see layouts.py for the rule)."""
    p_layout = FlatLayout.for_shapes(global_shapes, rows=p_rows, caps=p_caps)
    k_g = info.size("g")
    g_layout = p_layout.split(k_g, info.coordinate["g"]) if k_g > 1 else p_layout
    k_os, os_index = info.os_split
    os_layout = p_layout.split(k_os, os_index) if k_os > 1 else p_layout
    return p_layout, g_layout, os_layout


def find_state(module: nn.Module) -> AMSPState:
    state = getattr(module, "_amsp_state", None)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} is not an AMSP root: call amsp.fully_shard on each "
            "block and then on the root model, and pass the root here"
        )
    return state

