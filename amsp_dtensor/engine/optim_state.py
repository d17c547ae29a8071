"""The optimizer's checkpoint format: what ``AMSPOptimizer.state_dict()`` offers and
``load_state_dict()`` takes, apart from the optimizer itself.

Entries are keyed by parameter FQN; the master and every state with one value per row of
it (states shaped like the param, Adafactor's row factor) are DTensors in the OS layout,
so DCP saves and reshards them; scalars (``step``) and states that do not follow the rows
stay plain. A value saved under another plan or world size is brought to this rank's OS
rows (``to_os_layout``). Before the first step torch optimizers have no state to offer, so
``materialize_placeholder`` makes one (see its docstring), and the param groups of a
checkpoint are matched to the wrapped optimizer's (``saved_groups``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .. import compat
from .layouts import gather_full


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def row_sharded(key: str, value, master_local: torch.Tensor) -> bool:
    """Whether an optimizer state holds one value per row of the master (sharded with it):
    states shaped like the param, and Adafactor's row factor."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return value.shape == master_local.shape or key == "row_var"


def as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's rows of a tensor sharded like ``like`` (same rows; its trailing dims
    may differ, as Adafactor's row factor's do, which is not used with TP)."""
    if local.shape == like.to_local().shape:
        shape = like.shape
    else:
        shape = torch.Size((like.shape[0], *local.shape[1:]))
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=shape, stride=contiguous_stride(shape))


def to_os_layout(value: torch.Tensor, like: DTensor) -> DTensor:
    """A saved value (a DTensor of any layout, or a full tensor) as this rank's part of
    ``like``'s OS layout: its rows, and under TP its columns too where TP splits them
    (Shard(1)); trailing dims the state does not share with the param (a factor) stay
    whole. Raises ValueError when the value cannot belong to the param."""
    if isinstance(value, DTensor):
        if value.device_mesh == like.device_mesh and value.placements == like.placements:
            return value
        value = gather_full(value)
    full = value.to(like.dtype)
    if full.dim() != like.dim() or (full.dim() and full.shape[0] != like.shape[0]):
        raise ValueError(f"optimizer state of shape {tuple(full.shape)} does not fit param "
                         f"{tuple(like.shape)}")
    local = like.to_local()
    if not full.dim():
        return DTensor.from_local(full.clone(), like.device_mesh, like.placements,
                                  run_check=False, shape=full.shape, stride=())
    offset = compat.global_offset(like)
    index = tuple(slice(o, o + n) if d == 0 or full.shape[d] == like.shape[d] else slice(None)
                  for d, (o, n) in enumerate(zip(offset, local.shape)))
    return DTensor.from_local(full[index].clone(), like.device_mesh, like.placements,
                              run_check=False, shape=full.shape,
                              stride=contiguous_stride(full.shape))


@torch.no_grad()
def materialize_placeholder(inner: torch.optim.Optimizer, params: list) -> None:
    """Create ``inner``'s per-parameter state before its first step.

    torch optimizers create their state in the first step(), and DCP (torchtitan's
    checkpointer) loads only the tensors a state_dict() offers: resuming into a fresh
    optimizer would silently drop exp_avg/exp_avg_sq/step. As
    torch.distributed.checkpoint.state_dict._init_optim_state does, step once with zero
    grads, lr 0 (params unchanged) and, unlike it, weight_decay 0 (Adam's L2 term would
    put wd*param into the moments); step counters go back to 0. The grads ``params``
    hold (clip_grad_norm_ may have prepared the coming step's) are put back. Not every
    optimizer's placeholder equals its fresh state (NAdam's mu_product, Rprop's
    step_size): the caller marks it as a placeholder."""
    prepared = [param.grad for param in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    saved = [{k: group[k] for k in ("lr", "weight_decay") if k in group}
             for group in inner.param_groups]
    for group, values in zip(inner.param_groups, saved):
        for key, value in values.items():
            group[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0
    try:
        inner.step()
    finally:
        for group, values in zip(inner.param_groups, saved):
            group.update(values)
        for param, grad in zip(params, prepared):
            param.grad = grad
    for param_state in inner.state.values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"].zero_()
        elif "step" in param_state:
            param_state["step"] = 0


def saved_groups(saved: list[dict], inner_groups: list[dict], fqn_of) -> list[dict]:
    """The saved param groups (params as FQNs) in the wrapped optimizer's order, each
    holding the inner indices of its parameters (``fqn_of(k)``: the FQN of inner index k;
    group g of ``inner_groups`` is a slice of them): the checkpoint must group the
    parameters as this optimizer does (torch's rule); its hyperparameters (lr, ...) are
    restored."""
    by_fqn = {fqn: g for g in saved for fqn in g["params"]}
    groups, start = [], 0
    for group in inner_groups:
        inner = range(start, start + len(group["params"]))
        start = inner.stop
        fqns = [fqn_of(k) for k in inner]
        match = by_fqn.get(fqns[0])
        if match is None or set(match["params"]) != set(fqns):
            raise ValueError(
                "the checkpoint's optimizer groups the parameters differently from this "
                f"one: its group of {fqns[0]!r} holds "
                f"{len(match['params']) if match else 0} parameters, this one's "
                f"{len(fqns)}; build AMSPOptimizer with the param_groups it was saved with")
        groups.append(dict(match, params=list(inner)))
    return groups
