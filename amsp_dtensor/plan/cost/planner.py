"""The planner: enumerate valid plans, keep those that fit in memory, rank by step time.

The AMSP paper's planner minimises T_comm = T_p + T_g + T_os0 + T_os1 over the valid
factors subject to D_total <= GPU memory; the space is small, so it filters, then
enumerates. Here plans are ranked by the predicted step time with overlap (cost/step.py:
compute from FLOPs plus the communication the engine cannot hide), each collective timed
by NCCL's tuning model (cost/nccl.py) or a measured table (cost/bandwidth.py); the
no-overlap sum of collective times stays as a column. Baseline systems (DDP, ZeRO-1/2/3,
HSDP/MiCS, ZeRO++ hpZ) are costed in the same model so their numbers sit beside the
chosen plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from ..sharding_plan import BASELINES, ResolvedPlan, ShardingPlan, enumerate_plans
from .bandwidth import BandwidthTable, load_table
from .comm import (
    AlphaBeta,
    PlannedComm,
    TimeModel,
    bytes_by_locality,
    predicted_events,
    step_comm_time,
    time_breakdown,
)
from .memory import DTYPE_BYTES, MemoryEstimate, estimate_memory
from .models import ModelShape, from_torchtitan_args, get_model
from .nccl import NcclModel, node_nic_bytes, wire_bytes
from .padding import shard_numel
from .step import ComputeModel, StepTime, step_time

__all__ = [
    "PlanEstimate",
    "PlanReport",
    "NoPlanFits",
    "estimate_plan",
    "choose_plan",
    "auto_plan",
    "plan",
    "BASELINE_LABELS",
]

BASELINE_LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3/FSDP",
    "hsdp": "HSDP/MiCS",
    "hpz": "ZeRO++ hpZ",
}


class NoPlanFits(ValueError):
    """No valid plan fits the memory budget; carries the smallest-memory plan."""

    def __init__(self, budget: int, smallest: "PlanEstimate"):
        self.budget = budget
        self.smallest = smallest
        super().__init__(
            f"no plan fits in {budget / 2**30:.2f} GiB per rank; the smallest-memory plan "
            f"{smallest.plan.name} needs {smallest.memory.total / 2**30:.2f} GiB "
            "(raise the memory, use activation checkpointing, or shrink the micro-batch)"
        )


@dataclass
class PlanEstimate:
    label: str  # plan name, or a baseline's name
    plan: ResolvedPlan
    memory: MemoryEstimate
    events: list[PlannedComm]
    comm_seconds: float
    breakdown: dict[str, float]
    fits: bool
    reshard_after_forward: Union[bool, int] = True
    step: StepTime | None = None

    @property
    def step_seconds(self) -> float:
        return self.step.seconds if self.step is not None else self.comm_seconds

    @property
    def bytes_intra(self) -> int:
        """Buffer bytes per step of the collectives inside a node (recorder convention)."""
        return bytes_by_locality(self.events)["intra"]

    @property
    def bytes_inter(self) -> int:
        """Buffer bytes per step of the collectives whose group spans nodes."""
        return bytes_by_locality(self.events)["inter"]

    @property
    def wire_bytes_intra(self) -> float:
        """Bytes this rank sends per step in groups inside a node (ring factor x buffer)."""
        return sum(e.count * wire_bytes(e.op, e.nbytes, e.group_size)
                   for e in self.events if not e.inter_node)

    @property
    def wire_bytes_inter(self) -> float:
        """Bytes this rank sends per step in groups that span nodes."""
        return sum(e.count * wire_bytes(e.op, e.nbytes, e.group_size)
                   for e in self.events if e.inter_node)

    @property
    def node_nic_bytes(self) -> float:
        """Bytes leaving one node through its NICs per step (all its ranks together)."""
        R = self.plan.ranks_per_node
        return sum(e.count * node_nic_bytes(e.op, e.nbytes, e.group, R) for e in self.events)

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "plan": {"param": self.plan.s_p, "grad": self.plan.s_g, "optim": self.plan.s_os},
            "name": self.plan.name,
            "reshard_after_forward": self.reshard_after_forward,
            "memory_bytes": self.memory.as_dict(),
            "bytes_intra": self.bytes_intra,
            "bytes_inter": self.bytes_inter,
            "wire_bytes_intra": self.wire_bytes_intra,
            "wire_bytes_inter": self.wire_bytes_inter,
            "node_nic_bytes": self.node_nic_bytes,
            "comm_seconds": self.comm_seconds,
            "step_seconds": self.step_seconds,
            "step": self.step.as_dict() if self.step is not None else None,
            "breakdown_seconds": self.breakdown,
            "fits": self.fits,
        }


@dataclass
class PlanReport:
    model: ModelShape
    settings: dict
    candidates: list[PlanEstimate]  # fitting plans first, fastest first
    baselines: dict[str, PlanEstimate] = field(default_factory=dict)
    time_model: str = "nccl"

    @property
    def best(self) -> PlanEstimate:
        return self.candidates[0]

    @property
    def plan(self) -> ResolvedPlan:
        """The chosen plan (what the torchtitan bridge reads)."""
        return self.best.plan

    @property
    def sharding_plan(self) -> ShardingPlan:
        return self.best.plan.as_plan()

    def to_toml(self) -> str:
        return self.best.plan.to_toml()

    def as_dict(self) -> dict:
        return {
            "model": self.model.name,
            "num_params": self.model.num_params,
            "settings": self.settings,
            "time_model": self.time_model,
            "chosen": self.best.as_dict(),
            "toml": self.to_toml(),
            "candidates": [c.as_dict() for c in self.candidates],
            "baselines": {k: v.as_dict() for k, v in self.baselines.items()},
        }


def _model_shape(model) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return get_model(model)
    if all(hasattr(model, k) for k in ("dim", "n_layers", "n_heads", "vocab_size")):
        return from_torchtitan_args(type(model).__name__, model)
    raise TypeError(f"model must be a name, ModelShape or TransformerModelArgs, got {model!r}")


class TableOverDefaults:
    """A measured table where it has the op and group shape, the default model elsewhere."""

    def __init__(self, table: BandwidthTable, default: TimeModel):
        self.table, self.default = table, default
        self.defaulted: set = set()

    def time(self, op, nbytes, group):
        if self.table.covers(op, group):
            return self.table.time(op, nbytes, group)
        self.defaulted.add((op, group.size, group.nodes))
        return self.default.time(op, nbytes, group)


def _time_model(bandwidth, cluster: NcclModel | None = None) -> tuple[TimeModel, str]:
    cluster = cluster or NcclModel()
    if bandwidth is None:
        return cluster, cluster.describe()
    if isinstance(bandwidth, (str, Path)):
        return (TableOverDefaults(load_table(bandwidth), cluster),
                f"measured table {bandwidth}, NCCL model where it has no data")
    if isinstance(bandwidth, BandwidthTable):
        return TableOverDefaults(bandwidth, cluster), "measured table, NCCL model elsewhere"
    if hasattr(bandwidth, "time"):
        return bandwidth, type(bandwidth).__name__
    raise TypeError(f"bandwidth must be None, a table path or a time model, got {bandwidth!r}")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def estimate_plan(
    model: ModelShape, plan: ResolvedPlan, *, seq_len: int, micro_batch: int,
    micro_batches: int, memory_budget_bytes: float, time_model: TimeModel,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", reshard_after_forward: Union[bool, int] = True,
    clip: bool = True, label: str | None = None, norm: str = "composite",
    reduce_dtype: str | None = None, reserve_bytes: int = 0,
    compute: ComputeModel | None = None, overlap_param_update: bool = False,
    backend: str = "nccl",
) -> PlanEstimate:
    """Memory, step communication and step time of one plan."""
    mem = estimate_memory(model, plan, seq_len, micro_batch, mixed_precision,
                          activation_checkpointing, attention, norm=norm,
                          reshard_after_forward=reshard_after_forward,
                          reduce_dtype=reduce_dtype, reserve_bytes=reserve_bytes,
                          clip=clip, backend=backend)
    events = predicted_events(plan, model.unit_param_shapes(), micro_batches,
                              DTYPE_BYTES[mixed_precision], model.root_unit_index,
                              reshard_after_forward=reshard_after_forward, clip=clip,
                              reduce_dtype_bytes=DTYPE_BYTES[reduce_dtype] if reduce_dtype else None)
    os_numel = shard_numel([sh for unit in model.unit_param_shapes() for sh in unit], plan.s_os)
    st = step_time(model, events, time_model, seq_len=seq_len, micro_batch=micro_batch,
                   micro_batches=micro_batches, os_numel=os_numel, compute=compute,
                   activation_checkpointing=activation_checkpointing,
                   overlap_param_update=overlap_param_update)
    return PlanEstimate(
        label=label or plan.name,
        plan=plan,
        memory=mem,
        events=events,
        comm_seconds=step_comm_time(events, time_model),
        breakdown=time_breakdown(events, time_model),
        fits=mem.total <= memory_budget_bytes,
        reshard_after_forward=reshard_after_forward,
        step=st,
    )


# Plans whose predicted step times differ by less than this are ties for the model; among
# them the one that moves fewer bytes is preferred (it leaves more slack if the overlap is
# worse than modelled, and leaves the network to other jobs).
STEP_TIME_TIE = 0.01


def _rank(estimates, rank_by: str = "step") -> list[PlanEstimate]:
    if rank_by == "comm":  # the paper's objective: the no-overlap communication sum
        return sorted(estimates, key=lambda e: (e.comm_seconds, e.memory.total))
    est = sorted(estimates, key=lambda e: (e.step_seconds, e.memory.total))
    if not est:
        return est
    limit = est[0].step_seconds * (1 + STEP_TIME_TIE)
    ties = sorted((e for e in est if e.step_seconds <= limit),
                  key=lambda e: (e.comm_seconds, e.step_seconds, e.memory.total))
    return ties + [e for e in est if e.step_seconds > limit]


def choose_plan(
    model, *, seq_len: int, micro_batch: int, micro_batches: int, world_size: int,
    ranks_per_node: int, memory_budget_bytes: float, bandwidth=None,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", clip: bool = True, include_baselines: bool = True,
    require_fit: bool = True, norm: str = "composite", reduce_dtype: str | None = None,
    reserve_bytes: int = 0, compute: ComputeModel | None = None,
    overlap_param_update: bool = False, cluster: NcclModel | None = None,
    rank_by: str = "step", backend: str = "nccl",
) -> PlanReport:
    """Rank every valid plan for the world by predicted step time among those fitting.

    model: a name from cost.models.MODELS (torchtitan flavor names accepted), a ModelShape,
      or a torchtitan TransformerModelArgs.
    micro_batches: gradient-accumulation steps per optimizer step (M).
    memory_budget_bytes: per rank. bandwidth: None (NCCL's tuning model on `cluster`, the
      paper's cluster by default), a profile JSON path (measured where it has data), or a
      time model. reserve_bytes: memory outside tensors, added to every plan's total.
    compute: ComputeModel (FLOP rate) for the step time; overlap_param_update: whether the
      post-step all-gather overlaps the next forward (the engine's default: no).
    backend: "nccl" or "gloo" (CPU runs: its all-gathers stage their output, which the
      memory estimate counts; cost/memory.py).
    rank_by: "step" (predicted step time with overlap; within 1% by comm sum) or "comm"
      (the no-overlap communication sum alone, e.g. for a CPU run whose compute rate is
      not the GPU default).
    Raises NoPlanFits (a ValueError) when nothing fits and require_fit.
    Returns a PlanReport: .best (PlanEstimate), .sharding_plan, .to_toml(), .as_dict().
    """
    shape = _model_shape(model)
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch),
                        ("micro_batches", micro_batches), ("world_size", world_size),
                        ("ranks_per_node", ranks_per_node)):
        _positive(name, value)
    if mixed_precision not in DTYPE_BYTES:
        raise ValueError(f"mixed_precision={mixed_precision!r}; use one of {sorted(DTYPE_BYTES)}")
    if not memory_budget_bytes or not memory_budget_bytes > 0:
        raise ValueError(f"memory budget must be positive, got {memory_budget_bytes!r}")
    if reduce_dtype is not None and reduce_dtype not in DTYPE_BYTES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    if not reserve_bytes >= 0:
        raise ValueError(f"reserve must be >= 0, got {reserve_bytes!r}")
    if cluster is None:
        cluster = NcclModel(gpus_per_node=ranks_per_node)
    tm, tm_name = _time_model(bandwidth, cluster)
    common = dict(seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                  memory_budget_bytes=memory_budget_bytes, time_model=tm,
                  mixed_precision=mixed_precision,
                  activation_checkpointing=activation_checkpointing, attention=attention,
                  clip=clip, norm=norm, reduce_dtype=reduce_dtype,
                  reserve_bytes=reserve_bytes, compute=compute,
                  overlap_param_update=overlap_param_update, backend=backend)
    estimates = [estimate_plan(shape, p, **common)
                 for p in enumerate_plans(world_size, ranks_per_node)]
    if rank_by not in ("step", "comm"):
        raise ValueError(f"rank_by={rank_by!r}; use 'step' or 'comm'")
    fitting = _rank((e for e in estimates if e.fits), rank_by)
    if not fitting and require_fit:
        raise NoPlanFits(int(memory_budget_bytes), min(estimates, key=lambda e: e.memory.total))
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total)
    baselines = {}
    if include_baselines:
        for key, sp in BASELINES.items():
            rp = sp.resolve(world_size, ranks_per_node)
            baselines[key] = estimate_plan(shape, rp, label=BASELINE_LABELS[key], **common)
        rp = BASELINES["zero3"].resolve(world_size, ranks_per_node)
        k = min(ranks_per_node, world_size)
        baselines["hpz"] = estimate_plan(shape, rp, label=BASELINE_LABELS["hpz"],
                                         reshard_after_forward=k if k < world_size else True,
                                         **common)
    settings = dict(seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                    world_size=world_size, ranks_per_node=ranks_per_node,
                    memory_budget_bytes=(int(memory_budget_bytes) if memory_budget_bytes != float("inf")
                                         else None),
                    mixed_precision=mixed_precision,
                    activation_checkpointing=activation_checkpointing, attention=attention,
                    norm=norm, reduce_dtype=reduce_dtype or mixed_precision,
                    reserve_bytes=int(reserve_bytes),
                    compute_flops=(compute or ComputeModel()).compute_flops,
                    peak_flops=(compute or ComputeModel()).peak_flops,
                    overlap_param_update=overlap_param_update, backend=backend)
    return PlanReport(shape, settings, fitting + rest, baselines, tm_name)


auto_plan = choose_plan

_TITAN_AC = {"full": "full"}  # "selective"/"memory_budget" keep more: costed as "none"
_TITAN_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}


def plan(
    model_args=None, *, model_name: str | None = None, seq_len: int,
    micro_batch_size: int, num_micro_batches: int = 1, world_size: int,
    ranks_per_node: int, gpu_memory_bytes: float | None = None,
    activation_checkpoint: str = "none", param_dtype: str = "bfloat16",
    bandwidth_table=None,
) -> PlanReport:
    """Entry point for the torchtitan integration (plan = "auto"); names follow its config.

    model_args: torchtitan TransformerModelArgs (preferred: exact shapes), else model_name
      ("llama3:8B", "llama3_8b", "debugmodel", ...). activation_checkpoint: torchtitan's mode
      ("full" is costed as full recompute; "selective" etc. conservatively as "none").
    param_dtype: torchtitan's mixed_precision_param ("bfloat16" or "float32").
    gpu_memory_bytes: per rank; None = no memory filter (fastest plan).
    bandwidth_table: a profile JSON path (python -m amsp_dtensor.plan.profile) or None.
    Returns the PlanReport; .plan is the chosen ResolvedPlan.
    """
    if model_args is not None:
        model = model_args
    elif model_name:
        model = get_model(model_name.split(":")[-1])
    else:
        raise ValueError("planner needs model_args or model_name")
    precision = _TITAN_DTYPE.get(str(param_dtype).replace("torch.", ""))
    if precision is None:
        raise ValueError(f"param_dtype={param_dtype!r}; the planner knows bfloat16 and float32")
    return choose_plan(
        model, seq_len=seq_len, micro_batch=micro_batch_size, micro_batches=num_micro_batches,
        world_size=world_size, ranks_per_node=ranks_per_node,
        memory_budget_bytes=gpu_memory_bytes if gpu_memory_bytes else float("inf"),
        bandwidth=bandwidth_table, mixed_precision=precision,
        activation_checkpointing=_TITAN_AC.get(activation_checkpoint, "none"),
    )
