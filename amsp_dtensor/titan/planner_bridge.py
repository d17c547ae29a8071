"""plan = "auto": hand the job's model, batch, world and memory to amsp_dtensor's planner.

The planner is amsp_dtensor.plan.cost.planner.plan (docs/planner.md); this module is the only place
that calls it, with the inputs named as its signature names them (extra inputs are
dropped, so the two sides can evolve). If the planner is missing from a checkout,
plan = "auto" stops with a one-line message telling the user to give explicit factors.
"""

from __future__ import annotations

import inspect

from amsp_dtensor.plan import ResolvedPlan


def _gpu_memory_bytes(job_config) -> float | None:
    gib = getattr(job_config.amsp, "gpu_memory_gib", 0.0) or 0.0
    if gib > 0:
        return gib * 2**30
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def _compression(job_config, compression):
    """The codecs for the cross-node stages: the value given, else [amsp] compress_grads /
    compress_weights when the config has them ("" or "none": off); None when off."""
    if compression is not None:
        return compression
    amsp = getattr(job_config, "amsp", None)
    grads = getattr(amsp, "compress_grads", None) or None
    weights = getattr(amsp, "compress_weights", None) or None
    if grads is None and weights is None:
        return None
    from amsp_dtensor.plan.compression import Compression

    off = {None, "", "none"}
    return Compression(grads=None if grads in off else grads,
                       weights=None if weights in off else weights)


def _model_args(job_config):
    """The model's shapes: what the job's view offers (``planner_model_args``: torchtitan
    0.3, see v03/job.py), else torchtitan 0.2.2's TrainSpec model args."""
    offered = getattr(job_config, "planner_model_args", None)
    if offered is not None:
        return offered()
    from torchtitan.protocols.train_spec import get_train_spec

    return get_train_spec(job_config.model.name).model_args[job_config.model.flavor]


def _check_pipeline(job_config, pipeline, accumulation: int) -> None:
    """The planner costs one pipeline schedule per optimizer step."""
    if pipeline is not None and accumulation > 1:
        from .config import AmspConfigError

        raise AmspConfigError(
            f"amsp.plan='auto' with parallelism.pipeline_parallel_degree={pipeline.degree}: the "
            "planner costs one pipeline schedule per optimizer step, but "
            f"training.global_batch_size asks for {accumulation} (gradient accumulation); set "
            "global_batch_size to local_batch_size x the data-parallel ranks, or give factors")


def planner_inputs(job_config, world: int, ranks_per_node: int, compression=None,
                   pipeline=None) -> dict:
    """What the planner needs, from the torchtitan job config (docs/design.md, 'Planner').
    compression: None, a Compression or its text ("grads=int8,weights=bf16"); None reads
    [amsp] compress_grads / compress_weights if the config has them. pipeline: the job's
    (validate.pipeline_of) under pipeline parallelism; world and ranks_per_node are then
    one stage's."""
    model_args = _model_args(job_config)
    t = job_config.training
    tp = job_config.parallelism.tensor_parallel_degree
    cp = job_config.parallelism.context_parallel_degree
    dp = world // tp // cp  # the batch ranks; each tp (and cp) group takes one share
    gbs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
    _check_pipeline(job_config, pipeline, gbs // (t.local_batch_size * dp))
    micro = job_config.parallelism.pipeline_parallel_microbatch_size if pipeline else None
    return {
        "model_args": model_args,
        "model_name": f"{job_config.model.name}:{job_config.model.flavor}",
        "seq_len": t.seq_len,
        "micro_batch_size": micro or t.local_batch_size,
        "num_micro_batches": None if pipeline else gbs // (t.local_batch_size * dp),
        "pipeline": pipeline,
        "world_size": world,
        "ranks_per_node": ranks_per_node,
        "tensor_parallel_degree": tp,
        "loss_parallel": not job_config.parallelism.disable_loss_parallel,
        "gpu_memory_bytes": _gpu_memory_bytes(job_config),
        "activation_checkpoint": job_config.activation_checkpoint.mode,
        "param_dtype": job_config.training.mixed_precision_param,
        "bandwidth_table": job_config.amsp.bandwidth_table or None,
        "compression": _compression(job_config, compression),
        "expert_parallel_degree": job_config.parallelism.expert_parallel_degree,
        "context_parallel_degree": cp,
    }


def plan_auto(job_config, world: int, ranks_per_node: int, compression=None,
              pipeline=None) -> ResolvedPlan:
    from .config import AmspConfigError

    try:
        from amsp_dtensor.plan.cost.planner import plan as planner_plan
    except ImportError:
        raise AmspConfigError(
            "amsp.plan='auto': the planner (amsp_dtensor.plan.cost.planner.plan) is not available "
            "in this checkout; set param_shard, grad_shard and optim_shard instead"
        ) from None
    try:
        inputs = planner_inputs(job_config, world, ranks_per_node, compression, pipeline)
    except AmspConfigError:
        raise
    except ValueError as e:  # a bad codec name in compress_grads / compress_weights
        raise AmspConfigError(f"amsp.plan='auto': {e}") from None
    accepted = inspect.signature(planner_plan).parameters
    tp, cp = inputs["tensor_parallel_degree"], inputs["context_parallel_degree"]
    if cp > 1 and "context_parallel_degree" not in accepted:
        raise AmspConfigError(
            f"amsp.plan='auto' with parallelism.context_parallel_degree={cp}: this checkout's "
            "planner does not model context parallelism; set param_shard, grad_shard and "
            "optim_shard instead")
    if tp > 1 and "tensor_parallel_degree" not in accepted:
        raise AmspConfigError(
            f"amsp.plan='auto' with parallelism.tensor_parallel_degree={tp}: this checkout's "
            "planner does not model tensor parallelism; set param_shard, grad_shard and "
            "optim_shard instead"
        )
    ep = inputs["expert_parallel_degree"]
    if tp > 1 and ep > 1:
        raise AmspConfigError(
            f"amsp.plan='auto' with parallelism.tensor_parallel_degree={tp} and "
            f"expert_parallel_degree={ep}: the planner has no tensor parallelism beside "
            "experts; set param_shard, grad_shard and optim_shard (and the expert_* keys) "
            "instead")
    kwargs = {k: v for k, v in inputs.items() if k in accepted}
    try:
        chosen = planner_plan(**kwargs)
    except ValueError as e:
        raise AmspConfigError(f"amsp.plan='auto': {e}") from None
    report, chosen = chosen, getattr(chosen, "plan", chosen)  # PlanReport or the plan itself
    _log_choice(report, chosen)
    if not isinstance(chosen, ResolvedPlan):
        chosen = chosen.resolve(world // tp, ranks_per_node // tp)  # the data-parallel world
    expert = getattr(report, "expert_plan", None)
    if expert is not None:  # resolve_expert_plan returns it for this dense plan
        setattr(job_config.amsp, AUTO_EXPERT_PLAN, (chosen, expert))
    return chosen


# on job_config.amsp after plan = "auto" on a model with experts: (the dense plan chosen,
# the expert plan chosen with it)
AUTO_EXPERT_PLAN = "_auto_expert_plan"


def _log_choice(report, chosen) -> None:
    from torchtitan.tools.logging import logger

    best = getattr(report, "best", None)
    pair = best.pair_name if best is not None and best.expert_plan is not None else chosen.name
    logger.info(f"[amsp] plan = \"auto\": the planner chose {pair}")
    if best is None:
        return
    gib = 2**30
    ranked = ", ".join(f"{c.plan.name} {c.step_seconds * 1e3:.3g} ms {c.memory.total / gib:.2f} GiB"
                       + ("" if c.fits else " (over budget)") for c in report.candidates[:6])
    logger.info(f"[amsp] planner: predicted step and memory per rank: {ranked}")
    for r in best.pipeline_ranks or ():
        logger.info(f"[amsp] planner: pipeline rank {r.rank} (stages {r.stages}): "
                    f"{r.memory.total / gib:.2f} GiB, {r.step_seconds * 1e3:.3g} ms of its "
                    "stages' work per step")
