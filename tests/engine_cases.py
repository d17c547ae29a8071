"""Runs every plan of a world on one process group (started once per test module)."""

from __future__ import annotations

import torch

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_on_ranks
from amsp_dtensor.testing.scenarios import amsp_training, reference_training

STEPS = 10
MICRO_BATCHES = 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _all_plans(rank, world, per_node, extra=None):
    out = {}
    for plan in enumerate_plans(world, per_node):
        key = (plan.s_p, plan.s_g, plan.s_os)
        for name, dtype in DTYPES.items():
            out[(key, name)] = amsp_training(rank, world, key, dtype, MICRO_BATCHES, STEPS)
    if extra is not None:
        out["extra"] = extra(rank, world)
    return out


def run_world(world, per_node, extra=None):
    """({(plan, dtype): [per-rank result]}, {dtype: reference}) for every plan."""
    results = run_on_ranks(_all_plans, world, per_node, per_node, extra, timeout=900)
    by_case = {key: [r[key] for r in results] for key in results[0]}
    refs = {name: reference_training(world, MICRO_BATCHES, STEPS, dt) for name, dt in DTYPES.items()}
    return by_case, refs


def rel_diff(a, b) -> float:
    """Strict: largest elementwise error over the largest reference magnitude."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


def rel_norm_diff(a, b) -> float:
    """Tensor relative error ||a - b||_2 / ||b||_2."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()
