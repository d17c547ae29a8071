"""The test model under context parallelism (cp ranks split each sequence, the attention
exchanges K and V over them) and an AMSP plan over the data-parallel world with the cp
ranks in it, trained like ``scenarios.amsp_training`` (same global batches, AdamW,
clipping): ``scenarios.reference_training`` over the world / cp batch-splitting ranks is
its single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .scenarios import (OPTIMIZERS, async_all_gathers, full_weights, make_model, shard_model,
                        train_steps)
from .tiny_llama import context_parallelize


def build_cp(plan, cp, ranks_per_node):
    """The test model split over cp ranks and sharded under ``plan`` (s_p, s_g, s_os of
    the world's data-parallel ranks, the cp ranks among them), and its AMSPOptimizer."""
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(*plan)
    mesh = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node, device_type="cpu", cp=cp)
    model = make_model(torch.float32)
    if cp > 1:
        context_parallelize(model, amsp.context_parallel_mesh(mesh))
    shard_model(model, mesh, sharding)
    cls, kwargs = OPTIMIZERS["adamw"]
    return model, amsp.AMSPOptimizer(model, cls, **kwargs)


def cp_training(rank, world_size, plan, cp, ranks_per_node, micro_batches, steps,
                record_step=1):
    """Train ``steps`` steps under ``plan`` with context-parallel degree ``cp``; returns
    losses, global grad norms, the whole weights (rank 0), the collectives of step
    ``record_step``, FSDP2's async all-gather settings and this rank's cp group."""
    from amsp_dtensor.engine.handle import root_state

    model, optim = build_cp(plan, cp, ranks_per_node)
    losses, norms, events = train_steps(model, optim, rank, world_size, range(steps),
                                        micro_batches, record_step, cp)
    optim.wait_param_update()
    weights = full_weights(model)
    cp_group = root_state(model).info.cp_mesh.get_group()
    return {"losses": losses, "norms": norms, "weights": weights if rank == 0 else None,
            "events": events, "async_all_gathers": async_all_gathers(model),
            "cp_ranks": dist.get_process_group_ranks(cp_group)}


def cp_checkpoints(rank, world_size, directory, ranks_per_node):
    """A job saved under one cp degree resumes under another. Every run sees the same
    global batches ((world / cp) x micro-batches is 4 throughout). Saved under cp 2
    ((2, 2, 4), 2 micro-batches) after 2 steps, then 2 more steps (the uninterrupted
    curve); loaded under cp 1 ((1, 1, 4), 1 micro-batch) and 2 steps. The reverse: saved
    under cp 1 ((2, 2, 2)) after 2 steps, 2 more; loaded under cp 4 ((4, 4, 4), 4
    micro-batches) and 2 steps; and saved under cp 1 ((2, 2, 2)), loaded under cp 2
    ((2, 2, 4), 2 micro-batches). Returns the curves of steps 2 and 3 (rank 0)."""
    from amsp_dtensor import checkpoint

    out = {}
    for name, (saved, resumed) in {"cp2_to_cp1": (((2, 2, 4), 2, 2), ((1, 1, 4), 1, 1)),
                                   "cp1_to_cp4": (((2, 2, 2), 1, 1), ((4, 4, 4), 4, 4)),
                                   "cp1_to_cp2": (((2, 2, 2), 1, 1), ((2, 2, 4), 2, 2))}.items():
        path = f"{directory}/{name}"
        (plan, cp, micro) = saved
        model, optim = build_cp(plan, cp, ranks_per_node)
        train_steps(model, optim, rank, world_size, range(2), micro, cp=cp)
        checkpoint.save(path, 2, model, optim)
        out[f"{name}/uninterrupted"] = train_steps(model, optim, rank, world_size,
                                                   range(2, 4), micro, cp=cp)[0]
        (plan, cp, micro) = resumed
        model, optim = build_cp(plan, cp, ranks_per_node)
        assert checkpoint.load(checkpoint.step_path(path, 2), model, optim) == 2
        out[f"{name}/resumed"] = train_steps(model, optim, rank, world_size, range(2, 4),
                                             micro, cp=cp)[0]
    return out if rank == 0 else None
