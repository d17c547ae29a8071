"""AMSP under tensor parallelism, as the multi-rank tests run it: the tiny llama split by
torchtitan's TP plan over the mesh's "tp" dim, then sharded by AMSP over the
data-parallel dims, trained like ``scenarios.amsp_training`` (same batches per DP rank,
AdamW, clipping), so ``scenarios.reference_training`` over the DP world is its
single-process reference."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .scenarios import (
    MAX_NORM,
    OPTIMIZERS,
    full_weights,
    global_batches,
    local_micro_batch,
    make_model,
    shard_model,
)
from .tiny_llama import loss_fn, tensor_parallelize


def tp_training(rank, world_size, plan, tp, ranks_per_node, micro_batches, steps,
                read_steps=0, record_step=1, overlap=False):
    """Train under ``plan`` (s_p, s_g, s_os of the DP world) with tensor-parallel degree
    ``tp``; returns losses, global grad norms, the weights read through
    ``model.parameters()`` after each of the first ``read_steps`` steps and at the end
    (rank 0), this rank's bytes per state, and the collectives of step ``record_step``."""
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(*plan)
    mesh = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node, device_type="cpu", tp=tp)
    model = make_model(torch.float32)
    tensor_parallelize(model, mesh["tp"])
    shard_model(model, mesh, sharding)  # every block, then the root
    cls, kwargs = OPTIMIZERS["adamw"]
    optim = amsp.AMSPOptimizer(model, cls, overlap_param_update=overlap, **kwargs)
    dp_world, dp_rank = world_size // tp, rank // tp
    recorder = amsp.CommRecorder()
    losses, norms, step_weights, memory = [], [], [], {}
    for step in range(steps):
        batch = global_batches(step, dp_world, micro_batches, model.cfg)
        record = amsp.record_comms(recorder) if step == record_step else contextlib.nullcontext()
        total = torch.zeros(1)
        with record:
            for micro in range(micro_batches):
                mb = local_micro_batch(batch, dp_rank, dp_world, micro)
                last = micro == micro_batches - 1
                with contextlib.nullcontext() if last else amsp.no_sync(model):
                    loss = loss_fn(model(mb[:, :-1]), mb[:, 1:]) / micro_batches
                    loss.backward()
                total += loss.detach()
                if step == 0 and micro == 0 and micro_batches > 1:
                    memory["grad"] = amsp.memory_by_state(model)["grad"]
            norms.append(optim.clip_grad_norm_(MAX_NORM).item())
            optim.step()
            if step < read_steps:
                if overlap:
                    optim.wait_param_update()
                step_weights.append(full_weights(model))
            optim.zero_grad()
        dist.all_reduce(total)  # every tp rank of a DP rank holds the same loss
        losses.append(total.item() / world_size)
    mem = amsp.memory_by_state(model, optim)
    memory["param"], memory["optim"] = mem["param"], mem["optim"]
    optim.wait_param_update()
    weights = full_weights(model)
    return {
        "losses": losses,
        "norms": norms,
        "weights": weights if rank == 0 else None,
        "step_weights": step_weights if rank == 0 else None,
        "memory": memory,
        "events": [e.key() for e in recorder.events],
    }
