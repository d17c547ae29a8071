"""The rank side of tests/test_engine.py: every plan of a world, each (plan, variant) one
case of run_cases on the world's process group (started once per test module), and at
world 4 the cases of error_cases, extra_cases and recovery_cases. Cases return what they
measured (losses, weights, events, bytes, messages); the test module compares."""

from __future__ import annotations

from functools import partial

import torch

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.scenarios import amsp_training

MICRO_BATCHES = 2
READ_STEPS = 3  # weights read through model.parameters() after each of the first steps
# Steps trained per world size: 6 at 4 ranks; at 8 ranks (on 2 cores here the slower half
# of the module) the READ_STEPS the reads need.
STEPS = {4: 6, 8: READ_STEPS}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (name, param dtype, MixedPrecisionPolicy.reduce_dtype, overlap_param_update, read steps)
VARIANTS = {
    "fp32": (torch.float32, None, False, READ_STEPS),
    "bf16": (torch.bfloat16, None, False, 0),
    "fp32-overlap": (torch.float32, None, True, READ_STEPS),
}
# bf16 parameters with an fp32 gradient reduction. It and "bf16" run at world 4 only: at 8
# the same code paths run with more ranks, which fp32 checks exactly (and bf16 within 2e-2
# would not see), and its 16 plans are the slower half of the module on 2 cores.
REDUCE_FP32 = ("bf16-reduce-fp32", (torch.bfloat16, torch.float32, False, 0))
OVERLAP_STEPS = READ_STEPS  # the overlap variant trains just long enough for its reads
# How close two fp32 (bf16) runs must be: rel_diff (rel_norm_diff for bf16 weights)
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


def variants_of(world: int) -> dict:
    if world != 4:
        return {k: v for k, v in VARIANTS.items() if k != "bf16"}
    return {**VARIANTS, REDUCE_FP32[0]: REDUCE_FP32[1]}


def plan_case(rank, world, plan, variant):
    """One plan trained in one variant (amsp_training's result on this rank)."""
    dtype, reduce_dtype, overlap, read_steps = variants_of(world)[variant]
    steps = OVERLAP_STEPS if overlap else STEPS[world]
    return amsp_training(rank, world, plan, dtype, MICRO_BATCHES, steps, overlap=overlap,
                         reduce_dtype=reduce_dtype, read_steps=read_steps)


# At 8 ranks (2 nodes of 4), plans whose cross-node stages are compressed: the recorded
# bytes are compared with the cost model's (test_compression.py does 4 ranks)
COMPRESSED = {(1, 1, 8): dict(grads="int8", weights="bf16"),  # os RS, os AG
              (1, 1, 4): dict(grads="int8", weights="int8"),  # os RS and AG inside, rep AR
              (2, 8, 8): dict(grads="bf16", weights="int8")}  # g RS every micro-batch


def compressed_case(rank, world, plan):
    return amsp_training(rank, world, plan, torch.float32, MICRO_BATCHES, 2,
                         compression=COMPRESSED[plan])


def world_cases(world, per_node) -> dict:
    """name -> case for run_cases: (plan, variant) for every plan and variant; at world 4
    also "errors", ("recovery", plan) and the extra_cases."""
    cases = {}
    for p in enumerate_plans(world, per_node):
        plan = (p.s_p, p.s_g, p.s_os)
        for variant in variants_of(world):
            cases[(plan, variant)] = partial(plan_case, plan=plan, variant=variant)
    if world == 8:
        for plan in COMPRESSED:
            cases[("compressed", plan)] = partial(compressed_case, plan=plan)
    if world == 4:
        import extra_cases
        import recovery_cases
        from error_cases import run_error_cases

        cases["errors"] = run_error_cases
        cases.update(extra_cases.CASES)
        for plan in recovery_cases.PLANS:
            cases[("recovery", plan)] = partial(recovery_cases.run_recovery_case, plan=plan)
    return cases


def rel_diff(a, b) -> float:
    """Strict: largest elementwise error over the largest reference magnitude."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


def rel_norm_diff(a, b) -> float:
    """Tensor relative error ||a - b||_2 / ||b||_2."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()
