"""Pipeline parallelism with AMSP on 4 CPU ranks: 2 stages x 2 data-parallel ranks (one
node of 2 per stage). The test model is cut into stages, each sharded by AMSP over its
stage's DP ranks and run by torch.distributed.pipelining's schedules (amsp.pipeline_stage):
GPipe, 1F1B, interleaved 1F1B, and the split-backward ones (interleaved zero bubble, ZBV,
DualPipeV) on the plans with s_p = 1; losses, global grad norms and every weight after 3
steps are compared with single-process training of the whole model on the same global
batch, for every plan of a stage's DP world. One process group for the module."""

from functools import partial

import pytest
import torch

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.pipeline import (
    pipeline_errors,
    pipeline_mesh_layout,
    pipeline_training,
    unwrapped_stage_message,
)
from amsp_dtensor.testing.scenarios import reference_training
from engine_cases import TOLERANCE, rel_diff

WORLD, RANKS_PER_NODE, PP = 4, 2, 2
DP = WORLD // PP
STEPS, MICRO_BATCHES = 3, 2
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(DP, RANKS_PER_NODE)]
# (plan, schedule, scale_grads): 1F1B on every plan; GPipe and interleaved 1F1B (two stages
# per rank) on the plan with FSDP's all-gathers and on the one with a replica all-reduce.
# scale_grads=False divides the loss by the micro-batch count instead.
# The zero-bubble schedules (split backwards) on every plan with s_p = 1, the only ones
# they run with.
TRAINED = ([(plan, "1f1b", True) for plan in PLANS]
           + [((2, 2, 2), "gpipe", False), ((1, 1, 1), "gpipe", True),
              ((2, 2, 2), "interleaved1f1b", True), ((1, 1, 1), "interleaved1f1b", False)]
           + [(plan, "interleavedzb", True) for plan in PLANS if plan[0] == 1]
           + [((1, 2, 2), "zbv", True), ((1, 1, 1), "zbv", False)])
# DualPipeV needs as many micro-batches as stages (4)
MICRO_BATCHES_OF = {"dualpipev": 4}
TRAINED += [((1, 2, 2), "dualpipev", True)]


def _id(case):
    plan, schedule, scale = case
    return f"p{plan[0]}-g{plan[1]}-os{plan[2]}-{schedule}" + ("" if scale else "-loss-scaled")


@pytest.fixture(scope="module")
def world():
    cases = {_id(c): partial(pipeline_training, plan=c[0], schedule=c[1], steps=STEPS,
                             micro_batches=MICRO_BATCHES_OF.get(c[1], MICRO_BATCHES), pp=PP,
                             scale_grads=c[2])
             for c in TRAINED}
    cases["layout"] = partial(pipeline_mesh_layout, plan=(1, 1, 2), pp=PP)
    cases["errors"] = pipeline_errors
    cases["unwrapped"] = unwrapped_stage_message  # last: it leaves its model mid-step
    return run_cases(cases, WORLD, RANKS_PER_NODE, timeout=600)


@pytest.fixture(scope="module")
def references():
    """micro-batch count -> single-process training on the same global batches"""
    return {n: reference_training(DP, n, STEPS, torch.float32)
            for n in {MICRO_BATCHES, *MICRO_BATCHES_OF.values()}}


@pytest.mark.parametrize("case", TRAINED, ids=[_id(c) for c in TRAINED])
def test_matches_single_process(world, references, case):
    reference = references[MICRO_BATCHES_OF.get(case[1], MICRO_BATCHES)]
    per_rank = world.get(_id(case))
    tol = TOLERANCE["fp32"]
    for rank, got in enumerate(per_rank):  # every rank saw the step loss and global norm
        assert rel_diff(got["losses"], reference["losses"]) <= tol, (rank, got["losses"])
        assert rel_diff(got["norms"], reference["norms"]) <= tol, (rank, got["norms"])
    weights = {}
    for got in per_rank:
        if got["weights"] is not None:  # DP rank 0 of each stage
            assert not weights.keys() & got["weights"].keys()
            weights.update(got["weights"])
    assert weights.keys() == reference["weights"].keys()
    for name, want in reference["weights"].items():
        assert weights[name].shape == want.shape, name
        assert rel_diff(weights[name], want) <= tol, (name, rel_diff(weights[name], want))
    assert reference["losses"][-1] < reference["losses"][0]
    # the stages' sends and receives run on the training thread: FSDP2's all-gathers stay
    # synchronous on CPU (engine/overlap.py, Note: async all-gathers on CPU)
    fsdp = case[0][0] > 1
    assert all(got["async_all_gathers"] == ([False] if fsdp else []) for got in per_rank)


@pytest.mark.parametrize("case", TRAINED, ids=[_id(c) for c in TRAINED])
def test_gradients_sync_once_per_step(world, case):
    """The sync across replicas runs once per unit per step, after the stage's last
    micro-batch (with 2 micro-batches a per-micro-batch sync would double it); the
    micro-batches before it use the P and G dims only; the norm adds the stages once."""
    plan = case[0]
    for rank, got in enumerate(world.get(_id(case))):
        for step, events in enumerate(got["events"]):
            counts = dict(events)
            sync = sum(n for (op, dim, phase), n in counts.items() if phase == "sync")
            # in a 2-rank DP world the cross-replica part is one collective per unit,
            # and nothing is left to sync when P is sharded over both ranks
            want = 0 if plan[0] == DP else got["units"]
            assert sync == want, (rank, step, counts)
            for (op, dim, phase), n in counts.items():
                if phase in ("forward", "backward"):
                    assert dim in ("p", "g"), (rank, step, op, dim, phase)
            assert counts[("all_reduce", "pp", "step")] == 1, (rank, step, counts)


def test_pipeline_mesh_layout(world):
    """pp outermost: stage i holds ranks 2i, 2i+1; a pipeline is {r, r + 2}."""
    for rank, got in enumerate(world.get("layout")):
        assert got["pp"] == [rank % DP, rank % DP + DP], (rank, got)
        assert got["shard"] == [r for r in range(WORLD) if r // DP == rank // DP], (rank, got)
        assert (got["dp_world"], got["dp_per_node"]) == (DP, RANKS_PER_NODE)
        assert got["mesh_dims"] == ("pp", "rep", "p", "g", "os")


def test_pipeline_misuse_is_refused_in_one_line(world):
    got = world.get("errors")[0]
    want = {
        "pp does not divide the world": "pp=3 does not divide the world size 4",
        "plan over the whole world": "data-parallel world of one stage (2 ranks, 2 per node)",
        "stage module not sharded": "is not an AMSP root",
        "split backward": "needs param_shard = 1 on the stage",
    }
    for name, fragment in want.items():
        assert got[name] is not None and fragment in got[name], (name, got[name])
        assert "\n" not in got[name], got[name]


def test_stage_not_handed_to_amsp_is_refused(world):
    """torch's PipelineStage reduces FSDP2's gradients outside autograd: the engine says
    to use amsp.pipeline_stage instead of failing inside torch."""
    for message in world.get("unwrapped"):
        assert message is not None and "amsp.pipeline_stage(stage)" in message, message
        assert "\n" not in message
