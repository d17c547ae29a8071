"""Step time with overlap against hand-built timelines and the compute formula."""

import pytest

from amsp_dtensor.plan.cost.comm import GroupShape, PlannedComm, predicted_events
from amsp_dtensor.plan.cost.models import ModelShape
from amsp_dtensor.plan.cost.step import (
    OPTIM_STEP_BYTES, ComputeModel, model_flops_per_token, step_time)
from amsp_dtensor.plan import ShardingPlan

MODEL = ModelShape("t", dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_hidden=128)
CM = ComputeModel(compute_flops=1e9, peak_flops=2e9, hbm_bw=1e9)


class Const:
    """Every collective takes `t` seconds."""

    def __init__(self, t):
        self.t = t

    def time(self, op, nbytes, group):
        return self.t if group.size > 1 else 0.0


def _events(plan, W=4, R=2, M=1):
    rp = ShardingPlan.from_name(plan).resolve(W, R)
    return rp, predicted_events(rp, MODEL.unit_param_shapes(), M, 2, MODEL.root_unit_index,
                                clip=True)


def test_no_communication_is_compute_plus_optimizer():
    rp, ev = _events("p1-g1-os1", W=1, R=1)
    st = step_time(MODEL, ev, Const(1.0), seq_len=8, micro_batch=2, micro_batches=3,
                   os_numel=1000, compute=CM)
    tokens = 8 * 2 * 3
    flops = tokens * model_flops_per_token(MODEL, 8)
    assert flops == tokens * 3 * (2 * (2 * MODEL.block_numel + 2 * 8 * 64) + 2 * 128 * 64)
    assert st.seconds == pytest.approx(flops / 1e9 + OPTIM_STEP_BYTES * 1000 / 1e9)
    assert st.comm_sum_seconds == 0 and st.exposed_comm_seconds == pytest.approx(0)
    assert st.mfu == pytest.approx(flops / (st.seconds * 2e9))


def test_ddp_sync_of_the_root_is_exposed_blocks_hide_behind_backward():
    # DDP over 4 ranks: one all-reduce per unit in the last backward. Compute is much
    # longer than a collective, so block 1's hides behind block 0's backward; block 0's
    # and the root's (the embedding's grads come last) have nothing left to hide behind.
    rp, ev = _events("p1-g1-os1")
    st = step_time(MODEL, ev, Const(1e-3), seq_len=8, micro_batch=2, micro_batches=1,
                   os_numel=0, compute=CM)
    assert st.exposed_comm_seconds == pytest.approx(2e-3)
    assert st.comm_sum_seconds == pytest.approx(3e-3)


def test_post_step_all_gather_exposed_unless_overlapped():
    rp, ev = _events("p1-g1-os4")  # RS over os + post-step AG over os, no "rep"
    kw = dict(seq_len=8, micro_batch=2, micro_batches=1, os_numel=0, compute=CM)
    slow = step_time(MODEL, ev, Const(1e-4), overlap_param_update=False, **kw)
    fast = step_time(MODEL, ev, Const(1e-4), overlap_param_update=True, **kw)
    # without overlap the three post-step all-gathers (root, block 0, block 1) add to the
    # step in full; with it the forward must still wait for the root's and block 0's before
    # its first block, and block 1's hides behind block 0's compute
    assert slow.seconds - fast.seconds == pytest.approx(1e-4)


def test_comm_bound_step_is_at_least_the_serial_comm():
    rp, ev = _events("p4-g4-os4")
    st = step_time(MODEL, ev, Const(1.0), seq_len=8, micro_batch=2, micro_batches=2,
                   os_numel=0, compute=CM)
    assert st.seconds >= st.comm_sum_seconds
