"""The root's per-step state (the counterpart of FSDP2's root FSDPState): shared by every
unit under the module ``amsp.fully_shard`` was last called on.

It holds what belongs to the step rather than to one unit: the overlap switches, whether
gradients sync this backward (``no_sync``), the divide factor, the backward in progress,
the stages of every unit's gradient sync in issue order, the forward order, and whether an
optimizer owns the masters. Its methods are the only writers of these fields; the units'
own step state is theirs (unit.py).

[Note: issue order and completion]
Collectives are async. Each stage is issued as soon as its input is ready: a unit's first
stage in its own hook; its next stage when the first completes, which is waited for in the
next unit's hook (it ran while that unit's backward computed). At the end of backward the
last units' first stages are completed first, so every remaining stage is issued before
anything waits on a last stage. The last stage of each unit (the replica all-reduce;
without replicas, the last unit's reduce-scatter over "os": earlier units' are completed
in the hooks, which frees their P-sized inputs) is left in flight after ``backward()``
returns. A reduce-scatter over "g" is always completed there: its result is added to the
partial G, and two G-sized buffers would otherwise stay alive until the step.

``step()`` waits for the units one by one and updates each as soon as its own gradients
have landed (optim.py); anything else that needs the gradients (``clip_grad_norm_``,
``zero_grad``, the next backward, memory accounting) completes them all first
(``finish_sync``). Completion always runs in issue order, and the order of issue depends
only on the order in which units fire, which autograd makes the same on every rank, so
every rank issues the same sequence on every group. With ``set_overlap(grad_sync=False)``
each collective is waited for right after it is issued (the ablation's serial baseline).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from .. import compat
from ..plan.compression import Compression
from . import grad as grad_path
from . import overlap, param_update, streams
from .collectives import Collectives
from .mesh import MeshInfo
from .overlap import Overlap
from .unit import ALL_STAGES, FIRST_STAGES, AMSPUnit, GradStage, InFlightStage


@dataclass
class BackwardPass:
    """What one backward has done so far (exists from the first unit's hook to the end-of-
    backward callback; left behind by a backward that raised)."""

    sync: bool  # the last micro-batch's backward (outside no_sync)
    fired: set = field(default_factory=set)  # id(unit) of units whose grads arrived
    grads_seen: dict = field(default_factory=dict)  # s_p = 1: id(unit) -> params with grads
    fsdp_grads_to_drop: list = field(default_factory=list)  # units whose FSDP .grad to free
    # streams.Deferred: another stream's tensors the grad stream read, kept until that
    # stream's wait is queued (the next unit's hook, or the end of backward); CUDA only
    held: list = field(default_factory=list)


@dataclass(eq=False)
class RootState:
    info: MeshInfo
    collectives: Collectives
    units: list[AMSPUnit] = field(default_factory=list)  # units with trainable params
    frozen_units: list[AMSPUnit] = field(default_factory=list)  # P only (see shard.py)
    grad_stream: object = None  # CUDA: the engine's grad stream (streams.py); None on CPU
    requires_grad_sync: bool = True
    gradient_divide_factor: float | None = None  # None: world size (mean over ranks)
    # a pipeline schedule's scale_grads (its micro-batch count when it scales): the
    # gradients are divided by it too (pipeline.py)
    pipeline_grad_scale: float = 1.0
    backward: BackwardPass | None = None
    in_flight: list[InFlightStage] = field(default_factory=list)  # in issue order
    in_forward: bool = False  # root forward started and has not returned
    unsynced_micro_batches: int = 0
    optimizer_bound: bool = False  # an AMSPOptimizer was built over these units
    overlap: Overlap = field(default_factory=Overlap)
    compression: Compression = field(default_factory=Compression)  # all exact by default
    # units in the order their forward pre-hooks first ran (overlap.py: prefetch order);
    # complete once the root's first forward has returned
    forward_order: list[AMSPUnit] = field(default_factory=list)
    forward_order_known: bool = False
    # called as observer(unit, hook_input) at the end of each unit's gradient hook, when
    # the engine has taken that unit's grads (observe/ uses it to measure memory there)
    unit_grad_observers: list = field(default_factory=list)

    @property
    def divide_factor(self) -> float:
        """What the summed gradients are divided by: the data-parallel world (the mean
        over its ranks' batches), for the experts too. An expert's gradient summed over
        its expert world already holds every rank's tokens, which EP's all-to-all brought
        to it; torchtitan divides its expert gradients by the same factor."""
        if self.gradient_divide_factor is None:
            return float(self.info.plan.world_size) * self.pipeline_grad_scale
        return self.gradient_divide_factor * self.pipeline_grad_scale

    def set_pipeline_grad_scale(self, scale: float) -> None:
        """A pipeline schedule's scale for this step (engine/pipeline.py's scale_grads)."""
        self.pipeline_grad_scale = float(scale)

    def iteration_aborted(self) -> bool:
        """A forward or backward raised and left its state behind (it is not running now:
        callers are outside autograd and outside the root's forward)."""
        return self.in_forward or (self.backward is not None and not compat.in_backward())

    # ---- settings ----------------------------------------------------------------
    @contextlib.contextmanager
    def grad_sync_suspended(self):
        previous = self.requires_grad_sync
        self.requires_grad_sync = False
        try:
            yield
        finally:
            self.requires_grad_sync = previous

    def set_divide_factor(self, factor: float | None) -> None:
        self.gradient_divide_factor = factor

    def set_overlap(self, **switches) -> Overlap:
        if self.in_forward or self.backward is not None:
            raise RuntimeError("set_overlap() during a forward or backward: call it between steps")
        self.overlap = dataclasses.replace(self.overlap, **switches)
        overlap.apply_prefetch(self)
        return self.overlap

    def set_compression(self, setting: Compression) -> Compression:
        if self.in_forward or self.backward is not None:
            raise RuntimeError(
                "set_compression() during a forward or backward: call it between steps")
        if self.optimizer_bound and setting.weights != self.compression.weights:
            raise ValueError(
                f"set_compression(weights={setting.weights!r}) after AMSPOptimizer was built: "
                "call amsp.set_compression before building the optimizer (with fp32 "
                "parameters its masters are views into them unless weights are compressed)"
            )
        self.finish_sync()  # stages in flight complete with the codec they were issued with
        if (setting.grads, setting.error_feedback) != (self.compression.grads,
                                                       self.compression.error_feedback):
            for unit in self.units:
                unit.drop_residuals()
        self.compression = setting
        if setting.enabled and not self._crossing_stages():
            warnings.warn(
                f"set_compression({setting}): no stage of plan {self.info.plan.name} on "
                f"{self.info.plan.ranks_per_node} ranks per node crosses nodes, so nothing is "
                "compressed (stages inside a node are always sent exactly)", stacklevel=3)
        return setting

    def _crossing_stages(self) -> list[str]:
        """The mesh dims of this plan's (and the expert plan's) gradient stages and
        post-step all-gather that span nodes (what compression can apply to)."""
        infos = [self.info, *((self.info.expert,) if self.info.expert else ())]
        return [info.label(dim) for info in infos for dim in ("g", "os", "rep")
                if info.size(dim) > 1 and info.crosses_nodes(dim)]

    def bind_optimizer(self, overlap_param_update: bool) -> None:
        self.optimizer_bound = True
        self.overlap = dataclasses.replace(self.overlap, param_update=overlap_param_update)

    # ---- forward -----------------------------------------------------------------
    def pre_forward(self) -> None:
        if self.iteration_aborted():
            raise RuntimeError(
                "the previous forward or backward of this model raised and left gradient "
                "collectives or FSDP state behind: call optimizer.zero_grad() (which resets "
                "the iteration) before running the model again"
            )
        param_update.check_not_written(self.units)
        self.in_forward = True

    def record_forward(self, unit: AMSPUnit) -> None:
        """A unit's forward pre-hook ran: learn the forward order (first forward only)."""
        if not self.forward_order_known and unit not in self.forward_order:
            self.forward_order.append(unit)

    def post_forward(self) -> None:
        self.in_forward = False
        if not self.forward_order_known:  # the order is known: set the prefetch from it
            self.forward_order_known = True
            overlap.apply_prefetch(self)

    # ---- backward ----------------------------------------------------------------
    def begin_backward(self) -> BackwardPass:
        if self.backward is None:
            # the last stages of a previous backward (no step in between) land first
            self.finish_sync()
            self.backward = BackwardPass(sync=self.requires_grad_sync)
            try:
                compat.queue_end_of_backward_callback(self._end_of_backward)
            except RuntimeError as e:
                self.backward = None
                if compat.in_backward():
                    raise
                # torch's PipelineStage reduces an FSDP2 module's gradients after the
                # backwards, outside autograd ("Final callbacks can only be installed
                # during backward pass"), when the stage was not handed to the engine
                raise RuntimeError(
                    "gradients reached an AMSP unit outside a backward (torch's pipeline "
                    "stage reducing them as FSDP2's?): wrap each pipeline stage of an AMSP "
                    "model with amsp.pipeline_stage(stage) before the schedule's first step"
                ) from e
        return self.backward

    def end_backward_outside_autograd(self) -> None:
        """A backward that ran outside autograd's engine (the weight half of a pipeline
        schedule's split backward, engine/pipeline.py) left each s_p = 1 unit's grads in
        its params' ``.grad``, with no hook run: they enter the gradient path as at the
        end of a backward (``_flush_unfired`` reads them), syncing when not suspended."""
        if self.backward is not None:
            raise RuntimeError("end_backward_outside_autograd called while a backward of "
                               "this root is still open")
        self.finish_sync()
        self.backward = BackwardPass(sync=self.requires_grad_sync)
        self._end_of_backward()

    def on_unit_grads(self, unit: AMSPUnit, flat_p: torch.Tensor) -> None:
        """This rank's P-shard grads of ``unit`` (p_layout flat buffer), which the engine
        may keep (FSDP2 only makes views of it for ``.grad``, dropped here)."""
        if flat_p.numel() != unit.p_layout.numel:
            raise RuntimeError(
                f"AMSP unit {unit.name}: got {flat_p.numel()} gradient elements, expected "
                f"{unit.p_layout.numel}; a trainable parameter that gets no gradient in a "
                "backward (unused in forward) is not supported inside a unit: freeze it "
                "(requires_grad=False)"
            )
        backward = self.begin_backward()
        backward.fired.add(id(unit))
        _release_held(backward)  # the previous unit's hook input (streams.py, rules 1-2)
        # FSDP2 views the buffers it handed to earlier units as their .grad. The hooks of
        # grad.drop_fsdp_grad_views free them as soon as they are made; this catches params
        # whose hooks were lost because FSDP2 swapped the Parameter objects (materialising a
        # meta model), at the next unit's hook rather than at the end of backward.
        _drop_fsdp_grads(backward)
        if unit.uses_fsdp:
            backward.fsdp_grads_to_drop.append(unit)
        # Complete the first stages issued for earlier units: they overlapped with the
        # backward compute of this one.
        self.complete(FIRST_STAGES)
        unit.accept_grads(flat_p, backward.sync)
        if not self.overlap.grad_sync:
            self.complete(ALL_STAGES)  # serial: wait for each stage as it is issued
        for observer in self.unit_grad_observers:
            observer(unit, flat_p)

    def hold(self, deferred) -> None:
        """Keep a streams.Deferred (None: nothing to keep) until the next unit's hook."""
        if deferred is not None:
            self.backward.held.append(deferred)

    def after_fsdp_hook(self, unit: AMSPUnit, hook_input: torch.Tensor) -> None:
        """Rule 1 of streams.py's Note: FSDP2's reduce-scatter stream waits for what the
        grad stream has queued, and the hook's input is kept until the next hook."""
        if self.grad_stream is None:
            return
        streams.release_to(compat.fsdp_reduce_scatter_stream(unit.module), self.grad_stream)
        self.hold(streams.Deferred.kept(self.grad_stream, [hook_input]))

    def _end_of_backward(self) -> None:
        """Runs once after each backward (queued after FSDP2's own final callback)."""
        backward = self.backward
        with record_function("AMSP::end_of_backward"), streams.on_grad_stream(self.grad_stream):
            for unit in self.units:
                if id(unit) not in backward.fired:
                    self._flush_unfired(unit)
            # Issue every remaining stage before waiting for any last stage; the last
            # stages stay in flight (see the Note at the top).
            while (index := next((i for i, e in enumerate(self.in_flight)
                                  if self._completed_at_end_of_backward(e)), None)) is not None:
                self._complete_at(index)
        _drop_fsdp_grads(backward)
        streams.join_compute(self.grad_stream)  # rule 3; it covers what is held, too
        backward.held.clear()
        self.unsynced_micro_batches = 0 if backward.sync else self.unsynced_micro_batches + 1
        self.backward = None

    def _completed_at_end_of_backward(self, entry: InFlightStage) -> bool:
        """A reduce-scatter over "g" always (its result is added to the partial G, so
        waiting frees one of two G-sized buffers, and on the last backward it issues the
        sync), an OS reduce-scatter when a replica all-reduce follows it."""
        if entry.stage is GradStage.G_REDUCE:
            return True
        return entry.stage is GradStage.OS_REDUCE and entry.unit.info.size("rep") > 1

    def _flush_unfired(self, unit: AMSPUnit) -> None:
        """A unit without grads this backward still joins the collectives, with zeros for
        the missing grads, so every rank issues the same sequence."""
        flat = torch.zeros(unit.p_layout.numel, dtype=unit.grad_dtype(), device=unit.device)
        read = []
        if not unit.uses_fsdp:
            for view, param in zip(unit.p_layout.views(flat), unit.params):
                if param.grad is not None:
                    grad = grad_path.local_grad(param)
                    view.copy_(grad.view_as(view))
                    read.append(grad)
                    param.grad = None
        self.on_unit_grads(unit, flat)
        # the grads were made on the compute stream: kept until the join (rule 2)
        self.hold(streams.Deferred.kept(self.grad_stream, read))

    # ---- the gradient stages in flight -------------------------------------------
    def enqueue(self, entry: InFlightStage) -> None:
        """A unit issued a stage (AMSPUnit._issue): it completes in this order."""
        self.in_flight.append(entry)

    def complete(self, stages: frozenset[GradStage]) -> None:
        """Complete, in issue order, the in-flight entries of the given stages (and any
        they issue in turn)."""
        while (index := next((i for i, e in enumerate(self.in_flight) if e.stage in stages),
                             None)) is not None:
            self._complete_at(index)

    def _complete_at(self, index: int) -> None:
        entry = self.in_flight.pop(index)
        with entry.unit.profile_range(f"AMSP::{entry.stage.value}_wait"):
            result = entry.pending.wait()
        entry.unit.advance(entry, result)

    def finish_sync(self) -> None:
        """Complete every gradient collective still in flight (in issue order): afterwards
        every unit that took part in the last syncing backward is SYNCED."""
        with streams.on_grad_stream(self.grad_stream):
            self.complete(ALL_STAGES)
        streams.join_compute(self.grad_stream)  # the step reads them on the compute stream

    def finish_unit_sync(self, unit: AMSPUnit) -> None:
        """Complete the in-flight collectives issued up to and including ``unit``'s last
        one (issue order is kept: earlier units' entries complete first)."""
        with streams.on_grad_stream(self.grad_stream):
            while any(e.unit is unit for e in self.in_flight):
                self._complete_at(0)
        streams.join_compute(self.grad_stream)

    def unit_sync_done(self, unit: AMSPUnit) -> bool:
        """No collective of ``unit`` or of an entry issued before its last one is still
        running (``finish_unit_sync(unit)`` would not block on communication)."""
        last = max((i for i, e in enumerate(self.in_flight) if e.unit is unit), default=-1)
        return all(e.pending.done() for e in self.in_flight[:last + 1])

    def sync_order(self) -> list[AMSPUnit]:
        """The units in the order their gradients finish syncing: those already done, then
        those with collectives in flight, by their first in-flight entry."""
        waiting = list({id(e.unit): e.unit for e in self.in_flight}.values())
        return [u for u in self.units if u not in waiting] + waiting

    # ---- end of a step, or of a failed one ---------------------------------------
    def zero_grad(self) -> None:
        """Drop the step's gradients (nothing may land in a buffer dropped here)."""
        self.finish_sync()
        for unit in self.units:
            unit.drop_grads()
        self.unsynced_micro_batches = 0

    def reset_iteration(self) -> None:
        """After a forward or backward raised: complete what was issued (every rank issued
        the same), drop this iteration's gradients, reset FSDP2's per-iteration state, and
        put every unit back to IDLE. Pending parameter updates are landed, not dropped (and
        a ParamWrittenWhilePending from landing them is raised once the reset is complete)."""
        try:
            param_update.land_all(self.units)
        finally:
            for entry in self.in_flight:
                entry.pending.wait()
            self.in_flight.clear()
            if self.backward is not None:
                _drop_fsdp_grads(self.backward)
                streams.join_compute(self.grad_stream)
                self.backward.held.clear()
            self.backward = None
            self.in_forward = False
            for unit in self.units:
                unit.reset()
            self.unsynced_micro_batches = 0


def _release_held(backward: BackwardPass) -> None:
    for deferred in backward.held:
        deferred.release()
    backward.held.clear()


def _drop_fsdp_grads(backward: BackwardPass) -> None:
    for unit in backward.fsdp_grads_to_drop:
        for param in unit.params:
            param.grad = None
    backward.fsdp_grads_to_drop.clear()
