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
Collectives are async. A unit's stage is completed, and its next stage issued, when a later
unit's grads arrive (its reduce-scatter ran while that unit's backward computed) or in the
end-of-backward callback, which completes everything. The order of issue depends only on
the order in which units fire, which autograd makes the same on every rank, so every rank
issues the same sequence on every group. After ``backward()`` returns every grad is final,
as with DDP and FSDP.
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
    _complete(state, stages=("g_reduce", "os_reduce"))
    unit.lifecycle.to(StepState.REDUCING if backward.sync else StepState.ACCUMULATING)
    k_g = state.info.size("g")
    if k_g > 1:
        packed = unit.p_layout.pack(flat_p, k_g)
        g_shard = flat_p.new_empty(unit.g_layout.numel)
        pending = state.collectives.reduce_scatter(
            g_shard, packed.view(-1), "g", phase="sync" if backward.sync else "backward"
        )
        state.in_flight.append(InFlight(unit, "g_reduce", pending, packed))
    else:
        _accumulate(unit, flat_p, backward.sync)
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
        state.in_flight.append(InFlight(unit, "os_reduce", pending, packed))
    else:
        _issue_replica_reduce(unit, grad)


def _issue_replica_reduce(unit: AMSPUnit, os_shard: torch.Tensor) -> None:
    state = unit.state
    if state.info.size("rep") > 1:
        pending = state.collectives.all_reduce(os_shard, "rep", phase="sync")
        state.in_flight.append(InFlight(unit, "rep_reduce", pending, None))
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
    "g_reduce": lambda entry, result, sync: _accumulate(entry.unit, result, sync),
    "os_reduce": lambda entry, result, sync: _issue_replica_reduce(entry.unit, result),
    "rep_reduce": lambda entry, result, sync: _store_synced(entry.unit, result),
}


def _complete(state: AMSPState, stages: tuple[str, ...]) -> None:
    """Complete, in issue order, the in-flight entries of the given stages (and any they
    issue in turn), then run each unit's next stage."""
    sync = state.backward.sync
    while True:
        index = next((i for i, e in enumerate(state.in_flight) if e.stage in stages), None)
        if index is None:
            return
        entry = state.in_flight.pop(index)
        result = entry.pending.wait()
        _NEXT_STAGE[entry.stage](entry, result, sync)


def _begin_backward(state: AMSPState) -> BackwardPass:
    if state.backward is None:
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
        _complete(state, stages=("g_reduce", "os_reduce", "rep_reduce"))
    _drop_fsdp_grads(backward)
    kept = [b for u in state.units for b in (u.grad_accum, u.grad_synced) if b is not None]
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
    every unit back to IDLE. Pending parameter updates are landed, not dropped."""
    param_update.land_all(state.units)
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
