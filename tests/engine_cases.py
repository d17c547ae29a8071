"""Runs every plan of a world on one process group (started once per test module)."""

from __future__ import annotations

import torch

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_on_ranks
from amsp_dtensor.testing.scenarios import amsp_training, reference_training

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
# bf16 parameters with an fp32 gradient reduction (run at world 4 only)
REDUCE_FP32 = ("bf16-reduce-fp32", (torch.bfloat16, torch.float32, False, 0))
OVERLAP_STEPS = READ_STEPS  # the overlap variant trains just long enough for its reads


def variants_of(world: int) -> dict:
    out = dict(VARIANTS)
    if world == 4:
        out[REDUCE_FP32[0]] = REDUCE_FP32[1]
    return out


def _all_plans(rank, world, per_node, extra=None):
    out = {}
    for plan in enumerate_plans(world, per_node):
        key = (plan.s_p, plan.s_g, plan.s_os)
        for name, (dtype, reduce_dtype, overlap, read_steps) in variants_of(world).items():
            steps = OVERLAP_STEPS if overlap else STEPS[world]
            out[(key, name)] = amsp_training(
                rank, world, key, dtype, MICRO_BATCHES, steps, overlap=overlap,
                reduce_dtype=reduce_dtype, read_steps=read_steps,
            )
    if extra is not None:
        out["extra"] = extra(rank, world)
    return out


def run_world(world, per_node, extra=None):
    """({(plan, variant): [per-rank result]}, {dtype name: reference}) for every plan."""
    results = run_on_ranks(_all_plans, world, per_node, per_node, extra, timeout=900)
    by_case = {key: [r[key] for r in results] for key in results[0]}
    refs = {name: reference_training(world, MICRO_BATCHES, STEPS[world], dt, read_steps=READ_STEPS)
            for name, dt in DTYPES.items()}
    return by_case, refs


def rel_diff(a, b) -> float:
    """Strict: largest elementwise error over the largest reference magnitude."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


def rel_norm_diff(a, b) -> float:
    """Tensor relative error ||a - b||_2 / ||b||_2."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()
