"""Bad plans, meshes and calls, run inside a live process group (one case of the world-4
group of tests/test_engine.py): each must raise an exception naming the problem, before
any collective, and the group must still work afterwards. The cases are keyed by name;
the test keeps the expected exception and message of each under the same name."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard as torch_fully_shard

import amsp_dtensor as amsp
from amsp_dtensor.plan import ShardingPlan
from amsp_dtensor.testing.scenarios import make_model
from amsp_dtensor.testing.tiny_llama import TinyLlama, loss_fn


def run_error_cases(rank, world):
    """{"outcomes": {case name: (exception type name or None, message)}, "all_reduce":
    the sum of ones over the ranks after every case}; tests/test_engine.py holds what
    each case must raise, keyed by the same names."""
    plan = ShardingPlan(2, 2, 4)
    mesh = amsp.init_mesh(plan, ranks_per_node=2, device_type="cpu")
    replica = ShardingPlan(1, 1, 1)
    replica_mesh = amsp.init_mesh(replica, ranks_per_node=2, device_type="cpu")
    plain_mesh = init_device_mesh("cpu", (4,))

    def sharded_model():
        model = make_model(torch.float32)
        for block in model.layers:
            amsp.fully_shard(block, mesh=mesh, plan=plan)
        return amsp.fully_shard(model, mesh=mesh, plan=plan)

    good = sharded_model()
    good_optim = amsp.AMSPOptimizer(good, torch.optim.AdamW, lr=1e-3)

    def mixed():
        m = make_model(torch.float32)
        m.layers[0].attention.wq.to(torch.bfloat16)
        amsp.fully_shard(m.layers[0], mesh=mesh, plan=plan)

    def meta():
        # sharding a meta model is fine (torchtitan does it); the optimizer needs values
        with torch.device("meta"):
            m = TinyLlama()
        for block in m.layers:
            amsp.fully_shard(block, mesh=mesh, plan=plan)
        amsp.AMSPOptimizer(amsp.fully_shard(m, mesh=mesh, plan=plan), torch.optim.AdamW)

    def torch_wrapped():
        m = make_model(torch.float32)
        torch_fully_shard(m.layers[0], mesh=plain_mesh)
        amsp.fully_shard(m.layers[0], mesh=mesh, plan=plan)

    def no_sync_then_step():
        tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))
        with amsp.no_sync(good):
            loss_fn(good(tokens[:, :-1]), tokens[:, 1:]).backward()
        good_optim.step()

    def step_twice():
        tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))
        loss_fn(fresh(tokens[:, :-1]), tokens[:, 1:]).backward()
        fresh_optim.step()
        fresh_optim.step()

    def step_without_backward():
        fresh_optim.zero_grad()
        fresh_optim.step()

    def moved_after_sharding():
        m = sharded_model()
        m.to("meta")
        m(torch.zeros(2, 8, dtype=torch.long))

    def replaced_after_optimizer():
        # fp32 masters are views into the params: a param given new storage is refused
        m = make_model(torch.float32)
        for block in m.layers:
            amsp.fully_shard(block, mesh=replica_mesh, plan=replica)
        amsp.fully_shard(m, mesh=replica_mesh, plan=replica)
        optim = amsp.AMSPOptimizer(m, torch.optim.AdamW, lr=1e-3)
        tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))
        loss_fn(m(tokens[:, :-1]), tokens[:, 1:]).backward()
        optim.zero_grad()  # completes the gradient sync: nothing left in flight
        m.layers[0].attention.wq.weight.data = m.layers[0].attention.wq.weight.data.clone()
        optim.step()

    def written_while_pending():
        # overlap_param_update=True leaves the update in flight after step(); an in-place
        # edit made before it lands would be overwritten by it, so the next forward refuses
        m = sharded_model()
        optim = amsp.AMSPOptimizer(m, torch.optim.AdamW, lr=1e-3, overlap_param_update=True)
        tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))
        loss_fn(m(tokens[:, :-1]), tokens[:, 1:]).backward()
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            m.layers[1].feed_forward.w1.weight.mul_(0.5)
        m(tokens[:, :-1])

    fresh = sharded_model()
    fresh_optim = amsp.AMSPOptimizer(fresh, torch.optim.AdamW, lr=1e-3)
    cases = {
        "plan breaks chain order": lambda: ShardingPlan(2, 1, 4).resolve(4, 2),
        "factor does not divide world": lambda: amsp.init_mesh(
            ShardingPlan(3, 3, 3), ranks_per_node=2, device_type="cpu"),
        "plan of wrong type": lambda: amsp.init_mesh("full", ranks_per_node=2),
        "resolved plan for another world": lambda: amsp.init_mesh(
            ShardingPlan().resolve(8, 4), ranks_per_node=2),
        "plan differs from mesh": lambda: amsp.fully_shard(
            make_model(torch.float32), mesh=mesh, plan=replica),
        "not a module": lambda: amsp.fully_shard("layer", mesh=mesh, plan=plan),
        "mesh not from init_mesh": lambda: amsp.fully_shard(
            make_model(torch.float32), mesh=plain_mesh, plan=plan),
        "sharded twice": lambda: amsp.fully_shard(good.layers[0], mesh=mesh, plan=plan),
        "mp_policy of wrong type": lambda: amsp.fully_shard(
            make_model(torch.float32), mesh=mesh, plan=plan, mp_policy="bf16"),
        "hpZ factor not dividing param_shard": lambda: amsp.fully_shard(
            make_model(torch.float32), mesh=mesh, plan=plan, reshard_after_forward=3),
        "optimizer on a meta-device model": meta,
        "mixed dtypes": mixed,
        "optimizer class is a string": lambda: amsp.AMSPOptimizer(good, "adamw", lr=1e-3),
        "optimizer on an unsharded model": lambda: amsp.AMSPOptimizer(
            make_model(torch.float32), torch.optim.AdamW),
        "no_sync on an unsharded model": lambda: amsp.no_sync(
            make_model(torch.float32)).__enter__(),
        "divide factor zero": lambda: amsp.set_gradient_divide_factor(good, 0),
        "clip with max_norm 0": lambda: good_optim.clip_grad_norm_(0.0),
        "already wrapped by torch fully_shard": torch_wrapped,
        "cast without all-gather": lambda: amsp.fully_shard(
            make_model(torch.float32).layers[0], mesh=replica_mesh, plan=replica,
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        ),
        "step after no_sync only": no_sync_then_step,
        "step twice without a backward": step_twice,
        "step without any backward": step_without_backward,
        "fully_shard after the optimizer was built": lambda: amsp.fully_shard(
            fresh.layers[0].attention, mesh=mesh, plan=plan),
        "a second optimizer on one model": lambda: amsp.AMSPOptimizer(
            fresh, torch.optim.AdamW, lr=1e-3),
        "model moved after sharding": moved_after_sharding,
        "zero_grad keeping grads": lambda: fresh_optim.zero_grad(set_to_none=False),
        "parameter storage replaced after the optimizer": replaced_after_optimizer,
        "parameter written while its update is in flight": written_while_pending,
    }
    outcomes = {}  # name -> (exception type name or None, message)
    for name, case in cases.items():  # in order: some share a model whose state moves on
        try:
            case()
            outcomes[name] = (None, "no exception")
        except Exception as exc:  # noqa: BLE001 - the test inspects the type
            outcomes[name] = (type(exc).__name__, str(exc))
    # The group still works: a proper step after the errors, and a plain collective.
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(rank))
    loss_fn(good(tokens[:, :-1]), tokens[:, 1:]).backward()
    good_optim.step()
    good_optim.zero_grad()
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return {"outcomes": outcomes, "all_reduce": ones.item()}
