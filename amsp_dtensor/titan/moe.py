"""torchtitan's mixture-of-experts load balancing for the AMSP optimizers.

torchtitan's MoE TrainSpecs build their optimizers with
``build_optimizers_with_moe_load_balancing``: a step pre-hook that, before every optimizer
step, sums each MoE layer's ``tokens_per_expert`` over the data-parallel ranks and moves
its ``expert_bias`` (DeepSeek-V3's auxiliary-loss-free balancing). That hook is a closure
over torchtitan's own container; an AMSP job builds its container itself, so the same
hook is registered here, with torchtitan's arithmetic line for line and over the same
group (ParallelDims' "loss" mesh: every data-parallel and context-parallel rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from ..compat import no_reentrant_checkpoint_impl


def _moe_blocks(model_parts: list[nn.Module]) -> list[nn.Module]:
    blocks = []
    for part in model_parts:
        layers = getattr(part, "layers", None)
        if layers is None:
            continue
        for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
            if getattr(block, "moe_enabled", False):
                blocks.append(block)
    return blocks


def balances_load(model_parts: list[nn.Module]) -> bool:
    """torchtitan's rule: the hook is registered when the MoE layers have a
    load_balance_coeff (it is set on all or none)."""
    blocks = _moe_blocks(model_parts)
    return bool(blocks) and bool(getattr(blocks[0].moe, "load_balance_coeff", None))


@torch.no_grad()
def update_expert_bias(model_parts: list[nn.Module], parallel_dims) -> None:
    """torchtitan's ``_update_expert_bias``: tokens per expert summed over the "loss"
    mesh (halved under full activation checkpointing, which counts them twice), then each
    layer's bias moved by coeff x sign(mean - count), centred, and the counts reset."""
    blocks = _moe_blocks(model_parts)
    counts = []
    for block in blocks:
        if block.moe.load_balance_coeff is None:
            return
        tokens = block.moe.tokens_per_expert
        if getattr(block, "checkpoint_impl", None) is no_reentrant_checkpoint_impl():
            tokens = tokens // 2
        counts.append(tokens)
    if not counts:
        return
    by_layer = torch.vstack(counts)
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    if loss_mesh is not None:
        if isinstance(by_layer, DTensor):
            by_layer = by_layer.redistribute(placements=[Replicate()] * by_layer.device_mesh.ndim)
        else:
            torch.distributed.all_reduce(by_layer, group=loss_mesh.get_group(),
                                         op=torch.distributed.ReduceOp.SUM)
    for block, tokens in zip(blocks, by_layer):
        tokens = tokens.float()
        delta = block.moe.load_balance_coeff * torch.sign(tokens.mean() - tokens)
        block.moe.expert_bias.add_(delta - delta.mean())
        block.moe.tokens_per_expert.zero_()


def register_load_balancing(container, model_parts: list[nn.Module], parallel_dims) -> None:
    """Register the expert-bias update as ``container``'s step pre-hook, as torchtitan's
    MoE optimizers do (nothing for a dense model or MoE layers without a coefficient)."""
    if balances_load(model_parts):
        container.register_step_pre_hook(
            lambda *args, **kwargs: update_expert_bias(model_parts, parallel_dims))
