"""The gradient path: from each unit's P-shard grads to G shards to synced OS-layout grads.

Per micro-batch, per unit, this rank receives its P-shard grads as one flat buffer in the
gradient dtype (FSDP2's reduce-scatter output through ``set_all_reduce_hook`` when
s_p > 1; our own flatten of the unit's param grads, cast to the policy's reduce_dtype,
when s_p = 1). Then, in stages:

- "g_reduce" (s_g > s_p): reduce-scatter over "g" (s_g/s_p ranks), keep 1/s_g, accumulate;
  s_g = s_p: accumulate the P-shard grads as they are (the buffer is taken, not copied).
- On the last backward of a step (outside ``no_sync``) the accumulated G is reduced across
  the ranks that hold the same shard: "os_reduce" (reduce-scatter over "os") when
  s_g = s_p < s_os, then "rep_reduce" (all-reduce over "rep"). The result is the step's G
  in the OS layout, and the unit is SYNCED (lifecycle.py).

[Note: issue order and completion]
Collectives are async. Each stage is issued as soon as its input is ready: a unit's first
stage in its own hook; its next stage when the first completes, which is waited for in the
next unit's hook (it ran while that unit's backward computed). At the end of backward the
last units' first stages are completed first, so every remaining stage is issued before
anything waits on a last stage. The last stage of each unit (the replica all-reduce;
without replicas, the last unit's reduce-scatter over "os": earlier units' are completed
in the hooks, which frees their P-sized inputs) is left in flight after ``backward()``
returns (a reduce-scatter over "g" is completed, since its result still has to be added
to the accumulated G: two G-sized buffers would otherwise stay alive until the step):
``step()`` waits for the units one by one and updates each as soon as its own gradients
have landed (optim.py), and anything else that needs the gradients (``clip_grad_norm_``,
``zero_grad``, the next backward, memory accounting) completes them all first
(``finish_sync``). Completion always runs in issue order, and the order of issue depends
only on the order in which units fire, which autograd makes the same on every rank, so
every rank issues the same sequence on every group. With ``set_overlap(grad_sync=False)``
each collective is waited for right after it is issued (the ablation's serial baseline).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from . import compat, param_update, streams
from .lifecycle import StepState
from .state import AMSPState, AMSPUnit, BackwardPass, InFlight, find_state


def on_unit_grads(unit: AMSPUnit, flat_p: torch.Tensor) -> None:
    """Entry point: this rank's P-shard grads of ``unit`` (p_layout flat buffer), which
    the engine may keep (FSDP2 only makes views of it for ``.grad``, dropped here)."""
    state = unit.state
    if flat_p.numel() != unit.p_layout.numel:
        raise RuntimeError(
            f"AMSP unit {unit.name}: got {flat_p.numel()} gradient elements, expected "
            f"{unit.p_layout.numel}; a trainable parameter that gets no gradient in a backward "
            "(unused in forward) is not supported inside a unit: freeze it (requires_grad=False)"
        )
    backward = _begin_backward(state)
    backward.fired.add(id(unit))
    # FSDP2 views the buffers it handed to earlier units as their .grad. The hooks of
    # drop_fsdp_grad_views free them as soon as they are made; this catches params whose
    # hooks were lost because FSDP2 swapped the Parameter objects (materialising a meta
    # model), at the next unit's hook rather than at the end of backward.
    _drop_fsdp_grads(backward)
    if unit.uses_fsdp:
        backward.fsdp_grads_to_drop.append(unit)
    # Complete the first stages issued for earlier units: they overlapped with the
    # backward compute of this one.
    _complete(state, stages=FIRST_STAGES)
    unit.lifecycle.to(StepState.REDUCING if backward.sync else StepState.ACCUMULATING)
    k_g = state.info.size("g")
    if k_g > 1:
        packed = unit.p_layout.pack(flat_p, k_g)
        g_shard = flat_p.new_empty(unit.g_layout.numel)
        pending = state.collectives.reduce_scatter(
            g_shard, packed.view(-1), "g", phase="sync" if backward.sync else "backward"
        )
        state.in_flight.append(InFlight(unit, "g_reduce", pending, packed, backward.sync))
    else:
        _accumulate(unit, flat_p, backward.sync)
    if not state.overlap.grad_sync:
        _complete(state, stages=ALL_STAGES)  # serial: wait for each stage as it is issued
    for observer in state.unit_grad_observers:
        observer(unit, flat_p)


def _accumulate(unit: AMSPUnit, g_shard: torch.Tensor, sync: bool) -> None:
    if unit.grad_accum is None:
        unit.grad_accum = g_shard
    else:
        unit.grad_accum += g_shard
    if sync:
        _issue_sync(unit)


def _issue_sync(unit: AMSPUnit) -> None:
    """Reduce this step's G across the ranks holding the same shard (last backward)."""
    state = unit.state
    grad, unit.grad_accum = unit.grad_accum, None
    k_g, k_os = state.info.size("g"), state.info.size("os")
    if k_g == 1 and k_os > 1:
        # s_g = s_p < s_os: shrink the P-sized G to the OS shard while reducing it.
        packed = unit.p_layout.pack(grad, k_os)
        os_shard = grad.new_empty(unit.os_layout.numel)
        pending = state.collectives.reduce_scatter(os_shard, packed.view(-1), "os", phase="sync")
        state.in_flight.append(InFlight(unit, "os_reduce", pending, packed, True))
    else:
        _issue_replica_reduce(unit, grad)


def _issue_replica_reduce(unit: AMSPUnit, os_shard: torch.Tensor) -> None:
    state = unit.state
    if state.info.size("rep") > 1:
        pending = state.collectives.all_reduce(os_shard, "rep", phase="sync")
        state.in_flight.append(InFlight(unit, "rep_reduce", pending, None, True))
    else:
        _store_synced(unit, os_shard)


def _store_synced(unit: AMSPUnit, os_shard: torch.Tensor) -> None:
    # Several syncing backwards in one step add up, as DDP's do.
    if unit.grad_synced is None:
        unit.grad_synced = os_shard
    else:
        unit.grad_synced += os_shard
    unit.lifecycle.to(StepState.SYNCED)


_NEXT_STAGE = {
    "g_reduce": lambda entry, result: _accumulate(entry.unit, result, entry.sync),
    "os_reduce": lambda entry, result: _issue_replica_reduce(entry.unit, result),
    "rep_reduce": lambda entry, result: _store_synced(entry.unit, result),
}
# completed in the next unit's hook: their inputs are P-sized copies, and their
# completion issues the next stage, if any
FIRST_STAGES = ("g_reduce", "os_reduce")
ALL_STAGES = ("g_reduce", "os_reduce", "rep_reduce")


def _complete(state: AMSPState, stages: tuple[str, ...]) -> None:
    """Complete, in issue order, the in-flight entries of the given stages (and any they
    issue in turn), then run each unit's next stage."""
    while True:
        index = next((i for i, e in enumerate(state.in_flight) if e.stage in stages), None)
        if index is None:
            return
        _complete_entry(state, index)


def _complete_entry(state: AMSPState, index: int) -> None:
    entry = state.in_flight.pop(index)
    result = entry.pending.wait()
    _NEXT_STAGE[entry.stage](entry, result)


def _issues_more(state: AMSPState, entry: InFlight) -> bool:
    """Whether ``entry`` is completed at the end of backward: a reduce-scatter over "g"
    always (its result is added to the accumulated G, so waiting frees one of two G-sized
    buffers, and on the last backward it issues the sync), an OS reduce-scatter when a
    replica all-reduce follows it."""
    if entry.stage == "g_reduce":
        return True
    return entry.stage == "os_reduce" and state.info.size("rep") > 1


def finish_sync(state: AMSPState) -> None:
    """Complete every gradient collective still in flight (in issue order): afterwards
    every unit that took part in the last syncing backward is SYNCED."""
    with streams.on_grad_stream(state.grad_stream):
        _complete(state, stages=ALL_STAGES)
    streams.join_compute(state.grad_stream, [])  # the step reads them on the compute stream


def finish_unit_sync(state: AMSPState, unit: AMSPUnit) -> None:
    """Complete the in-flight collectives issued up to and including ``unit``'s last one
    (issue order is kept: earlier units' entries complete first)."""
    with streams.on_grad_stream(state.grad_stream):
        while any(e.unit is unit for e in state.in_flight):
            _complete_entry(state, 0)
    streams.join_compute(state.grad_stream, [])


def sync_order(state: AMSPState) -> list[AMSPUnit]:
    """The units in the order their gradients finish syncing: those already done, then
    those with collectives in flight, by their first in-flight entry."""
    waiting = list({id(e.unit): e.unit for e in state.in_flight}.values())
    return [u for u in state.units if u not in waiting] + waiting


def in_flight_units(state: AMSPState) -> set[int]:
    return {id(e.unit) for e in state.in_flight}


def _begin_backward(state: AMSPState) -> BackwardPass:
    if state.backward is None:
        # the last stages of a previous backward (no step in between) land first
        finish_sync(state)
        state.backward = BackwardPass(sync=state.requires_grad_sync)
        compat.queue_end_of_backward_callback(lambda: _end_of_backward(state))
    return state.backward


def _drop_fsdp_grads(backward: BackwardPass) -> None:
    for unit in backward.fsdp_grads_to_drop:
        for param in unit.params:
            param.grad = None
    backward.fsdp_grads_to_drop.clear()


def _end_of_backward(state: AMSPState) -> None:
    """Runs once after each backward (queued after FSDP2's own final callback)."""
    backward = state.backward
    with streams.on_grad_stream(state.grad_stream):
        for unit in state.units:
            if id(unit) not in backward.fired:
                _flush_unfired(unit)
        # Issue every remaining stage before waiting for any last stage; the last stages
        # stay in flight (see the note at the top).
        while True:
            index = next((i for i, e in enumerate(state.in_flight) if _issues_more(state, e)),
                         None)
            if index is None:
                break
            _complete_entry(state, index)
    _drop_fsdp_grads(backward)
    kept = [b for u in state.units for b in (u.grad_accum, u.grad_synced) if b is not None]
    kept += [e.pending.result for e in state.in_flight]
    streams.join_compute(state.grad_stream, kept)
    if backward.sync:
        state.unsynced_micro_batches = 0
    else:
        state.unsynced_micro_batches += 1
    state.backward = None


def _flush_unfired(unit: AMSPUnit) -> None:
    """A unit without grads this backward still joins the collectives, with zeros for
    the missing grads, so every rank issues the same sequence."""
    flat = torch.zeros(unit.p_layout.numel, dtype=unit.grad_dtype(), device=unit.device)
    if not unit.uses_fsdp:
        for view, param in zip(unit.p_layout.views(flat), unit.params):
            if param.grad is not None:
                view.copy_(param.grad.view_as(view))
                param.grad = None
    on_unit_grads(unit, flat)


def fsdp_grad_hook(unit: AMSPUnit):
    """FSDP2's all-reduce hook (s_p > 1): runs on the engine's grad stream."""

    def hook(reduce_output: torch.Tensor) -> None:
        if unit.state.grad_stream is not None:
            reduce_output.record_stream(unit.state.grad_stream)
        on_unit_grads(unit, reduce_output)

    return hook


def drop_fsdp_grad_views(unit: AMSPUnit) -> None:
    """FSDP2 views its reduce-scatter output as each sharded param's ``.grad`` right after
    our all-reduce hook has taken the buffer, then runs the param's post-accumulate-grad
    hooks: dropping the view there frees it at once, instead of at the next unit's hook
    (``BackwardPass.fsdp_grads_to_drop`` stays as the fallback for params FSDP swapped)."""

    def hook(param: torch.Tensor) -> None:
        param.grad = None

    for param in unit.params:
        param.register_post_accumulate_grad_hook(hook)


def register_param_hooks(unit: AMSPUnit) -> None:
    """s_p = 1: each param's post-accumulate-grad hook feeds the unit's gradient path."""
    hook = _param_grad_hook(unit)
    for param in unit.params:
        param.register_post_accumulate_grad_hook(hook)


def _param_grad_hook(unit: AMSPUnit):
    """Post-accumulate-grad hook for the s_p = 1 path: flatten the unit's grads (in the
    gradient dtype) once the last of them has arrived (the unit's "bucket" is full)."""

    def hook(param: torch.Tensor) -> None:
        backward = _begin_backward(unit.state)
        seen = backward.grads_seen.get(id(unit), 0) + 1
        backward.grads_seen[id(unit)] = seen
        if seen < len(unit.params):
            return
        grads = [p.grad for p in unit.params]
        with streams.on_grad_stream(unit.state.grad_stream, *grads):
            flat = torch.cat([g.reshape(-1).to(unit.grad_dtype()) for g in grads])
            for p in unit.params:
                p.grad = None
            on_unit_grads(unit, flat)

    return hook


def reset_iteration(state: AMSPState) -> None:
    """After a forward or backward raised: complete what was issued (every rank issued the
    same), drop this iteration's gradients, reset FSDP2's per-iteration state, and put
    every unit back to IDLE. Pending parameter updates are landed, not dropped (and a
    ParamWrittenWhilePending from landing them is raised once the reset is complete)."""
    try:
        param_update.land_all(state.units)
    finally:
        _reset_gradients(state)


def _reset_gradients(state: AMSPState) -> None:
    for entry in state.in_flight:
        entry.pending.wait()
    state.in_flight.clear()
    if state.backward is not None:
        _drop_fsdp_grads(state.backward)
    state.backward = None
    state.in_forward = False
    for unit in state.units:
        if unit.uses_fsdp:
            compat.fsdp_reset_iteration(unit.module)
        for param in unit.params:
            param.grad = None
        unit.grad_accum = unit.grad_synced = None
        unit.lifecycle.to(StepState.IDLE)
    state.unsynced_micro_batches = 0


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate grads locally (at their G size) without any cross-replica traffic.

    Use around every micro-batch's backward but the last, as with DDP's no_sync; the
    last backward, outside this context, runs the once-per-step gradient sync.
    """
    state = find_state(model)
    previous = state.requires_grad_sync
    state.requires_grad_sync = False
    try:
        yield
    finally:
        state.requires_grad_sync = previous


def set_gradient_divide_factor(model: nn.Module, factor: float | None) -> None:
    """Summed grads are divided by ``factor`` before the optimizer sees them.

    Default (None): the world size, i.e. grads are the mean over ranks (DDP/FSDP's
    default). Use 1.0 when the loss is already normalised globally (torchtitan does so).
    """
    if factor is not None and (isinstance(factor, bool) or not factor > 0):
        raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
    find_state(model).gradient_divide_factor = None if factor is None else float(factor)
