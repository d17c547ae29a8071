"""One AMSP unit (the counterpart of FSDP2's FSDPParamGroup): its parameters, layouts and
the step state that owns its gradient and update buffers.

A *unit* is one module (or list of sibling modules) passed to ``amsp.fully_shard`` with
the parameters it owns (those not owned by a unit below it). Its place in the training
step is a value of one of the classes below, which holds exactly the buffers of that
state (lifecycle.py has the table of transitions); the methods of ``AMSPUnit`` are the
only code that replaces it:

- ``accept_grads`` (backward: one micro-batch's P-shard grads arrive),
- ``advance`` (one of its gradient stages completed: run the next one),
- ``send`` / ``land`` (optimizer step: the post-step all-gather issued / landed),
- ``drop_grads`` (``zero_grad()``) and ``reset`` (after an exception).

[Note: gradient stages]
Per micro-batch this rank receives the unit's P-shard grads as one flat buffer in the
gradient dtype (FSDP2's reduce-scatter output when s_p > 1, our own flatten of the
params' grads when s_p = 1). Then:

- G_REDUCE (s_g > s_p): reduce-scatter over "g", keep 1/s_g, add to the partial sum.
  With s_g = s_p the P-shard grads are added as they are (the first buffer is taken).
- On the last backward of a step (outside ``no_sync``) the partial sum is reduced across
  the ranks that hold the same shard: OS_REDUCE (reduce-scatter over "os") when
  s_g = s_p < s_os, then REP_REDUCE (all-reduce over "rep"). The result is the step's G
  in the OS layout, added to a G the unit already held (a second syncing backward before
  the step, as DDP adds), and the unit is SYNCED.

A unit has at most one stage in flight, held by its state; the root keeps the stages of
all units in issue order (root.py) and completes them in that order, calling ``advance``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from .. import compat
from ..plan.compression import Compression, codec_applies
from . import compression, param_update
from .collectives import Collectives, PendingComm
from .fqn import clean_fqn
from .layouts import FlatLayout
from .lifecycle import StepState, check_transition
from .mesh import MeshInfo
from .overlap import Overlap


NO_RANGE = contextlib.nullcontext()  # profile_range when no profiler collects


class GradStage(enum.Enum):
    """The collectives of a unit's gradient sync, in the order they can run."""

    G_REDUCE = "g_reduce"  # reduce-scatter over "g" of one micro-batch's P-shard grads
    OS_REDUCE = "os_reduce"  # reduce-scatter over "os" of the step's G (s_g = s_p < s_os)
    REP_REDUCE = "rep_reduce"  # all-reduce over "rep" of the step's G in the OS layout


# Completed in the next unit's hook: their inputs are P-sized, and their completion
# issues the unit's next stage, if any.
FIRST_STAGES = frozenset({GradStage.G_REDUCE, GradStage.OS_REDUCE})
ALL_STAGES = frozenset(GradStage)


@dataclass(eq=False)
class InFlightStage:
    """One issued stage of a unit's gradient sync."""

    unit: "AMSPUnit"
    stage: GradStage
    pending: PendingComm  # owns the stage's buffers until it completes (collectives.py)


@dataclass(frozen=True)
class PendingUpdate:
    """A unit's post-step all-gather in flight (SENDING), with what landing it needs."""

    # the all-gather: its input is this rank's new rows, its result every OS rank's
    comm: PendingComm
    # the unit's write_versions() when it was issued; None when step() lands it before
    # returning (overlap_param_update off), so no user code can write in between
    versions: tuple[int, ...] | None


class UnitRoot(Protocol):
    """What a unit and the hooks on it use of their root (root.RootState implements it;
    root.py imports this module, so the unit knows its root by this interface)."""

    units: list["AMSPUnit"]
    compression: Compression  # the codecs of the cross-node stages
    overlap: "Overlap"  # overlap.param_update decides whether ``send`` records versions
    optimizer_bound: bool  # an AMSPOptimizer owns the masters (no more fully_shard)

    def enqueue(self, entry: InFlightStage) -> None:
        """A unit issued a gradient stage: the root completes stages in issue order."""

    def record_forward(self, unit: "AMSPUnit") -> None:
        """A unit's forward pre-hook ran (the forward order sets the prefetch)."""

    def on_unit_grads(self, unit: "AMSPUnit", flat_p: torch.Tensor) -> None:
        """A unit's P-shard grads of this backward arrived (its gradient hook)."""

    def after_fsdp_hook(self, unit: "AMSPUnit", hook_input: torch.Tensor) -> None:
        """FSDP2's all-reduce hook of ``unit`` is returning (stream order, streams.py)."""


# ---- step states: each holds exactly its buffers ---------------------------------------
@dataclass(frozen=True)
class Idle:
    kind: ClassVar[StepState] = StepState.IDLE


@dataclass(frozen=True)
class Accumulating:
    """Backwards under no_sync: the partial G sum (g_layout flat; None until the first
    G_REDUCE lands), a G synced earlier in this step that the sync will add to, and the
    stage in flight."""

    kind: ClassVar[StepState] = StepState.ACCUMULATING
    partial: torch.Tensor | None
    carried: torch.Tensor | None
    stage: InFlightStage | None


@dataclass(frozen=True)
class Reducing:
    """The last backward issued the sync: the same buffers as Accumulating; ``partial``
    is given up when the sync across replicas is issued."""

    kind: ClassVar[StepState] = StepState.REDUCING
    partial: torch.Tensor | None
    carried: torch.Tensor | None
    stage: InFlightStage | None


@dataclass(frozen=True)
class Synced:
    kind: ClassVar[StepState] = StepState.SYNCED
    grad: torch.Tensor  # the step's G reduced over all ranks (os_layout flat)


@dataclass(frozen=True)
class Sending:
    kind: ClassVar[StepState] = StepState.SENDING
    grad: torch.Tensor | None  # kept until zero_grad(), as torch keeps .grad
    update: PendingUpdate


@dataclass(frozen=True)
class Updated:
    kind: ClassVar[StepState] = StepState.UPDATED
    grad: torch.Tensor | None


StepValue = Idle | Accumulating | Reducing | Synced | Sending | Updated


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
    # tensor parallelism (mesh "tp" dim): each trainable param's TP placement (Shard(d) or
    # Replicate()) and its whole shape; ``global_shapes`` above are then the TP-local
    # shapes, which the P, G and OS rows split. Empty without TP.
    tp_placements: list = field(default_factory=list)
    full_shapes: list[torch.Size] = field(default_factory=list)
    root: "UnitRoot | None" = None  # the root.RootState, once the root is sharded
    # every collective the unit issues goes through it: the one of its own mesh (the
    # dense mesh's, or the expert mesh's; mesh.py's Note on expert parallelism)
    collectives: Collectives | None = None
    _step: StepValue = field(default_factory=Idle)
    # error feedback of each compressed gradient stage (compression.py's Note): what its
    # codec dropped, kept across steps in the stage's input shape and dtype
    residuals: dict = field(default_factory=dict)
    # inside accept_grads only: the hook's input when it is FSDP2's buffer (``_own``)
    _borrowed: torch.Tensor | None = field(default=None, repr=False)

    def attach(self, root, prefixes: list[str]) -> None:
        """The root (root.RootState) now owns this unit; ``prefixes``: the FQN of each of
        the unit's modules under the root (what messages and checkpoints name)."""
        self.root = root
        self.fqn = prefixes[0] if len(prefixes) == 1 else f"[{', '.join(prefixes)}]"
        self.param_fqns = [clean_fqn(f"{prefixes[i]}.{n}" if prefixes[i] else n)
                           for i, n in zip(self.param_module, self.param_names)]

    # ---- reading the step state ---------------------------------------------------
    @property
    def step_state(self) -> StepState:
        return self._step.kind

    @property
    def partial_grad(self) -> torch.Tensor | None:
        """ACCUMULATING / REDUCING: the partial G sum of this step (g_layout flat)."""
        return getattr(self._step, "partial", None)

    @property
    def synced_grad(self) -> torch.Tensor | None:
        """The G synced this step (os_layout flat): held from SYNCED until zero_grad()."""
        step = self._step
        return step.carried if isinstance(step, (Accumulating, Reducing)) else getattr(
            step, "grad", None)

    @property
    def stage_in_flight(self) -> InFlightStage | None:
        return getattr(self._step, "stage", None)

    @property
    def pending_update(self) -> PendingUpdate | None:
        return self._step.update if isinstance(self._step, Sending) else None

    def ready_to_step(self) -> bool:
        """SYNCED, or REDUCING with its last stage still in flight after the backward."""
        step = self._step
        return isinstance(step, Synced) or (isinstance(step, Reducing) and step.stage is not None)

    def _to(self, new: StepValue) -> None:
        check_transition(self.name, self._step.kind, new.kind)
        self._step = new

    # ---- gradient path (Note: gradient stages) ------------------------------------
    def accept_grads(self, flat_p: torch.Tensor, sync: bool) -> None:
        """This backward's P-shard grads of the unit (p_layout flat buffer, which the unit
        may keep); ``sync``: the last backward of the step, outside no_sync."""
        assert self.stage_in_flight is None, f"{self.name}: a gradient stage is still in flight"
        state = Reducing if sync else Accumulating
        self._to(state(self.partial_grad, self.synced_grad, None))
        k_g = self.info.size("g")
        if k_g > 1:
            self._issue_stage(GradStage.G_REDUCE, "g", self.p_layout.pack(flat_p, k_g),
                              "sync" if sync else "backward")
            return
        self._borrowed = flat_p if self.uses_fsdp else None
        try:
            self._add_partial(flat_p)
        finally:
            self._borrowed = None

    def advance(self, entry: InFlightStage, result: torch.Tensor) -> None:
        """``entry``, this unit's stage in flight, completed with ``result``: run the
        next stage (the root calls this in issue order)."""
        step = self._step
        assert step.stage is entry, f"{self.name}: completed a stage it does not hold"
        self._step = dataclasses.replace(step, stage=None)  # same state, stage done
        if entry.stage is GradStage.G_REDUCE:
            self._add_partial(result)
        elif entry.stage is GradStage.OS_REDUCE:
            self._issue_replica_reduce(result)
        else:
            self._store_synced(result)

    def _add_partial(self, g_shard: torch.Tensor) -> None:
        step = self._step
        if step.partial is None:
            partial = g_shard
        else:
            partial = step.partial
            partial += g_shard
        self._step = dataclasses.replace(step, partial=partial)
        if isinstance(step, Reducing):
            self._issue_sync()

    def _issue_sync(self) -> None:
        """Reduce this step's G across the ranks holding the same shard (last backward)."""
        grad = self._step.partial
        self._step = dataclasses.replace(self._step, partial=None)
        k_g, k_os = self.info.size("g"), self.info.size("os")
        if k_g == 1 and k_os > 1:
            # s_g = s_p < s_os: shrink the P-sized G to the OS shard while reducing it.
            self._issue_stage(GradStage.OS_REDUCE, "os", self.p_layout.pack(grad, k_os), "sync")
        else:
            self._issue_replica_reduce(grad)

    def _issue_replica_reduce(self, os_shard: torch.Tensor) -> None:
        if self.info.size("rep") > 1:
            self._issue_stage(GradStage.REP_REDUCE, "rep", os_shard, "sync")
        else:
            self._store_synced(os_shard)

    def _issue_stage(self, stage: GradStage, dim: str, tensor: torch.Tensor, phase: str) -> None:
        """Issue ``stage`` over mesh dim ``dim``: the one place that picks its collective.
        G_REDUCE / OS_REDUCE reduce-scatter ``tensor`` ([k, m], pack's output) to this
        rank's m elements; REP_REDUCE all-reduces ``tensor`` in place. Each is the
        compressed form (compression.py) when the stage has a codec, else exact; either
        way one PendingComm that owns the stage's buffers (collectives.py's Note:
        buffers in flight)."""
        codec = self.grad_codec(dim)
        scatter = stage is not GradStage.REP_REDUCE
        comms = self.collectives
        with self.profile_range(f"AMSP::{stage.value}_issue"):
            if codec is not None:
                shape = tensor.shape if scatter else (
                    self.info.size(dim),
                    compression.residual_rows(tensor.numel(), self.info.size(dim)))
                op = compression.reduce_scatter if scatter else compression.all_reduce
                pending = op(comms, tensor, self._residual(stage, shape), dim, phase, codec)
            elif scatter:
                pending = comms.reduce_scatter(tensor.new_empty(tensor.shape[1]),
                                               tensor.view(-1), dim, phase=phase)
            else:
                pending = comms.all_reduce(self._own(tensor), dim, phase=phase)
        entry = InFlightStage(self, stage, pending)
        self._step = dataclasses.replace(self._step, stage=entry)
        self.root.enqueue(entry)

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or a copy of it when it is the buffer this backward's hook was handed
        by FSDP2 (its reduce-scatter output, FSDP2's until the hook returns) and FSDP2
        still reads it afterwards (its cast for ``.grad`` when the gradient dtype is not
        the parameters'): what an in-place collective may write (collectives.py's Note:
        buffers in flight, rule 2). Only a step's single syncing micro-batch with
        s_g = s_p = s_os and replicas hands that buffer to the replica all-reduce."""
        if tensor is self._borrowed and compat.fsdp_reads_reduce_output_after_hook(
                tensor.dtype, self.first_local().dtype):
            return tensor.clone()
        return tensor

    # ---- compression of the cross-node stages (compression.py) ---------------------
    def grad_codec(self, dim: str) -> str | None:
        """The codec of this unit's gradient stage over ``dim``: the root's setting when
        the dim's group spans nodes and the codec is narrower than the gradient dtype."""
        codec = self.root.compression.grads
        if codec is None or not self.info.crosses_nodes(dim):
            return None
        return codec if codec_applies(codec, self.grad_dtype().itemsize) else None

    def weight_codec(self) -> str | None:
        """The codec of the post-step all-gather (None: sent exactly, or none issued)."""
        codec = self.root.compression.weights
        dim = self.info.os_subgroup_dim
        if codec is None or dim is None or not self.info.crosses_nodes(dim):
            return None
        return codec if codec_applies(codec, self.params[0].dtype.itemsize) else None

    def _residual(self, stage: GradStage, shape) -> torch.Tensor | None:
        if not self.root.compression.error_feedback:
            return None
        residual = self.residuals.get(stage)
        if residual is None or residual.shape != torch.Size(shape):
            residual = torch.zeros(shape, dtype=self.grad_dtype(), device=self.device)
            self.residuals[stage] = residual
        return residual

    def drop_residuals(self) -> None:
        """Forget the error feedback (the compression setting changed)."""
        self.residuals = {}

    def residual_state(self) -> dict[str, torch.Tensor]:
        """The error-feedback residuals by stage name (checkpoint.py saves them)."""
        return {stage.value: r for stage, r in self.residuals.items()}

    def load_residuals(self, state: dict[str, torch.Tensor]) -> None:
        """Residuals saved by ``residual_state`` (same plan, world and codec)."""
        self.residuals = {GradStage(name): r.to(self.grad_dtype()) for name, r in state.items()}

    def _store_synced(self, os_shard: torch.Tensor) -> None:
        # Several syncing backwards in one step add up, as DDP's do.
        carried = self._step.carried
        if carried is None:
            grad = os_shard
        else:
            grad = carried
            grad += os_shard
        self._to(Synced(grad))

    # ---- optimizer step and update -----------------------------------------------
    @torch.no_grad()
    def send(self, masters: list, masters_are_p: bool = False) -> None:
        """After the step (SYNCED): the new weights from the fp32 masters back to the P
        shards: a local copy if s_os == s_p (UPDATED; none when ``masters_are_p``, every
        master a view of its P rows), else the all-gather over the OS subgroup is issued
        (SENDING; ``land`` completes it)."""
        grad = self._step.grad
        with self.profile_range("AMSP::param_update_issue"):
            issued = param_update.issue(self, masters, self.collectives, masters_are_p)
        if issued is None:
            self._to(Updated(grad))
        else:
            versions = self.write_versions() if self.root.overlap.param_update else None
            self._to(Sending(grad, PendingUpdate(issued, versions=versions)))

    @torch.no_grad()
    def land(self) -> list[str]:
        """Land the all-gathered new P rows (no-op unless SENDING); returns the FQNs of
        the params written in place since the update was sent (param_update.py's Note)."""
        step = self._step
        if not isinstance(step, Sending):
            return []
        pending = step.update
        written = [] if pending.versions is None else self._written_since(pending.versions)
        self._to(Updated(step.grad))
        with self.profile_range("AMSP::param_update_land"):
            param_update.unpack(self, pending.comm)
        return written

    def _written_since(self, versions: tuple[int, ...]) -> list[str]:
        """FQNs of the params whose write_versions() moved since ``versions``."""
        now = self.write_versions()
        if now == versions:
            return []
        n = len(self.params)  # versions: each param's, then (FSDP) each local tensor's
        moved = sorted({i % n for i, (a, b) in enumerate(zip(now, versions)) if a != b})
        names = self.param_fqns if len(self.param_fqns) == n else [self.name] * n
        return list(dict.fromkeys(names[i] for i in moved))

    def written_while_pending(self) -> bool:
        """A param was written in place while this unit's update is in flight."""
        pending = self.pending_update
        return (pending is not None and pending.versions is not None
                and self.write_versions() != pending.versions)

    @torch.no_grad()
    def overwrite(self, masters: list) -> None:
        """Masters -> P now (a checkpoint was loaded; nothing may be in flight)."""
        assert self.pending_update is None, "land the update before loading the masters"
        issued = param_update.issue(self, masters, self.collectives)
        if issued is not None:
            param_update.unpack(self, issued)

    def drop_grads(self) -> None:
        """``zero_grad()``: no stage may be in flight (the root completes them first).
        A SENDING unit keeps its update in flight; every other state goes to IDLE."""
        assert self.stage_in_flight is None, f"{self.name}: zero_grad with a stage in flight"
        if isinstance(self._step, Sending):
            self._step = dataclasses.replace(self._step, grad=None)
        else:
            self._to(Idle())

    def reset(self) -> None:
        """After a forward or backward raised (the root has waited for every stage and
        landed every update): drop this iteration's gradients and FSDP2's state."""
        if self.uses_fsdp:
            compat.fsdp_reset_iteration(self.module)
        for param in self.params:
            param.grad = None
        self._to(Idle())

    # ---- parameters ---------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """The unit's params in the order of the flat gradient buffers. For FSDP units,
        FSDP's sharded params, read each time: materialising a meta model (to_empty)
        lets FSDP swap them."""
        return list(self._fsdp_params()) if self.uses_fsdp else self.own_params

    def _fsdp_params(self):
        """FSDP's trainable sharded params of the unit, in order (FSDP units only)."""
        return (fp.sharded_param for fp in compat.fsdp_params(self.module)
                if fp.sharded_param.requires_grad)

    def first_local(self) -> torch.Tensor | None:
        """``local_params()[0]`` (None if the unit has no params), without building the
        lists: what the P shards' dtype and device are read from."""
        if self.uses_fsdp:
            first = next(self._fsdp_params(), None)
        else:
            first = self.own_params[0] if self.own_params else None
        if first is None:
            return None
        return values_of(compat.dtensor_local(first) if self.uses_fsdp or self.tp_placements
                         else first.data)

    @property
    def name(self) -> str:
        return self.fqn or type(self.module).__name__

    def profile_label(self, label: str) -> str:
        """A profiler range name, FSDP2-style: ``AMSP::<phase> (<unit fqn>)``."""
        return f"{label} ({self.fqn})" if self.fqn else label

    def profile_range(self, label: str):
        """``record_function(profile_label(label))`` while a profiler collects; nothing
        (not even the name) otherwise: ranges cost host time on every step."""
        return record_function(self.profile_label(label)) if compat.profiler_enabled() else NO_RANGE

    def refresh_params(self) -> bool:
        """For s_p = 1 units: pick up Parameter objects that ``module.to_empty`` (materialising
        a meta model) may have replaced. Returns True if any changed (hooks need re-adding)."""
        if self.uses_fsdp:
            return False
        current = self._module_params()
        self._check_tp_kind(current)
        changed = any(a is not b for a, b in zip(current, self.own_params))
        self.own_params = current
        return changed

    def _module_params(self) -> list[nn.Parameter]:
        return [self.modules[i].get_parameter(name)
                for i, name in zip(self.param_module, self.param_names)]

    def _check_tp_kind(self, current: list) -> None:
        """A param may be replaced by one of the same kind (``to_empty`` does that), but
        not turned into a tensor-parallel DTensor (or back): the layouts, masters and hooks
        were built for what ``fully_shard`` saw."""
        was = self.tp_placements or [None] * len(current)
        for j, (param, placement) in enumerate(zip(current, was)):
            now = param.placements[0] if isinstance(param, DTensor) else None
            if now != placement:
                name = self.param_fqns[j] if len(self.param_fqns) == len(current) else self.name
                raise RuntimeError(
                    f"parameter {name} was {_kind(placement)} when amsp.fully_shard ran and is "
                    f"{_kind(now)} now: apply tensor parallelism (parallelize_module) before "
                    "amsp.fully_shard, not after"
                )

    def local_params(self) -> list[torch.Tensor]:
        """This rank's P rows of each param, as plain tensors sharing the param storage."""
        if self.uses_fsdp or self.tp_placements:  # FSDP's or TP's DTensors
            return [values_of(compat.dtensor_local(p)) for p in self.params]
        return [values_of(p.data) for p in self.params]

    def write_versions(self) -> tuple[int, ...]:
        """Version counters that move when a P shard is written in place: each param's
        own (``p.mul_()``, ``p.copy_()``, ``load_state_dict``) and, for DTensor params (FSDP
        units, TP), its local tensor's (``p.to_local().mul_()``). A write through ``p.data`` moves neither."""
        params = self.params
        local = ([compat.dtensor_local(p) for p in params]
                 if self.uses_fsdp or self.tp_placements else [])
        return tuple(compat.tensor_version(t) for t in [*params, *local])

    def grad_dtype(self) -> torch.dtype:
        """dtype of G and of every gradient collective: the policy's reduce_dtype, else
        the parameters' dtype."""
        return self.reduce_dtype or self.params[0].dtype

    def check_device(self) -> None:
        """The P shards must still be where they were sharded: the masters, layouts and
        process groups were all built for that device. A unit sharded on the meta device
        (torchtitan's flow) takes the device it is materialised on (``to_empty``)."""
        if not self.uses_fsdp:
            self._check_tp_kind(self._module_params())
        first = self.first_local()
        if first is None:
            return
        device = first.device  # every P shard of a unit is on one device: the first tells
        if device == self.device:
            return
        if self.device.type == "meta":
            self.device = device
        else:
            raise RuntimeError(
                f"AMSP unit {self.name} was sharded on {self.device} but its parameters are "
                f"now on {device}: move the model before amsp.fully_shard (or build "
                "it on the target device), not after"
            )


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds a P shard's values.

    A weight can be a tensor subclass that wraps its values and changes only how they are
    sent or used: torchao's float8 training weights (``Float8Linear`` with
    ``enable_fsdp_float8_all_gather``, a ``WeightWithDynamicFloat8CastTensor``) keep the
    high-precision tensor inside and cast it to float8 in FSDP2's all-gather. Such a
    wrapper has no storage of its own ("Attempted to access the data pointer on an invalid
    python storage"); the engine builds the fp32 masters from, and lands the updates in,
    the tensor it wraps: the wrapper subclass's inner tensor (``__tensor_flatten__``) of
    the same shape and dtype. A plain tensor is returned as it is.
    """
    while type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        inner = getattr(t, names[0]) if names else None
        if not isinstance(inner, torch.Tensor) or inner.shape != t.shape or inner.dtype != t.dtype:
            break
        t = inner
    return t


def _kind(tp_placement) -> str:
    return "a plain tensor" if tp_placement is None else f"a DTensor placed {tp_placement!r}"
