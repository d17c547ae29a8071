"""Every valid plan on 8 CPU ranks as 2 nodes x 4: equivalence with single-process
training, bytes held per state, and the exact collective schedule."""

import pytest

from amsp_dtensor.plan import enumerate_plans
from engine_cases import MICRO_BATCHES, run_world
from engine_checks import check_cost_model, check_equivalence, check_memory, check_schedule

WORLD, PER_NODE = 8, 4
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]
CASES = [(plan, dtype) for plan in PLANS for dtype in ("fp32", "bf16")]


@pytest.fixture(scope="module")
def world():
    return run_world(WORLD, PER_NODE)


@pytest.mark.parametrize("plan,dtype", CASES, ids=[f"p{p[0]}-g{p[1]}-os{p[2]}-{d}" for p, d in CASES])
def test_matches_single_process(world, plan, dtype):
    results, refs = world
    check_equivalence(results[(plan, dtype)], refs[dtype], dtype)


@pytest.mark.parametrize("plan", PLANS, ids=[f"p{p[0]}-g{p[1]}-os{p[2]}" for p in PLANS])
def test_bytes_per_state(world, plan):
    results, _ = world
    check_memory(results[(plan, "bf16")], plan, WORLD, "bf16")


@pytest.mark.parametrize("plan,dtype", CASES, ids=[f"p{p[0]}-g{p[1]}-os{p[2]}-{d}" for p, d in CASES])
def test_collective_schedule(world, plan, dtype):
    results, _ = world
    check_schedule(results[(plan, dtype)], plan, WORLD, PER_NODE, MICRO_BATCHES, dtype)


@pytest.mark.parametrize("plan,dtype", CASES, ids=[f"p{p[0]}-g{p[1]}-os{p[2]}-{d}" for p, d in CASES])
def test_cost_model_matches_engine(world, plan, dtype):
    results, _ = world
    check_cost_model(results[(plan, dtype)], plan, WORLD, PER_NODE, MICRO_BATCHES, dtype)


