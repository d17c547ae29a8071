"""The per-unit step's batches ([Note: per-unit step] in engine/optim.py): which units each
call of the wrapped optimizer steps, for a known state of the gradient collectives when
``step()`` starts, and that the result is bit-identical to one step over every unit
(``set_overlap(step=False)``).

4 gloo ranks (2 nodes x 2), a TinyLlama of 7 blocks cut as torchtitan cuts it (9 units).
In issue order (the backward's) the units are [norm, output], layers.6 ... layers.0 and
tok_embeddings; each rank steps half the rows of each (s_os = 2): 1616, 5152 (each block)
and 1600 elements, 39280 in all. At HSDP's schedule (p2-g2-os2) every unit's replica
all-reduce is in flight when ``step()`` starts. Halving by hand: the first call takes
units until it holds at least half of 39280 (1616 + 4 x 5152 = 22224), the second half of
the 17056 left (2 x 5152), the third half of the 6752 left (5152), the last what remains.
Whether a collective completed meanwhile is pinned (otherwise the gloo group decides),
except in the "as is" case, which checks only the results.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import amsp_dtensor as amsp
from amsp_dtensor.engine.handle import root_state
from amsp_dtensor.engine.optim import STEP_BATCHES, step_batches
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import (
    OPTIMIZERS, full_weights, global_batches, make_model, micro_batch_backwards, plan_mesh,
    shard_model)
from amsp_dtensor.testing.tiny_llama import TinyLlamaConfig

WORLD, PER_NODE, BLOCKS, STEPS, MICRO_BATCHES = 4, 2, 7, 2, 2
HSDP, NO_REPLICAS = (2, 2, 2), (2, 2, 4)
LAYERS = [f"layers.{i}" for i in range(BLOCKS)]
ALL_UNITS = {"tok_embeddings", *LAYERS, "[norm, output]"}
# the calls at HSDP's schedule, by hand (module docstring)
HSDP_CALLS = [
    {"[norm, output]", "layers.6", "layers.5", "layers.4", "layers.3"},
    {"layers.2", "layers.1"},
    {"layers.0"},
    {"tok_embeddings"},
]


def _train(rank, world_size, plan, step, done=None, clip=False):
    """Train STEPS steps; returns the losses, the final weights, and per step the units
    with a collective in flight when step() starts and the units of each call of the
    wrapped optimizer. ``done``: what RootState.unit_sync_done answers (None: the gloo
    group's answer)."""
    sharding = amsp.ShardingPlan(*plan)
    model = make_model(torch.float32, TinyLlamaConfig(n_layers=BLOCKS))
    shard_model(model, plan_mesh(sharding, PER_NODE), sharding, layout="titan")
    amsp.set_overlap(model, step=step)
    cls, kwargs = OPTIMIZERS["adamw"]
    optim = amsp.AMSPOptimizer(model, cls, **kwargs)
    root = root_state(model)
    if done is not None:
        root.unit_sync_done = lambda unit: done
    owner = {}
    for unit in root.units:
        for name in unit.param_fqns:
            owner[name] = unit.name
    by_param = {id(p): owner[fqn] for p, fqn in zip(optim._opt_params, optim._fqns)}
    calls, in_flight, losses = [], [], []
    inner_step = optim.inner.step

    def counting_step(*args, **kw):
        calls[-1].append(sorted({by_param[id(p)] for group in optim.inner.param_groups
                                 for p in group["params"] if p.grad is not None}))
        return inner_step(*args, **kw)

    optim.inner.step = counting_step
    for i in range(STEPS):
        batch = global_batches(i, world_size, MICRO_BATCHES, model.cfg)
        loss = sum(float(l) for _, _, l in micro_batch_backwards(
            model, batch, rank, world_size, MICRO_BATCHES))
        in_flight.append(sorted({e.unit.name for e in root.in_flight}))
        if clip:
            optim.clip_grad_norm_(1.0)
        calls.append([])
        optim.step()
        optim.zero_grad()
        losses.append(loss)
    return {"losses": losses, "weights": full_weights(model), "calls": calls,
            "in_flight": in_flight}


CASES = {
    ("hsdp", "off"): partial(_train, plan=HSDP, step=False),
    ("hsdp", "pending"): partial(_train, plan=HSDP, step=True, done=False),
    ("hsdp", "completed"): partial(_train, plan=HSDP, step=True, done=True),
    ("hsdp", "as is"): partial(_train, plan=HSDP, step=True),
    ("hsdp", "clip"): partial(_train, plan=HSDP, step=True, done=False, clip=True),
    ("hsdp", "clip off"): partial(_train, plan=HSDP, step=False, clip=True),
    ("no replicas", "off"): partial(_train, plan=NO_REPLICAS, step=False),
    ("no replicas", "pending"): partial(_train, plan=NO_REPLICAS, step=True, done=False),
}


@pytest.fixture(scope="module")
def runs():
    return run_cases(CASES, WORLD, PER_NODE, timeout=600)


def _as_sets(calls):
    return [[set(call) for call in step] for step in calls]


def test_step_batches_rule():
    assert step_batches([], 4) == []
    assert step_batches([7], 4) == [1]
    assert step_batches([1] * 10, 4) == [5, 3, 1, 1]
    assert step_batches([1] * 19, 4) == [10, 5, 2, 2]
    assert step_batches([1] * 19, 1) == [19]
    assert step_batches([1] * 3, 4) == [2, 1]
    assert step_batches([9, 1, 1, 1], 4) == [1, 2, 1]  # a large first unit is a batch alone
    assert step_batches([1, 1, 1, 9], 4) == [4]  # the half is only reached by the last one
    assert step_batches([1616] + [5152] * 7 + [1600], STEP_BATCHES) == [5, 2, 1, 1]
    with pytest.raises(ValueError):
        step_batches([1], 0)


def test_hsdp_schedule_steps_in_halving_batches(runs):
    for rank, result in enumerate(runs.get(("hsdp", "pending"))):
        assert result["in_flight"] == [sorted(ALL_UNITS)] * STEPS, rank
        assert _as_sets(result["calls"]) == [HSDP_CALLS] * STEPS, rank
        assert len(HSDP_CALLS) == STEP_BATCHES


def test_completed_collectives_join_the_batch(runs):
    """After the first batch's wait, every later unit reports its collectives done: they
    are stepped in the same call."""
    for rank, result in enumerate(runs.get(("hsdp", "completed"))):
        assert _as_sets(result["calls"]) == [[ALL_UNITS]] * STEPS, rank


def test_units_synced_before_step_share_one_call(runs):
    """Without replicas only the last unit's OS reduce-scatter is in flight: the others
    are stepped in one call first, it in a second. After clip_grad_norm_ every gradient
    has landed: one call."""
    for rank, result in enumerate(runs.get(("no replicas", "pending"))):
        assert result["in_flight"] == [["tok_embeddings"]] * STEPS, rank
        assert _as_sets(result["calls"]) == [[ALL_UNITS - {"tok_embeddings"},
                                              {"tok_embeddings"}]] * STEPS, rank
    for rank, result in enumerate(runs.get(("hsdp", "clip"))):
        assert _as_sets(result["calls"]) == [[ALL_UNITS]] * STEPS, rank


def test_step_off_is_one_call(runs):
    for rank, result in enumerate(runs.get(("hsdp", "off"))):
        assert _as_sets(result["calls"]) == [[ALL_UNITS]] * STEPS, rank


@pytest.mark.parametrize("plan,case,off", [
    ("hsdp", "pending", "off"), ("hsdp", "completed", "off"), ("hsdp", "as is", "off"),
    ("hsdp", "clip", "clip off"), ("no replicas", "pending", "off")])
def test_batched_step_is_bit_identical_to_one_step(runs, plan, case, off):
    ref, got = runs.get((plan, off))[0], runs.get((plan, case))[0]
    assert got["losses"] == ref["losses"]
    assert got["weights"].keys() == ref["weights"].keys()
    for name, weight in ref["weights"].items():
        assert torch.equal(got["weights"][name], weight), name
