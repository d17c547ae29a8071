"""Bad inputs to AMSP with tensor parallelism, each refused in one line that names the fix,
before any collective: one process as rank 0 of a 4-rank job on torch's fake process
group (no data moves; what is checked is the refusal)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

import amsp_dtensor as amsp
from amsp_dtensor.testing.scenarios import shard_model
from amsp_dtensor.testing.tiny_llama import TinyLlama, loss_fn, tensor_parallelize


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def test_tp_that_does_not_divide_ranks_per_node(fake_four_ranks):
    with pytest.raises(ValueError) as e:
        amsp.init_mesh(amsp.ShardingPlan(1, 1, 1), ranks_per_node=4, device_type="cpu", tp=3)
    assert "tp=3 does not divide ranks_per_node=4" in _one_line(e)


def test_plan_factor_that_does_not_fit_the_data_parallel_world(fake_four_ranks):
    with pytest.raises(ValueError) as e:  # 4 ranks / tp 2 = 2 data-parallel ranks
        amsp.init_mesh(amsp.ShardingPlan(4, 4, 4), ranks_per_node=4, device_type="cpu", tp=2)
    message = _one_line(e)
    assert "under tp=2" in message and "data-parallel world (2 ranks, 2 per node)" in message
    assert "param=4" in message


def test_model_not_parallelized_before_fully_shard(fake_four_ranks):
    plan = amsp.ShardingPlan(2, 2, 2)
    mesh = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu", tp=2)
    with pytest.raises(ValueError) as e:
        amsp.fully_shard(TinyLlama().layers[0], mesh=mesh, plan=plan)
    message = _one_line(e)
    assert "plain tensor" in message and "tp=2" in message
    assert "parallelize_module(model, mesh['tp'], plan)) before amsp.fully_shard" in message


def test_tp_on_a_mesh_that_is_not_the_amsp_meshs_tp_dim(fake_four_ranks):
    plan = amsp.ShardingPlan(2, 2, 2)
    mesh = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu", tp=2)
    other = DeviceMesh("cpu", torch.tensor([0, 2]), mesh_dim_names=("tp",))  # mesh["tp"] is [0, 1]
    model = tensor_parallelize(TinyLlama(), other)
    with pytest.raises(ValueError) as e:
        amsp.fully_shard(model.layers[0], mesh=mesh, plan=plan)
    assert "not on the AMSP mesh's 'tp' dim" in _one_line(e)


def test_tp_params_with_a_mesh_built_without_tp(fake_four_ranks):
    plan = amsp.ShardingPlan(1, 1, 2)
    mesh = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu")
    tp_mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("tp",))
    model = tensor_parallelize(TinyLlama(), tp_mesh)
    with pytest.raises(ValueError) as e:
        amsp.fully_shard(model.layers[0], mesh=mesh, plan=plan)
    assert "amsp.init_mesh(plan, tp=N)" in _one_line(e)


@pytest.mark.parametrize("plan", [(1, 1, 4), (2, 2, 4)], ids=["s_p=1", "s_p=2"])
def test_tp_applied_after_fully_shard_is_refused_naming_the_order(fake_four_ranks, plan):
    """parallelize_module after amsp.fully_shard: refused by the first module it would
    split, before any parameter is replaced. (Without the refusal, s_p > 1 ends in torch's
    "Cannot distribute a DTensor with device mesh ..." and s_p = 1 silently replaces the
    plain parameters the unit was built over.)"""
    plan = amsp.ShardingPlan(*plan)
    mesh = amsp.init_mesh(plan, ranks_per_node=2, device_type="cpu")
    model = TinyLlama()
    shard_model(model, mesh, plan)
    before = {name: p for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as e:
        tensor_parallelize(model, DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("tp",)))
    message = _one_line(e)
    assert message.startswith("Embedding 'tok_embeddings' of TinyLlama was sharded by "
                              "amsp.fully_shard"), message
    assert message.endswith("apply it first (parallelize_module(model, mesh['tp'], tp_plan), "
                            "mesh from amsp.init_mesh(plan, tp=N)), then amsp.fully_shard")
    assert all(p is before[name] for name, p in model.named_parameters())


def test_parameter_made_a_dtensor_after_fully_shard_is_refused_at_the_next_forward(fake_four_ranks):
    """An s_p = 1 unit's plain parameter replaced by a TP DTensor some other way than
    parallelize_module: the unit refuses at its next forward, before anything is issued."""
    from torch.distributed.tensor import Shard, distribute_tensor

    plan = amsp.ShardingPlan(1, 1, 4)
    mesh = amsp.init_mesh(plan, ranks_per_node=2, device_type="cpu")
    model = TinyLlama()
    shard_model(model, mesh, plan)
    wq = model.layers[0].attention.wq
    tp_mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("tp",))
    wq.register_parameter("weight", torch.nn.Parameter(distribute_tensor(wq.weight, tp_mesh, [Shard(0)])))
    tokens = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(RuntimeError) as e:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    message = _one_line(e)
    assert "was a plain tensor when amsp.fully_shard ran" in message
    assert "apply tensor parallelism (parallelize_module) before amsp.fully_shard" in message


@pytest.mark.parametrize("optimizer,why", [
    (torch.optim.Adafactor, "its factored moments would also need sums over the "
                            "tensor-parallel ranks"),
    (torch.optim.Muon, "its Newton-Schulz update needs each matrix whole, which tensor "
                       "parallelism splits over the tp ranks"),
], ids=["Adafactor", "Muon"])
def test_whole_tensor_optimizers_with_tp(fake_four_ranks, optimizer, why):
    plan = amsp.ShardingPlan(2, 2, 2)
    mesh = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu", tp=2)
    model = tensor_parallelize(TinyLlama(), mesh["tp"])
    shard_model(model, mesh, plan)
    with pytest.raises(ValueError) as e:
        amsp.AMSPOptimizer(model, optimizer)
    message = _one_line(e)
    assert message.startswith(f"{optimizer.__name__} with tensor parallelism is not "
                              f"supported: {why}")
    assert message.endswith("use one of SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, NAdam, "
                            "RAdam, RMSprop, Rprop")
