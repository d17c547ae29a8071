"""torch.compile of AMSP-sharded, tensor-parallel blocks (torchtitan's per-block compile,
``titan/parallelize.py::compile_blocks``): one process as rank 0 of a 4-rank job on torch's
fake process group (collectives move no data: what is checked is that the compiled
blocks trace, run forward and backward and feed the engine's gradient path, not values;
tests/test_titan_tp.py compares the losses of a real 4-rank run with torchtitan's).

Two things stood in the way, each pinned here: a copy of an AMSP mesh (which torch.compile
makes of every DTensor's spec it guards on, and torch.save of a DTensor) must not copy the
process groups the engine memoises on it; and the first compiled block must not be given
the embeddings' pending asynchronous redistribution (compat.settle_async_collective)."""

from __future__ import annotations

import copy
import io
import types

import torch

import amsp_dtensor as amsp
from amsp_dtensor.engine import handle
from amsp_dtensor.testing.scenarios import shard_model
from amsp_dtensor.testing.tiny_llama import TinyLlama, loss_fn, tensor_parallelize


def _tp_model(plan):
    mesh = amsp.init_mesh(plan, ranks_per_node=4, device_type="cpu", tp=2)
    torch.manual_seed(0)
    model = tensor_parallelize(TinyLlama(), mesh["tp"])
    return mesh, model


def test_a_copied_amsp_mesh_carries_no_process_group(fake_four_ranks):
    """deepcopy (torch.compile's guard on a DTensor spec) and pickling (torch.save) of a
    DTensor on the AMSP mesh or a sub-mesh: they failed with "TypeError: cannot pickle
    'torch._C._distributed_c10d.ProcessGroup' object"."""
    mesh, model = _tp_model(amsp.ShardingPlan(2, 2, 2))
    weight = model.layers[0].attention.wq.weight  # a DTensor on mesh["tp"], whose root is mesh
    spec = copy.deepcopy(weight._spec)
    assert spec == weight._spec and spec.mesh == mesh["tp"]
    torch.save(weight.detach(), io.BytesIO())
    copied = copy.deepcopy(mesh)
    info, copied_info = handle.mesh_info_of(mesh), handle.mesh_info_of(copied)
    assert copied_info.mesh is copied and copied_info.plan == info.plan
    assert copied_info._groups == {} and set(info._groups) == {"rep", "p", "g", "os", "shard", "tp"}


def test_compiled_tp_blocks_train_through_the_engine(fake_four_ranks):
    """Plan (1, 1, 2): no FSDP2 between the embeddings and the first block, so the block
    is handed the pending redistribution itself (without the settling, backward failed
    with "AttributeError: 'Tensor' object has no attribute '_local_tensor'"). The blocks
    compile (fullgraph, aot_eager) and steps run through the engine; later steps, with the
    overlapped update in flight at each forward, reuse the compiled code (the engine's
    landing hooks on the blocks' submodules stay out of it: they made it recompile)."""
    from amsp_dtensor.titan.parallelize import compile_blocks

    sharding = amsp.ShardingPlan(1, 1, 2)
    mesh, model = _tp_model(sharding)
    compile_blocks(model, types.SimpleNamespace(backend="aot_eager"))
    shard_model(model, mesh, sharding, layout="titan")
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3, overlap_param_update=True)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def step():
        loss_fn(model(tokens), tokens).backward()
        optim.step()
        optim.zero_grad()

    step()
    with torch.compiler.set_stance("fail_on_recompile"):
        step()
        step()
    optim.wait_param_update()
    assert all(u.step_state.value == "updated" for u in handle.root_of(model).units), [
        (u.name, u.step_state) for u in handle.root_of(model).units]
