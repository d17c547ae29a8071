"""Mixture-of-experts training as the multi-rank tests run it: the tiny MoE split over
``ep`` ranks by expert parallelism, its experts sharded by the expert plan on the expert
mesh and everything else by the dense plan, trained like ``scenarios.amsp_training``
(same global batches, AdamW, clipping); ``reference_training`` is its single-process
reference (the same model, unsplit, on the whole batch)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .scenarios import (MAX_NORM, OPTIMIZERS, async_all_gathers, full_weights, global_batches,
                        train_steps)
from .tiny_llama import loss_fn
from .tiny_moe import TinyMoE, TinyMoEConfig, expert_parallelize

_MESHES: dict = {}  # (dense plan, expert plan, ep) -> mesh (scenarios.py's Note: one mesh per plan)
_GROUPS: dict = {}  # ranks -> the process group new_group made for them first


def reuse_process_groups() -> None:
    """Make ``new_group`` return the group it made before for the same ranks, in this
    process from now on (idempotent).

    A test that trains every (dense plan, expert plan) pair builds a mesh pair for each,
    about ten groups per rank, over a few hundred cases; every gloo group keeps polling
    threads (scenarios.py's Note: one mesh per plan). Over 4 ranks there are only a few
    distinct rank sets, so reusing one group per set keeps a handful. Every rank makes
    the same calls in the same order, so every rank reuses the same ones; a reused group
    is the one new_group would have made (same ranks, default backend and timeout)."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d

    if getattr(c10d.new_group, "reuses_groups", False):
        return
    made = c10d.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kwargs):
        if timeout is not None or backend is not None or pg_options is not None:
            return made(ranks, timeout, backend, pg_options, **kwargs)
        key = tuple(sorted(ranks)) if ranks is not None else None
        if key not in _GROUPS:
            _GROUPS[key] = made(ranks, **kwargs)
        return _GROUPS[key]

    new_group.reuses_groups = True
    c10d.new_group = new_group
    device_mesh.new_group = new_group


def make_moe(dtype: torch.dtype = torch.float32) -> TinyMoE:
    torch.manual_seed(0)
    return TinyMoE(TinyMoEConfig()).to(dtype)


def moe_mesh(dense, expert, ep: int, ranks_per_node: int):
    import amsp_dtensor as amsp

    key = (dense, expert, ep, ranks_per_node, dist.get_world_size(), id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = amsp.init_mesh(amsp.ShardingPlan(*dense), ranks_per_node=ranks_per_node,
                                      device_type="cpu", ep=ep,
                                      expert_plan=amsp.ShardingPlan(*expert))
    return _MESHES[key]


def shard_moe(model: TinyMoE, mesh, ep: int) -> None:
    """EP over the expert mesh's "ep" dim, then, bottom-up: each MoE layer's experts on
    the expert mesh, every block, the root (embeddings, final norm, output) on the dense
    mesh."""
    import amsp_dtensor as amsp

    emesh = amsp.expert_mesh(mesh)
    if ep > 1:
        expert_parallelize(model, emesh["ep"])
    for block in model.layers:
        if block.moe is not None:
            amsp.fully_shard(block.moe.experts, mesh=emesh)
        amsp.fully_shard(block, mesh=mesh)
    amsp.fully_shard(model, mesh=mesh)


def moe_unit_shapes(model: TinyMoE, ep: int = 1) -> tuple[list, int, list]:
    """(dense units' param shapes, the root unit's index, the expert units' EP-local
    shapes) as shard_moe cuts an unsplit tiny MoE: each MoE layer's experts (rows / ep),
    every block's other params, the root (embeddings, final norm, output)."""
    dense, experts = [], []
    for block in model.layers:
        routed = block.moe.experts if block.moe is not None else None
        if routed is not None:
            experts.append([(p.shape[0] // ep, *p.shape[1:]) for p in routed.parameters()])
        own = {id(p) for p in routed.parameters()} if routed is not None else set()
        dense.append([tuple(p.shape) for p in block.parameters() if id(p) not in own])
    in_blocks = {id(p) for block in model.layers for p in block.parameters()}
    dense.append([tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks])
    return dense, len(dense) - 1, experts


def build_moe(dense, expert, ep, compression: dict | None = None):
    """The tiny MoE under (dense plan, expert plan) tuples with EP degree ``ep``, and its
    AMSPOptimizer (AdamW); ``compression``: keyword arguments of amsp.set_compression."""
    import amsp_dtensor as amsp

    reuse_process_groups()
    mesh = moe_mesh(dense, expert, ep, int(os.environ["LOCAL_WORLD_SIZE"]))
    model = make_moe()
    shard_moe(model, mesh, ep)
    if compression:
        amsp.set_compression(model, **compression)
    cls, kwargs = OPTIMIZERS["adamw"]
    return model, amsp.AMSPOptimizer(model, cls, **kwargs)


def train_moe(model, optim, rank, world_size, steps, micro_batches=2, record_step=None,
              memory=None):
    """scenarios.train_steps; ``memory``: a dict that gets the G bytes of each group after
    the first micro-batch (a no_sync partial sum) of the first step."""
    import amsp_dtensor as amsp

    def grads():
        memory.update({g: amsp.memory_by_state(model, group=g)["grad"]
                       for g in ("dense", "expert")})

    return train_steps(model, optim, rank, world_size, steps, micro_batches, record_step,
                       after_first_micro=grads if memory is not None else None)


def moe_training(rank, world_size, dense, expert, ep, steps, micro_batches=2,
                 record_step=None):
    """Train under (dense plan, expert plan) tuples with EP degree ``ep``; returns losses,
    norms, the whole weights (rank 0), bytes per state of each group, and the events of
    ``record_step``."""
    import amsp_dtensor as amsp

    model, optim = build_moe(dense, expert, ep)
    grad: dict = {}
    losses, norms, events = train_moe(model, optim, rank, world_size, range(steps),
                                      micro_batches, record_step, grad)
    memory = {group: {**amsp.memory_by_state(model, optim, group=group), "grad": grad[group]}
              for group in ("dense", "expert")}
    weights = full_weights(model)
    return {"losses": losses, "norms": norms, "weights": weights if rank == 0 else None,
            "memory": memory, "events": events, "async_all_gathers": async_all_gathers(model)}


def reference_training(world_size, steps, micro_batches=2):
    """One process, the whole global batch: fp32 masters + AdamW, the same clipping."""
    model = make_moe()
    params = list(model.parameters())
    cls, kwargs = OPTIMIZERS["adamw"]
    optim = cls(params, **kwargs)
    losses, norms = [], []
    for step in range(steps):
        batch = global_batches(step, world_size, micro_batches, model.cfg)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": full_weights(model)}
