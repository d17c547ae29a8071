"""Every valid plan on 4 CPU ranks (2 nodes x 2) and on 8 (2 nodes x 4): equivalence with
single-process training, parameters current when step() returns (and, with
overlap_param_update, once landed), a gradient reduction in fp32 under bf16 parameters,
bytes held per state, the exact collective schedule, and the cost model's predictions of
both. Each world's process group is started once, for all its cases."""

import pytest
import torch

from amsp_dtensor.plan import enumerate_plans
from engine_cases import MICRO_BATCHES, rel_diff, run_world, variants_of
from engine_checks import (
    TOLERANCE,
    VARIANT,
    check_cost_model,
    check_equivalence,
    check_memory,
    check_params_after_step,
    check_schedule,
)

RANKS_PER_NODE = {4: 2, 8: 4}
PLANS = {
    world: [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(world, per_node)]
    for world, per_node in RANKS_PER_NODE.items()
}


def _cases(variants):
    cases = [(w, plan, v) for w in RANKS_PER_NODE for plan in PLANS[w] for v in variants
             if v in variants_of(w)]
    return cases, [f"w{w}-p{p[0]}-g{p[1]}-os{p[2]}-{v}" for w, p, v in cases]


TRAINED, TRAINED_IDS = _cases(("fp32", "bf16", "bf16-reduce-fp32"))
SCHEDULED, SCHEDULED_IDS = _cases(("fp32", "bf16", "bf16-reduce-fp32", "fp32-overlap"))
READ, READ_IDS = _cases(("fp32", "fp32-overlap"))
PLAN_CASES = [(w, plan) for w in RANKS_PER_NODE for plan in PLANS[w]]
PLAN_IDS = [f"w{w}-p{p[0]}-g{p[1]}-os{p[2]}" for w, p in PLAN_CASES]


def _errors_case(rank, world):
    from error_cases import run_error_cases
    from extra_cases import run_extra_cases
    from recovery_cases import run_recovery_cases

    return {"errors": run_error_cases(rank, world), "extra": run_extra_cases(rank, world),
            "recovery": run_recovery_cases(rank, world)}


@pytest.fixture(scope="module")
def worlds():
    """world size -> (results, references); each world runs on first use. A world whose
    run failed fails every later test of it at once with the same error, instead of
    running again (up to its timeout) for each."""
    runs, failed = {}, {}

    def get(world):
        if world in failed:
            pytest.fail(f"the {world}-rank run failed earlier in this module: {failed[world]}")
        if world not in runs:
            extra = _errors_case if world == 4 else None
            try:
                runs[world] = run_world(world, RANKS_PER_NODE[world], extra=extra)
            except Exception as e:
                failed[world] = f"{type(e).__name__}: {e}"[:2000]
                raise
        return runs[world]

    return get


@pytest.fixture(scope="module")
def world4(worlds):
    return worlds(4)


@pytest.mark.parametrize("world,plan,variant", TRAINED, ids=TRAINED_IDS)
def test_matches_single_process(worlds, world, plan, variant):
    results, refs = worlds(world)
    dtype = VARIANT[variant][0]
    check_equivalence(results[(plan, variant)], refs[dtype], dtype)


@pytest.mark.parametrize("world,plan,variant", READ, ids=READ_IDS)
def test_parameters_are_current_after_step(worlds, world, plan, variant):
    results, refs = worlds(world)
    case = results[(plan, variant)]
    check_params_after_step(case, refs["fp32"], plan)
    if variant == "fp32-overlap":
        # the all-gather really was deferred exactly where one exists (s_os > s_p)
        assert case[0]["stale_before_wait"] == (plan[2] > plan[0]), case[0]["stale_before_wait"]
        # and overlapping changes no collective
        assert sorted(case[0]["events"]) == sorted(results[(plan, "fp32")][0]["events"])


@pytest.mark.parametrize("world,plan", PLAN_CASES, ids=PLAN_IDS)
def test_bytes_per_state(worlds, world, plan):
    results, _ = worlds(world)
    check_memory(results[(plan, "bf16")], plan, world, "bf16")


@pytest.mark.parametrize("world,plan,variant", SCHEDULED, ids=SCHEDULED_IDS)
def test_collective_schedule(worlds, world, plan, variant):
    results, _ = worlds(world)
    check_schedule(results[(plan, variant)], plan, world, RANKS_PER_NODE[world], MICRO_BATCHES, variant)


@pytest.mark.parametrize("world,plan,variant", SCHEDULED, ids=SCHEDULED_IDS)
def test_cost_model_matches_engine(worlds, world, plan, variant):
    results, _ = worlds(world)
    check_cost_model(results[(plan, variant)], plan, world, RANKS_PER_NODE[world], MICRO_BATCHES, variant)


def test_bad_inputs_raise_and_leave_the_group_usable(world4):
    results, _ = world4
    from error_cases import check_error_results

    check_error_results([r["errors"] for r in results["extra"]])


def test_exception_in_forward_or_backward_then_retry_is_exact(world4):
    from recovery_cases import PLANS

    results, _ = world4
    for rank, r in enumerate(results["extra"]):
        for plan in PLANS:
            clean, retried = r["recovery"][plan]["clean"], r["recovery"][plan]["retried"]
            assert retried["failures"] == 1, (rank, plan)
            assert retried["losses"] == clean["losses"], (rank, plan)
            for name, want in clean["weights"].items():
                assert torch.equal(retried["weights"][name], want), (rank, plan, name)


def test_submodule_forward_lands_an_overlapped_update(world4):
    results, _ = world4
    for r in results["extra"]:
        assert r["extra"]["pending_after_zero_grad"] is True
        assert r["extra"]["submodule_output_equal"] is True


def test_state_dicts_land_an_overlapped_update_first(world4):
    """With the update in flight: a submodule's state_dict() reads the step's weights
    (those of a run without the overlap), and loading an earlier model or optimizer
    state is what the weights hold afterwards, not overwritten by the update landing."""
    results, _ = world4
    for rank, r in enumerate(results["extra"]):
        for plan, got in r["extra"]["pending_io"].items():
            assert got["pending_before_read"] is True, (rank, plan)
            assert got["pending_before_model_load"] is True, (rank, plan)
            assert got["pending_before_optim_load"] is True, (rank, plan)
            assert got["submodule_read_exact"] is True, (rank, plan)
            assert got["model_load_kept"] is True, (rank, plan)
            assert got["optim_load_kept"] is True, (rank, plan)


def test_an_in_place_edit_of_fp32_weights_is_what_the_next_step_updates(world4):
    """fp32 params are their own masters: halving a weight between two steps gives the
    weights single-process AdamW gives with the same edit."""
    results, _ = world4
    for r in results["extra"]:
        for name, got in r["extra"]["edited"].items():
            want = r["extra"]["edited_reference"][name]
            assert rel_diff(got, want) <= TOLERANCE["fp32"], name


def test_hpz_secondary_group(world4):
    results, _ = world4
    for r in results["extra"]:
        extra = r["extra"]
        assert extra["hpz_losses"] == extra["plain_losses"] or max(
            abs(a - b) / abs(b) for a, b in zip(extra["hpz_losses"], extra["plain_losses"])
        ) <= 1e-5
        # forward gathers over the 4-rank "p" group (2 nodes); backward only inside a node
        assert ("all_gather", "p", 4, True, "forward") in extra["hpz_events"]
        assert ("all_gather", "p_hpz", 2, False, "backward") in extra["hpz_events"]
        assert not any(e[0] == "all_gather" and e[1] == "p" and e[4] == "backward" for e in extra["hpz_events"])


def test_optimizer_checkpoint_moves_between_plans(world4):
    results, _ = world4
    for r in results["extra"]:
        extra = r["extra"]
        assert extra["optim_state_types"] == ["DTensor", "Tensor"]  # states + the step counter
        assert extra["loaded_lr"] == 1e-3  # param_groups come from the checkpoint
        target, source = extra["target_continued"], extra["source_continued"]
        # the first loss uses the loaded weights only: identical up to reduction order
        assert abs(target[0] - source[0]) / abs(source[0]) <= 1e-6, (target, source)
        # later ones also the loaded Adam states and step counts; the two plans sum grads
        # in different orders, so fp32 drift of ~1e-5 per step is expected
        for a, b in zip(target, source):
            assert abs(a - b) / abs(b) <= 1e-4, (target, source)
