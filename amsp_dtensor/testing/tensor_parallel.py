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
    async_all_gathers,
    full_weights,
    global_batches,
    local_micro_batch,
    make_model,
    shard_model,
)
from .tiny_llama import loss_fn, tensor_parallelize


def build(plan, tp, ranks_per_node, overlap=False):
    """The tiny llama, TP over mesh["tp"], sharded by ``plan``, and its AMSPOptimizer."""
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(*plan)
    mesh = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node, device_type="cpu", tp=tp)
    model = make_model(torch.float32)
    if tp > 1:
        tensor_parallelize(model, mesh["tp"])
    shard_model(model, mesh, sharding)  # every block, then the root
    cls, kwargs = OPTIMIZERS["adamw"]
    return model, amsp.AMSPOptimizer(model, cls, overlap_param_update=overlap, **kwargs)


def train(model, optim, rank, world_size, tp, micro_batches, steps, first_step=0,
          read_steps=0, record_step=None, memory=None):
    """Steps ``first_step`` .. ``first_step + steps - 1``; the global batch of a step is
    the same for any DP world with the same dp * micro_batches. Returns (losses, norms,
    weights read after each of the first ``read_steps`` steps, events of ``record_step``)."""
    import amsp_dtensor as amsp

    dp_world, dp_rank = world_size // tp, rank // tp
    recorder = amsp.CommRecorder()
    losses, norms, step_weights = [], [], []
    for step in range(first_step, first_step + steps):
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
                if memory is not None and step == first_step and micro == 0 and micro_batches > 1:
                    memory["grad"] = amsp.memory_by_state(model)["grad"]
            norms.append(optim.clip_grad_norm_(MAX_NORM).item())
            optim.step()
            if step - first_step < read_steps:
                optim.wait_param_update()
                step_weights.append(full_weights(model))
            optim.zero_grad()
        dist.all_reduce(total)  # every tp rank of a DP rank holds the same loss
        losses.append(total.item() / world_size)
    return losses, norms, step_weights, [e.key() for e in recorder.events]


def full_optimizer_state(optim) -> dict:
    """Every optimizer state as a whole tensor (a collective: every rank calls it)."""
    from amsp_dtensor import gather_full

    out = {}
    for fqn, entry in optim.state_dict()["state"].items():
        out[fqn] = {k: (gather_full(v) if hasattr(v, "device_mesh") else v).detach().clone()
                    for k, v in entry.items()}
    return out


def tp_training(rank, world_size, plan, tp, ranks_per_node, micro_batches, steps,
                read_steps=0, record_step=1, overlap=False):
    """Train under ``plan`` (s_p, s_g, s_os of the DP world) with tensor-parallel degree
    ``tp``; returns losses, global grad norms, the weights read through
    ``model.parameters()`` after each of the first ``read_steps`` steps and at the end
    (rank 0), this rank's bytes per state, and the collectives of step ``record_step``."""
    import amsp_dtensor as amsp

    model, optim = build(plan, tp, ranks_per_node, overlap)
    memory = {}
    losses, norms, step_weights, events = train(
        model, optim, rank, world_size, tp, micro_batches, steps, read_steps=read_steps,
        record_step=record_step, memory=memory)
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
        "events": events,
        "async_all_gathers": async_all_gathers(model),
    }
