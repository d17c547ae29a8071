"""The gradient path's entry points: the hooks that hand each unit's P-shard grads to the
engine, and the public switches of the path (``no_sync``, the divide factor).

With s_p > 1 FSDP2 calls our all-reduce hook with its reduce-scatter output; with
s_p = 1 each param's post-accumulate-grad hook counts the unit's grads and, once the last
has arrived, flattens them in the gradient dtype. Either way the flat buffer goes to
``RootState.on_unit_grads`` (root.py), which orders the unit's stages (unit.py's Note).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import compat
from . import streams
from .handle import root_state
from .unit import AMSPUnit


def fsdp_grad_hook(unit: AMSPUnit):
    """FSDP2's all-reduce hook (s_p > 1): runs on the engine's grad stream."""

    def hook(reduce_output: torch.Tensor) -> None:
        unit.root.on_unit_grads(unit, reduce_output)
        unit.root.after_fsdp_hook(unit, reduce_output)

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


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` as a plain tensor laid out like the param's local piece. Under tensor
    parallelism autograd leaves DTensor grads whose placement may differ from the
    param's: Partial for a SequenceParallel norm (summed over the tp ranks here, an
    all-reduce) and Replicate for a RowwiseParallel embedding (this rank's rows taken);
    FSDP2 redistributes them the same way on its path (s_p > 1)."""
    grad = param.grad
    if isinstance(grad, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(grad.device_mesh, param.placements)
        return grad.to_local()
    return grad


def register_param_hooks(unit: AMSPUnit) -> None:
    """s_p = 1: each param's post-accumulate-grad hook feeds the unit's gradient path. The
    hook holds the unit weakly: [Note: post-accumulate-grad hooks and the garbage collector]
    in compat.py."""
    for param in unit.params:
        compat.register_post_accumulate_grad_hook(param, unit, _param_grad_hook)


def _param_grad_hook(unit: AMSPUnit, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook for the s_p = 1 path: flatten the unit's grads (in the
    gradient dtype) once the last of them has arrived (the unit's "bucket" is full)."""
    root = unit.root
    backward = root.begin_backward()
    seen = backward.grads_seen.get(id(unit), 0) + 1
    backward.grads_seen[id(unit)] = seen
    if seen < len(unit.params):
        return
    grads = [local_grad(p) for p in unit.params]
    compute = streams.current_stream(root.grad_stream)
    with streams.on_grad_stream(root.grad_stream):
        flat = torch.cat([g.reshape(-1).to(unit.grad_dtype()) for g in grads])
        # made on the compute stream: kept until it has waited for the flatten (rule 2)
        read = streams.Deferred.after_reads(compute, root.grad_stream, grads)
        for p in unit.params:
            p.grad = None
        root.on_unit_grads(unit, flat)
        root.hold(read)


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate grads locally (at their G size) without any cross-replica traffic.

    Use around every micro-batch's backward but the last, as with DDP's no_sync; the
    last backward, outside this context, runs the once-per-step gradient sync.
    """
    with root_state(model).grad_sync_suspended():
        yield


def set_gradient_divide_factor(model: nn.Module, factor: float | None) -> None:
    """Summed grads are divided by ``factor`` before the optimizer sees them.

    Default (None): the world size, i.e. grads are the mean over ranks (DDP/FSDP's
    default). Use 1.0 when the loss is already normalised globally (torchtitan does so).
    """
    if factor is not None and (isinstance(factor, bool) or not factor > 0):
        raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
    root_state(model).set_divide_factor(None if factor is None else float(factor))
