"""The overlap runs of tests/test_overlap.py: every valid plan at 4 ranks, units as
torchtitan cuts them, with every overlap off and on; one process group for all, each
(plan, config) one case of it."""

from __future__ import annotations

from functools import partial

import torch

import amsp_dtensor as amsp
from amsp_dtensor.plan import ShardingPlan, enumerate_plans
from amsp_dtensor.engine.handle import root_state
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import amsp_training, make_model, shard_model

WORLD, PER_NODE = 4, 2
STEPS, MICRO_BATCHES, RECORD_STEP = 4, 2, 1
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]
ALL_OFF = {"grad_sync": False, "prefetch": False, "step": False}
# name -> (set_overlap kwargs, overlap_param_update, clip before each step)
CONFIGS = {
    "none": (ALL_OFF, False, False),
    "all": (None, True, False),  # the defaults, plus the param-update overlap
    "all-clip": (None, True, True),
}


def _errors(rank, world):
    """Each misuse raises one line naming the fix (message text, exception name)."""
    plan = ShardingPlan(2, 2, 4)
    mesh = amsp.init_mesh(plan, ranks_per_node=PER_NODE, device_type="cpu")
    out = {}

    def attempt(name, fn):
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as e:
            out[name] = (type(e).__name__, str(e))
        else:
            out[name] = ("no error", "")

    model = make_model(torch.float32)
    attempt("same module twice", lambda: amsp.fully_shard(
        [model.norm, model.norm], mesh=mesh, plan=plan))
    attempt("nested modules", lambda: amsp.fully_shard(
        [model.layers[0], model.layers[0].attention], mesh=mesh, plan=plan))
    attempt("empty list", lambda: amsp.fully_shard([], mesh=mesh, plan=plan))
    sharded = make_model(torch.float32)
    shard_model(sharded, mesh, plan, layout="titan")
    attempt("set_overlap not a bool", lambda: amsp.set_overlap(sharded, step=1))
    attempt("set_overlap on a block", lambda: amsp.set_overlap(sharded.layers[0], step=True))
    out["set_overlap returns"] = repr(amsp.set_overlap(sharded, prefetch=False))
    out["unit names"] = sorted(u.name for u in root_state(sharded).units)
    return out


def run_overlap_cases():
    """run_cases results: every (plan, config), and "errors"."""
    cases = {(plan, name): partial(
                 amsp_training, plan=plan, dtype=torch.float32, micro_batches=MICRO_BATCHES,
                 steps=STEPS, record_step=RECORD_STEP, overlap=param_update, layout="titan",
                 overlaps=overlaps, clip=clip)
             for plan in PLANS for name, (overlaps, param_update, clip) in CONFIGS.items()}
    cases["errors"] = _errors
    return run_cases(cases, WORLD, PER_NODE, timeout=900)
