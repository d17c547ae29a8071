"""``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=None)`` on fp32 parameters
reduces in bf16 on every supported torch: FSDP2's reduce-scatter (the P path), the
engine's G buffers and its own reduce-scatter. torch 2.15 changed FSDP2's default for
``reduce_dtype=None`` to the parameters' dtype (fp32 here); the engine hands FSDP2 an
explicit reduce dtype (compat.fsdp_mixed_precision), so the bytes stay those of 2.13.

One process as rank 0 of a 4-rank job on torch's fake backend (collectives move no
data): the recorded bytes and dtypes are what is checked, not values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import amsp_dtensor as amsp
from amsp_dtensor.engine.recorder import record_comms
from amsp_dtensor.engine.handle import root_state

# two bias-free linears, one unit: 8x8 + 4x8 weights, rows divisible by s_p = 2 (no padding)
NUMEL = 8 * 8 + 4 * 8


def _gradient_comms(policy, model_dtype=torch.float32):
    plan = amsp.ShardingPlan(2, 2, 4)  # P and G over 2 ranks, OS over 4 (an "os" reduce)
    mesh = amsp.init_mesh(plan, ranks_per_node=2, device_type="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
    model = model.to(model_dtype)
    amsp.fully_shard(model, mesh=mesh, plan=plan, mp_policy=policy)
    with record_comms() as rec:
        model(torch.randn(3, 8, dtype=model_dtype)).float().sum().backward()
        state = root_state(model)
        state.finish_sync()
    unit = state.units[0]
    comms = {(e.op, e.dim): e.nbytes for e in rec.events if e.op == "reduce_scatter"}
    return comms, unit


def test_reduce_dtype_none_reduces_in_param_dtype(fake_four_ranks):
    comms, unit = _gradient_comms(MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    bf16 = 2  # bytes per element
    # FSDP2's reduce-scatter over "p": the unit's full (unsharded) grads in bf16; then
    # the engine's over "os" (2 G shards per OS subgroup): this rank's half of them
    assert comms == {("reduce_scatter", "p"): NUMEL * bf16,
                     ("reduce_scatter", "os"): NUMEL // 2 * bf16}
    assert unit.grad_dtype() is torch.bfloat16
    assert unit.synced_grad.dtype is torch.bfloat16
    assert unit.synced_grad.numel() == NUMEL // 4


def test_explicit_reduce_dtype_is_kept(fake_four_ranks):
    comms, unit = _gradient_comms(MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32))
    fp32 = 4
    assert comms == {("reduce_scatter", "p"): NUMEL * fp32,
                     ("reduce_scatter", "os"): NUMEL // 2 * fp32}
    assert unit.synced_grad.dtype is torch.float32


def test_no_policy_reduces_in_the_params_dtype(fake_four_ranks):
    comms, unit = _gradient_comms(None, model_dtype=torch.bfloat16)
    assert comms == {("reduce_scatter", "p"): NUMEL * 2, ("reduce_scatter", "os"): NUMEL}
    assert unit.synced_grad.dtype is torch.bfloat16
