"""Per-unit and per-model engine state (the counterpart of FSDP2's _fsdp_state).

A *unit* is one module passed to ``amsp.fully_shard`` with the parameters it owns (those
not owned by a unit below it). The *model state* is shared by all units under the module
``fully_shard`` was last called on (the root): the no_sync flag, the divide factor, the
backward in progress and its in-flight gradient collectives. Each unit's place in the
training step is its ``lifecycle`` (see lifecycle.py); the buffers below are what each
state holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import compat
from .collectives import Collectives, PendingComm
from .layouts import FlatLayout
from .lifecycle import StepLifecycle
from .mesh import MeshInfo


@dataclass(frozen=True)
class Overlap:
    """Which of the engine's overlaps are on (``amsp.set_overlap``); see overlap.py."""

    grad_sync: bool = True  # each gradient stage issued as soon as its input is ready
    prefetch: bool = True  # explicit FSDP2 prefetch of the next unit's all-gather
    step: bool = True  # per-unit optimizer step, each unit's all-gather right after it


@dataclass(eq=False)  # units are compared and hashed by identity
class AMSPUnit:
    module: nn.Module  # the first of ``modules`` (FSDP2 keeps a list's state on it)
    fqn: str  # for messages; set when the root is known
    info: MeshInfo
    own_params: list[nn.Parameter] | None  # s_p = 1 units; FSDP units read FSDP's (below)
    param_names: list[str]  # relative to their module, in the order of the flat buffers
    frozen_params: list[nn.Parameter]  # s_p = 1: requires_grad=False params (P only)
    uses_fsdp: bool  # False when s_p == 1: plain params, our own hooks, no FSDP copy
    global_shapes: list[torch.Size]
    p_layout: FlatLayout  # this rank's P rows of each param (FSDP's padded shard layout)
    g_layout: FlatLayout  # this rank's G rows (P rows split over the "g" dim)
    os_layout: FlatLayout  # this rank's OS rows (P rows split over the OS subgroup)
    reduce_dtype: torch.dtype | None  # MixedPrecisionPolicy.reduce_dtype (None: param dtype)
    device: torch.device  # where the P shards were when sharded (checked before use)
    # every module of the unit (``amsp.fully_shard([norm, output])``: several, as FSDP2
    # takes), and for each entry of ``param_names`` the index of the module it is in
    modules: list[nn.Module] = field(default_factory=list)
    param_module: list[int] = field(default_factory=list)
    param_fqns: list[str] = field(default_factory=list)
    state: "AMSPState | None" = None
    lifecycle: StepLifecycle = field(default_factory=StepLifecycle)
    # ACCUMULATING: partial sums this step (g_layout flat). SYNCED / UPDATED: the step's
    # G reduced over all ranks (os_layout flat).
    grad_accum: torch.Tensor | None = None
    grad_synced: torch.Tensor | None = None
    # SENDING: the post-step all-gather of the new P rows, its send buffer, and the
    # params' version counters when it was issued (param_update.py)
    pending_update: "PendingUpdate | None" = None

    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's params in the order of the flat gradient buffers. For FSDP units,
        FSDP's sharded params, read each time: materialising a meta model (to_empty)
        lets FSDP swap them."""
        if self.uses_fsdp:
            return [fp.sharded_param for fp in compat.fsdp_params(self.module)
                    if fp.sharded_param.requires_grad]
        return self.own_params

    @property
    def name(self) -> str:
        return self.fqn or type(self.module).__name__

    def refresh_params(self) -> bool:
        """For s_p = 1 units: pick up Parameter objects that ``module.to_empty`` (materialising
        a meta model) may have replaced. Returns True if any changed (hooks need re-adding)."""
        if self.uses_fsdp:
            return False
        current = [self.modules[i].get_parameter(name)
                   for i, name in zip(self.param_module, self.param_names)]
        changed = any(a is not b for a, b in zip(current, self.own_params))
        self.own_params = current
        return changed

    def local_params(self) -> list[torch.Tensor]:
        """This rank's P rows of each param, as plain tensors sharing the param storage."""
        if self.uses_fsdp:
            return [p.to_local() for p in self.params]
        return [p.data for p in self.params]

    def write_versions(self) -> tuple[int, ...]:
        """Version counters that move when a P shard is written in place: each param's
        own (``p.mul_()``, ``p.copy_()``, ``load_state_dict``) and, for FSDP units, its
        local tensor's (``p.to_local().mul_()``). A write through ``p.data`` moves neither."""
        params = self.params
        local = [p.to_local() for p in params] if self.uses_fsdp else []
        return tuple(compat.tensor_version(t) for t in [*params, *local])

    def grad_dtype(self) -> torch.dtype:
        """dtype of G and of every gradient collective: the policy's reduce_dtype, else
        the parameters' dtype."""
        return self.reduce_dtype or self.params[0].dtype

    def check_device(self) -> None:
        """The P shards must still be where they were sharded: the masters, layouts and
        process groups were all built for that device. A unit sharded on the meta device
        (torchtitan's flow) takes the device it is materialised on (``to_empty``)."""
        local = self.local_params()
        if not local or local[0].device == self.device:
            return
        if self.device.type == "meta":
            self.device = local[0].device
        else:
            raise RuntimeError(
                f"AMSP unit {self.name} was sharded on {self.device} but its parameters are "
                f"now on {local[0].device}: move the model before amsp.fully_shard (or build "
                "it on the target device), not after"
            )


@dataclass(frozen=True)
class PendingUpdate:
    """A unit's post-step all-gather in flight (SENDING), with what landing it needs."""

    comm: PendingComm  # the all-gather; its result holds every OS rank's new rows
    send_buf: torch.Tensor  # this rank's new rows, alive until the all-gather completes
    versions: tuple[int, ...]  # the unit's write_versions() when it was issued


@dataclass
class InFlight:
    """One issued stage of a unit's gradient sync (see grad.py for the stages)."""

    unit: AMSPUnit
    stage: str  # "g_reduce" | "os_reduce" | "rep_reduce"
    pending: PendingComm
    keepalive: torch.Tensor | None  # the collective's input, alive until it completes
    sync: bool  # issued by the last backward of a step (its completion issues the sync)


@dataclass
class BackwardPass:
    """What one backward has done so far (exists from the first unit's hook to the end-of-
    backward callback; left behind by a backward that raised)."""

    sync: bool  # the last micro-batch's backward (outside no_sync)
    fired: set = field(default_factory=set)  # id(unit) of units whose grads arrived
    grads_seen: dict = field(default_factory=dict)  # s_p = 1: id(unit) -> params with grads
    fsdp_grads_to_drop: list = field(default_factory=list)  # units whose FSDP .grad to free


@dataclass
class AMSPState:
    info: MeshInfo
    collectives: Collectives
    units: list[AMSPUnit] = field(default_factory=list)  # units with trainable params
    frozen_units: list[AMSPUnit] = field(default_factory=list)  # P only (see shard.py)
    requires_grad_sync: bool = True
    gradient_divide_factor: float | None = None  # None: world size (mean over ranks)
    backward: BackwardPass | None = None
    in_flight: list[InFlight] = field(default_factory=list)
    in_forward: bool = False  # root forward started and has not returned
    unsynced_micro_batches: int = 0
    optimizer_bound: bool = False  # an AMSPOptimizer was built over these units
    overlap: Overlap = field(default_factory=Overlap)
    # units in the order their forward pre-hooks first ran (overlap.py: prefetch order);
    # complete once the root's first forward has returned
    forward_order: list = field(default_factory=list)
    forward_order_known: bool = False
    grad_stream: object = None  # CUDA: the engine's grad stream (streams.py); None on CPU
    # called as observer(unit, hook_input) at the end of each unit's gradient hook, when
    # the engine has taken that unit's grads (observe/ uses it to measure memory there)
    unit_grad_observers: list = field(default_factory=list)

    @property
    def divide_factor(self) -> float:
        if self.gradient_divide_factor is None:
            return float(self.info.plan.world_size)
        return self.gradient_divide_factor

    def iteration_aborted(self) -> bool:
        """A forward or backward raised and left its state behind (it is not running now:
        callers are outside autograd and outside the root's forward)."""
        return self.in_forward or (self.backward is not None and not compat.in_backward())


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


def clean_fqn(name: str) -> str:
    """A parameter or module FQN without wrapper components (activation checkpointing's
    ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``), as torch's DCP state
    dicts name it, so checkpoints load across AC / compile settings."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES)


_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def find_state(module: nn.Module) -> AMSPState:
    state = getattr(module, "_amsp_state", None)
    if state is None:
        raise ValueError(
            f"{type(module).__name__} is not an AMSP root: call amsp.fully_shard on each "
            "block and then on the root model, and pass the root here"
        )
    return state
