"""The AMSP parallelize_fn: a torchtitan model's recipe with FSDP2 swapped for amsp.fully_shard.

``amsp_parallelize_fn(base_fn)`` builds it for any dense torchtitan TrainSpec whose model
keeps its transformer blocks in ``model.layers`` (llama3, qwen3, ...). It mirrors the base
parallelize_fn (e.g. parallelize_llama, parallelize_qwen3) for everything AMSP does not
replace (activation checkpointing with that model's selective-AC op list, per-block
torch.compile, mixed precision) by calling the helpers of the base's own module, then shards
bottom-up like apply_fsdp: the token embeddings, every transformer block, then the final
norm and output head together (kept unsharded after forward: backward needs them first),
each one AMSP unit, so each unit's gradients sync while backward goes on; the root holds
nothing. Tied weights (qwen3's output = tok_embeddings) must sit in one unit: such a
model keeps embeddings, final norm and output in the root unit.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra import parallelize as _llama3_parallelize
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_type

from ..engine import handle
from .. import compat
from ..compat import titan_sac_save_list

from .validate import (AmspConfigError, compression_of, job_plan, job_ranks_per_node,
                       reshard_after_forward_of)
from .weights import init_full_model, keep_weights

def amsp_plan_of(model: nn.Module):
    """The ResolvedPlan an AMSP-parallelized model runs, or None for any other model."""
    root = handle.root_of(model)
    return root.info.plan if root is not None else None


def _mixed_precision(job_config) -> MixedPrecisionPolicy | None:
    param = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    reduce = TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
    model_dtype = TORCH_DTYPE_MAP[job_config.training.dtype]
    if param == model_dtype and reduce == model_dtype:
        return None  # nothing to cast: no mixed precision
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def compile_blocks(model: nn.Module, compile_config) -> None:
    """Per-block torch.compile as torchtitan's apply_compile does (fullgraph, the configured
    backend), but compiling each block's ``forward`` in place instead of wrapping the block
    in an OptimizedModule.

    Why not torchtitan's apply_compile: the OptimizedModule wrapper forwards attribute
    writes to the module it wraps, so the AMSP unit set on the wrapper is found on both
    (``layers.0`` and ``layers.0._orig_mod``) and the engine steps each block twice
    (LifecycleError "AMSP unit layers.0: updated -> updated is not a valid step
    transition" in the first optimizer step; torch 2.13). In place, the block keeps its
    FQNs (no ``_orig_mod.``), and the unit's hooks stay outside the compiled region as with
    the wrapper.

    Under tensor parallelism the first block's input can be the pending result of the
    embeddings' asynchronous redistribution, which the compiled code must not get (see
    ``compat.settle_async_collective``): each compiled forward is called with its tensor
    inputs settled first, outside the compiled region.
    """
    for block in _blocks(model):
        block.forward = _with_settled_inputs(torch.compile(
            block.forward, backend=compile_config.backend, fullgraph=True))
    logger.info("Compiling each TransformerBlock with torch.compile")


def _with_settled_inputs(compiled):
    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        args = tuple(compat.settle_async_collective(a) for a in args)
        kwargs = {k: compat.settle_async_collective(v) for k, v in kwargs.items()}
        return compiled(*args, **kwargs)

    return forward


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    raise AmspConfigError(
        f"model {type(model).__name__}: AMSP shards one unit per transformer block and "
        "expects them in model.layers (an nn.ModuleDict or nn.ModuleList)"
    )


def _end_units(model: nn.Module) -> tuple | None:
    """(embeddings, [final norm, output head]) as torchtitan's apply_fsdp cuts them, or
    None when the model lacks them or ties the output head to the embeddings. A pipeline
    stage (torchtitan sets the modules of other stages to None) has either or neither:
    the one it lacks is None."""
    parts = [getattr(model, name, None) for name in ("tok_embeddings", "norm", "output")]
    embeddings, norm, output = (part if isinstance(part, nn.Module) else None for part in parts)
    if embeddings is not None and output is not None:
        shared = {id(p) for p in embeddings.parameters()} & {id(p) for p in output.parameters()}
        if shared:
            return None
    head = [norm, output] if norm is not None and output is not None else None
    if embeddings is None and head is None:
        return None
    if (embeddings is None or head is None) and not _pipeline_stage(model):
        return None
    return embeddings, head


def _pipeline_stage(model: nn.Module) -> bool:
    """A part torchtitan's pipeline split left some of the model's modules out of (they
    are None on it)."""
    return any(getattr(model, name, False) is None for name in ("tok_embeddings", "norm", "output"))


_PIPELINE_MESHES: dict = {}  # one mesh per plan and degrees, shared by a rank's stages


def _mesh(amsp, plan, tp: int, pp: int, ranks_per_node: int):
    """The AMSP mesh of the job's resolved plan (init_mesh keeps that object as the
    mesh's plan); under pipeline parallelism one for all stages of this rank (each
    init_mesh makes process groups: looped schedules parallelize several parts)."""
    if pp == 1:
        return amsp.init_mesh(plan, ranks_per_node=plan.ranks_per_node * tp,
                              device_type=device_type, tp=tp)
    key = (plan.s_p, plan.s_g, plan.s_os, ranks_per_node, tp, pp,
           id(torch.distributed.group.WORLD))
    if key not in _PIPELINE_MESHES:
        _PIPELINE_MESHES[key] = amsp.init_mesh(plan, ranks_per_node=ranks_per_node,
                                               device_type=device_type, tp=tp, pp=pp)
    return _PIPELINE_MESHES[key]


def amsp_parallelize_fn(base_fn, base_name: str | None = None):
    """The AMSP parallelize_fn for the TrainSpec whose parallelize_fn is ``base_fn``.

    Activation checkpointing uses the selective-AC op list of ``base_fn``'s module (falling
    back to llama3's); torch.compile is ``compile_blocks``.
    """
    module = importlib.import_module(base_fn.__module__)
    sac_save_list = titan_sac_save_list(module)
    if sac_save_list is None:
        sac_save_list = titan_sac_save_list(_llama3_parallelize)

    def parallelize_amsp(model: nn.Module, parallel_dims: ParallelDims, job_config):
        import amsp_dtensor as amsp

        plan = job_plan(job_config, world=parallel_dims.world_size)  # resolved once per job
        tp, pp = parallel_dims.tp, parallel_dims.pp
        blocks = _blocks(model)
        mesh = _mesh(amsp, plan, tp, pp, job_ranks_per_node(job_config))
        full_init = job_config.amsp.init_full_model
        if tp > 1:
            # [Note: TP, then everything else] As parallelize_llama: TP first, on the plain
            # model, so its plan's module paths hold; then AC, compile and the sharding. With
            # full init the weights are made whole first (same seed on every rank), so each
            # tp rank keeps its chunk of one initialisation, whatever the layout.
            if full_init:
                init_full_model(model, job_config)
            _apply_tp(model, module, mesh["tp"], job_config)

        # Same order as parallelize_llama: AC wrapping, then per-block compile, then sharding.
        compile_model = job_config.compile.enable and "model" in job_config.compile.components
        if job_config.activation_checkpoint.mode != "none":
            apply_ac(
                model,
                job_config.activation_checkpoint,
                model_compile_enabled=compile_model,
                op_sac_save_list=sac_save_list,
                base_folder=job_config.job.dump_folder,
            )
        if compile_model:
            compile_blocks(model, job_config.compile)
        blocks = _blocks(model)  # AC and compile replace the blocks with wrappers

        if full_init and tp == 1:
            # Same seed, whole model, every rank: all plans start from identical weights.
            # torchtitan's later to_empty/init_weights are then kept off it (keep_weights).
            init_full_model(model, job_config)
        # else: shard the meta model; torchtitan's Trainer materialises and initialises the
        # shards afterwards (to_empty + init_weights), as with its own FSDP path.

        mp_policy = _mixed_precision(job_config)
        # [amsp] reshard_after_forward / [parallelism] fsdp_reshard_after_forward, as
        # torchtitan's apply_fsdp maps its policy (the last units reshard only on "always")
        raf, raf_last = reshard_after_forward_of(job_config, plan)
        ends = _end_units(model)
        if ends and ends[0] is not None:
            amsp.fully_shard(ends[0], mesh=mesh, mp_policy=mp_policy,
                             reshard_after_forward=raf)
        for block in blocks:
            amsp.fully_shard(block, mesh=mesh, mp_policy=mp_policy,
                             reshard_after_forward=raf)
        if ends and ends[1] is not None:
            amsp.fully_shard(ends[1], mesh=mesh, mp_policy=mp_policy,
                             reshard_after_forward=raf_last)
        amsp.fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        # torchtitan divides the loss by the global token count itself (Trainer.train_step):
        # the engine must sum gradients, not average them over ranks.
        amsp.set_gradient_divide_factor(model, 1.0)
        # before torchtitan builds the optimizer (compressed weights need separate masters)
        compression = amsp.set_compression(model, **vars(compression_of(job_config.amsp)))
        if full_init:
            keep_weights(model)
        under_tp = f" x tp {tp}" if tp > 1 else ""
        under_tp += f" (one pipeline stage of {pp})" if pp > 1 else ""
        logger.info(
            f"Applied AMSP plan {plan.name} (s_p={plan.s_p}, s_g={plan.s_g}, s_os={plan.s_os}) "
            f"on {plan.world_size} data-parallel ranks{under_tp}, {plan.ranks_per_node} per "
            f"node; mesh {plan.mesh_shape}"
            + (f"; cross-node stages compressed: {compression}" if compression.enabled else "")
        )
        return model

    parallelize_amsp.amsp_base = base_name or base_fn.__module__
    parallelize_amsp.amsp_base_module = module  # for the checks before start-up
    parallelize_amsp.__qualname__ = f"parallelize_amsp[{parallelize_amsp.amsp_base}]"
    return parallelize_amsp


def _apply_tp(model: nn.Module, base_module, tp_mesh, job_config) -> None:
    """The base recipe's own ``apply_tp`` (sequence parallel; loss parallel unless
    ``parallelism.disable_loss_parallel``; float8 TP as it decides), then async TP if
    asked, as torchtitan's parallelize_llama does."""
    apply_tp = tp_apply_fn(base_module, tp_mesh.size())
    float8 = "float8" in job_config.model.converters and (
        job_config.quantize.linear.float8.recipe_name not in ("rowwise", "rowwise_with_gw_hp"))
    apply_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
             enable_float8_tensorwise_tp=float8)
    maybe_enable_async_tp(job_config, tp_mesh)


def tp_apply_fn(base_module, tp: int):
    """The base recipe's ``apply_tp``; AmspConfigError when its module has none (qwen3's
    keeps its TP plan inside parallelize_qwen3). specs.check_model asks before start-up."""
    apply_tp = getattr(base_module, "apply_tp", None)
    if apply_tp is None:
        raise AmspConfigError(
            f"parallelism.tensor_parallel_degree={tp}: {base_module.__name__} has no "
            "apply_tp to split this model with; set it to 1"
        )
    return apply_tp


def is_amsp_parallelize_fn(fn) -> bool:
    return getattr(fn, "amsp_base", None) is not None


parallelize_llama_amsp = amsp_parallelize_fn(_llama3_parallelize.parallelize_llama, "llama3")
