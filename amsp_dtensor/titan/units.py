"""The AMSP units of a torchtitan decoder, for either torchtitan: the one sharding sequence.

Both integrations (``parallelize`` for 0.2.2, ``v03.parallelize`` for 0.3) end in
``shard_units``: the token embeddings, every transformer block, then the final norm and
output head together (kept unsharded after forward: backward needs them first), each one
AMSP unit, as torchtitan's apply_fsdp cuts them, then the root, which holds nothing; a
model that ties its output head to the embeddings keeps the three in the root unit. Here
also: per-block compile (``compile_blocks``), the blocks (``model.layers``) and the mesh of
the resolved plan (``plan_mesh``). torchtitan is read only through names both versions
have (``tools.utils.device_type``, ``tools.logging.logger``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_type

from .. import compat
from ..engine import handle
from .amsp_optimizers import PIPELINE_STAGE_OF
from .config import AmspConfigError
from .weights import keep_weights, whole_model_of_parts


def mixed_precision(training) -> MixedPrecisionPolicy | None:
    """The units' mixed precision from torchtitan's [training] dtype and
    mixed_precision_param / _reduce (None when nothing is cast)."""
    param = TORCH_DTYPE_MAP[training.mixed_precision_param]
    reduce = TORCH_DTYPE_MAP[training.mixed_precision_reduce]
    model_dtype = TORCH_DTYPE_MAP[training.dtype]
    if param == model_dtype and reduce == model_dtype:
        return None  # nothing to cast: no mixed precision
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def amsp_plan_of(model: nn.Module):
    """The ResolvedPlan an AMSP-parallelized model runs, or None for any other model."""
    root = handle.root_of(model)
    return root.info.plan if root is not None else None


def expert_plan_of(model: nn.Module):
    """The experts' ResolvedPlan of an AMSP-parallelized model with an expert mesh, or
    None."""
    root = handle.root_of(model)
    expert = root.info.expert if root is not None else None
    return expert.plan if expert is not None else None


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
    parts = [getattr(model, name, None) for name in ("tok_embeddings", "norm", _head_name(model))]
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
    return any(getattr(model, name, False) is None
               for name in ("tok_embeddings", "norm", _head_name(model)))


def _head_name(model: nn.Module) -> str:
    """The output head's attribute: ``output`` (torchtitan 0.2.2), ``lm_head`` (0.3)."""
    return "lm_head" if hasattr(model, "lm_head") else "output"


_PIPELINE_MESHES: dict = {}  # one mesh per plan and degrees, shared by a rank's stages


def plan_mesh(amsp, plan, tp: int, pp: int, ranks_per_node: int, ep: int = 1,
              expert_plan=None, cp: int = 1):
    """The AMSP mesh of the job's resolved plan (init_mesh keeps that object as the
    mesh's plan), with the expert mesh of ``expert_plan`` when there is one, and the cp
    mesh under context parallelism; under pipeline parallelism one for all stages of this
    rank (each init_mesh makes process groups: looped schedules parallelize several
    parts)."""
    experts = {} if expert_plan is None else {"ep": ep, "expert_plan": expert_plan}
    if pp == 1:
        return amsp.init_mesh(plan, ranks_per_node=plan.ranks_per_node * tp,
                              device_type=device_type, tp=tp, cp=cp, **experts)
    key = (plan.s_p, plan.s_g, plan.s_os, ranks_per_node, tp, pp, cp,
           id(torch.distributed.group.WORLD),
           None if expert_plan is None else (ep, expert_plan.s_p, expert_plan.s_g,
                                             expert_plan.s_os))
    if key not in _PIPELINE_MESHES:
        _PIPELINE_MESHES[key] = amsp.init_mesh(plan, ranks_per_node=ranks_per_node,
                                               device_type=device_type, tp=tp, pp=pp, cp=cp,
                                               **experts)
    return _PIPELINE_MESHES[key]


def routed_experts(block: nn.Module) -> nn.Module | None:
    """A transformer block's routed experts, the module holding their weights, or None
    for a dense block: torchtitan 0.2.2's ``block.moe.experts``, 0.3's grouped-GEMM
    ``block.moe.routed_experts.inner_experts`` (the module 0.3's apply_fsdp_to_decoder
    puts on its expert mesh; ``routed_experts`` around it holds only the token
    dispatcher)."""
    moe = getattr(block, "moe", None)
    experts = getattr(moe, "experts", None)
    if experts is None:  # torchtitan 0.3
        experts = getattr(getattr(moe, "routed_experts", None), "inner_experts", None)
    return experts if isinstance(experts, nn.Module) else None


def shard_units(model: nn.Module, mesh, mp_policy, raf, raf_last, compression,
                keep: bool, experts: bool = False):
    """amsp.fully_shard on each unit of ``model`` (see the module docstring), with
    ``raf`` the reshard_after_forward of the embeddings and blocks and ``raf_last`` that of
    [norm, head]; then the gradient divide factor 1 (torchtitan divides the loss by the
    global token count itself), ``compression`` (before the optimizer exists: compressed
    weights need separate masters) and, with ``keep``, torchtitan's later to_empty /
    init_weights made no-ops. With ``experts``, each MoE block's routed experts are a unit
    of their own on the expert mesh, sharded before their block (as torchtitan's
    apply_fsdp shards ``moe.experts`` on its expert mesh); an int ``raf`` (hpZ, a factor
    of the dense param_shard) leaves them resharding fully. Returns the compression
    setting the engine took."""
    import amsp_dtensor as amsp

    ends = _end_units(model)
    if ends and ends[0] is not None:
        amsp.fully_shard(ends[0], mesh=mesh, mp_policy=mp_policy, reshard_after_forward=raf)
    emesh = amsp.expert_mesh(mesh) if experts else None
    for block in _blocks(model):
        routed = routed_experts(block) if emesh is not None else None
        if routed is not None:
            amsp.fully_shard(routed, mesh=emesh, mp_policy=mp_policy,
                             reshard_after_forward=raf if isinstance(raf, bool) else True)
        amsp.fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=raf)
    if ends and ends[1] is not None:
        amsp.fully_shard(ends[1], mesh=mesh, mp_policy=mp_policy,
                         reshard_after_forward=raf_last)
    amsp.fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    amsp.set_gradient_divide_factor(model, 1.0)
    taken = amsp.set_compression(model, **vars(compression))
    if keep:
        keep_weights(model)
    return taken


def log_applied(plan, tp: int, pp: int, compression, expert_plan=None, ep: int = 1,
                cp: int = 1) -> None:
    under_tp = f" (context parallel {cp} among them)" if cp > 1 else ""
    under_tp += f" x tp {tp}" if tp > 1 else ""
    under_tp += f" (one pipeline stage of {pp})" if pp > 1 else ""
    experts = "" if expert_plan is None else (
        f"; experts: plan {expert_plan.name} on {expert_plan.world_size} expert-world ranks "
        f"x ep {ep}, {expert_plan.ranks_per_node} per node")
    logger.info(
        f"Applied AMSP plan {plan.name} (s_p={plan.s_p}, s_g={plan.s_g}, s_os={plan.s_os}) "
        f"on {plan.world_size} data-parallel ranks{under_tp}, {plan.ranks_per_node} per "
        f"node; mesh {plan.mesh_shape}" + experts
        + (f"; cross-node stages compressed: {compression}" if compression.enabled else "")
    )


def amsp_pipelining_fn(base_fn):
    """``base_fn`` (torchtitan's pipelining_fn, e.g. pipeline_llm, the same function and
    return value in 0.2.2 and 0.3: it cuts the model into stages and calls the
    parallelize_fn, AMSP's, on each part, with the model first), then every stage of the
    schedule handed to the engine; None stays None. While the parts are cut, each takes its
    weights from one initialisation of the whole model (see [Note: pipeline parts start
    from the whole model])."""
    if base_fn is None:
        return None

    def pipeline_amsp(*args, **kwargs):
        import amsp_dtensor as amsp

        model = args[0] if args else kwargs["model"]
        with whole_model_of_parts(model):
            schedule, model_parts, has_first, has_last = base_fn(*args, **kwargs)
        for stage in compat.pipeline_schedule_stages(schedule):
            amsp.pipeline_stage(stage)
            PIPELINE_STAGE_OF[stage.submod] = stage.stage_index
        return schedule, model_parts, has_first, has_last

    pipeline_amsp.__qualname__ = f"pipeline_amsp[{getattr(base_fn, '__qualname__', base_fn)}]"
    return pipeline_amsp
