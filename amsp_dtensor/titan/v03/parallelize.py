"""The AMSP parallelize_fn of torchtitan 0.3: a ModelSpec's parallelize_fn with FSDP2
swapped for the AMSP units.

0.3 chooses a model's parallelism through ``ModelSpec.parallelize_fn`` (e.g. llama3's
``parallelize_llama``) and calls it with the config sections it needs
(``parallel_dims, training, parallelism, compile_config, ac_config, dump_folder``).
``amsp_model_spec(spec)`` is the same ModelSpec with ``parallelize_amsp``; the AMSP
trainer binds the job's resolved plan and ``[amsp]`` section to it before torchtitan
calls it (``bind``), so the plan is resolved once, before any process group, and every
unit reads it from the mesh. The order is parallelize_llama's: tensor and expert
parallelism (the model's own ``parallelize``), activation checkpointing, per-block
compile, then the AMSP units (``units.shard_units``) in place of apply_fsdp_to_decoder.
Under context parallelism the attention's K/V all-gather (torchtitan's
``apply_cp_to_forward``, first, as there) runs over the AMSP mesh's "cp" ranks, which are
among the data-parallel ranks the plan's factors range over (engine/mesh.py, Note:
context parallelism).

MoE models (deepseek_v3, qwen3's MoE flavors): expert parallelism is torchtitan 0.3's
own, as parallelize_deepseekv3 / parallelize_qwen3 apply it: ``model.parallelize``
distributes each MoE layer's grouped experts Shard(0) over the "ep" mesh and wires the
token dispatcher's all-to-all to it; here that "ep" mesh is the AMSP expert mesh's "ep"
dimension (``_AmspMeshDims``; the same ranks as torchtitan's, ep innermost). The routed
experts (``moe.routed_experts.inner_experts``) are then a unit of their own on the expert
mesh with the expert plan, where torchtitan puts them on its efsdp mesh; the router,
the shared experts, the expert bias and the dense first layers stay in their block's
unit, as in torchtitan's per-block fully_shard. The expert-bias load balancing is
torchtitan's own ``register_moe_load_balancing_hook`` (the ModelSpec's
post_optimizer_build_fn, kept by ``amsp_model_spec``), registered on the AMSP optimizers.
"""

from __future__ import annotations

import dataclasses
import functools

import torch.nn as nn

from ... import compat
from ..config import AmspConfigError
from ..units import (_blocks, amsp_pipelining_fn, compile_blocks, log_applied,
                     mixed_precision, plan_mesh, routed_experts, shard_units)
from ..validate import compression_of, job_ranks_per_node, reshard_after_forward_of
from ..weights import init_full_model


def parallelize_amsp(model: nn.Module, *, parallel_dims, training, parallelism, compile_config,
                     ac_config, dump_folder: str, plan=None, job=None, expert_plan=None):
    """``plan``: the job's ResolvedPlan; ``job``: the job as ``titan.validate`` reads it
    (v03.job.job_view); ``expert_plan``: the experts' ResolvedPlan, None when the experts
    belong to their blocks. All are bound by the AMSP trainer (``bind``)."""
    import amsp_dtensor as amsp

    if plan is None or job is None:
        raise AmspConfigError(
            "parallelize_amsp: no AMSP plan bound; build the job with the AMSP trainer "
            "(amsp_dtensor.titan.v03.AmspTrainer.Config, e.g. the *_amsp config registry "
            "entries, or python -m amsp_dtensor.train)")
    blocks = _blocks(model)  # one unit per transformer block, in model.layers
    tp, pp, ep = parallel_dims.tp, parallel_dims.pp, parallel_dims.ep
    if expert_plan is not None and pp == 1 and not any(map(routed_experts, blocks)):
        # check_job refuses this before start-up from the model's config; here in case a
        # model builds its MoE layers some other way (a pipeline stage may hold dense
        # blocks only: deepseek_v3's first layers)
        raise AmspConfigError(
            f"parallelism.expert_parallel_degree={ep} / [amsp] expert_*: "
            f"{type(model).__name__} has no routed experts in model.layers[*].moe; set it "
            "to 1 and remove them")
    cp = parallel_dims.cp
    mesh = _job_mesh(amsp, parallel_dims, plan, job, expert_plan)
    full_init = job.amsp.init_full_model
    if cp > 1:
        # before the model's own parallelize, as parallelize_llama: each block's attention
        # all-gathers K and V over the AMSP mesh's cp ranks (the same ranks as
        # torchtitan's "cp" mesh, which the trainer splits the inputs over)
        from torchtitan.distributed.context_parallel import apply_cp_to_forward

        apply_cp_to_forward([block.attention.inner_attention for block in blocks],
                            amsp.context_parallel_mesh(mesh))
    if tp > 1 or ep > 1:
        # TP and EP first, on the plain model (its sharding configs name the module paths),
        # as parallelize_llama / parallelize_deepseekv3; with full init the weights are made
        # whole first, so each tp (ep) rank keeps its chunk of one initialisation.
        if full_init:
            init_full_model(model, job)
        swaps = {}
        if tp > 1:
            swaps["tp"] = mesh["tp"]
        if ep > 1:
            swaps["ep"] = amsp.expert_mesh(mesh)["ep"]
        model.parallelize(_AmspMeshDims(parallel_dims, swaps))
    compile_model = compile_config.enable and "model" in compile_config.components
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_model:
        compat.titan03_compile_settings()
        compile_blocks(model, compile_config)
    if full_init and tp == 1 and ep == 1:
        # Same seed, whole model, every rank: every plan starts from identical weights.
        init_full_model(model, job)
    raf, raf_last = reshard_after_forward_of(job, plan)
    compression = shard_units(model, mesh, mixed_precision(training), raf, raf_last,
                              compression_of(job.amsp), keep=full_init,
                              experts=expert_plan is not None)
    log_applied(plan, tp, pp, compression, expert_plan, ep, cp)
    return model


def _job_mesh(amsp, parallel_dims, plan, job, expert_plan):
    """The AMSP mesh the job's units are sharded on (one for all of a rank's pipeline
    parts: ``units.plan_mesh``)."""
    return plan_mesh(amsp, plan, parallel_dims.tp, parallel_dims.pp, job_ranks_per_node(job),
                     parallel_dims.ep, expert_plan, parallel_dims.cp)


class _AmspMeshDims:
    """torchtitan's ParallelDims with its one-dimensional "tp" and "ep" meshes replaced by
    the AMSP mesh's tp dimension and the AMSP expert mesh's ep dimension (the same ranks:
    both put tp, and ep inside the expert data-parallel ranks, innermost), so the model's
    own TP plan, its expert parallelism and the AMSP units share one process group per
    dimension. Under 0.3's partial_dtensor backend every mesh the model's sharding configs
    resolve is one of these two (``ParallelDims.resolve_mesh`` keeps only tp and ep)."""

    def __init__(self, parallel_dims, meshes: dict):
        self._dims, self._meshes = parallel_dims, meshes

    def _swap(self, mesh):
        if mesh is None:
            return None
        names = tuple(mesh.mesh_dim_names or ())
        if len(names) == 1 and names[0] in self._meshes:
            return self._meshes[names[0]]
        if set(names) & set(self._meshes):
            raise AmspConfigError(
                f"parallelism: the model asked for torchtitan's {'x'.join(names)} mesh, which "
                "AMSP does not build (it composes tensor and expert parallelism one at a "
                "time); set tensor_parallel_degree or expert_parallel_degree to 1")
        return mesh

    def get_mesh(self, names):
        return self._swap(self._dims.get_mesh(names))

    def get_optional_mesh(self, names, *args, **kwargs):
        return self._swap(self._dims.get_optional_mesh(names, *args, **kwargs))

    def resolve_mesh(self, axes):
        return self._swap(self._dims.resolve_mesh(axes))

    def resolve_shared_mesh(self, placements):
        return self._swap(self._dims.resolve_shared_mesh(placements))

    def __getattr__(self, name):
        return getattr(self._dims, name)


def is_amsp(spec) -> bool:
    fn = getattr(spec, "parallelize_fn", None)
    fn = fn.func if isinstance(fn, functools.partial) else fn
    return fn is parallelize_amsp


def amsp_model_spec(spec):
    """``spec`` (a 0.3 ModelSpec) trained by AMSP: its parallelize_fn is parallelize_amsp,
    its pipelining_fn (pipeline_llm) hands each stage to the engine, its name gets
    ``_amsp``."""
    if is_amsp(spec):
        return spec
    return dataclasses.replace(spec, name=f"{spec.name}_amsp", parallelize_fn=parallelize_amsp,
                               pipelining_fn=_pipelining_on_amsp_tp(spec.pipelining_fn))


def _pipelining_on_amsp_tp(base_fn):
    """``base_fn`` (0.3's pipeline_llm) made AMSP's (``units.amsp_pipelining_fn``), with
    its mesh lookup answering "tp" with the AMSP mesh's tp dimension.

    [Note: the pipeline's mesh lookup] torch 2.14's pipeline stages send a DTensor as a
    plain tensor plus its mesh's names and layout; the receiving stage rebuilds it on the
    mesh torchtitan's callback returns for those names (``parallel_dims.get_mesh``), which
    must have the same layout. Under TP the stage's activations are DTensors on the AMSP
    mesh's tp dimension, not on torchtitan's own tp mesh, and the lookup failed in the
    first step ("Mesh lookup failed: callback returned None for mesh_dim_names=('tp',)").
    pipeline_llm builds that callback from the parallel_dims it is given, so it gets one
    whose "tp" is the tp dimension of the AMSP mesh the parts will be sharded on (the
    job's, from the plan bound to the parallelize_fn it is handed)."""
    pipelining = amsp_pipelining_fn(base_fn)
    if pipelining is None:
        return None

    def pipeline_amsp(model, *, parallel_dims, parallelize_fn, **kwargs):
        bound = getattr(parallelize_fn, "keywords", {})  # bind's plan, job and expert plan
        if parallel_dims.tp > 1 and bound.get("plan") is not None:
            import amsp_dtensor as amsp

            mesh = _job_mesh(amsp, parallel_dims, bound["plan"], bound["job"],
                             bound.get("expert_plan"))
            parallel_dims = _TpLookup(parallel_dims, mesh["tp"])
        return pipelining(model, parallel_dims=parallel_dims, parallelize_fn=parallelize_fn,
                          **kwargs)

    pipeline_amsp.__qualname__ = pipelining.__qualname__
    return pipeline_amsp


class _TpLookup:
    """torchtitan's ParallelDims whose ``get_mesh(["tp"])`` is ``amsp_tp`` (see [Note: the
    pipeline's mesh lookup]); everything else is torchtitan's."""

    def __init__(self, parallel_dims, amsp_tp):
        self._dims, self._tp_mesh = parallel_dims, amsp_tp

    def get_mesh(self, names):
        if list(names) == ["tp"]:
            return self._tp_mesh
        return self._dims.get_mesh(names)

    def __getattr__(self, name):
        return getattr(self._dims, name)


def bind(spec, plan, job, expert_plan=None):
    """The ModelSpec with ``plan``, ``job`` and ``expert_plan`` bound to its
    parallelize_amsp."""
    return dataclasses.replace(spec, parallelize_fn=functools.partial(
        parallelize_amsp, plan=plan, job=job, expert_plan=expert_plan))
