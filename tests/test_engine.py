"""Every valid plan on 4 CPU ranks (2 nodes x 2) and on 8 (2 nodes x 4): equivalence with
single-process training, parameters current when step() returns (and, with
overlap_param_update, once landed), a gradient reduction in fp32 under bf16 parameters,
bytes held per state, the exact collective schedule, and the cost model's predictions of
both. Each world's process group is started once, for all its cases (run_cases: a case
that fails fails only the tests that read it). The ranks return what they measured; each
test compares it with its reference here."""

from collections import Counter

import pytest
import torch

import amsp_dtensor as amsp
from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import (
    LR,
    global_batches,
    make_model,
    reference_training,
)
from amsp_dtensor.testing.tiny_llama import loss_fn
from engine_cases import (
    DTYPES,
    MICRO_BATCHES,
    READ_STEPS,
    STEPS,
    TOLERANCE,
    rel_diff,
    rel_norm_diff,
    variants_of,
    world_cases,
    COMPRESSED,
)
from engine_expectations import expected_step_events, ideal_bytes, os_bytes
from extra_cases import EXTRA_PLANS
from recovery_cases import PLANS as RECOVERY_PLANS

RANKS_PER_NODE = {4: 2, 8: 4}
PLANS = {
    world: [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(world, per_node)]
    for world, per_node in RANKS_PER_NODE.items()
}
ELEM = {"fp32": 4, "bf16": 2}
# variant -> (dtype of the reference and the tolerance, param bytes, gradient bytes)
VARIANT = {
    "fp32": ("fp32", 4, 4),
    "bf16": ("bf16", 2, 2),
    "fp32-overlap": ("fp32", 4, 4),
    "bf16-reduce-fp32": ("bf16", 2, 4),
}


def _cases(variants):
    cases = [(w, plan, v) for w in RANKS_PER_NODE for plan in PLANS[w] for v in variants
             if v in variants_of(w)]
    return cases, [f"w{w}-p{p[0]}-g{p[1]}-os{p[2]}-{v}" for w, p, v in cases]


def _plan_id(plan):
    return f"p{plan[0]}-g{plan[1]}-os{plan[2]}"


TRAINED, TRAINED_IDS = _cases(("fp32", "bf16", "bf16-reduce-fp32"))
SCHEDULED, SCHEDULED_IDS = _cases(("fp32", "bf16", "bf16-reduce-fp32", "fp32-overlap"))
READ, READ_IDS = _cases(("fp32", "fp32-overlap"))
PLAN_CASES = [(w, plan) for w in RANKS_PER_NODE for plan in PLANS[w]]
PLAN_IDS = [f"w{w}-{_plan_id(p)}" for w, p in PLAN_CASES]


@pytest.fixture(scope="module")
def worlds():
    """world size -> (its run_cases results, {dtype name: single-process reference});
    each world runs on first use."""
    runs = {}

    def get(world):
        if world not in runs:
            per_node = RANKS_PER_NODE[world]
            results = run_cases(world_cases(world, per_node), world, per_node, timeout=900)
            dtypes = {VARIANT[v][0] for v in variants_of(world)}  # bf16 at world 4 only
            refs = {name: reference_training(world, MICRO_BATCHES, STEPS[world], dt,
                                             read_steps=READ_STEPS)
                    for name, dt in DTYPES.items() if name in dtypes}
            runs[world] = results, refs
        return runs[world]

    return get


@pytest.fixture(scope="module")
def world4(worlds):
    return worlds(4)[0]


@pytest.mark.parametrize("world,plan,variant", TRAINED, ids=TRAINED_IDS)
def test_matches_single_process(worlds, world, plan, variant):
    results, refs = worlds(world)
    case = results.get((plan, variant))
    dtype = VARIANT[variant][0]
    ref, tol = refs[dtype], TOLERANCE[dtype]
    rank0 = case[0]
    assert rel_diff(rank0["losses"], ref["losses"]) <= tol, (rank0["losses"], ref["losses"])
    assert rel_diff(rank0["norms"], ref["norms"]) <= tol, (rank0["norms"], ref["norms"])
    for name, want in ref["weights"].items():
        got = rank0["weights"][name]
        assert got.shape == want.shape, name
        # fp32: every element within tol of the largest. bf16: the tensor's relative
        # error; elementwise, AdamW turns bf16 noise on near-zero grads into +-lr steps
        # (seen: 5 bf16 ulps on one element of one 32x32 weight at world 8).
        diff = rel_diff(got, want) if dtype == "fp32" else rel_norm_diff(got, want)
        assert diff <= tol, (name, diff)
    # every rank saw the same (all-reduced) losses and global norms
    for other in case[1:]:
        assert other["losses"] == rank0["losses"]
        assert other["norms"] == rank0["norms"]
    # and training did something
    assert rank0["losses"][-1] < rank0["losses"][0]


@pytest.mark.parametrize("world,plan,variant", READ, ids=READ_IDS)
def test_parameters_are_current_after_step(worlds, world, plan, variant):
    """Weights read through model.parameters() after each of the first steps (right after
    step(), or after the landing call with overlap) equal single-process training."""
    results, refs = worlds(world)
    case = results.get((plan, variant))
    got, want = case[0]["step_weights"], refs["fp32"]["step_weights"]
    assert len(got) == len(want) == READ_STEPS, (len(got), len(want))
    for step, (got_w, want_w) in enumerate(zip(got, want)):
        for name, w in want_w.items():
            diff = rel_diff(got_w[name], w)
            assert diff <= TOLERANCE["fp32"], (step, name, diff)
    if variant == "fp32-overlap":
        # the all-gather really was deferred exactly where one exists (s_os > s_p)
        assert case[0]["stale_before_wait"] == (plan[2] > plan[0]), case[0]["stale_before_wait"]
        # and overlapping changes no collective
        plain = results.get((plan, "fp32"))
        assert sorted(case[0]["events"]) == sorted(plain[0]["events"])


@pytest.mark.parametrize("world,plan", PLAN_CASES, ids=PLAN_IDS)
def test_bytes_per_state(worlds, world, plan):
    results, _ = worlds(world)
    dtype = "bf16" if "bf16" in variants_of(world) else "fp32"  # bf16 runs at 4 ranks
    case = results.get((plan, dtype))
    elem = ELEM[dtype]  # parameters and gradients both in this dtype
    ideal = ideal_bytes(plan, elem)
    row = ideal["row_elems"]
    for rank, result in enumerate(case):
        mem = result["memory"]
        assert ideal["param"] <= mem["param"] <= ideal["param"] + elem * row, (rank, mem, ideal)
        assert ideal["grad"] <= mem["grad"] <= ideal["grad"] + elem * row, (rank, mem, ideal)
        assert mem["optim"] <= ideal["optim"] + os_bytes(elem) * row, (rank, mem, ideal)
    # one shard group (ranks 0 .. s_os-1) holds exactly one copy of the 2 states (and of
    # the fp32 master, unless the params are fp32: then P is the master)
    s_os = plan[2]
    assert sum(case[r]["memory"]["optim"] for r in range(s_os)) == os_bytes(elem) * ideal["phi"]


@pytest.mark.parametrize("world,plan,variant", SCHEDULED, ids=SCHEDULED_IDS)
def test_collective_schedule(worlds, world, plan, variant):
    results, _ = worlds(world)
    case = results.get((plan, variant))
    _, elem, grad_elem = VARIANT[variant]
    want = expected_step_events(plan, world, RANKS_PER_NODE[world], MICRO_BATCHES, elem,
                                grad_elem=grad_elem)
    for rank, result in enumerate(case):
        got = Counter(result["events"])
        assert got == want, (rank, sorted((got - want).items()), sorted((want - got).items()))
    # no cross-replica traffic before the last micro-batch: only P and G collectives there
    for key in want:
        op, dim, _, _, _, phase = key
        if phase in ("forward", "backward"):
            assert dim in ("p", "g"), key


@pytest.mark.parametrize("plan", list(COMPRESSED))
def test_cost_model_matches_a_compressed_engine_step(worlds, plan):
    """At 8 ranks (2 nodes of 4) with amsp.set_compression: the recorded collectives equal
    the cost model's compressed schedule byte for byte, and the error-feedback residuals
    and the separate fp32 masters the bytes its memory model adds."""
    from amsp_dtensor.plan import ShardingPlan
    from amsp_dtensor.plan.compression import Compression
    from amsp_dtensor.plan.cost.check import schedule_differences, unit_param_shapes_of
    from amsp_dtensor.plan.cost.memory import compression_bytes, state_bytes_of_rank
    from amsp_dtensor.testing.tiny_llama import TinyLlama

    results, _ = worlds(8)
    case = results.get(("compressed", plan))
    resolved = ShardingPlan(*plan).resolve(8, RANKS_PER_NODE[8])
    setting = Compression(**COMPRESSED[plan])
    model = TinyLlama()
    units, root = unit_param_shapes_of(model, model.layers)
    added = compression_bytes(units, resolved, setting, 4)
    assert added.error_feedback > 0
    for rank, result in enumerate(case):
        diffs = schedule_differences(resolved, units, MICRO_BATCHES, 4, root, result["events"],
                                     clip=True, compression=setting)
        assert diffs == [], (rank, diffs)
        assert any(key[0] == "all_to_all" for key in result["events"])
        assert result["residual_bytes"] == added.error_feedback, rank
    exact_optim = state_bytes_of_rank(units, resolved, 0, 4).optim
    assert case[0]["memory"]["optim"] - exact_optim == added.fp32_master


@pytest.mark.parametrize("world,plan,variant", SCHEDULED, ids=SCHEDULED_IDS)
def test_cost_model_matches_engine(worlds, world, plan, variant):
    """The planner's cost model predicts exactly what the engine did (bytes per collective
    and the state bytes of every rank), on the same runs as the checks above."""
    from amsp_dtensor.plan import ShardingPlan
    from amsp_dtensor.plan.cost.check import schedule_differences, unit_param_shapes_of
    from amsp_dtensor.plan.cost.memory import state_bytes_of_rank
    from amsp_dtensor.testing.tiny_llama import TinyLlama

    results, _ = worlds(world)
    case = results.get((plan, variant))
    resolved = ShardingPlan(*plan).resolve(world, RANKS_PER_NODE[world])
    model = TinyLlama()
    units, root = unit_param_shapes_of(model, model.layers)
    _, elem, grad_elem = VARIANT[variant]
    for rank, result in enumerate(case):
        diffs = schedule_differences(resolved, units, MICRO_BATCHES, elem, root,
                                     result["events"], clip=True, reduce_dtype_bytes=grad_elem)
        assert diffs == [], (rank, diffs)
        predicted = state_bytes_of_rank(units, resolved, rank, elem)
        grad = state_bytes_of_rank(units, resolved, rank, grad_elem).grad  # G in reduce dtype
        mem = result["memory"]
        assert (mem["param"], mem["grad"], mem["optim"]) == (
            predicted.param, grad, predicted.optim
        ), (rank, mem, predicted, grad)


# ---- bad inputs ---------------------------------------------------------------------------
# error_cases' case name -> (the exception it must raise, texts its message must contain)
ERRORS = {
    "plan breaks chain order": (ValueError, ["param <= grad <= optim"]),
    "factor does not divide world": (ValueError, ["divide"]),
    "plan of wrong type": (TypeError, ["ShardingPlan"]),
    "resolved plan for another world": (
        ValueError,
        ["this job has 4 data-parallel ranks, 2 per node",
         "pass the ShardingPlan itself, or resolve it for this job with .resolve(4, 2)"],
    ),
    "plan differs from mesh": (ValueError, ["does not match the mesh"]),
    "not a module": (TypeError, ["nn.Module"]),
    "mesh not from init_mesh": (ValueError, ["amsp.init_mesh"]),
    "sharded twice": (ValueError, ["already sharded"]),
    "mp_policy of wrong type": (TypeError, ["MixedPrecisionPolicy"]),
    "hpZ factor not dividing param_shard": (ValueError, ["reshard_after_forward=3"]),
    "optimizer on a meta-device model": (ValueError, ["meta device"]),
    "mixed dtypes": (ValueError, ["mixes parameter dtypes"]),
    "optimizer class is a string": (TypeError, ["torch.optim.Optimizer subclass"]),
    "optimizer on an unsharded model": (ValueError, ["not an AMSP root"]),
    "no_sync on an unsharded model": (ValueError, ["not an AMSP root"]),
    "divide factor zero": (ValueError, ["positive"]),
    "clip with max_norm 0": (ValueError, ["max_norm must be positive"]),
    "already wrapped by torch fully_shard": (ValueError, ["torch's fully_shard"]),
    "cast without all-gather": (ValueError, ["param_shard=1 has none"]),
    "step after no_sync only": (RuntimeError, ["outside no_sync"]),
    "step twice without a backward": (RuntimeError, ["twice without a backward"]),
    "step without any backward": (RuntimeError, ["run backward"]),
    "fully_shard after the optimizer was built": (ValueError, ["after AMSPOptimizer was built"]),
    "a second optimizer on one model": (ValueError, ["already has an AMSPOptimizer"]),
    "model moved after sharding": (RuntimeError, ["move the model before amsp.fully_shard"]),
    "zero_grad keeping grads": (ValueError, ["set_to_none=False"]),
    "parameter storage replaced after the optimizer": (RuntimeError, ["storage was replaced"]),
    # the case halves layers.1.feed_forward.w1.weight with its update in flight: the
    # message names that parameter, and it alone, and says what to do instead
    "parameter written while its update is in flight": (amsp.ParamWrittenWhilePending, [
        "parameter(s) layers.1.feed_forward.w1.weight were written in place",
        "call optimizer.wait_param_update() after step() and before editing parameters",
    ]),
}


def test_bad_inputs_raise_and_leave_the_group_usable(world4):
    """Every error case ran and has an expectation (and no expectation lacks its case);
    the group still trains and all-reduces after them."""
    for rank, result in enumerate(world4.get("errors")):
        outcomes = result["outcomes"]
        assert outcomes.keys() == ERRORS.keys(), (rank, sorted(outcomes.keys() ^ ERRORS.keys()))
        assert result["all_reduce"] == 4.0, rank
    value_or_type = [name for name, (exc, _) in ERRORS.items() if exc in (ValueError, TypeError)]
    assert len(value_or_type) >= 12


@pytest.mark.parametrize("name", list(ERRORS), ids=[n.replace(" ", "-") for n in ERRORS])
def test_bad_input_raises_naming_the_problem(world4, name):
    exc_type, texts = ERRORS[name]
    for rank, result in enumerate(world4.get("errors")):
        assert name in result["outcomes"], (rank, name)
        got_type, message = result["outcomes"][name]
        assert got_type == exc_type.__name__, (rank, got_type, message)
        for text in texts:
            assert text in message, (rank, text, message)
        assert "\n" not in message.strip(), (rank, message)


# ---- recovery, hpZ, checkpoints between plans, the in-flight update ----------------------
@pytest.mark.parametrize("plan", RECOVERY_PLANS, ids=[_plan_id(p) for p in RECOVERY_PLANS])
def test_exception_in_forward_or_backward_then_retry_is_exact(world4, plan):
    for rank, r in enumerate(world4.get(("recovery", plan))):
        clean, retried = r["clean"], r["retried"]
        assert retried["failures"] == 1, (rank, plan)
        assert retried["losses"] == clean["losses"], (rank, plan)
        for name, want in clean["weights"].items():
            assert torch.equal(retried["weights"][name], want), (rank, plan, name)


def test_submodule_forward_lands_an_overlapped_update(world4):
    """A submodule run on its own after an overlapped step (zero_grad does not land the
    update) gives the output of the same submodule trained without the overlap."""
    for rank, r in enumerate(world4.get("submodule forward")):
        assert r["pending_after_zero_grad"] is True, rank
        assert torch.equal(r["overlapped_output"], r["plain_output"]), rank


def _differing(got: dict, want: dict) -> list:
    """Keys whose tensors are not identical (a key in one dict only counts)."""
    return sorted(set(got) ^ set(want)) + [k for k in want if k in got
                                           and not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("plan_name", list(EXTRA_PLANS))
def test_state_dicts_land_an_overlapped_update_first(world4, plan_name):
    """With the update in flight: a submodule's state_dict() reads the step's weights
    (those of a run without the overlap), and loading an earlier model or optimizer
    state is what the weights hold afterwards, not overwritten by the update landing."""
    for rank, got in enumerate(world4.get(("pending io", plan_name))):
        assert got["pending_before_read"] is True, rank
        assert got["pending_before_model_load"] is True, rank
        assert got["pending_before_optim_load"] is True, rank
        assert _differing(got["submodule"], got["submodule_without_overlap"]) == [], rank
        assert _differing(got["after_model_load"], got["saved"]) == [], rank
        assert _differing(got["after_optim_load"], got["saved"]) == [], rank


def _reference_with_edit(world):
    """One process, the whole batch, plain AdamW: step 0, wq of block 0 halved, step 1."""
    model = make_model(torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        if step == 1:
            with torch.no_grad():
                model.layers[0].attention.wq.weight.mul_(0.5)
        batch = global_batches(step, world, 1, model.cfg)
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        optim.step()
        optim.zero_grad()
    return model.layers[0].attention.wq.weight.detach().clone()


@pytest.mark.parametrize("plan_name", list(EXTRA_PLANS))
def test_an_in_place_edit_of_fp32_weights_is_what_the_next_step_updates(world4, plan_name):
    """fp32 params are their own masters: halving a weight between two steps gives the
    weights single-process AdamW gives with the same edit."""
    want = _reference_with_edit(4)
    for rank, got in enumerate(world4.get(("edited", plan_name))):
        assert rel_diff(got, want) <= TOLERANCE["fp32"], (rank, rel_diff(got, want))


def test_hpz_secondary_group(world4):
    for extra in world4.get("hpz"):
        assert extra["hpz_losses"] == extra["plain_losses"] or max(
            abs(a - b) / abs(b) for a, b in zip(extra["hpz_losses"], extra["plain_losses"])
        ) <= 1e-5
        # forward gathers over the 4-rank "p" group (2 nodes); backward only inside a node
        assert ("all_gather", "p", 4, True, "forward") in extra["hpz_events"]
        assert ("all_gather", "p_hpz", 2, False, "backward") in extra["hpz_events"]
        assert not any(e[0] == "all_gather" and e[1] == "p" and e[4] == "backward"
                       for e in extra["hpz_events"])


def test_optimizer_checkpoint_moves_between_plans(world4):
    for extra in world4.get("optimizer checkpoint"):
        assert extra["optim_state_types"] == ["DTensor", "Tensor"]  # states + the step counter
        assert extra["loaded_lr"] == 1e-3  # param_groups come from the checkpoint
        target, source = extra["target_continued"], extra["source_continued"]
        # the first loss uses the loaded weights only: identical up to reduction order
        assert abs(target[0] - source[0]) / abs(source[0]) <= 1e-6, (target, source)
        # later ones also the loaded Adam states and step counts; the two plans sum grads
        # in different orders, so fp32 drift of ~1e-5 per step is expected
        for a, b in zip(target, source):
            assert abs(a - b) / abs(b) <= 1e-4, (target, source)
