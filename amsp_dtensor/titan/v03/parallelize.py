"""The AMSP parallelize_fn of torchtitan 0.3: a ModelSpec's parallelize_fn with FSDP2
swapped for the AMSP units.

0.3 chooses a model's parallelism through ``ModelSpec.parallelize_fn`` (e.g. llama3's
``parallelize_llama``) and calls it with the config sections it needs
(``parallel_dims, training, parallelism, compile_config, ac_config, dump_folder``).
``amsp_model_spec(spec)`` is the same ModelSpec with ``parallelize_amsp``; the AMSP
trainer binds the job's resolved plan and ``[amsp]`` section to it before torchtitan
calls it (``bind``), so the plan is resolved once, before any process group, and every
unit reads it from the mesh. The order is parallelize_llama's: tensor parallelism (the
model's own ``parallelize``), activation checkpointing, per-block compile, then the AMSP
units (``units.shard_units``) in place of apply_fsdp_to_decoder.
"""

from __future__ import annotations

import dataclasses
import functools

import torch.nn as nn

from ..config import AmspConfigError
from ..units import _blocks, compile_blocks, log_applied, mixed_precision, plan_mesh, shard_units
from ..validate import compression_of, job_ranks_per_node, reshard_after_forward_of
from ..weights import init_full_model


def parallelize_amsp(model: nn.Module, *, parallel_dims, training, parallelism, compile_config,
                     ac_config, dump_folder: str, plan=None, job=None):
    """``plan``: the job's ResolvedPlan; ``job``: the job as ``titan.validate`` reads it
    (v03.job.job_view). Both are bound by the AMSP trainer (``bind``)."""
    import amsp_dtensor as amsp

    if plan is None or job is None:
        raise AmspConfigError(
            "parallelize_amsp: no AMSP plan bound; build the job with the AMSP trainer "
            "(amsp_dtensor.titan.v03.AmspTrainer.Config, e.g. the *_amsp config registry "
            "entries, or python -m amsp_dtensor.train)")
    _blocks(model)  # one unit per transformer block, in model.layers
    tp, pp = parallel_dims.tp, parallel_dims.pp  # pp is 1: v03.trainer.check_job
    mesh = plan_mesh(amsp, plan, tp, pp, job_ranks_per_node(job))
    full_init = job.amsp.init_full_model
    if tp > 1:
        # TP first, on the plain model (its sharding configs name the module paths), as
        # parallelize_llama; with full init the weights are made whole first, so each tp
        # rank keeps its chunk of one initialisation.
        if full_init:
            init_full_model(model, job)
        model.parallelize(_TensorParallelDims(parallel_dims, mesh["tp"]))
    compile_model = compile_config.enable and "model" in compile_config.components
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_model:
        compile_blocks(model, compile_config)
    if full_init and tp == 1:
        # Same seed, whole model, every rank: every plan starts from identical weights.
        init_full_model(model, job)
    raf, raf_last = reshard_after_forward_of(job, plan)
    compression = shard_units(model, mesh, mixed_precision(training), raf, raf_last,
                              compression_of(job.amsp), keep=full_init)
    log_applied(plan, tp, pp, compression)
    return model


class _TensorParallelDims:
    """torchtitan's ParallelDims with its "tp" mesh replaced by the AMSP mesh's tp
    dimension (the same ranks: both put tp innermost), so the model's own TP plan and the
    AMSP units share one tp process group."""

    def __init__(self, parallel_dims, tp_mesh):
        self._dims, self._tp_mesh = parallel_dims, tp_mesh

    def _swap(self, mesh):
        if mesh is not None and tuple(mesh.mesh_dim_names or ()) == ("tp",):
            return self._tp_mesh
        return mesh

    def get_mesh(self, names):
        return self._swap(self._dims.get_mesh(names))

    def get_optional_mesh(self, names):
        return self._swap(self._dims.get_optional_mesh(names))

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
    its name gets ``_amsp``; pipelining is not offered."""
    if is_amsp(spec):
        return spec
    return dataclasses.replace(spec, name=f"{spec.name}_amsp", parallelize_fn=parallelize_amsp,
                               pipelining_fn=None)


def bind(spec, plan, job):
    """The ModelSpec with ``plan`` and ``job`` bound to its parallelize_amsp."""
    return dataclasses.replace(spec, parallelize_fn=functools.partial(
        parallelize_amsp, plan=plan, job=job))
