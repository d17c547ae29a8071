"""The gradient path: from each unit's P-shard grads to G shards to synced OS-layout grads.

Per micro-batch, per unit, this rank receives its P-shard grads as one flat buffer (FSDP2's
reduce-scatter output through ``set_all_reduce_hook`` when s_p > 1; our own flatten of the
unit's param grads when s_p = 1). Then:

- s_g > s_p: reduce-scatter over "g" (s_g/s_p ranks), keep 1/s_g, accumulate;
- s_g = s_p: accumulate the P-shard grads as they are.

On the last backward of a step (outside ``no_sync``) the accumulated G is reduced across
the ranks that hold the same shard: reduce-scatter over "os" when s_g = s_p < s_os, then
all-reduce over "rep". The result is the G of the step in the OS layout.

Collectives are async: each unit's reduce-scatter runs while the next unit's backward
computes, and is completed when the next unit's grads arrive (or in the end-of-backward
callback), which is also where the final all-reduces are waited for. After ``backward()``
returns, every grad is final, as with DDP and FSDP.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from .state import AMSPState, AMSPUnit, find_state


def on_unit_grads(unit: AMSPUnit, flat_p: torch.Tensor, owned: bool) -> None:
    """Entry point: this rank's P-shard grads of ``unit`` (p_layout flat buffer).

    ``owned`` says whether the engine may keep ``flat_p`` (False for FSDP's buffer, which
    FSDP then views into param.grad).
    """
    state = unit.state
    if flat_p.numel() != unit.p_layout.numel:
        raise RuntimeError(
            f"AMSP unit {unit.fqn or type(unit.module).__name__}: got {flat_p.numel()} gradient "
            f"elements, expected {unit.p_layout.numel}; unused or frozen parameters inside a "
            "unit are not supported"
        )
    _ensure_final_callback(state)
    unit.fired = True
    # Complete the reduce-scatters issued for earlier units: they overlapped with the
    # backward compute of this one.
    _drain_reduces(state)
    sync = state.requires_grad_sync
    k_g = state.info.size("g")
    if k_g > 1:
        packed = unit.p_layout.pack(flat_p, k_g)
        g_shard = flat_p.new_empty(unit.g_layout.numel)
        pending = state.collectives.reduce_scatter(
            g_shard, packed.view(-1), "g", phase="sync" if sync else "backward"
        )
        state.reduce_pending.append(
            (pending, packed, functools.partial(_accumulate, unit, g_shard, True, sync))
        )
    else:
        _accumulate(unit, flat_p, owned, sync)


def _accumulate(unit: AMSPUnit, g_shard: torch.Tensor, owned: bool, sync: bool) -> None:
    if unit.grad_accum is None:
        unit.grad_accum = g_shard if owned else g_shard.clone()
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
        state.reduce_pending.append(
            (pending, packed, functools.partial(_issue_replica_reduce, unit, os_shard))
        )
    else:
        _issue_replica_reduce(unit, grad)


def _issue_replica_reduce(unit: AMSPUnit, os_shard: torch.Tensor) -> None:
    state = unit.state
    if state.info.size("rep") > 1:
        pending = state.collectives.all_reduce(os_shard, "rep", phase="sync")
        state.sync_pending.append((pending, functools.partial(_store_synced, unit, os_shard)))
    else:
        _store_synced(unit, os_shard)


def _store_synced(unit: AMSPUnit, os_shard: torch.Tensor) -> None:
    # Several syncing backwards in one step add up, as DDP's do.
    if unit.grad_synced is None:
        unit.grad_synced = os_shard
    else:
        unit.grad_synced += os_shard


def _drain_reduces(state: AMSPState) -> None:
    while state.reduce_pending:
        pending, _keepalive_input, continuation = state.reduce_pending.pop(0)
        pending.wait()
        continuation()


def _ensure_final_callback(state: AMSPState) -> None:
    if not state.callback_queued:
        state.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_end_of_backward, state)
        )


def _end_of_backward(state: AMSPState) -> None:
    """Runs once after each backward (queued after FSDP2's own final callback)."""
    try:
        for unit in state.units:
            if not unit.fired:
                _flush_unfired(unit)
        _drain_reduces(state)
        while state.sync_pending:
            pending, continuation = state.sync_pending.pop(0)
            pending.wait()
            continuation()
        for unit in state.units:
            if unit.uses_fsdp:
                # FSDP assigned views of its reduce-scatter output; the engine keeps its
                # own copy, so drop these rather than let FSDP accumulate a second G.
                for param in unit.params:
                    param.grad = None
        if state.requires_grad_sync:
            state.unsynced_micro_batches = 0
        else:
            state.unsynced_micro_batches += 1
    finally:
        state.callback_queued = False
        for unit in state.units:
            unit.fired = False
            unit.grads_seen = 0


def _flush_unfired(unit: AMSPUnit) -> None:
    """A unit without grads this backward still joins the collectives, with zeros for
    the missing grads, so every rank issues the same sequence."""
    dtype = unit.params[0].dtype if unit.params else torch.float32
    flat = torch.zeros(unit.p_layout.numel, dtype=dtype, device=_device_of(unit))
    if not unit.uses_fsdp:
        for view, param in zip(unit.p_layout.views(flat), unit.params):
            if param.grad is not None:
                view.copy_(param.grad.view_as(view))
                param.grad = None
    on_unit_grads(unit, flat, owned=True)


def _device_of(unit: AMSPUnit) -> torch.device:
    return unit.local_params()[0].device


def make_param_grad_hook(unit: AMSPUnit, index: int):
    """Post-accumulate-grad hook for the s_p = 1 path: flatten the unit's grads once the
    last of them has arrived (the unit's "bucket" is full)."""

    def hook(param: torch.Tensor) -> None:
        unit.grads_seen += 1
        if unit.grads_seen < len(unit.params):
            return
        flat = torch.cat([p.grad.reshape(-1) for p in unit.params])
        for p in unit.params:
            p.grad = None
        on_unit_grads(unit, flat, owned=True)

    return hook


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
