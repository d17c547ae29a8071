"""The rank side of tests/test_moe.py: every (dense plan, expert plan) pair of the tiny MoE
on 4 CPU ranks (2 nodes x 2) with ep 1 and 2, each one case of run_cases, and the misuse
cases; each returns what it measured, the test module compares."""

from __future__ import annotations

from functools import partial

import torch

from amsp_dtensor.plan import enumerate_plans, expert_parallel_world
from amsp_dtensor.testing.moe import moe_training, reuse_process_groups

WORLD, PER_NODE = 4, 2
STEPS = 3
RECORD_STEP = 1


def plans(world: int, per_node: int) -> list[tuple[int, int, int]]:
    return [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(world, per_node)]


def pairs() -> list[tuple[int, tuple, tuple]]:
    """(ep, dense plan, expert plan) for every valid pair at ep 1 and 2."""
    out = []
    for ep in (1, 2):
        expert_world = expert_parallel_world(WORLD, PER_NODE, ep)
        out += [(ep, d, e) for d in plans(WORLD, PER_NODE) for e in plans(*expert_world)]
    return out


def pair_case(rank, world, ep, dense, expert):
    return moe_training(rank, world, dense, expert, ep, STEPS, record_step=RECORD_STEP)


def _message(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _ranks(mesh) -> list[int]:
    return sorted(torch.distributed.get_process_group_ranks(mesh.get_group()))


def error_case(rank, world):
    """Misuse of the expert API on the ranks: {name: the message raised, or None}."""
    import amsp_dtensor as amsp
    from amsp_dtensor.testing.moe import make_moe, moe_mesh
    from amsp_dtensor.testing.tiny_moe import expert_parallelize

    reuse_process_groups()
    plan = amsp.ShardingPlan(2, 2, 4)
    init = partial(amsp.init_mesh, ranks_per_node=PER_NODE, device_type="cpu")
    out = {
        "ep_not_dividing": _message(lambda: init(plan, ep=3)),
        "expert_plan_too_big": _message(
            lambda: init(plan, ep=2, expert_plan=amsp.ShardingPlan(1, 1, 4))),
    }
    # beside tp 2, EP spans the tp ranks: this rank's groups of the dense and expert meshes
    for ep, expert_plan in ((2, None), (4, amsp.ShardingPlan(1, 1, 1))):
        dense = init(amsp.ShardingPlan(1, 1, 2), ep=ep, tp=2, expert_plan=expert_plan)
        experts = amsp.expert_mesh(dense)
        out[f"groups_tp2_ep{ep}"] = {
            **{dim: _ranks(dense[dim]) for dim in ("tp", "os")},
            **{f"expert_{dim}": _ranks(experts[dim]) for dim in ("ep", "os")}}
    # nothing was left half-made: a valid mesh pair builds and its groups work
    mesh = moe_mesh((2, 2, 4), (1, 1, 2), 2, PER_NODE)
    ones = torch.ones(1)
    torch.distributed.all_reduce(ones, group=amsp.expert_mesh(mesh)["ep"].get_group())
    out["ep_group_sum"] = ones.item()
    dense_only = init(plan)
    out["no_expert_mesh"] = _message(lambda: amsp.expert_mesh(dense_only))

    model = make_moe()
    expert_parallelize(model, amsp.expert_mesh(mesh)["ep"])
    # the experts left to the block on the dense mesh
    out["experts_on_dense_mesh"] = _message(lambda: amsp.fully_shard(model.layers[1], mesh=mesh))

    model = make_moe()
    expert_parallelize(model, amsp.expert_mesh(mesh)["ep"])
    amsp.fully_shard(model.layers[1].moe.experts, mesh=amsp.expert_mesh(mesh))
    # the root on the expert mesh
    out["root_on_expert_mesh"] = _message(
        lambda: amsp.fully_shard(model, mesh=amsp.expert_mesh(mesh)))
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh)
    amsp.fully_shard(model, mesh=mesh)
    out["adafactor"] = _message(lambda: amsp.AMSPOptimizer(model, torch.optim.Adafactor))
    return out


# a checkpoint saved under ep 2 and one plan pair on 4 ranks (2 per node), resumed under
# ep 1 and another pair on 2 ranks (1 per node), with the same global batches
SAVED = (2, (2, 2, 4), (1, 1, 2))
RESUMED = (1, (1, 1, 2), (2, 2, 2))
CKPT_STEPS, CKPT_AT = 6, 3


def save_case(rank, world, path):
    """The uninterrupted run's losses; then a run to CKPT_AT saved, and its full state."""
    from amsp_dtensor import checkpoint
    from amsp_dtensor.testing.moe import build_moe, train_moe
    from amsp_dtensor.testing.scenarios import full_state

    ep, dense, expert = SAVED
    model, optim = build_moe(dense, expert, ep)
    whole, _, _ = train_moe(model, optim, rank, world, range(CKPT_STEPS))
    model, optim = build_moe(dense, expert, ep)
    first, _, _ = train_moe(model, optim, rank, world, range(CKPT_AT))
    checkpoint.save(path, CKPT_AT, model, optim)
    return {"whole": whole, "first": first, "state": full_state(model, optim)}


def resume_case(rank, world, path):
    """A fresh model and optimizer under RESUMED load the checkpoint: their full state,
    and the losses of the remaining steps (micro-batches doubled: the same global batch on
    half the ranks)."""
    from amsp_dtensor import checkpoint
    from amsp_dtensor.testing.moe import build_moe, train_moe
    from amsp_dtensor.testing.scenarios import full_state

    ep, dense, expert = RESUMED
    model, optim = build_moe(dense, expert, ep)
    checkpoint.load(checkpoint.step_path(path, CKPT_AT), model, optim)
    state = full_state(model, optim)
    rest, _, _ = train_moe(model, optim, rank, world, range(CKPT_AT, CKPT_STEPS),
                           micro_batches=2 * WORLD // world)
    return {"rest": rest, "state": state}


INT8 = {"grads": "int8"}
OTHER_EXPERTS = (2, (2, 2, 4), (2, 2, 2))  # SAVED's dense plan and ep, another expert plan


def compressed_checkpoint_case(rank, world, path):
    """int8 gradients (SAVED: the dense os and the experts' os stages cross nodes): save at
    step 2 of 4, resume under the same pair (every residual restored bit-identically, the
    same losses), and under another expert plan (its residuals reset with a warning)."""
    import warnings

    from amsp_dtensor import checkpoint
    from amsp_dtensor.engine.handle import root_state
    from amsp_dtensor.testing.moe import build_moe, train_moe

    def residuals(model):
        return {f"{i}.{k}": v.clone() for i, u in enumerate(root_state(model).units)
                for k, v in u.residual_state().items()}

    ep, dense, expert = SAVED
    model, optim = build_moe(dense, expert, ep, INT8)
    train_moe(model, optim, rank, world, range(2))
    checkpoint.save(path, 2, model, optim)
    saved = residuals(model)
    expert_units = [i for i, u in enumerate(root_state(model).units) if u.info.is_expert]
    straight, _, _ = train_moe(model, optim, rank, world, range(2, 4))
    model, optim = build_moe(dense, expert, ep, INT8)
    checkpoint.load(checkpoint.step_path(path, 2), model, optim)
    loaded = residuals(model)
    resumed, _, _ = train_moe(model, optim, rank, world, range(2, 4))
    ep, dense, expert = OTHER_EXPERTS
    model, optim = build_moe(dense, expert, ep, INT8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(checkpoint.step_path(path, 2), model, optim)
    return {
        "expert_residuals": [k for k in saved if int(k.split(".")[0]) in expert_units],
        "restored": loaded.keys() == saved.keys() and all(
            torch.equal(loaded[k], saved[k]) for k in saved),
        "straight": straight, "resumed": resumed,
        "other_warnings": [str(w.message) for w in caught if "error-feedback" in str(w.message)],
        "other_residuals": len(residuals(model)),
    }


def cases(path: str) -> dict:
    out = {("pair", *pair): partial(pair_case, ep=pair[0], dense=pair[1], expert=pair[2])
           for pair in pairs()}
    out["errors"] = error_case
    out["save"] = partial(save_case, path=path)
    out["compressed_checkpoint"] = partial(compressed_checkpoint_case,
                                           path=path + "-compressed")
    return out
