"""After the optimizer step: the new weights, fp32 masters in the OS layout, back to the P
shards (bf16 or the model's dtype).

Each rank's OS rows are a sub-chunk of its own P rows. When s_os = s_p they are the same
rows and the update is a local copy. Otherwise the s_os/s_p ranks that split one P shard
all-gather their OS rows ("the OS subgroup", layouts.py) and each unpacks the P rows.

``send`` issues that all-gather and leaves the unit SENDING; ``land`` waits for it and
unpacks, leaving it UPDATED. ``AMSPOptimizer.step()`` lands every unit before it returns,
unless ``overlap_param_update=True``, when the next forward's pre-hook of each unit lands
it (so the all-gather overlaps that forward), or ``state_dict()`` or
``wait_param_update()`` do.
"""

from __future__ import annotations

import torch

from . import streams
from .collectives import Collectives
from .lifecycle import StepState
from .state import AMSPUnit


@torch.no_grad()
def send(unit: AMSPUnit, masters: list, collectives: Collectives) -> None:
    """After a step (SYNCED): local copy if s_os == s_p (UPDATED), else issue the
    all-gather over the OS subgroup (SENDING)."""
    unit.pending_update = _issue(unit, masters, collectives)
    unit.lifecycle.to(StepState.SENDING if unit.pending_update else StepState.UPDATED)


@torch.no_grad()
def land(unit: AMSPUnit) -> None:
    """Land the all-gathered new P rows of ``unit`` (no-op unless SENDING)."""
    if unit.pending_update is None:
        return
    pending, unit.pending_update = unit.pending_update, None
    _unpack(unit, pending)
    unit.lifecycle.to(StepState.UPDATED)


@torch.no_grad()
def overwrite(unit: AMSPUnit, masters: list, collectives: Collectives) -> None:
    """Masters -> P now, whatever the unit's step state (a checkpoint was loaded)."""
    land(unit)
    pending = _issue(unit, masters, collectives)
    if pending is not None:
        _unpack(unit, pending)


def _issue(unit: AMSPUnit, masters: list, collectives: Collectives):
    p_locals = unit.local_params()
    k = unit.info.os_split[0]
    if k == 1:
        for dest, master in zip(p_locals, masters):
            src = master.to_local().view(dest.shape)
            if src.data_ptr() != dest.data_ptr():  # an fp32 P shard is its own master
                dest.copy_(src)
        return None
    send_buf = torch.zeros(unit.os_layout.numel, dtype=p_locals[0].dtype, device=p_locals[0].device)
    for view, master in zip(unit.os_layout.views(send_buf), masters):
        view.copy_(master.to_local().reshape(view.shape))
    gathered = send_buf.new_empty(k, unit.os_layout.numel)
    pending = collectives.all_gather(gathered.view(-1), send_buf, unit.info.os_subgroup_dim,
                                     phase="step")
    return pending, send_buf


def _unpack(unit: AMSPUnit, pending) -> None:
    comm, _send_buf = pending
    k = unit.info.os_split[0]
    gathered = comm.wait().view(k, -1)
    unit.p_layout.unpack_into(gathered, k, unit.local_params())
    if unit.uses_fsdp:
        streams.order_before_copy_in(unit.module)


def land_all(units: list[AMSPUnit]) -> None:
    for unit in units:
        land(unit)


def pending(units: list[AMSPUnit]) -> bool:
    return any(unit.pending_update is not None for unit in units)


# [Note: nothing in flight at exit]
# With overlap_param_update=True the last step's all-gathers are still in flight when a
# script ends without another forward. Call optimizer.wait_param_update() (or
# model.state_dict(), or a forward) before dist.destroy_process_group() and exit; the
# torchtitan trainer does at its last step, and every test does. Landing them from an
# atexit hook instead was tried and made gloo abort more often at exit ("terminate called
# without an active exception", 2 of 8 runs with the hook, 0 of 8 without), since the
# wait then runs while the interpreter is being finalized.
