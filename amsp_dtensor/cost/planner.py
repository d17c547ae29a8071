"""The planner: enumerate valid plans, keep those that fit in memory, rank by comm time.

PAPER.md, "Planner": minimise T_comm = T_p + T_g + T_os0 + T_os1 over the valid factors
subject to D_total <= GPU memory; the space is small, so filter then enumerate. Baseline
systems (DDP, ZeRO-1/2/3, HSDP/MiCS, ZeRO++ hpZ) are costed in the same model so their
numbers sit beside the chosen plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from ..plan import BASELINES, ResolvedPlan, ShardingPlan, enumerate_plans
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

    @property
    def bytes_intra(self) -> int:
        return bytes_by_locality(self.events)["intra"]

    @property
    def bytes_inter(self) -> int:
        return bytes_by_locality(self.events)["inter"]

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "plan": {"param": self.plan.s_p, "grad": self.plan.s_g, "optim": self.plan.s_os},
            "name": self.plan.name,
            "reshard_after_forward": self.reshard_after_forward,
            "memory_bytes": self.memory.as_dict(),
            "bytes_intra": self.bytes_intra,
            "bytes_inter": self.bytes_inter,
            "comm_seconds": self.comm_seconds,
            "breakdown_seconds": self.breakdown,
            "fits": self.fits,
        }


@dataclass
class PlanReport:
    model: ModelShape
    settings: dict
    candidates: list[PlanEstimate]  # fitting plans first, fastest first
    baselines: dict[str, PlanEstimate] = field(default_factory=dict)
    time_model: str = "alpha-beta"

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


def _time_model(bandwidth) -> tuple[TimeModel, str]:
    if bandwidth is None:
        return AlphaBeta(), "alpha-beta (paper's cluster defaults)"
    if isinstance(bandwidth, (str, Path)):
        return load_table(bandwidth), f"measured table {bandwidth}"
    if isinstance(bandwidth, (BandwidthTable, AlphaBeta)) or hasattr(bandwidth, "time"):
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
    clip: bool = True, label: str | None = None,
) -> PlanEstimate:
    """Memory and step communication of one plan."""
    mem = estimate_memory(model, plan, seq_len, micro_batch, mixed_precision,
                          activation_checkpointing, attention,
                          reshard_after_forward=reshard_after_forward)
    events = predicted_events(plan, model.unit_param_shapes(), micro_batches,
                              DTYPE_BYTES[mixed_precision], model.root_unit_index,
                              reshard_after_forward=reshard_after_forward, clip=clip)
    return PlanEstimate(
        label=label or plan.name,
        plan=plan,
        memory=mem,
        events=events,
        comm_seconds=step_comm_time(events, time_model),
        breakdown=time_breakdown(events, time_model),
        fits=mem.total <= memory_budget_bytes,
        reshard_after_forward=reshard_after_forward,
    )


def choose_plan(
    model, *, seq_len: int, micro_batch: int, micro_batches: int, world_size: int,
    ranks_per_node: int, memory_budget_bytes: float, bandwidth=None,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", clip: bool = True, include_baselines: bool = True,
    require_fit: bool = True,
) -> PlanReport:
    """Rank every valid plan for the world by predicted step comm time among those fitting.

    model: a name from cost.models.MODELS (torchtitan flavor names accepted), a ModelShape,
      or a torchtitan TransformerModelArgs.
    micro_batches: gradient-accumulation steps per optimizer step (M).
    memory_budget_bytes: per rank. bandwidth: None (alpha-beta), a profile JSON path, or a
      time model. Raises NoPlanFits (a ValueError) when nothing fits and require_fit.
    Returns a PlanReport: .best (PlanEstimate), .sharding_plan, .to_toml(), .as_dict().
    """
    shape = _model_shape(model)
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch),
                        ("micro_batches", micro_batches), ("world_size", world_size),
                        ("ranks_per_node", ranks_per_node)):
        _positive(name, value)
    if mixed_precision not in DTYPE_BYTES:
        raise ValueError(f"mixed_precision={mixed_precision!r}; use one of {sorted(DTYPE_BYTES)}")
    if not memory_budget_bytes or memory_budget_bytes <= 0:
        raise ValueError(f"memory budget must be positive, got {memory_budget_bytes!r}")
    tm, tm_name = _time_model(bandwidth)
    common = dict(seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                  memory_budget_bytes=memory_budget_bytes, time_model=tm,
                  mixed_precision=mixed_precision,
                  activation_checkpointing=activation_checkpointing, attention=attention,
                  clip=clip)
    estimates = [estimate_plan(shape, p, **common)
                 for p in enumerate_plans(world_size, ranks_per_node)]
    fitting = sorted((e for e in estimates if e.fits),
                     key=lambda e: (e.comm_seconds, e.memory.total))
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
                    activation_checkpointing=activation_checkpointing, attention=attention)
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
    bandwidth_table: a profile JSON path (python -m amsp_dtensor.profile) or None.
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
