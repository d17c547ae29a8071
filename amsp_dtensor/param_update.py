"""After the optimizer step: the new weights, fp32 masters in the OS layout, back to the P
shards (bf16 or the model's dtype).

Each rank's OS rows are a sub-chunk of its own P rows. When s_os = s_p they are the same
rows and the update is a local copy. Otherwise the s_os/s_p ranks that split one P shard
all-gather their OS rows ("the OS subgroup", layouts.py) and each unpacks the P rows.

``send`` issues that all-gather and leaves the unit SENDING; ``land`` waits for it and
unpacks, leaving it UPDATED. ``AMSPOptimizer.step()`` lands every unit before it returns,
unless ``overlap_param_update=True``, when the next forward's pre-hook of each unit lands
it (so the all-gather overlaps that forward), or a ``state_dict()`` or
``load_state_dict()`` (the model's, any submodule's, the optimizer's) or
``wait_param_update()`` do.

[Note: writes while an update is in flight] Landing writes every P row of the unit,
this rank's own included (from the send buffer), so an in-place write to a parameter
made between ``step()`` and the landing (``p.mul_()``, ``p.copy_()``) would be
overwritten without a trace. ``send`` therefore records the params' version counters
(AMSPUnit.write_versions) and ``land`` compares them: if they moved, it still lands (the
engine stays consistent and training can go on) and then raises ParamWrittenWhilePending,
naming the parameters and the fix. The loads above land first, so they are not such
writes. A write through ``p.data`` moves no counter and cannot be seen.
"""

from __future__ import annotations

import torch

from . import streams
from .collectives import Collectives
from .lifecycle import StepState
from .state import AMSPUnit, PendingUpdate


class ParamWrittenWhilePending(RuntimeError):
    """A parameter was written in place while its post-step all-gather was in flight."""


@torch.no_grad()
def send(unit: AMSPUnit, masters: list, collectives: Collectives) -> None:
    """After a step (SYNCED): local copy if s_os == s_p (UPDATED), else issue the
    all-gather over the OS subgroup (SENDING)."""
    issued = _issue(unit, masters, collectives)
    unit.pending_update = None if issued is None else PendingUpdate(
        *issued, versions=unit.write_versions())
    unit.lifecycle.to(StepState.SENDING if unit.pending_update else StepState.UPDATED)


@torch.no_grad()
def land(unit: AMSPUnit) -> None:
    """Land the all-gathered new P rows of ``unit`` (no-op unless SENDING); raises
    ParamWrittenWhilePending, after landing, if a param was written in the meantime."""
    written = _land(unit)
    if written:
        raise ParamWrittenWhilePending(_written_message(written))


def land_all(units: list[AMSPUnit]) -> None:
    """Land every unit, then raise ParamWrittenWhilePending if any param was written."""
    written = [fqn for unit in units for fqn in _land(unit)]
    if written:
        raise ParamWrittenWhilePending(_written_message(written))


def check_not_written(units: list[AMSPUnit]) -> None:
    """Land everything and raise if a param with an update in flight was written (the
    root's pre-forward: before any unit's forward starts)."""
    if any(unit.pending_update is not None and unit.write_versions() != unit.pending_update.versions
           for unit in units):
        land_all(units)


@torch.no_grad()
def overwrite(unit: AMSPUnit, masters: list, collectives: Collectives) -> None:
    """Masters -> P now (a checkpoint was loaded; nothing may be in flight)."""
    assert unit.pending_update is None, "land the update before loading the masters"
    issued = _issue(unit, masters, collectives)
    if issued is not None:
        _unpack(unit, issued[0])


@torch.no_grad()
def _land(unit: AMSPUnit) -> list[str]:
    """Land ``unit``'s update; the FQNs of its params written since it was sent."""
    pending = unit.pending_update
    if pending is None:
        return []
    now = unit.write_versions()
    n = len(unit.params)  # versions: each param's, then (FSDP) each local tensor's
    moved = sorted({i % n for i, (a, b) in enumerate(zip(now, pending.versions)) if a != b})
    names = unit.param_fqns if len(unit.param_fqns) == n else [unit.name] * n
    written = list(dict.fromkeys(names[i] for i in moved))
    unit.pending_update = None
    _unpack(unit, pending.comm)
    unit.lifecycle.to(StepState.UPDATED)
    return written


def _written_message(fqns: list[str]) -> str:
    shown = ", ".join(fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
    return (
        f"parameter(s) {shown} were written in place while the last step's update of them "
        "was still in flight (overlap_param_update=True), and landing that update has now "
        "overwritten the write: call optimizer.wait_param_update() after step() and before "
        "editing parameters, or build AMSPOptimizer with overlap_param_update=False"
    )


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


def _unpack(unit: AMSPUnit, comm) -> None:
    k = unit.info.os_split[0]
    gathered = comm.wait().view(k, -1)
    unit.p_layout.unpack_into(gathered, k, unit.local_params())
    if unit.uses_fsdp:
        streams.order_before_copy_in(unit.module)


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
