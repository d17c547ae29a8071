"""The AMSP parallelize_fn: torchtitan's llama3 recipe with FSDP2 swapped for amsp.fully_shard.

Mirrors torchtitan.models.llama3.infra.parallelize.parallelize_llama for everything AMSP
does not replace (activation checkpointing, per-block torch.compile, mixed precision), by
calling torchtitan's own helpers, then shards bottom-up like apply_fsdp: every transformer
block is one AMSP unit, the root (embeddings, final norm, output) is the last.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_type

from .validate import AmspConfigError, resolve_plan
from .weights import init_full_model, keep_weights

PLAN_ATTR = "_amsp_plan"  # set on the root module: marks an AMSP model, holds its ResolvedPlan


def amsp_plan_of(model: nn.Module):
    """The ResolvedPlan an AMSP-parallelized model runs, or None for any other model."""
    return getattr(model, PLAN_ATTR, None)


def _check_parallelism(parallel_dims: ParallelDims) -> None:
    for name, degree in (
        ("tensor_parallel_degree", parallel_dims.tp),
        ("context_parallel_degree", parallel_dims.cp),
        ("pipeline_parallel_degree", parallel_dims.pp),
        ("expert_parallel_degree", parallel_dims.ep),
    ):
        if degree != 1:
            raise AmspConfigError(
                f"parallelism.{name}={degree}: llama3_amsp shards data-parallel states only; "
                "set it to 1 (AMSP with TP/CP/PP is not implemented)"
            )


def _mixed_precision(job_config) -> MixedPrecisionPolicy | None:
    param = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    reduce = TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
    model_dtype = TORCH_DTYPE_MAP[job_config.training.dtype]
    if param == model_dtype and reduce == model_dtype:
        return None  # nothing to cast: no mixed precision
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def parallelize_llama_amsp(model: nn.Module, parallel_dims: ParallelDims, job_config):
    import amsp_dtensor as amsp

    _check_parallelism(parallel_dims)
    plan = resolve_plan(job_config, world=parallel_dims.world_size)

    # Same order as parallelize_llama: AC wrapping, then per-block compile, then sharding.
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        apply_compile(model, job_config.compile)

    full_init = job_config.amsp.init_full_model
    if full_init:
        # Same seed, whole model, every rank: all plans start from identical weights.
        # torchtitan's later to_empty/init_weights are then kept off it (keep_weights).
        init_full_model(model, job_config)
    # else: shard the meta model; torchtitan's Trainer materialises and initialises the
    # shards afterwards (to_empty + init_weights), as with its own FSDP path.

    sharding = amsp.ShardingPlan(plan.s_p, plan.s_g, plan.s_os)
    mesh = amsp.init_mesh(sharding, ranks_per_node=plan.ranks_per_node, device_type=device_type)
    mp_policy = _mixed_precision(job_config)
    raf = job_config.amsp.reshard_after_forward
    for block in model.layers.values():
        amsp.fully_shard(block, mesh=mesh, plan=sharding, mp_policy=mp_policy,
                         reshard_after_forward=raf)
    amsp.fully_shard(model, mesh=mesh, plan=sharding, mp_policy=mp_policy)
    # torchtitan divides the loss by the global token count itself (Trainer.train_step):
    # the engine must sum gradients, not average them over ranks.
    amsp.set_gradient_divide_factor(model, 1.0)
    if full_init:
        keep_weights(model)
    setattr(model, PLAN_ATTR, plan)
    logger.info(
        f"Applied AMSP plan {plan.name} (s_p={plan.s_p}, s_g={plan.s_g}, s_os={plan.s_os}) "
        f"on {plan.world_size} ranks, {plan.ranks_per_node} per node; mesh {plan.mesh_shape}"
    )
    return model
