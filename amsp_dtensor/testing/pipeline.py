"""Pipeline parallelism scenarios: the test model cut into stages, each stage sharded by
AMSP over its stage's data-parallel ranks and run by a ``torch.distributed.pipelining``
schedule; compared with single-process training of the whole model (scenarios.py)."""

from __future__ import annotations

import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

from .scenarios import (LR, MAX_NORM, MICRO_BATCH, async_all_gathers, full_weights,
                        global_batches, make_model)
from .tiny_llama import TinyLlama, loss_fn


class TinyLlamaStage(nn.Module):
    """Consecutive pieces of a TinyLlama (its embeddings, blocks, final norm and output
    head, in that order) as one module, under the whole model's parameter names
    (``layers`` keyed by block index, as torchtitan's pipeline split keeps them)."""

    def __init__(self, model: TinyLlama, pieces: list):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if "embed" in pieces else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in pieces if isinstance(i, int)})
        head = "head" in pieces
        self.norm = model.norm if head else None
        self.output = model.output if head else None

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for block in self.layers.values():
            x = block(x)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def split_stages(model: TinyLlama, n_stages: int) -> list[TinyLlamaStage]:
    """The model's pieces (embeddings, each block, the head) cut into ``n_stages`` runs
    of equal length."""
    pieces = ["embed", *range(len(model.layers)), "head"]
    if len(pieces) % n_stages:
        raise ValueError(f"{len(pieces)} pieces do not split into {n_stages} equal stages")
    per = len(pieces) // n_stages
    return [TinyLlamaStage(model, pieces[i * per:(i + 1) * per]) for i in range(n_stages)]


def shard_stage(stage: TinyLlamaStage, mesh, sharding) -> None:
    """Every block, then the stage module as the root (its embeddings / head with it)."""
    import amsp_dtensor as amsp

    for block in stage.layers.values():
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(stage, mesh=mesh, plan=sharding)


SCHEDULES = {  # name -> (torch class name, stages per rank)
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", 2),
    # split backwards (input and weight halves: engine/pipeline.py, [Note: split backward])
    "interleavedzb": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),  # V: rank r holds stages r and 2 pp - 1 - r
    "dualpipev": ("ScheduleDualPipeV", 2),  # V, forward and backward of two micro-batches overlapped
}


def stages_of_rank(schedule: str, pp_rank: int, pp: int) -> list[int]:
    """The stage indices a rank runs: looped (r, r + pp, ...) or, for a V schedule, r and
    2 pp - 1 - r."""
    if schedule in ("zbv", "dualpipev"):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(SCHEDULES[schedule][1])]

_MESHES: dict = {}  # scenarios.py's Note: one mesh per plan


def pipeline_mesh(sharding, ranks_per_node: int, pp: int):
    import amsp_dtensor as amsp

    key = (sharding.param, sharding.grad, sharding.optim, ranks_per_node, pp,
           dist.get_world_size(), id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node,
                                      device_type="cpu", pp=pp)
    return _MESHES[key]


def pipeline_training(rank, world_size, plan, schedule, steps, micro_batches, pp=2,
                      scale_grads=True, ranks_per_node=None):
    """Train the test model (fp32) in ``pp`` stages x world/pp data-parallel ranks under
    ``plan`` (factors of one stage's DP world) with ``schedule`` (SCHEDULES); returns the
    step losses and global grad norms, every parameter this rank's stages hold (DP rank 0
    of each stage; whole, under the model's names) and the per-step counts of collectives
    by (op, mesh dim, phase)."""
    import amsp_dtensor as amsp
    from amsp_dtensor.engine.handle import root_state
    from amsp_dtensor.engine.mesh import mesh_info
    from torch.distributed import pipelining

    ranks_per_node = ranks_per_node or int(os.environ["LOCAL_WORLD_SIZE"])
    sharding = amsp.ShardingPlan(*plan)
    mesh = pipeline_mesh(sharding, ranks_per_node, pp)
    info = mesh_info(mesh)
    pp_rank = mesh["pp"].get_local_rank()
    dp_world = world_size // pp
    dp_rank = rank % dp_world
    cls_name, per_rank = SCHEDULES[schedule]
    model = make_model(torch.float32)
    parts = split_stages(model, pp * per_rank)
    mine = stages_of_rank(schedule, pp_rank, pp)
    stages, optims = [], []
    for index in mine:
        part = parts[index]
        shard_stage(part, mesh, sharding)
        stage = pipelining.PipelineStage(part, index, len(parts), torch.device("cpu"),
                                         group=info.pp_group)
        stages.append(amsp.pipeline_stage(stage))
        optims.append(amsp.AMSPOptimizer(part, torch.optim.AdamW, lr=LR, weight_decay=0.1))
    fn = loss_fn if scale_grads else (lambda out, y: loss_fn(out, y) / micro_batches)
    cls = getattr(pipelining, cls_name)
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=micro_batches,
                loss_fn=fn, scale_grads=scale_grads)
    from amsp_dtensor import compat

    assert compat.pipeline_schedule_stages(sched) == stages  # what titan/specs.py reads
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    losses, norms, events = [], [], []
    for step in range(steps):
        batch = global_batches(step, dp_world, micro_batches, model.cfg)
        n = micro_batches * MICRO_BATCH
        local = batch[dp_rank * n:(dp_rank + 1) * n]
        mb_losses = []
        recorder = amsp.CommRecorder()
        with amsp.record_comms(recorder):
            kwargs = {"target": local[:, 1:], "losses": mb_losses} if has_last else {}
            args = (local[:, :-1],) if has_first else ()
            sched.step(*args, **kwargs)
            norms.append(amsp.clip_grad_norm_(optims, MAX_NORM).item())
            for optim in optims:
                optim.step()
                optim.zero_grad()
        events.append(sorted(Counter((e.op, e.dim, e.phase) for e in recorder.events).items()))
        step_loss = torch.zeros(1)
        if has_last:
            step_loss += sum(l.detach() for l in mb_losses) / (micro_batches if scale_grads else 1)
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / dp_world)
    units = sum(len(root_state(parts[index]).units) for index in mine)
    weights = {}
    for index in mine:
        weights.update(full_weights(parts[index]))
    return {"losses": losses, "norms": norms, "weights": weights if dp_rank == 0 else None,
            "events": events, "stages": mine, "units": units,
            "async_all_gathers": async_all_gathers(*(parts[index] for index in mine))}


def pipeline_mesh_layout(rank, world_size, plan, pp=2):
    """This rank's groups on a pp mesh: the global ranks of its pipeline ("pp") group, of
    its stage's "shard" group, and its stage's data-parallel size."""
    import amsp_dtensor as amsp
    from amsp_dtensor.engine.mesh import mesh_info

    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    info = mesh_info(pipeline_mesh(amsp.ShardingPlan(*plan), ranks_per_node, pp))
    return {"pp": dist.get_process_group_ranks(info.pp_group),
            "shard": dist.get_process_group_ranks(info.group("shard")),
            "dp_world": info.plan.world_size, "dp_per_node": info.plan.ranks_per_node,
            "mesh_dims": pipeline_mesh(amsp.ShardingPlan(*plan), ranks_per_node,
                                       pp).mesh_dim_names}


def pipeline_errors(rank, world_size):
    """Misuse with pipeline parallelism: name -> the message raised."""
    import amsp_dtensor as amsp
    from torch.distributed import pipelining

    out = {}

    def expect(name, fn):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        else:
            out[name] = None

    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    plan = amsp.ShardingPlan(1, 1, 2)
    expect("pp does not divide the world",
           lambda: amsp.init_mesh(plan, ranks_per_node=ranks_per_node, device_type="cpu", pp=3))
    expect("plan over the whole world",
           lambda: amsp.init_mesh(amsp.ShardingPlan(1, 1, 4), ranks_per_node=ranks_per_node,
                                  device_type="cpu", pp=2))
    mesh = pipeline_mesh(plan, ranks_per_node, 2)
    pp_rank = mesh["pp"].get_local_rank()
    parts = split_stages(make_model(torch.float32), 2)
    plain = pipelining.PipelineStage(parts[pp_rank], pp_rank, 2, torch.device("cpu"),
                                     group=mesh["pp"].get_group())
    expect("stage module not sharded", lambda: amsp.pipeline_stage(plain))
    shard_stage(parts[pp_rank], mesh, plan)
    amsp.pipeline_stage(plain)
    # a split backward on a stage whose P is sharded by FSDP2 (s_p = 2)
    sharded = amsp.ShardingPlan(2, 2, 2)
    part = split_stages(make_model(torch.float32), 2)[pp_rank]
    shard_stage(part, pipeline_mesh(sharded, ranks_per_node, 2), sharded)
    fsdp_stage = amsp.pipeline_stage(pipelining.PipelineStage(
        part, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group()))
    expect("split backward", lambda: fsdp_stage.backward_maybe_with_nosync("input", {}))
    return out


def unwrapped_stage_message(rank, world_size):
    """An s_p = 2 stage handed to torch's PipelineStage without amsp.pipeline_stage: torch
    reduces FSDP2's gradients after the backwards, outside autograd; the message raised."""
    import amsp_dtensor as amsp
    from torch.distributed import pipelining

    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    plan = amsp.ShardingPlan(2, 2, 2)
    mesh = pipeline_mesh(plan, ranks_per_node, 2)
    pp_rank = mesh["pp"].get_local_rank()
    model = make_model(torch.float32)
    part = split_stages(model, 2)[pp_rank]
    shard_stage(part, mesh, plan)
    stage = pipelining.PipelineStage(part, pp_rank, 2, torch.device("cpu"),
                                     group=mesh["pp"].get_group())
    sched = pipelining.ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
    batch = global_batches(0, 2, 2, model.cfg)[: 2 * MICRO_BATCH]
    try:
        if pp_rank == 0:
            sched.step(batch[:, :-1])
        else:
            sched.step(target=batch[:, 1:], losses=[])
    except RuntimeError as e:
        return str(e)
    return None
