"""Must-show 1 and 2 (first half): the cost model against the engine, exact.

For every valid plan at W=4 and W=8 (2 ranks per "node", gloo, one spawned group per
world): the collectives the engine records in one optimizer step (2 micro-batches, bf16,
clip_grad_norm_) equal predicted_events() key by key and count by count, and every rank's
P/G/OS tensor bytes (amsp.memory_by_state) equal state_bytes_of_rank().
"""

from __future__ import annotations

import os

import pytest
import torch

from amsp_dtensor.cost.check import schedule_differences, unit_param_shapes_of
from amsp_dtensor.cost.memory import state_bytes_of_rank
from amsp_dtensor.plan import enumerate_plans

amsp = pytest.importorskip("amsp_dtensor")
if not hasattr(amsp, "fully_shard"):
    pytest.skip("engine not in the tree yet", allow_module_level=True)

from amsp_dtensor.testing.multiproc import run_on_ranks  # noqa: E402
from amsp_dtensor.testing.scenarios import (  # noqa: E402
    LR,
    MAX_NORM,
    global_batches,
    local_micro_batch,
    make_model,
)
from amsp_dtensor.testing.tiny_llama import loss_fn  # noqa: E402

RANKS_PER_NODE = 2
MICRO_BATCHES = 2
WORLDS = [int(w) for w in os.environ.get("AMSP_COST_WORLDS", "4,8").split(",")]


def _one_plan(rank, world_size, plan, dtype, steps=2, record_step=1):
    """Train `steps` steps; record step `record_step` from its first forward until its
    param all-gathers have landed (finish_param_sync inside the recording: the engine
    records a collective when it is waited for, and the post-step all-gather is otherwise
    waited in the next step's forward)."""
    sharding = amsp.ShardingPlan(plan.s_p, plan.s_g, plan.s_os)
    mesh = amsp.init_mesh(sharding, ranks_per_node=RANKS_PER_NODE, device_type="cpu")
    model = make_model(dtype)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    memory, events = {}, []
    for step in range(steps):
        optim.finish_param_sync()
        batch = global_batches(step, world_size, MICRO_BATCHES, model.cfg)
        with amsp.record_comms() as rec:
            for micro in range(MICRO_BATCHES):
                mb = local_micro_batch(batch, rank, world_size, micro)
                last = micro == MICRO_BATCHES - 1
                if last:
                    loss_fn(model(mb[:, :-1]), mb[:, 1:]).backward()
                else:
                    with amsp.no_sync(model):
                        loss_fn(model(mb[:, :-1]), mb[:, 1:]).backward()
                    memory["grad_accum"] = amsp.memory_by_state(model)["grad"]
            memory["grad_synced"] = amsp.memory_by_state(model)["grad"]
            optim.clip_grad_norm_(MAX_NORM)
            optim.step()
            optim.finish_param_sync()
        if step == record_step:
            events = [e.key() for e in rec.events]
        optim.zero_grad()
    mem = amsp.memory_by_state(model, optim)
    memory["param"], memory["optim"] = mem["param"], mem["optim"]
    return {"memory": memory, "events": events}


def _all_plans(rank, world_size, dtype):
    return {p.name: _one_plan(rank, world_size, p, dtype)
            for p in enumerate_plans(world_size, RANKS_PER_NODE)}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"W{w}")
def engine_runs(request):
    world = request.param
    results = run_on_ranks(_all_plans, world, RANKS_PER_NODE, torch.bfloat16, timeout=900)
    return world, results


def _units():
    model = make_model(torch.bfloat16)
    return unit_param_shapes_of(model, model.layers)


def test_predicted_events_equal_recorded(engine_runs):
    world, results = engine_runs
    units, root = _units()
    problems = []
    for plan in enumerate_plans(world, RANKS_PER_NODE):
        for rank, per_plan in enumerate(results):
            diff = schedule_differences(plan, units, MICRO_BATCHES, 2, root,
                                        per_plan[plan.name]["events"], clip=True)
            if diff:
                problems.append(f"W={world} {plan.name} rank {rank}: " + "; ".join(diff[:4]))
    assert not problems, "\n".join(problems[:20])


def test_predicted_state_bytes_equal_engine(engine_runs):
    world, results = engine_runs
    units, _ = _units()
    problems = []
    for plan in enumerate_plans(world, RANKS_PER_NODE):
        for rank, per_plan in enumerate(results):
            got = per_plan[plan.name]["memory"]
            want = state_bytes_of_rank(units, plan, rank, 2)
            synced = state_bytes_of_rank(units, plan, rank, 2, grads_synced=True)
            pairs = {"param": want.param, "grad_accum": want.grad,
                     "grad_synced": synced.grad, "optim": want.optim}
            for kind, value in pairs.items():
                if got.get(kind) != value:
                    problems.append(f"W={world} {plan.name} rank {rank} {kind}: "
                                    f"predicted {value}, engine {got.get(kind)}")
    assert not problems, "\n".join(problems[:20])
