"""After the optimizer step: the new weights, fp32 masters in the OS layout, back to the P
shards (bf16 or the model's dtype).

Each rank's OS rows are a sub-chunk of its own P rows. When s_os = s_p they are the same
rows and the update is a local copy. Otherwise the s_os/s_p ranks that split one P shard
all-gather their OS rows ("the OS subgroup", layouts.py) and each unpacks the P rows.

``AMSPUnit.send`` issues that all-gather (``issue`` below) and leaves the unit SENDING;
``AMSPUnit.land`` waits for it and unpacks (``unpack``), leaving it UPDATED.
``AMSPOptimizer.step()`` lands every unit before it returns, unless
``overlap_param_update=True``, when the next forward's pre-hook of each unit lands it (so
the all-gather overlaps that forward), or a ``state_dict()`` or ``load_state_dict()`` (the
model's, any submodule's, the optimizer's) or ``wait_param_update()`` do.

[Note: writes while an update is in flight] Landing writes every P row of the unit,
this rank's own included (from the send buffer), so an in-place write to a parameter
made between ``step()`` and the landing (``p.mul_()``, ``p.copy_()``) would be
overwritten without a trace. With overlap_param_update=True, ``send`` therefore records
the params' version counters (AMSPUnit.write_versions) and ``land`` compares them: if
they moved, it still lands (the engine stays consistent and training can go on) and then
ParamWrittenWhilePending is raised, naming the parameters and the fix. (Without it,
``step()`` lands before it returns: no user code runs in between, nothing is recorded.)
The loads above land first, so they are not such writes. A write through ``p.data``
moves no counter and cannot be seen.
"""

from __future__ import annotations

import torch

from .. import compat
from . import compression, streams
from .collectives import Collectives

# "AMSPUnit" below is unit.AMSPUnit, which calls these functions (not imported here).


class ParamWrittenWhilePending(RuntimeError):
    """A parameter was written in place while its post-step all-gather was in flight."""


def land(unit: "AMSPUnit") -> None:
    """Land ``unit``'s update (no-op unless SENDING); raises ParamWrittenWhilePending,
    after landing, if a param was written in the meantime."""
    written = unit.land()
    if written:
        raise ParamWrittenWhilePending(_written_message(written))


def land_all(units: list["AMSPUnit"]) -> None:
    """Land every unit, then raise ParamWrittenWhilePending if any param was written."""
    written = [fqn for unit in units for fqn in unit.land()]
    if written:
        raise ParamWrittenWhilePending(_written_message(written))


def check_not_written(units: list["AMSPUnit"]) -> None:
    """Land everything and raise if a param with an update in flight was written (the
    root's pre-forward: before any unit's forward starts)."""
    if any(unit.written_while_pending() for unit in units):
        land_all(units)


def pending(units: list["AMSPUnit"]) -> bool:
    return any(unit.pending_update is not None for unit in units)


def _written_message(fqns: list[str]) -> str:
    shown = ", ".join(fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
    return (
        f"parameter(s) {shown} were written in place while the last step's update of them "
        "was still in flight (overlap_param_update=True), and landing that update has now "
        "overwritten the write: call optimizer.wait_param_update() after step() and before "
        "editing parameters, or build AMSPOptimizer with overlap_param_update=False"
    )


@torch.no_grad()
def issue(unit: "AMSPUnit", masters: list, collectives: Collectives,
          masters_are_p: bool = False):
    """Masters -> P shards: copies locally when s_os = s_p (None; nothing to copy when
    ``masters_are_p``: every master is a view of its P shard's rows), else issues the
    all-gather over the OS subgroup: its PendingComm, which owns the send buffer
    (``input``) and the gathered rows (``result``) until the update lands."""
    k = unit.info.os_split[0]
    if k == 1 and masters_are_p:
        return None
    sources = [compat.dtensor_local(master) for master in masters]
    if k == 1:
        p_locals = unit.local_params()
        # an fp32 P shard is its own master: nothing to copy
        pairs = [(dest, src.view(dest.shape)) for dest, src in zip(p_locals, sources)
                 if src.data_ptr() != dest.data_ptr()]
        if pairs:
            compat.foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        return None
    layout, p_local = unit.os_layout, unit.first_local()
    if layout.dense:
        # the masters laid end to end, cast to the P dtype: one kernel, as FSDP2's copy-in
        send_buf = torch.empty(layout.numel, dtype=p_local.dtype, device=p_local.device)
        compat.chunk_cat(sources, 1, send_buf.view(1, -1))
    else:
        # padded slots: zero-filled, each master copied into its slot's real rows
        send_buf = torch.zeros(layout.numel, dtype=p_local.dtype, device=p_local.device)
        views = layout.views(send_buf)
        compat.foreach_copy_(views, [src.reshape(view.shape) for view, src in zip(views, sources)])
    if codec := unit.weight_codec():
        # every rank, this one included, lands the values dequantized from the same bytes
        return compression.all_gather(collectives, send_buf, unit.info.os_subgroup_dim,
                                      "step", codec)
    gathered = send_buf.new_empty(k, unit.os_layout.numel)
    return collectives.all_gather(gathered.view(-1), send_buf, unit.info.os_subgroup_dim,
                                  phase="step")


@torch.no_grad()
def unpack(unit: "AMSPUnit", comm) -> None:
    """Wait for the all-gather and write every P row of the unit from it."""
    k = unit.info.os_split[0]
    gathered = comm.wait().view(k, -1)
    unit.p_layout.unpack_into(gathered, k, unit.local_params())
    if unit.uses_fsdp:
        streams.order_before_copy_in(unit.module)


# [Note: nothing in flight at exit]
# With overlap_param_update=True the last step's all-gathers are still in flight when a
# script ends without another forward. Call optimizer.wait_param_update() (or
# model.state_dict(), or a forward) before dist.destroy_process_group() and exit; the
# torchtitan trainer does at its last step, and every test does. Landing them from an
# atexit hook instead was tried and made gloo abort more often at exit ("terminate called
# without an active exception", 2 of 8 runs with the hook, 0 of 8 without), since the
# wait then runs while the interpreter is being finalized.
