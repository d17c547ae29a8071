"""Bytes this rank holds per state kind, read from the actual tensors."""

from __future__ import annotations

import torch.nn as nn

from .. import compat
from ..engine.handle import root_state


GROUPS = ("dense", "expert")


def memory_by_state(model: nn.Module, optimizer=None, group: str | None = None) -> dict[str, int]:
    """{"param", "grad", "optim"} bytes on this rank (``group``: "dense" or "expert", only
    the units of that mesh; None: all).

    param: P storage (FSDP's padded shard, or the full param when s_p = 1);
    grad: G buffers alive now (accumulating, synced, or still being reduced in a
      collective left in flight after backward);
    optim: fp32 masters plus optimizer states shaped like them (0 without optimizer; a
      master that is a view into an fp32 P shard is counted once, as param);
    residual (only with ``amsp.set_compression(grads=...)``): the error-feedback residuals
      of the compressed gradient stages.
    """
    state = root_state(model)
    if group not in (None, *GROUPS):
        raise ValueError(f"group must be None or one of {GROUPS}, got {group!r}")

    def counted(unit) -> bool:
        return group is None or unit.info.is_expert == (group == "expert")

    param = grad = 0
    for unit in [*state.units, *state.frozen_units]:
        if not counted(unit):
            continue
        if unit.uses_fsdp:
            for fsdp_param in compat.fsdp_params(unit.module):
                data = compat.fsdp_sharded_storage(fsdp_param)
                param += data.numel() * data.element_size()
        else:
            param += sum(_local(p).numel() * p.element_size()
                         for p in [*unit.params, *unit.frozen_params])
        for buf in (unit.partial_grad, unit.synced_grad):
            if buf is not None:
                grad += buf.numel() * buf.element_size()
    grad += sum(e.pending.result.numel() * e.pending.result.element_size()
                for e in state.in_flight if counted(e.unit))
    units = None if group is None else [u for u in state.units if counted(u)]
    optim = optimizer.memory_bytes(units) if optimizer is not None else 0
    out = {"param": param, "grad": grad, "optim": optim}
    if state.compression.grads is not None:
        out["residual"] = sum(r.numel() * r.element_size() for unit in state.units
                              if counted(unit) for r in unit.residuals.values())
    return out


def step_buffer_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the buffers the optimizer step leaves alive beside P and OS, read from the
    engine's state: {"synced_grad": every unit's synced G (until zero_grad), "gather":
    every post-step all-gather still in flight (send buffer + output)}. Read it right
    after ``step()`` with ``overlap_param_update=True``, before the updates land, to see
    the step's peak (cost.memory.step_bytes models the same buffers)."""
    state = root_state(model)
    synced = gather = 0
    for unit in state.units:
        if unit.synced_grad is not None:
            synced += unit.synced_grad.numel() * unit.synced_grad.element_size()
        if unit.pending_update is not None:
            pending = unit.pending_update
            for t in (pending.comm.result, pending.comm.input):
                gather += t.numel() * t.element_size()
    return {"synced_grad": synced, "gather": gather}


def _local(param):
    """A TP DTensor param's local piece (what this rank holds)."""
    return param.to_local() if hasattr(param, "to_local") else param
