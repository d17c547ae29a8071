"""torchtitan 0.2.2's OptimizersContainer around amsp.AMSPOptimizer (see amsp_optimizers).

The container keeps torchtitan's interface (iteration for the LR schedulers, step hooks,
zero_grad) and its optimizer settings ([optimizer] name/lr/betas/eps/weight_decay/
implementation).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from .. import compat
from .amsp_optimizers import (OPTIMIZER_CLASSES, PIPELINE_STAGE_OF, RESIDUALS,  # noqa: F401
                              AmspOptimizers, refuse_part_keyed)
from .moe import register_load_balancing
from .validate import check_optimizer


class AmspOptimizersContainer(AmspOptimizers, OptimizersContainer):
    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs: dict[str, Any]):
        all_params = self._build_amsp_optimizers(model_parts, optimizer_cls, optimizer_kwargs)
        compat.titan_optimizers_container_init(self, all_params, optimizer_kwargs)


def build_amsp_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager=None,
    *,
    balance_load: bool = False,
) -> AmspOptimizersContainer:
    """Like torchtitan.components.optimizer.build_optimizers, with AMSPOptimizer inside;
    with ``balance_load`` (the TrainSpec's own optimizers were torchtitan's
    build_optimizers_with_moe_load_balancing: deepseek_v3, llama4, gpt_oss, not qwen3)
    also its expert-bias load balancing (moe.py)."""
    # amsp_dtensor.train refuses these before start-up (resolve_plan -> check_unsupported);
    # this repeats it for other launchers (python -m torchtitan.train with the _amsp specs).
    check_optimizer(optimizer_config, ft_manager is not None and getattr(ft_manager, "enabled", False))
    name = optimizer_config.name
    impl = optimizer_config.implementation
    kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    container = AmspOptimizersContainer(model_parts, OPTIMIZER_CLASSES[name], kwargs)
    if balance_load:
        register_load_balancing(container, model_parts, parallel_dims)
    return container
