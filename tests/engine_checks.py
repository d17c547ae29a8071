"""Assertions shared by the world-4 and world-8 engine tests."""

from __future__ import annotations

from collections import Counter

from engine_cases import READ_STEPS, rel_diff, rel_norm_diff
from engine_expectations import expected_step_events, ideal_bytes, os_bytes

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
ELEM = {"fp32": 4, "bf16": 2}
# variant -> (dtype of the reference and the tolerance, param bytes, gradient bytes)
VARIANT = {
    "fp32": ("fp32", 4, 4),
    "bf16": ("bf16", 2, 2),
    "fp32-overlap": ("fp32", 4, 4),
    "bf16-reduce-fp32": ("bf16", 2, 4),
}


def check_equivalence(case, ref, dtype):
    rank0 = case[0]
    tol = TOLERANCE[dtype]
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


def check_memory(case, plan, world, dtype):
    elem = ELEM[dtype]  # parameters and gradients both in ``dtype``
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


def check_params_after_step(case, ref, plan):
    """Weights read through model.parameters() after each of the first steps (right after
    step(), or after the landing call with overlap) equal single-process training."""
    got, want = case[0]["step_weights"], ref["step_weights"]
    assert len(got) == len(want) == READ_STEPS, (len(got), len(want))
    for step, (got_w, want_w) in enumerate(zip(got, want)):
        for name, w in want_w.items():
            diff = rel_diff(got_w[name], w)
            assert diff <= TOLERANCE["fp32"], (step, name, diff)


def check_schedule(case, plan, world, per_node, micro_batches, variant):
    _, elem, grad_elem = VARIANT[variant]
    want = expected_step_events(plan, world, per_node, micro_batches, elem, grad_elem=grad_elem)
    for rank, result in enumerate(case):
        got = Counter(result["events"])
        assert got == want, (rank, sorted((got - want).items()), sorted((want - got).items()))
    # no cross-replica traffic before the last micro-batch: only P and G collectives there
    for key in want:
        op, dim, _, _, _, phase = key
        if phase in ("forward", "backward"):
            assert dim in ("p", "g"), key


def check_cost_model(case, plan, world, per_node, micro_batches, variant):
    """The planner's cost model predicts exactly what the engine did (bytes per collective
    and the state bytes of every rank), on the same runs as the checks above."""
    from amsp_dtensor.plan.cost.check import schedule_differences, unit_param_shapes_of
    from amsp_dtensor.plan.cost.memory import state_bytes_of_rank
    from amsp_dtensor.plan import ShardingPlan
    from amsp_dtensor.testing.tiny_llama import TinyLlama

    resolved = ShardingPlan(*plan).resolve(world, per_node)
    model = TinyLlama()
    units, root = unit_param_shapes_of(model, model.layers)
    _, elem, grad_elem = VARIANT[variant]
    for rank, result in enumerate(case):
        diffs = schedule_differences(resolved, units, micro_batches, elem, root, result["events"],
                                     clip=True, reduce_dtype_bytes=grad_elem)
        assert diffs == [], (rank, diffs)
        predicted = state_bytes_of_rank(units, resolved, rank, elem)
        grad = state_bytes_of_rank(units, resolved, rank, grad_elem).grad  # G in reduce dtype
        mem = result["memory"]
        assert (mem["param"], mem["grad"], mem["optim"]) == (
            predicted.param, grad, predicted.optim
        ), (rank, mem, predicted, grad)
