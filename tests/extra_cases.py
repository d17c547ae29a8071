"""Cases run inside the world-4 process group of tests/test_engine.py (CASES, name -> case):
hpZ (reshard_after_forward=int), optimizer checkpoints moved between plans, and
overlap_param_update's in-flight update met by a submodule forward, an in-place edit and
state_dict loads. Each returns what it measured; the test compares."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

import amsp_dtensor as amsp
from amsp_dtensor.testing.scenarios import (
    LR,
    global_batches,
    local_micro_batch,
    make_model,
    plan_mesh,
)
from amsp_dtensor.testing.tiny_llama import loss_fn


def _build(plan, reshard_after_forward=None):
    sharding = amsp.ShardingPlan(*plan)
    mesh = plan_mesh(sharding, 2)
    model = make_model(torch.float32)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding, reshard_after_forward=reshard_after_forward)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    return model


def _train(model, optim, rank, world, steps, first_step=0, recorder=None, max_norm=None):
    """One micro-batch per step (clipped to ``max_norm`` when given); the mean losses."""
    losses = []
    for step in range(first_step, first_step + steps):
        mb = local_micro_batch(global_batches(step, world, 1, model.cfg), rank, world, 0)
        with amsp.record_comms(recorder) if recorder is not None else contextlib.nullcontext():
            loss = loss_fn(model(mb[:, :-1]), mb[:, 1:])
            loss.backward()
            if max_norm is not None:
                optim.clip_grad_norm_(max_norm)
            optim.step()
            optim.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def hpz_case(rank, world):
    """hpZ: the numbers of plain ZeRO-3-in-a-plan, with the backward all-gather on the
    2-rank group; the losses of both and the collectives hpZ issued."""
    plain = _build((4, 4, 4))
    plain_optim = amsp.AMSPOptimizer(plain, torch.optim.AdamW, lr=LR)
    hpz = _build((4, 4, 4), reshard_after_forward=2)
    hpz_optim = amsp.AMSPOptimizer(hpz, torch.optim.AdamW, lr=LR)
    recorder = amsp.CommRecorder()
    out = {"plain_losses": _train(plain, plain_optim, rank, world, 3),
           "hpz_losses": _train(hpz, hpz_optim, rank, world, 3, recorder=recorder)}
    out["hpz_events"] = sorted({(e.op, e.dim, e.group_size, e.inter_node, e.phase)
                                for e in recorder.events})
    return out


def optimizer_checkpoint_case(rank, world):
    """Train under (2,2,4), move model + optimizer state to (1,4,4), continue both: the
    state's types, the loaded lr, and the losses of the source and the target."""
    source = _build((2, 2, 4))
    source_optim = amsp.AMSPOptimizer(source, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    _train(source, source_optim, rank, world, 3)
    # model.state_dict() (here via DCP's helper) first lands the weights that the last
    # step's overlapped all-gather is still bringing
    full = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(source, options=full)
    optim_state = source_optim.state_dict()
    out = {"optim_state_types": sorted(
        {type(v).__name__ for entry in optim_state["state"].values() for v in entry.values()})}
    target = _build((1, 4, 4))
    set_model_state_dict(target, model_state, options=full)
    target_optim = amsp.AMSPOptimizer(target, torch.optim.AdamW, lr=0.0)
    target_optim.load_state_dict(optim_state)
    out["loaded_lr"] = target_optim.param_groups[0]["lr"]
    out["source_continued"] = _train(source, source_optim, rank, world, 3, first_step=3)
    out["target_continued"] = _train(target, target_optim, rank, world, 3, first_step=3)
    return out


def submodule_forward_case(rank, world):
    """overlap_param_update=True, s_p = 1: one submodule of a unit run on its own right
    after the step (zero_grad does not land the update); its output and that of the same
    submodule trained without the overlap."""
    overlapped = _build((1, 1, 4))
    overlapped_optim = amsp.AMSPOptimizer(overlapped, torch.optim.AdamW, lr=LR,
                                          overlap_param_update=True)
    plain = _build((1, 1, 4))
    plain_optim = amsp.AMSPOptimizer(plain, torch.optim.AdamW, lr=LR)
    _train(overlapped, overlapped_optim, rank, world, 1)
    _train(plain, plain_optim, rank, world, 1)
    x = torch.ones(2, overlapped.cfg.dim)
    pending = overlapped_optim.param_update_pending
    return {"pending_after_zero_grad": pending,
            "overlapped_output": overlapped.layers[0].attention.wq(x).detach(),
            "plain_output": plain.layers[0].attention.wq(x).detach()}


def edited_case(rank, world, plan):
    """One step, block 0's wq halved in place, one more step: that weight, whole. fp32
    params are their own masters, so the edit is what the second step updates."""
    model = _build(plan)
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR)
    _train(model, optim, rank, world, 1)
    with torch.no_grad():
        model.layers[0].attention.wq.weight.mul_(0.5)
    _train(model, optim, rank, world, 1, first_step=1)
    w = model.layers[0].attention.wq.weight
    return (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()


EXTRA_PLANS = {"p2-g2-os4": (2, 2, 4), "p1-g1-os4": (1, 1, 4)}


def _cloned(value):
    """A copy of a state dict whose tensors (DTensors too) are cloned (a deepcopy would
    try to copy the process groups of the DTensors' mesh)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _full_values(state_dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state_dict.items()}


def pending_io_case(rank, world, plan):
    """overlap_param_update=True, each read right after a step (its update in flight): a
    submodule's state_dict() next to the same submodule's of a run without the overlap;
    the model's full state saved a step earlier, and the full state read back after
    model.load_state_dict() and after optimizer.load_state_dict() of the states saved
    then, each done while the next step's update is in flight (an update landing after
    the load would overwrite it)."""
    model = _build(plan)
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR, overlap_param_update=True)
    plain = _build(plan)
    plain_optim = amsp.AMSPOptimizer(plain, torch.optim.AdamW, lr=LR)
    _train(model, optim, rank, world, 1)
    _train(plain, plain_optim, rank, world, 1)
    out = {"pending_before_read": optim.param_update_pending,
           "submodule": _full_values(model.layers[1].state_dict()),
           "submodule_without_overlap": _full_values(plain.layers[1].state_dict())}
    saved_model = _cloned(model.state_dict())
    saved_optim = _cloned(optim.state_dict())
    out["saved"] = _full_values(saved_model)
    _train(model, optim, rank, world, 1, first_step=1)
    out["pending_before_model_load"] = optim.param_update_pending
    model.load_state_dict(saved_model)
    out["after_model_load"] = _full_values(model.state_dict())
    _train(model, optim, rank, world, 1, first_step=2)
    out["pending_before_optim_load"] = optim.param_update_pending
    optim.load_state_dict(saved_optim)
    out["after_optim_load"] = _full_values(model.state_dict())
    return out


CASES = {
    "hpz": hpz_case,
    "optimizer checkpoint": optimizer_checkpoint_case,
    "submodule forward": submodule_forward_case,
    **{("edited", name): partial(edited_case, plan=plan) for name, plan in EXTRA_PLANS.items()},
    **{("pending io", name): partial(pending_io_case, plan=plan)
       for name, plan in EXTRA_PLANS.items()},
}
