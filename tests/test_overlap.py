"""Overlaps change when collectives are waited for, never what they compute: every valid
plan at 4 CPU ranks (2 nodes x 2), units cut as torchtitan cuts them (embeddings, each
block, [norm, output]), trained with every overlap off and with every overlap on. Losses
and weights are bit-identical, match single-process training, and the recorded schedule
is the cost model's. One process group for the whole module, each (plan, config) one case
of it."""

import math

import pytest
import torch

from amsp_dtensor.plan.cost.check import schedule_differences, unit_param_shapes_of
from amsp_dtensor.plan.cost.models import ModelShape
from amsp_dtensor.engine.recorder import CommEvent, overlap_summary
from amsp_dtensor.plan import ShardingPlan
from amsp_dtensor.testing.scenarios import reference_training
from amsp_dtensor.testing.tiny_llama import TinyLlama
from engine_cases import TOLERANCE, rel_diff
from overlap_cases import MICRO_BATCHES, PER_NODE, PLANS, STEPS, WORLD, run_overlap_cases

IDS = [f"p{p}-g{g}-os{o}" for p, g, o in PLANS]


@pytest.fixture(scope="module")
def runs():
    return run_overlap_cases()


@pytest.fixture(scope="module")
def reference():
    return reference_training(WORLD, MICRO_BATCHES, STEPS, torch.float32)


@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_bit_identical_with_overlaps_on_and_off(runs, plan):
    off, on = runs.get((plan, "none"))[0], runs.get((plan, "all"))[0]
    assert off["losses"] == on["losses"]
    assert off["weights"].keys() == on["weights"].keys()
    for name, weight in off["weights"].items():
        assert torch.equal(weight, on["weights"][name]), name


@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_overlapped_training_matches_single_process(runs, reference, plan):
    got = runs.get((plan, "all-clip"))[0]
    assert rel_diff(got["losses"], reference["losses"]) <= TOLERANCE["fp32"]
    assert rel_diff(got["norms"], reference["norms"]) <= TOLERANCE["fp32"]
    for name, weight in reference["weights"].items():
        assert rel_diff(got["weights"][name], weight) <= TOLERANCE["fp32"], name


@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_schedule_equals_cost_model(runs, plan):
    """Each rank's recorded step, with every overlap on, is the cost model's schedule for
    the torchtitan cut ([norm, output] kept unsharded after forward), collective by
    collective; the ModelShape "titan" layout gives the same units."""
    resolved = ShardingPlan(*plan).resolve(WORLD, PER_NODE)
    model = TinyLlama()
    units, root = unit_param_shapes_of(
        model, [model.tok_embeddings, *model.layers, [model.norm, model.output]])
    assert root is None
    kept = len(units) - 1
    for rank, result in enumerate(runs.get((plan, "all"))):
        diffs = schedule_differences(resolved, units, MICRO_BATCHES, 4, [kept],
                                     result["events"], clip=False)
        assert diffs == [], (rank, diffs)
    cfg = model.cfg
    shape = ModelShape("tiny", cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size,
                       cfg.ffn_dim, layout="titan")
    assert [sorted(u) for u in shape.unit_param_shapes()] == [sorted(u) for u in units]
    assert shape.root_unit_index == kept


@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_last_gradient_stages_stay_in_flight_until_step(runs, plan):
    """With grad_sync on, step() begins with the last stage of the gradient sync in
    flight: the replica all-reduce of every unit, or, without replicas, the last unit's
    OS reduce-scatter (earlier units' complete in the hooks, freeing their inputs; a
    reduce-scatter over "g" completes by the end of backward). With it off, nothing is
    in flight."""
    resolved = ShardingPlan(*plan).resolve(WORLD, PER_NODE)
    n_units = 1 + len(TinyLlama().layers) + 1
    if WORLD // resolved.s_os > 1:
        expected = n_units
    elif resolved.s_g == resolved.s_p < resolved.s_os:
        expected = 1
    else:
        expected = 0
    all_on, all_off = runs.get((plan, "all")), runs.get((plan, "none"))
    for rank in range(WORLD):
        on = all_on[rank]["in_flight_after_backward"]
        off = all_off[rank]["in_flight_after_backward"]
        assert off == [0] * STEPS
        assert on == [expected] * STEPS, (rank, on)


@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_all_gathers_are_async_on_cpu_with_data_parallelism_alone(runs, plan):
    """Prefetch on: every FSDP unit all-gathers async on CPU (the model communicates on no
    other group); off: none does. (TP, EP and pipelines keep them synchronous: their own
    tests.) A plan with P unsharded has no FSDP unit."""
    fsdp = ShardingPlan(*plan).resolve(WORLD, PER_NODE).s_p > 1
    for rank in range(WORLD):
        assert runs.get((plan, "all"))[rank]["async_all_gathers"] == ([True] if fsdp else [])
        assert runs.get((plan, "none"))[rank]["async_all_gathers"] == ([False] if fsdp else [])


@pytest.mark.parametrize("plan", PLANS, ids=IDS)
def test_recorded_wait_times(runs, plan):
    """Every recorded collective has 0 <= blocked <= issue-to-completion;
    with every overlap off each of the engine's own collectives is waited for at once."""
    for config in ("none", "all"):
        for result in runs.get((plan, config)):
            assert result["timings"], config
            for seconds, blocked in result["timings"]:
                assert 0 <= blocked <= seconds, (config, seconds, blocked)


def test_overlap_summary_formula():
    def event(seconds, blocked):
        return CommEvent("all_reduce", "rep", 2, 8, True, "sync", seconds, blocked)

    summary = overlap_summary([event(1.0, 0.25), event(3.0, 0.75)])
    assert summary["comm_seconds"] == 4.0 and summary["exposed_seconds"] == 1.0
    assert summary["hidden_fraction"] == pytest.approx(0.75)
    assert math.isnan(overlap_summary([])["hidden_fraction"])


def test_misuse_messages(runs):
    errors = runs.get("errors")[0]
    assert errors["same module twice"] == ("ValueError",
                                           "fully_shard got the same module twice in one list")
    assert errors["nested modules"][0] == "ValueError"
    assert "list sibling modules only" in errors["nested modules"][1]
    assert errors["empty list"][0] == "TypeError"
    assert "non-empty list" in errors["empty list"][1]
    assert errors["set_overlap not a bool"] == (
        "TypeError", "set_overlap(step=...) takes a bool or None, got 1")
    assert errors["set_overlap on a block"][0] == "ValueError"
    assert "not an AMSP root" in errors["set_overlap on a block"][1]
    assert errors["set_overlap returns"] == (
        "Overlap(grad_sync=True, prefetch=False, step=True, param_update=False)")
    assert errors["unit names"] == sorted(
        ["tok_embeddings", "layers.0", "layers.1", "[norm, output]"])
