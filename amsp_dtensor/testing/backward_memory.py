"""Measure the gradient census of one training step per plan and dtype, next to the
memory model's prediction (tests/test_backward_memory.py checks it and, run as a script,
prints the table in docs/layouts.md).

``measure_backward_memory`` runs on every rank of one process group (run_on_ranks): for
each plan it builds TinyLlama, shards every block and then the root, trains one step of
``micro_batches`` micro-batches (all but the last under ``amsp.no_sync``) inside
``amsp.track_backward_memory`` and returns, per (plan, dtype), this rank's samples, its P
bytes and the prediction from ``cost.backward_peak`` for the same rank, keyed by
(plan, dtype name, micro_batches).
"""

from __future__ import annotations

import os

import torch

from .scenarios import LR, global_batches, make_model, micro_batch_backwards
from .tiny_llama import TinyLlamaConfig

# vocab 99: the embedding and output rows do not divide 2 or 4, so P, G and OS slots
# carry padding rows (the census counts slots, the prediction must too)
CONFIG = TinyLlamaConfig(vocab_size=99)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def firing_order(model) -> tuple[list[list[torch.Size]], list[list[torch.Size]]]:
    """TinyLlama's units in the order their gradient hooks fire (the blocks last to
    first, then the root), with their param shapes; and, per firing, the shapes of the
    root params whose grads autograd has already produced (the output head and the final
    norm come first in backward, the embedding last)."""
    blocks = [[p.shape for p in block.parameters()] for block in model.layers]
    root = [model.tok_embeddings.weight.shape, model.norm.weight.shape,
            model.output.weight.shape]
    early = [model.norm.weight.shape, model.output.weight.shape]
    units = list(reversed(blocks)) + [root]
    return units, [list(early) for _ in blocks] + [[]]


def measure_backward_memory(rank, world_size, plans, dtypes=("fp32", "bf16"), micro_batches=2):
    import amsp_dtensor as amsp
    from amsp_dtensor.plan.cost.backward_peak import predict_backward_grad_bytes
    from amsp_dtensor.engine.handle import root_state

    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    out = {}
    for plan in plans:
        sharding = amsp.ShardingPlan(*plan)
        resolved = sharding.resolve(world_size, ranks_per_node)
        mesh = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node, device_type="cpu")
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            model = make_model(dtype, CONFIG)
            units, early = firing_order(model)
            for block in model.layers:
                amsp.fully_shard(block, mesh=mesh, plan=sharding)
            amsp.fully_shard(model, mesh=mesh, plan=sharding)
            optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)
            batch = global_batches(0, world_size, micro_batches, model.cfg)
            with amsp.track_backward_memory(model) as tracker:
                for _ in micro_batch_backwards(model, batch, rank, world_size, micro_batches):
                    pass
            observers_left = len(root_state(model).unit_grad_observers)
            optim.step()
            optim.zero_grad()
            optim.wait_param_update()
            e = torch.finfo(dtype).bits // 8
            predicted = predict_backward_grad_bytes(
                units, resolved, micro_batches, param_bytes=e, grad_bytes=e, rank=rank,
                early_grads=early)
            out[(plan, dtype_name, micro_batches)] = {
                "units": [f"layers.{i}" for i in reversed(range(len(model.layers)))]
                + [type(model).__name__],
                "observers_left": observers_left,
                "samples": [(s.unit, s.micro, s.sync, s.bytes, dict(s.parts))
                            for s in tracker.samples],
                "peak": tracker.peak_grad_bytes,
                "param": tracker.param_bytes,
                "predicted": [(s.unit_index, s.micro, s.sync, s.bytes) for s in predicted.samples],
                "predicted_peak": predicted.peak_grad_bytes,
                "predicted_param": predicted.param_bytes,
            }
    return out
