"""The unit step lifecycle (lifecycle.py) and the mesh registry (handle.py), in one process."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch.distributed as dist

from amsp_dtensor.engine.lifecycle import LifecycleError, StepState, check_transition

S = StepState
# The transitions of the lifecycle Note, written out again: (from, to) pairs allowed.
DOCUMENTED = {
    (S.IDLE, S.ACCUMULATING), (S.IDLE, S.REDUCING),
    (S.ACCUMULATING, S.ACCUMULATING), (S.ACCUMULATING, S.REDUCING),
    (S.REDUCING, S.SYNCED),
    (S.SYNCED, S.SENDING), (S.SYNCED, S.UPDATED),
    # a backward after the sync and before the step adds to G, as DDP's would
    (S.SYNCED, S.ACCUMULATING), (S.SYNCED, S.REDUCING),
    (S.SENDING, S.UPDATED),
    # the next step's backward (G kept until zero_grad, as torch keeps .grad)
    (S.UPDATED, S.ACCUMULATING), (S.UPDATED, S.REDUCING),
    # zero_grad() and the reset after an exception; a SENDING unit's update lands first
    *((src, S.IDLE) for src in S if src is not S.SENDING),
}


@pytest.mark.parametrize("src,dst", list(itertools.product(S, S)),
                         ids=lambda s: s.value)
def test_every_transition_is_checked(src, dst):
    if (src, dst) in DOCUMENTED:
        check_transition("layers.0", src, dst)
    else:
        with pytest.raises(LifecycleError, match=f"layers.0: {src.value} -> {dst.value}"):
            check_transition("layers.0", src, dst)


def test_one_training_step_walks_the_note():
    walk = (S.IDLE, S.ACCUMULATING, S.REDUCING, S.SYNCED, S.SENDING, S.UPDATED, S.REDUCING,
            S.SYNCED, S.UPDATED, S.IDLE)
    for src, dst in zip(walk, walk[1:]):
        check_transition("", src, dst)


def test_two_meshes_of_one_plan_keep_their_own_info(tmp_path):
    """DeviceMesh compares by value: the registry must key by identity, so each of two
    equal meshes has its own MeshInfo and keeps it when the other one is collected."""
    import amsp_dtensor as amsp
    from amsp_dtensor import compat
    from amsp_dtensor.engine.mesh import mesh_info

    owned = not dist.is_initialized()
    if owned:
        compat.init_fake_process_group(rank=0, world_size=8)
    try:
        plan = amsp.ShardingPlan(2, 2, 4)
        first = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu")
        second = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu")
        assert first == second  # by value, as DeviceMesh compares
        info = mesh_info(second)
        assert mesh_info(first) is not info and mesh_info(first).plan == info.plan
        del first
        gc.collect()
        assert mesh_info(second) is info
        assert (info.plan.s_p, info.plan.s_g, info.plan.s_os) == (2, 2, 4)
    finally:
        if owned:
            dist.destroy_process_group()
