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

import importlib

import torch.nn as nn

from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra import parallelize as _llama3_parallelize

from ..compat import titan_sac_save_list

from .validate import (AmspConfigError, compression_of, job_expert_plan, job_plan,
                       job_ranks_per_node, reshard_after_forward_of)
from .units import (_blocks, _end_units, amsp_plan_of, compile_blocks,  # noqa: F401
                    log_applied, mixed_precision, plan_mesh, routed_experts, shard_units)
from .weights import init_full_model


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
        expert_plan = job_expert_plan(job_config, world=parallel_dims.world_size)
        tp, pp, ep = parallel_dims.tp, parallel_dims.pp, parallel_dims.ep
        blocks = _blocks(model)  # one unit per block: refused here without model.layers
        if expert_plan is not None and pp == 1 and not any(map(routed_experts, blocks)):
            # amsp_dtensor.train refuses this before start-up (specs.check_model); here for
            # torchtitan's own launcher, which would otherwise build an unused expert mesh
            raise AmspConfigError(
                f"parallelism.expert_parallel_degree={ep} / [amsp] expert_*: "
                f"{type(model).__name__} has no MoE layers; set it to 1 and remove them")
        mesh = plan_mesh(amsp, plan, tp, pp, job_ranks_per_node(job_config), ep, expert_plan)
        full_init = job_config.amsp.init_full_model
        if full_init and (tp > 1 or ep > 1):
            # [Note: TP, then everything else] As parallelize_llama: TP (and EP) first, on
            # the plain model, so its plan's module paths hold; then AC, compile and the
            # sharding. With full init the weights are made whole first (same seed on every
            # rank), so each tp (ep) rank keeps its chunk of one initialisation, whatever
            # the layout.
            init_full_model(model, job_config)
        if tp > 1:
            _apply_tp(model, module, mesh["tp"], job_config)
        if ep > 1:
            _apply_ep(model, module, amsp.expert_mesh(mesh)["ep"])

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

        if full_init and tp == 1 and ep == 1:
            # Same seed, whole model, every rank: all plans start from identical weights.
            # torchtitan's later to_empty/init_weights are then kept off it (keep_weights).
            init_full_model(model, job_config)
        # else: shard the meta model; torchtitan's Trainer materialises and initialises the
        # shards afterwards (to_empty + init_weights), as with its own FSDP path.

        # [amsp] reshard_after_forward / [parallelism] fsdp_reshard_after_forward, as
        # torchtitan's apply_fsdp maps its policy (the last units reshard only on "always")
        raf, raf_last = reshard_after_forward_of(job_config, plan)
        compression = shard_units(model, mesh, mixed_precision(job_config.training), raf,
                                  raf_last, compression_of(job_config.amsp), keep=full_init,
                                  experts=expert_plan is not None)
        log_applied(plan, tp, pp, compression, expert_plan, ep)
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


def _apply_ep(model: nn.Module, base_module, ep_mesh) -> None:
    """torchtitan's own expert parallelism over the expert mesh's "ep" dim: the base
    recipe's ``apply_moe_ep_tp`` without tensor parallelism (each MoE layer's routed
    experts split Shard(0) over ep, tokens dispatched by all-to-all), as its
    parallelize_fn applies it."""
    apply_moe_ep_tp = getattr(base_module, "apply_moe_ep_tp", None)
    if apply_moe_ep_tp is None:
        raise AmspConfigError(
            f"parallelism.expert_parallel_degree={ep_mesh.size()}: {base_module.__name__} has "
            "no apply_moe_ep_tp to split this model's experts with; set it to 1")
    apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=ep_mesh, etp_mesh=None, ep_etp_mesh=None)


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
