"""hpZ (reshard_after_forward=int) and optimizer checkpoints moved between plans, run
inside the world-4 process group."""

from __future__ import annotations

import contextlib

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


def _train(model, optim, rank, world, steps, first_step=0, recorder=None):
    losses = []
    for step in range(first_step, first_step + steps):
        mb = local_micro_batch(global_batches(step, world, 1, model.cfg), rank, world, 0)
        with amsp.record_comms(recorder) if recorder is not None else contextlib.nullcontext():
            loss = loss_fn(model(mb[:, :-1]), mb[:, 1:])
            loss.backward()
            optim.step()
            optim.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def run_extra_cases(rank, world):
    out = {}
    # hpZ: same numbers as plain ZeRO-3-in-a-plan, backward all-gather on the 2-rank group
    plain = _build((4, 4, 4))
    plain_optim = amsp.AMSPOptimizer(plain, torch.optim.AdamW, lr=LR)
    hpz = _build((4, 4, 4), reshard_after_forward=2)
    hpz_optim = amsp.AMSPOptimizer(hpz, torch.optim.AdamW, lr=LR)
    recorder = amsp.CommRecorder()
    out["plain_losses"] = _train(plain, plain_optim, rank, world, 3)
    out["hpz_losses"] = _train(hpz, hpz_optim, rank, world, 3, recorder=recorder)
    out["hpz_events"] = sorted({(e.op, e.dim, e.group_size, e.inter_node, e.phase) for e in recorder.events})

    # checkpoint: train under (2,2,4), move model + optimizer state to (1,4,4), continue
    source = _build((2, 2, 4))
    source_optim = amsp.AMSPOptimizer(source, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    _train(source, source_optim, rank, world, 3)
    # model.state_dict() (here via DCP's helper) first lands the weights that the last
    # step's overlapped all-gather is still bringing
    full = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(source, options=full)
    optim_state = source_optim.state_dict()
    out["optim_state_types"] = sorted(
        {type(v).__name__ for entry in optim_state["state"].values() for v in entry.values()}
    )
    target = _build((1, 4, 4))
    set_model_state_dict(target, model_state, options=full)
    target_optim = amsp.AMSPOptimizer(target, torch.optim.AdamW, lr=0.0)
    target_optim.load_state_dict(optim_state)
    out["loaded_lr"] = target_optim.param_groups[0]["lr"]
    out["source_continued"] = _train(source, source_optim, rank, world, 3, first_step=3)
    out["target_continued"] = _train(target, target_optim, rank, world, 3, first_step=3)

    # overlap_param_update=True, s_p = 1: running one submodule of a unit on its own right
    # after the step (zero_grad does not land the update) sees the new weights
    overlapped = _build((1, 1, 4))
    overlapped_optim = amsp.AMSPOptimizer(overlapped, torch.optim.AdamW, lr=LR, overlap_param_update=True)
    plain = _build((1, 1, 4))
    plain_optim = amsp.AMSPOptimizer(plain, torch.optim.AdamW, lr=LR)
    _train(overlapped, overlapped_optim, rank, world, 1)
    _train(plain, plain_optim, rank, world, 1)
    x = torch.ones(2, overlapped.cfg.dim)
    out["pending_after_zero_grad"] = overlapped_optim.param_update_pending
    out["submodule_output_equal"] = torch.equal(overlapped.layers[0].attention.wq(x),
                                                plain.layers[0].attention.wq(x))

    # fp32 params are their own masters: an in-place edit of the weights between steps (a
    # rescale, a model load_state_dict) is what the next step updates, as with torch.optim;
    # the same edit made to the single-process reference's params gives the same weights
    edited, reference = {}, {}
    for name, plan in (("p2-g2-os4", (2, 2, 4)), ("p1-g1-os4", (1, 1, 4))):
        model = _build(plan)
        optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR)
        _train(model, optim, rank, world, 1)
        with torch.no_grad():
            model.layers[0].attention.wq.weight.mul_(0.5)
        _train(model, optim, rank, world, 1, first_step=1)
        w = model.layers[0].attention.wq.weight
        edited[name] = (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()
        reference[name] = _reference_with_edit(rank, world)
    out["edited"] = edited
    out["edited_reference"] = reference
    out["pending_io"] = {name: _state_dicts_with_an_update_in_flight(plan, rank, world)
                         for name, plan in (("p2-g2-os4", (2, 2, 4)), ("p1-g1-os4", (1, 1, 4)))}
    return out


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


def _all_equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _state_dicts_with_an_update_in_flight(plan, rank, world):
    """overlap_param_update=True, each check right after a step (its update in flight):
    a submodule's state_dict() holds the step's weights; model.load_state_dict() and
    optimizer.load_state_dict() of the states saved a step earlier are what the weights
    hold afterwards (an update landing after them would overwrite them)."""
    model = _build(plan)
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR, overlap_param_update=True)
    plain = _build(plan)
    plain_optim = amsp.AMSPOptimizer(plain, torch.optim.AdamW, lr=LR)
    _train(model, optim, rank, world, 1)
    _train(plain, plain_optim, rank, world, 1)
    out = {"pending_before_read": optim.param_update_pending}
    got = _full_values(model.layers[1].state_dict())
    want = _full_values(plain.layers[1].state_dict())
    out["submodule_read_exact"] = _all_equal(got, want)
    saved_model = _cloned(model.state_dict())
    saved_optim = _cloned(optim.state_dict())
    want = _full_values(saved_model)
    _train(model, optim, rank, world, 1, first_step=1)
    out["pending_before_model_load"] = optim.param_update_pending
    model.load_state_dict(saved_model)
    got = _full_values(model.state_dict())
    out["model_load_kept"] = _all_equal(got, want)
    _train(model, optim, rank, world, 1, first_step=2)
    out["pending_before_optim_load"] = optim.param_update_pending
    optim.load_state_dict(saved_optim)
    got = _full_values(model.state_dict())
    out["optim_load_kept"] = _all_equal(got, want)
    return out


def _reference_with_edit(rank, world):
    """One process, the whole batch, plain AdamW: step 0, wq of block 0 halved, step 1."""
    model = make_model(torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        if step == 1:
            with torch.no_grad():
                model.layers[0].attention.wq.weight.mul_(0.5)
        batch = global_batches(step, world, 1, model.cfg)
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        optim.step()
        optim.zero_grad()
    return model.layers[0].attention.wq.weight.detach().clone()

