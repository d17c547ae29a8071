"""The planner: enumerate valid plans, keep those that fit in memory, rank by step time.

The AMSP paper's planner minimises T_comm = T_p + T_g + T_os0 + T_os1 over the valid
factors subject to D_total <= GPU memory; the space is small, so it filters, then
enumerates. Here plans are ranked by the predicted step time with overlap (cost/step.py:
compute from FLOPs plus the communication the engine cannot hide), each collective timed
by NCCL's tuning model (cost/nccl.py) or a measured table (cost/bandwidth.py); the
no-overlap sum of collective times stays as a column. Baseline systems (DDP, ZeRO-1/2/3,
HSDP/MiCS, ZeRO++ hpZ) are costed in the same model so their numbers sit beside the
chosen plan.

Tensor parallelism (``tp``, torchtitan's tensor_parallel_degree): a plan is then a
data-parallel plan over W / t ranks (sharding_plan.data_parallel_world), costed on the
TP-local parameter shapes, with TP's own collectives on the critical path
(cost/tensor_parallel.py). ``tp="auto"`` costs every TP degree that divides the node (up
to 8) at one global batch and keeps the fastest (tp, plan) that fits.

Compression (``compression=Compression(grads=, weights=)``, plan/compression.py): every
plan and baseline is costed with the cross-node stages compressed as the engine's
``amsp.set_compression`` does it (cost/comm.py): fewer bytes, an all-to-all in place of
a reduce-scatter, the codec's encode/decode time (cost/step.py) and its persistent
memory (cost/memory.py); each estimate keeps the exact schedule's bytes beside
(``bytes_inter_exact``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from ..sharding_plan import (
    BASELINES,
    EXPERT_DIM_PREFIX,
    ResolvedPlan,
    ShardingPlan,
    check_context_parallel,
    data_parallel_world,
    enumerate_plans,
    expert_parallel_world,
    tp_outside_node,
)
from .bandwidth import BandwidthTable, load_table
from ..compression import Compression
from .comm import (
    AlphaBeta,
    PlannedComm,
    TimeModel,
    bytes_by_locality,
    predicted_cp_events,
    predicted_ep_events,
    predicted_events,
    predicted_expert_events,
    step_comm_time,
    time_breakdown,
)
from .memory import (
    DTYPE_BYTES,
    CompressionBytes,
    MemoryEstimate,
    StateBytes,
    estimate_memory,
)
from .models import ModelShape, from_torchtitan_args, get_model
from .muon import MuonStep, muon_step
from .nccl import NcclModel, node_nic_bytes, wire_bytes
from .padding import shard_numel
from .pipeline import Pipeline, stage_model, with_p_gathers
from .step import (ComputeModel, StepTime, is_token_exchange, model_flops_per_token,
                   step_time)
from .tensor_parallel import check_sequence_parallel, tp_events, tp_seconds_per_micro_batch

__all__ = [
    "PlanEstimate",
    "PlanReport",
    "NoPlanFits",
    "estimate_plan",
    "choose_plan",
    "auto_plan",
    "plan",
    "BASELINE_LABELS",
    "MAX_AUTO_TP",
    "tp_degrees",
    "ranked",
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
        where = (f" at tensor_parallel_degree={smallest.tp}" if smallest.tp > 1 else "")
        super().__init__(
            f"no plan fits in {budget / 2**30:.2f} GiB per rank; the smallest-memory plan "
            f"{smallest.plan.name}{where} needs {smallest.memory.total / 2**30:.2f} GiB "
            "(raise the memory, use activation checkpointing, or shrink the micro-batch)"
        )


@dataclass
class PipelineRank:
    """One pipeline rank under a plan: its stages, memory, collectives and step seconds
    (its stages' timelines, without the pipeline's bubble)."""

    rank: int
    stages: list[int]
    memory: MemoryEstimate
    events: list[PlannedComm]
    step_seconds: float

    def as_dict(self) -> dict:
        return {"rank": self.rank, "stages": self.stages, "memory_bytes": self.memory.total,
                "step_seconds": self.step_seconds}


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
    tp: int = 1  # tensor-parallel degree; `plan` is then the data-parallel plan
    tp_events: list[PlannedComm] = field(default_factory=list)  # TP's collectives
    compression: Compression | None = None  # codecs of the cross-node stages, if any
    # with compression: the exact schedule's bytes per step, {"intra", "inter" (buffer),
    # "wire_inter"}
    exact_bytes: dict | None = None
    # under pipeline parallelism, every pipeline rank's own estimate (memory above is the
    # largest rank's, events and step the slowest rank's)
    pipeline_ranks: "list[PipelineRank] | None" = None
    # a model with experts: the routed experts' plan over the expert world and the EP
    # degree (memory, events and step are then of both groups and EP's all-to-alls)
    expert_plan: ResolvedPlan | None = None
    ep: int = 1
    muon: MuonStep | None = None  # Muon's part of the step (optimizer="muon")

    @property
    def pair_name(self) -> str:
        """"p2-g2-os4" or, with experts, "p2-g2-os4 + experts p1-g1-os2 (ep 8)"."""
        if self.expert_plan is None:
            return self.label
        return f"{self.label} + experts {self.expert_plan.name} (ep {self.ep})"

    def group_bytes(self) -> dict[str, dict[str, int]]:
        """Buffer bytes per step by group ("dense", "expert", "ep": EP's all-to-alls, "cp":
        CP's K/V exchange) and locality ({"intra", "inter"})."""
        out: dict[str, dict[str, int]] = {}
        for ev in self.events:
            group = (ev.dim if is_token_exchange(ev) else
                     "expert" if ev.dim.startswith(EXPERT_DIM_PREFIX) or ev.dim == "ep"
                     else "dense")
            where = out.setdefault(group, {"intra": 0, "inter": 0})
            where["inter" if ev.inter_node else "intra"] += ev.nbytes * ev.count
        return out

    @property
    def bytes_inter_exact(self) -> int:
        """Cross-node buffer bytes per step without compression (= bytes_inter when off)."""
        return self.exact_bytes["inter"] if self.exact_bytes is not None else self.bytes_inter

    @property
    def wire_bytes_inter_exact(self) -> float:
        """Bytes one GPU sends per step in cross-node groups without compression. (A
        compressed all-reduce is an all-to-all plus an all-gather: two buffers where the
        exact one counts one tensor, so buffer bytes can grow while wire bytes shrink.)"""
        if self.exact_bytes is None:
            return self.wire_bytes_inter
        return self.exact_bytes["wire_inter"]

    @property
    def step_seconds(self) -> float:
        return self.step.seconds if self.step is not None else self.comm_seconds

    @property
    def tp_comm_seconds(self) -> float:
        """TP's collectives per step, on the critical path (in step_seconds)."""
        return self.step.tp_comm_seconds if self.step is not None else 0.0

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
        """Bytes leaving one node through its NICs per step (all its ranks together:
        under TP each of the t TP ranks runs its own data-parallel groups)."""
        R = self.plan.ranks_per_node * self.tp
        return sum(e.count * node_nic_bytes(e.op, e.nbytes, e.group, R) for e in self.events)

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "plan": {"param": self.plan.s_p, "grad": self.plan.s_g, "optim": self.plan.s_os},
            "name": self.plan.name,
            "tensor_parallel_degree": self.tp,
            "reshard_after_forward": self.reshard_after_forward,
            "memory_bytes": self.memory.as_dict(),
            "bytes_intra": self.bytes_intra,
            "bytes_inter": self.bytes_inter,
            "wire_bytes_intra": self.wire_bytes_intra,
            "wire_bytes_inter": self.wire_bytes_inter,
            "node_nic_bytes": self.node_nic_bytes,
            "comm_seconds": self.comm_seconds,
            "step_seconds": self.step_seconds,
            "tp_comm_seconds": self.tp_comm_seconds,
            "step": self.step.as_dict() if self.step is not None else None,
            "breakdown_seconds": self.breakdown,
            "fits": self.fits,
            "pipeline_ranks": ([r.as_dict() for r in self.pipeline_ranks]
                               if self.pipeline_ranks is not None else None),
            "compression": str(self.compression) if self.compression is not None else None,
            "bytes_inter_exact": self.bytes_inter_exact,
            "wire_bytes_inter_exact": self.wire_bytes_inter_exact,
            "expert_plan": (None if self.expert_plan is None else
                            {"param": self.expert_plan.s_p, "grad": self.expert_plan.s_g,
                             "optim": self.expert_plan.s_os, "name": self.expert_plan.name}),
            "expert_parallel_degree": self.ep,
            "bytes_by_group": self.group_bytes() if self.expert_plan is not None else None,
            # optimizer="muon": each OS rank's Newton-Schulz FLOPs per step, and the
            # bytes its step buffers and its one momentum (saved against AdamW's two) take
            "muon": None if self.muon is None else {
                "newton_schulz_flops_per_rank": self.muon.member_flops,
                "step_scratch_bytes": self.muon.scratch_bytes,
                "optim_bytes_saved": self.muon.os_bytes_saved},
        }


@dataclass
class PlanReport:
    model: ModelShape
    settings: dict
    candidates: list[PlanEstimate]  # fitting plans first, fastest first
    baselines: dict[str, PlanEstimate] = field(default_factory=dict)
    time_model: str = "nccl"
    tp: int = 1  # tensor-parallel degree of every candidate
    # tp="auto": the report of every TP degree costed, by degree (this one among them)
    by_tp: dict[int, "PlanReport"] = field(default_factory=dict)
    # a model with experts: every expert plan with the chosen dense plan, fitting first,
    # fastest first (candidates are every dense plan with the chosen expert plan)
    expert_candidates: list[PlanEstimate] = field(default_factory=list)
    # the pair search's choices, (dense plan, expert plan): the one pair of the whole grid,
    # or each round's of the alternating search beyond it (_choose_pair)
    rounds: list[tuple[str, str]] = field(default_factory=list)
    # every (dense, expert) pair's estimate where the search costed the whole grid, else []
    pairs: list[PlanEstimate] = field(default_factory=list)

    @property
    def expert_plan(self) -> ResolvedPlan | None:
        """The chosen expert plan (over the expert world), None without experts."""
        return self.best.expert_plan

    @property
    def best(self) -> PlanEstimate:
        return self.candidates[0]

    @property
    def plan(self) -> ResolvedPlan:
        """The chosen plan (what the torchtitan bridge reads): with tp > 1, the plan of
        the data-parallel world (W / tp ranks, R / tp per node)."""
        return self.best.plan

    @property
    def tensor_parallel_degree(self) -> int:
        return self.tp

    @property
    def sharding_plan(self) -> ShardingPlan:
        return self.best.plan.as_plan()

    def to_toml(self) -> str:
        toml = self.best.plan.to_toml()
        expert = self.best.expert_plan
        if expert is not None:  # [amsp]'s expert keys
            toml = toml.rstrip() + "".join(
                f"\nexpert_{key} = {value}" for key, value in (
                    ("param_shard", expert.s_p), ("grad_shard", expert.s_g),
                    ("optim_shard", expert.s_os))) + "\n"
            if self.best.ep > 1:
                toml = f"[parallelism]\nexpert_parallel_degree = {self.best.ep}\n\n{toml}"
        compression = self.best.compression
        if compression is not None and compression.enabled:  # [amsp]'s keys for it
            toml = toml.rstrip() + "".join(
                f'\ncompress_{key} = "{getattr(compression, key)}"'
                for key in ("grads", "weights") if getattr(compression, key)) + "\n"
        if self.tp > 1:  # torchtitan's key for the TP degree
            toml = f"[parallelism]\ntensor_parallel_degree = {self.tp}\n\n{toml}"
        return toml

    def as_dict(self) -> dict:
        out = {
            "model": self.model.name,
            "num_params": self.model.num_params,
            "settings": self.settings,
            "time_model": self.time_model,
            "tensor_parallel_degree": self.tp,
            "chosen": self.best.as_dict(),
            "toml": self.to_toml(),
            "candidates": [c.as_dict() for c in self.candidates],
            "baselines": {k: v.as_dict() for k, v in self.baselines.items()},
        }
        if self.expert_candidates:
            out["expert_candidates"] = [c.as_dict() for c in self.expert_candidates]
            out["rounds"] = [list(r) for r in self.rounds]
        if self.by_tp:
            out["by_tp"] = {str(t): {"chosen": r.best.as_dict(),
                                     "settings": r.settings,
                                     "baselines": {k: v.as_dict()
                                                   for k, v in r.baselines.items()}}
                            for t, r in self.by_tp.items()}
        return out


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
    backend: str = "nccl", tp: int = 1, loss_parallel: bool = True,
    compression: Compression | None = None, pipeline: Pipeline | None = None,
    p_gathers: tuple[int, int] | None = None, expert_plan: ResolvedPlan | None = None,
    ep: int = 1, expert_shard_dim: int = 0, cp: int = 1, optimizer: str = "adamw",
) -> PlanEstimate:
    """Memory, step communication and step time of one plan. tp > 1: `plan` is the
    data-parallel plan (resolved with tensor_parallel_degree=tp), every state and DP
    collective is of the TP-local shapes, and TP's collectives join the step.
    compression: Compression or None (module docstring). pipeline: a Pipeline
    (cost/pipeline.py): `plan` is then one stage's data-parallel plan, costed on every
    pipeline rank's stages; ``micro_batches`` is ignored for the pipeline's own.
    p_gathers: (forward, backward) all-gathers over "p" of every unit per step, when not
    one per micro-batch (a pipeline stage's, Pipeline.all_gathers).
    expert_plan, ep: a model with experts: the routed experts' plan (resolved over the
    expert world, sharding_plan.expert_parallel_world) and the EP degree; required for
    such a model (the experts are a group of their own, never on the dense plan).
    expert_shard_dim: 0, the engine's layout of the experts (dim 0, padded to the
    factor), or 1 for torchtitan's Shard(1) (the baselines; ModelShape.expert_units).
    cp: the context-parallel degree (docs/context_parallel.md): ``plan`` is over the
    data-parallel world with the cp ranks in it; each rank computes and holds seq_len / cp
    tokens of a sequence, and CP's K/V exchange (predicted_cp_events) joins the step on
    the critical path of every block. optimizer: "adamw" (AdamW on every parameter) or
    "muon" (torch's Muon on every block matrix, AdamW on the rest: cost/muon.py)."""
    _check_optimizer(optimizer, tp=tp, experts=expert_plan is not None,
                     pipeline=pipeline is not None)
    if compression is not None and not compression.enabled:
        compression = None
    if cp != 1 and (pipeline is not None or expert_plan is not None):
        raise ValueError("the cost model has no context parallelism beside a pipeline or "
                         "experts yet")
    if (model.experts is None) != (expert_plan is None):
        raise ValueError(f"model {model.name}: " + (
            "has experts: give expert_plan (and ep)" if expert_plan is None else
            "has no experts: expert_plan and ep apply to a mixture-of-experts model"))
    if expert_plan is not None and pipeline is not None:
        raise ValueError("the cost model has no pipeline parallelism with experts yet")
    if pipeline is not None:
        return _estimate_pipelined(
            model, plan, pipeline, seq_len=seq_len, micro_batch=micro_batch,
            memory_budget_bytes=memory_budget_bytes, time_model=time_model,
            mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
            attention=attention, reshard_after_forward=reshard_after_forward, clip=clip,
            label=label, norm=norm, reduce_dtype=reduce_dtype, reserve_bytes=reserve_bytes,
            compute=compute, overlap_param_update=overlap_param_update, backend=backend,
            tp=tp, loss_parallel=loss_parallel, compression=compression)
    muon = muon_step(model, plan) if optimizer == "muon" else None
    mem = estimate_memory(model, plan, seq_len, micro_batch, mixed_precision,
                          activation_checkpointing, attention, norm=norm,
                          reshard_after_forward=reshard_after_forward,
                          reduce_dtype=reduce_dtype, reserve_bytes=reserve_bytes,
                          clip=clip, backend=backend, tp=tp, loss_parallel=loss_parallel,
                          compression=compression, expert_plan=expert_plan, ep=ep,
                          expert_shard_dim=expert_shard_dim, cp=cp, muon=muon)
    shapes = model.unit_param_shapes(tp)
    event_args = dict(reshard_after_forward=reshard_after_forward, clip=clip,
                      reduce_dtype_bytes=DTYPE_BYTES[reduce_dtype] if reduce_dtype else None)
    events = predicted_events(plan, shapes, micro_batches,
                              DTYPE_BYTES[mixed_precision], model.root_unit_index,
                              compression=compression, **event_args)
    if p_gathers is not None:
        events = with_p_gathers(events, p_gathers)
    expert_args = dict(model=model, plan=plan, expert_plan=expert_plan, ep=ep,
                       shard_dim=expert_shard_dim,
                       micro_batches=micro_batches, seq_len=seq_len, micro_batch=micro_batch,
                       dtype_bytes=DTYPE_BYTES[mixed_precision],
                       recompute=activation_checkpointing == "full", **event_args)
    events += _expert_events(**expert_args, compression=compression)
    cp_events = predicted_cp_events(cp, plan.ranks_per_node, model.n_layers, micro_batch,
                                    seq_len, model.kv_width // tp, micro_batches,
                                    DTYPE_BYTES[mixed_precision],
                                    recompute=activation_checkpointing == "full")
    events += cp_events
    if muon is not None:
        events += muon.events
    exact_bytes = None
    if compression is not None:
        exact = predicted_events(plan, shapes, micro_batches, DTYPE_BYTES[mixed_precision],
                                 model.root_unit_index, **event_args)
        exact += _expert_events(**expert_args)
        exact += cp_events
        if muon is not None:
            exact += muon.events
        exact_bytes = bytes_by_locality(exact)
        exact_bytes["wire_inter"] = sum(e.count * wire_bytes(e.op, e.nbytes, e.group_size)
                                        for e in exact if e.inter_node)
    tp_comms = tp_events(model, tp, seq_len=seq_len, micro_batch=micro_batch,
                         micro_batches=micro_batches, dtype_bytes=DTYPE_BYTES[mixed_precision],
                         activation_checkpointing=activation_checkpointing,
                         loss_parallel=loss_parallel, clip=clip)
    os_numel = shard_numel([sh for unit in shapes for sh in unit], plan.s_os)
    if expert_plan is not None:
        os_numel += shard_numel([sh for unit in model.expert_units(ep, expert_shard_dim)
                                 for sh in unit], expert_plan.s_os)
    st = step_time(model, events, time_model, seq_len=seq_len, micro_batch=micro_batch,
                   micro_batches=micro_batches, os_numel=os_numel, compute=compute,
                   activation_checkpointing=activation_checkpointing,
                   overlap_param_update=overlap_param_update, tp=tp,
                   tp_seconds=tp_seconds_per_micro_batch(tp_comms, time_model, micro_batches),
                   p_gathers=p_gathers, cp=cp,
                   step_flops=muon.busiest_flops if muon is not None else 0.0)
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
        tp=tp,
        tp_events=tp_comms,
        compression=compression,
        exact_bytes=exact_bytes,
        expert_plan=expert_plan,
        ep=ep,
        muon=muon,
    )


OPTIMIZERS = ("adamw", "muon")


def _check_optimizer(optimizer: str, *, tp: int, experts: bool, pipeline: bool) -> None:
    """The optimizers the cost model prices, where the engine runs them."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; use one of {OPTIMIZERS}")
    if optimizer == "muon" and (tp != 1 or experts or pipeline):
        what = "tensor parallelism" if tp != 1 else "experts" if experts else "a pipeline"
        raise ValueError(f"optimizer='muon' with {what}: AMSP runs Muon on a dense model's "
                         "data-parallel plans only (no TP, expert or pipeline meshes yet); "
                         "use optimizer='adamw' there")


def _expert_events(*, model: ModelShape, plan: ResolvedPlan, expert_plan, ep: int,
                   shard_dim: int, micro_batches: int, seq_len: int, micro_batch: int, dtype_bytes: int,
                   reshard_after_forward, clip: bool, reduce_dtype_bytes,
                   recompute: bool = False,
                   compression: Compression | None = None) -> list[PlannedComm]:
    """The routed experts' collectives on their plan (their units EP-local) and EP's token
    all-to-alls (cost/comm.py; ``recompute``: full activation checkpointing runs them again
    in backward), none without experts. hpZ (an int reshard_after_forward)
    is the dense units': the experts reshard fully."""
    if expert_plan is None:
        return []
    x = model.experts
    raf = reshard_after_forward if isinstance(reshard_after_forward, bool) else True
    return predicted_expert_events(
        expert_plan, ep, plan.ranks_per_node, model.expert_units(ep, shard_dim), micro_batches,
        dtype_bytes, raf, clip, reduce_dtype_bytes=reduce_dtype_bytes,
        compression=compression) + predicted_ep_events(
        ep, plan.ranks_per_node, model.moe_layers, seq_len * micro_batch, x.top_k, model.dim,
        x.n_experts, micro_batches, dtype_bytes, recompute=recompute)


def _estimate_pipelined(model: ModelShape, plan: ResolvedPlan, pipeline: Pipeline, *,
                        label, memory_budget_bytes, clip, **kw) -> PlanEstimate:
    """estimate_plan under pipeline parallelism (cost/pipeline.py): every local stage of
    every pipeline rank costed as a model of its own over the pipeline's micro-batches;
    the rank that needs the most memory decides the fit, the slowest rank the step."""
    M = pipeline.micro_batches
    kw["reshard_after_forward"] = pipeline.reshard_after_forward
    ranks = []
    for rank in range(pipeline.degree):
        ids = pipeline.stage_ids(rank)
        gathers = pipeline.all_gathers(rank)
        parts = [estimate_plan(stage_model(model, pipeline.stages[i]), plan,
                               micro_batches=M, memory_budget_bytes=memory_budget_bytes,
                               clip=False, p_gathers=gathers[i], **kw) for i in ids]
        acts = {i: part.memory.activations for i, part in zip(ids, parts)}
        in_flight = max(sum(n * acts[i] for i, n in state.items())
                        for state in pipeline.in_flight(rank))
        mems = [part.memory for part in parts]
        comps = [m.compression for m in mems if m.compression is not None]
        memory = MemoryEstimate(
            StateBytes(*(sum(getattr(m.states, f) for m in mems)
                         for f in ("param", "grad", "optim"))),
            in_flight, max(m.temp for m in mems), mems[0].reserve,
            sum(m.step for m in mems),  # an upper bound: each stage's scratch counted
            CompressionBytes(sum(c.error_feedback for c in comps),
                             sum(c.fp32_master for c in comps)) if comps else None)
        events = [ev for part in parts for ev in part.events]
        if clip:  # one norm over the rank's stages: over its shard group, then over pp
            events += predicted_events(plan, [], 1, 4, None, clip=True)
            events.append(pipeline.norm_all_reduce(plan, kw["tp"]))
        steps = [part.step for part in parts]
        ranks.append((memory, events, [ev for p in parts for ev in p.tp_events], steps))
    slowest = max(range(len(ranks)), key=lambda r: sum(s.seconds for s in ranks[r][3]))
    largest = max(range(len(ranks)), key=lambda r: ranks[r][0].total)
    _, events, tp_comms, steps = ranks[slowest]
    compute_per_micro_batch = max(sum(s.compute_seconds for s in r[3]) for r in ranks) / M
    bubble = (pipeline.degree - 1) / pipeline.stages_per_rank * compute_per_micro_batch
    seconds = sum(s.seconds for s in steps) + bubble
    tokens = kw["seq_len"] * kw["micro_batch"] * M
    compute = kw.get("compute") or ComputeModel()
    flops = tokens * model_flops_per_token(model, kw["seq_len"]) / (kw["tp"] * pipeline.degree)
    step = StepTime(
        seconds=seconds, compute_seconds=sum(s.compute_seconds for s in steps),
        comm_sum_seconds=sum(s.comm_sum_seconds for s in steps),
        exposed_comm_seconds=sum(s.exposed_comm_seconds for s in steps),
        mfu=flops / (seconds * compute.peak_flops) if seconds > 0 else 0.0, tokens=tokens,
        tp_comm_seconds=sum(s.tp_comm_seconds for s in steps),
        codec_seconds=sum(s.codec_seconds for s in steps))
    time_model = kw["time_model"]
    memory = ranks[largest][0]
    return PlanEstimate(
        label=label or plan.name, plan=plan, memory=memory, events=events,
        comm_seconds=step_comm_time(events, time_model),
        breakdown=time_breakdown(events, time_model),
        fits=all(r[0].total <= memory_budget_bytes for r in ranks),
        reshard_after_forward=kw["reshard_after_forward"], step=step, tp=kw["tp"],
        tp_events=tp_comms, compression=kw["compression"],
        pipeline_ranks=[PipelineRank(r, pipeline.stage_ids(r), memory, events,
                                     sum(s.seconds for s in steps))
                        for r, (memory, events, _, steps) in enumerate(ranks)])


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


def ranked(estimates, rank_by: str = "step") -> list[PlanEstimate]:
    """``estimates`` in the order the planner prefers them (its pick is the first that
    fits): by predicted step time, ties within STEP_TIME_TIE by bytes moved, or with
    rank_by="comm" by the communication sum."""
    _check_rank_by(rank_by)
    return _rank(list(estimates), rank_by)


def _check_rank_by(rank_by: str) -> None:
    if rank_by not in ("step", "comm"):
        raise ValueError(f"rank_by={rank_by!r}; use 'step' or 'comm'")


def _compression(value) -> Compression | None:
    """None, a Compression, or its CLI text ("grads=int8,weights=bf16", "none")."""
    if value is None:
        return None
    if isinstance(value, str):
        value = Compression.parse(value)
    if not isinstance(value, Compression):
        raise TypeError(f"compression must be a Compression, its text or None, got {value!r}")
    return value if value.enabled else None


def choose_plan(
    model, *, seq_len: int, micro_batch: int, micro_batches: int | None = None,
    world_size: int, ranks_per_node: int, memory_budget_bytes: float, bandwidth=None,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", clip: bool = True, include_baselines: bool = True,
    require_fit: bool = True, norm: str = "composite", reduce_dtype: str | None = None,
    reserve_bytes: int = 0, compute: ComputeModel | None = None,
    overlap_param_update: bool = False, cluster: NcclModel | None = None,
    rank_by: str = "step", backend: str = "nccl", tp: Union[int, str] = 1,
    global_batch_tokens: int | None = None, loss_parallel: bool = True,
    compression: Compression | None = None, pipeline: Pipeline | None = None,
    ep: int = 1, cp: int = 1, optimizer: str = "adamw",
) -> PlanReport:
    """Rank every valid plan for the world by predicted step time among those fitting.

    model: a name from cost.models.MODELS (torchtitan flavor names accepted), a ModelShape,
      or a torchtitan TransformerModelArgs.
    micro_batches: gradient-accumulation steps per optimizer step (M), per data-parallel
      rank; or give global_batch_tokens (tokens per optimizer step over the whole job):
      M = global_batch_tokens / (seq_len x micro_batch x data-parallel ranks).
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
    tp: tensor-parallel degree (torchtitan's tensor_parallel_degree), a divisor of
      ranks_per_node; the plans are then those of the data-parallel world (W / tp ranks,
      R / tp per node). "auto": every degree of tp_degrees() at one global batch (needs
      global_batch_tokens); the fastest (tp, plan) that fits, ties (within 1%) going to
      the smaller degree; the report's by_tp holds every degree's report.
    loss_parallel: torchtitan's default with TP (parallelism.disable_loss_parallel=False).
    compression: Compression(grads=, weights=), its text ("grads=int8,weights=bf16") or
      None: cost every plan with its cross-node stages compressed (module docstring);
      the ranking then includes the codec's bytes, time and memory.
    pipeline: a Pipeline (cost/pipeline.py) under pipeline parallelism: world_size and
      ranks_per_node are then one stage's (W / pp ranks), the micro-batches the
      pipeline's (give neither micro_batches nor global_batch_tokens), and every plan
      is costed on each pipeline rank's stages; a schedule that splits backwards
      (zero bubble) keeps the plans with param = 1 (engine/pipeline.py).
    ep: the expert-parallel degree, for a model with experts (Experts in cost/models.py):
      the plans are then pairs, a dense plan over the data-parallel world and an expert
      plan over the expert world (W / ep ranks, sharding_plan.expert_parallel_world),
      the fastest fitting pair of all (_choose_pair); report.expert_candidates ranks the expert
      plans beside the chosen dense one. The baselines pair the same system for both
      groups (ZeRO-3/FSDP: torchtitan's FSDP2 + EP, experts sharded over the expert world,
      on dim 1 where torchtitan does; the plans are the engine's, dim 0, padded).
    cp: the context-parallel degree (torchtitan's context_parallel_degree): the cp ranks
      are data-parallel ranks of every plan (the plans' factors range over them, a cp
      group sits in a node or spans whole nodes), each computes seq_len / cp tokens of a
      sequence, and the batch splits over the data-parallel ranks / cp (micro_batches
      and global_batch_tokens count those); not with a pipeline or experts yet.
    optimizer: "adamw", or "muon": torch's Muon on every block matrix and AdamW on the
      rest (AMSPOptimizer's Muon, engine/sharded_muon.py): every plan, and the baselines'
      schedules, with Muon's owner exchange, its Newton-Schulz on the busiest owner and
      its states (cost/muon.py); a dense model without TP or a pipeline.
    Raises NoPlanFits (a ValueError) when nothing fits and require_fit.
    Returns a PlanReport: .best (PlanEstimate), .sharding_plan, .tp, .to_toml(), .as_dict().
    """
    shape = _model_shape(model)
    args = dict(seq_len=seq_len, micro_batch=micro_batch, world_size=world_size,
                ranks_per_node=ranks_per_node, memory_budget_bytes=memory_budget_bytes,
                bandwidth=bandwidth, mixed_precision=mixed_precision,
                activation_checkpointing=activation_checkpointing, attention=attention,
                clip=clip, include_baselines=include_baselines, require_fit=require_fit,
                norm=norm, reduce_dtype=reduce_dtype, reserve_bytes=reserve_bytes,
                compute=compute, overlap_param_update=overlap_param_update, cluster=cluster,
                rank_by=rank_by, backend=backend, loss_parallel=loss_parallel,
                compression=_compression(compression), pipeline=pipeline, ep=ep, cp=cp,
                optimizer=optimizer)
    _check_optimizer(optimizer, tp=tp, experts=shape.experts is not None or ep != 1,
                     pipeline=pipeline is not None)
    if cp != 1 and (shape.experts is not None or ep != 1 or pipeline is not None):
        raise ValueError(f"cp={cp}: the cost model has no context parallelism beside a "
                         "pipeline or experts yet")
    if (shape.experts is not None or ep != 1) and (tp != 1 or pipeline is not None):
        raise ValueError(f"model {shape.name} with experts (ep={ep}): the cost model has "
                         "neither tensor nor pipeline parallelism with experts; use tp=1 "
                         "and no pipeline")
    if pipeline is not None:
        if tp == "auto":
            raise ValueError("tp='auto' with a pipeline: give the TP degree")
        if micro_batches is not None or global_batch_tokens is not None:
            raise ValueError("with a pipeline the micro-batches are the pipeline's: give "
                             "neither micro_batches nor global_batch_tokens")
        micro_batches = pipeline.micro_batches
    if tp == "auto":
        if micro_batches is not None or global_batch_tokens is None:
            raise ValueError(
                "tp='auto' compares TP degrees at one global batch: pass "
                "global_batch_tokens= (micro_batches is per data-parallel rank, so it "
                "changes with the TP degree)")
        return _choose_tp(shape, global_batch_tokens, args)
    return _choose_plan(shape, micro_batches=micro_batches,
                        global_batch_tokens=global_batch_tokens, tp=tp, **args)


# torchtitan's 2-D recipes use up to one node's 8 GPUs per TP group (tensor_parallel_degree
# = 8 in its 70B and 405B TOMLs); beyond a node TP's per-layer collectives would cross
# the network.
MAX_AUTO_TP = 8


def tp_degrees(model: ModelShape, ranks_per_node: int, seq_len: int) -> list[int]:
    """The TP degrees tp="auto" tries: divisors of the node up to MAX_AUTO_TP that
    torchtitan can split this model and sequence by."""
    out = []
    for t in range(1, min(ranks_per_node, MAX_AUTO_TP) + 1):
        if (tp_outside_node(t, ranks_per_node, f"tp={t}", "the node") is not None
                or model.kv_heads % t or (t > 1 and seq_len % (2 * t))):
            continue
        out.append(t)
    return out


def _choose_tp(shape: ModelShape, global_batch_tokens: int, args: dict) -> PlanReport:
    require_fit = args.pop("require_fit")
    reports: dict[int, PlanReport] = {}
    for t in tp_degrees(shape, args["ranks_per_node"], args["seq_len"]):
        dp_world = args["world_size"] // t
        if global_batch_tokens % (args["seq_len"] * args["micro_batch"] * dp_world):
            continue  # this batch does not split evenly over the DP ranks at this degree
        reports[t] = _choose_plan(shape, micro_batches=None, tp=t,
                                  global_batch_tokens=global_batch_tokens,
                                  require_fit=False, **args)
    if not reports:
        raise ValueError(
            f"global_batch_tokens={global_batch_tokens} is not a multiple of seq_len x "
            "micro_batch x data-parallel ranks at any TP degree tried; change the batch")
    fitting = {t: r for t, r in reports.items() if r.best.fits}
    if not fitting:
        if require_fit:
            smallest = min((c for r in reports.values() for c in r.candidates),
                           key=lambda c: c.memory.total)
            raise NoPlanFits(int(args["memory_budget_bytes"]), smallest)
        fitting = reports
    fastest = min(r.best.step_seconds for r in fitting.values())
    # ties for the model (STEP_TIME_TIE) go to the smaller degree: fewer collectives on
    # the critical path if the model is optimistic about them
    chosen = min(t for t, r in fitting.items()
                 if r.best.step_seconds <= fastest * (1 + STEP_TIME_TIE))
    report = reports[chosen]
    report.by_tp = reports
    return report


def _choose_plan(
    shape: ModelShape, *, seq_len: int, micro_batch: int, micro_batches: int | None,
    world_size: int, ranks_per_node: int, memory_budget_bytes: float, bandwidth,
    mixed_precision: str, activation_checkpointing: str, attention: str, clip: bool,
    include_baselines: bool, require_fit: bool, norm: str, reduce_dtype: str | None,
    reserve_bytes: int, compute: ComputeModel | None, overlap_param_update: bool,
    cluster: NcclModel | None, rank_by: str, backend: str, tp: int,
    global_batch_tokens: int | None, loss_parallel: bool,
    compression: Compression | None = None, pipeline: Pipeline | None = None, ep: int = 1,
    cp: int = 1, optimizer: str = "adamw",
) -> PlanReport:
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch),
                        ("world_size", world_size), ("ranks_per_node", ranks_per_node)):
        _positive(name, value)
    dp_world, dp_per_node = data_parallel_world(world_size, ranks_per_node, tp)
    shape.check_tensor_parallel(tp)
    check_sequence_parallel(seq_len, tp)
    check_context_parallel(cp, dp_world, dp_per_node)
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} does not split over cp={cp} ranks; use a multiple "
                         f"of {cp}")
    if (micro_batches is None) == (global_batch_tokens is None):
        raise ValueError("give one of micro_batches (per data-parallel rank) and "
                         "global_batch_tokens")
    if global_batch_tokens is not None:
        _positive("global_batch_tokens", global_batch_tokens)
        per_step = seq_len * micro_batch * dp_world // cp  # the cp ranks share sequences
        if global_batch_tokens % per_step:
            raise ValueError(
                f"global_batch_tokens={global_batch_tokens} is not a multiple of seq_len x "
                f"micro_batch x data-parallel ranks"
                + (f" / cp {cp}" if cp > 1 else "") + f" = {per_step} "
                f"(tensor_parallel_degree={tp}); change the batch or the micro-batch")
        micro_batches = global_batch_tokens // per_step
    _positive("micro_batches", micro_batches)
    if mixed_precision not in DTYPE_BYTES:
        raise ValueError(f"mixed_precision={mixed_precision!r}; use one of {sorted(DTYPE_BYTES)}")
    if not memory_budget_bytes or not memory_budget_bytes > 0:
        raise ValueError(f"memory budget must be positive, got {memory_budget_bytes!r}")
    if reduce_dtype is not None and reduce_dtype not in DTYPE_BYTES:
        raise ValueError(f"reduce_dtype={reduce_dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    if not reserve_bytes >= 0:
        raise ValueError(f"reserve must be >= 0, got {reserve_bytes!r}")
    if cluster is None:
        cluster = NcclModel(gpus_per_node=ranks_per_node)  # the node's GPUs, TP or not
    tm, tm_name = _time_model(bandwidth, cluster)
    common = dict(seq_len=seq_len, micro_batch=micro_batch, micro_batches=micro_batches,
                  memory_budget_bytes=memory_budget_bytes, time_model=tm,
                  mixed_precision=mixed_precision,
                  activation_checkpointing=activation_checkpointing, attention=attention,
                  clip=clip, norm=norm, reduce_dtype=reduce_dtype,
                  reserve_bytes=reserve_bytes, compute=compute,
                  overlap_param_update=overlap_param_update, backend=backend, tp=tp,
                  loss_parallel=loss_parallel, compression=compression, pipeline=pipeline,
                  cp=cp, optimizer=optimizer)
    plans = enumerate_plans(world_size, ranks_per_node, tp)
    if pipeline is not None and pipeline.split_backward:
        plans = [p for p in plans if p.s_p == 1]  # split backwards need plain parameters
    _check_rank_by(rank_by)
    expert_world = None
    if shape.experts is None:
        if ep != 1:
            raise ValueError(f"ep={ep}: model {shape.name} has no experts; expert "
                             "parallelism applies to a mixture-of-experts model")
        estimates = [estimate_plan(shape, p, **common) for p in plans]
        expert_estimates, rounds, pairs = [], [], []
    else:
        expert_world = expert_parallel_world(dp_world, dp_per_node, ep)
        shape.expert_units(ep)  # ep must divide the experts
        estimates, expert_estimates, rounds, pairs = _choose_pair(
            shape, plans, enumerate_plans(*expert_world), ep, common, rank_by)
    fitting = _rank((e for e in estimates if e.fits), rank_by)
    if not fitting and require_fit:
        raise NoPlanFits(int(memory_budget_bytes), min(estimates, key=lambda e: e.memory.total))
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total)
    baselines = {}
    if include_baselines:
        # under TP the baselines shard the data-parallel world: FSDP2 + TP (ZeRO-3 over
        # W / tp ranks), HSDP + TP (shard over the node's R / tp DP ranks), ...
        def experts_as(key):  # a baseline's experts: the same system over their world,
            # sharded as torchtitan shards them (Shard(1) where the factor x ep exceeds
            # the experts)
            if expert_world is None:
                return {}
            rp = BASELINES[key].resolve(*expert_world)
            return dict(expert_plan=rp, ep=ep,
                        expert_shard_dim=shape.titan_expert_shard_dim(rp, ep))

        for key, sp in BASELINES.items():
            rp = sp.resolve(world_size, ranks_per_node, tensor_parallel_degree=tp)
            baselines[key] = estimate_plan(shape, rp, label=BASELINE_LABELS[key], **common,
                                           **experts_as(key))
        rp = BASELINES["zero3"].resolve(world_size, ranks_per_node, tensor_parallel_degree=tp)
        k = min(dp_per_node, dp_world)
        baselines["hpz"] = estimate_plan(shape, rp, label=BASELINE_LABELS["hpz"],
                                         reshard_after_forward=k if k < dp_world else True,
                                         **common, **experts_as("zero3"))
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
                    overlap_param_update=overlap_param_update, backend=backend,
                    tensor_parallel_degree=tp, data_parallel_world_size=dp_world,
                    loss_parallel=loss_parallel if tp > 1 else None,
                    pipeline=(dict(degree=pipeline.degree, schedule=pipeline.schedule,
                                   micro_batches=pipeline.micro_batches,
                                   stages=[vars(st) for st in pipeline.stages])
                              if pipeline is not None else None),
                    compression=str(compression) if compression is not None else None,
                    expert_parallel_degree=ep if expert_world is not None else None,
                    expert_world_size=expert_world[0] if expert_world is not None else None,
                    context_parallel_degree=cp if cp > 1 else None, optimizer=optimizer)
    return PlanReport(shape, settings, fitting + rest, baselines, tm_name, tp=tp,
                      expert_candidates=expert_estimates, rounds=rounds, pairs=pairs)


# [Note: every plan pair, or alternating]
# A model with experts is planned as a pair: a dense plan and an expert plan, sharing one
# memory budget and the step's communication queue. An alternating search (the dense plan
# for the expert plan, then the expert plan for that dense plan, until it settles) costs
# len(plans) + len(expert_plans) estimates a round, but it stops at the first pair that
# neither step improves. On the emulated cluster's MoE model (4 ranks, ep 2, fp32) it did:
# from torchtitan's experts (ZeRO-3 over the expert world) the fastest dense plan took the
# budget whole (p1-g1-os1), no expert plan then fitted beside it but the one it started
# from, and the search kept p1-g1-os1 / p2-g2-os2 while p1-g1-os4 / p1-g1-os2 fitted the
# same budget by its own estimate and ran 2.2x faster as measured. So the planner costs
# every pair where there are at most PAIR_GRID_LIMIT (784 at 64 GPUs, 8 per node, ep 8: about
# 2 s for deepseek_v3_16b) and alternates beyond: a pair's estimate takes 1-17 ms (17 for
# deepseek_v3_671b's 61 blocks), and 1024 GPUs at ep 64 have 3025 pairs (52 s).
PAIR_GRID_LIMIT = 1024
# the alternating search's rounds at most: each round picks the dense plan for the expert
# plan, then the expert plan for that dense plan; it stops when the expert plan stays
MAX_PAIR_ROUNDS = 4


def _choose_pair(shape: ModelShape, plans: list, expert_plans: list, ep: int, common: dict,
                 rank_by: str) -> tuple[list, list, list, list]:
    """(dense plan, expert plan) for a model with experts: the fastest fitting pair of
    all (see [Note: every plan pair, or alternating]), or, beyond PAIR_GRID_LIMIT pairs,
    _alternate's. Returns every dense plan's estimate with the chosen expert plan, every
    expert plan's with the chosen dense plan (fitting first, fastest first), the search's
    choices ((dense, expert) names: the one pair of the whole grid, or each alternating
    round's) and every pair's estimate (the grid; [] when alternating)."""
    if len(plans) * len(expert_plans) > PAIR_GRID_LIMIT:
        return (*_alternate(shape, plans, expert_plans, ep, common, rank_by), [])
    grid = {(p.name, q.name): estimate_plan(shape, p, expert_plan=q, ep=ep, **common)
            for p in plans for q in expert_plans}
    best = _best(list(grid.values()), rank_by)
    dense = [grid[(p.name, best.expert_plan.name)] for p in plans]
    experts = [grid[(best.plan.name, q.name)] for q in expert_plans]
    return (dense, _fitting_first(experts, rank_by), [(best.plan.name, best.expert_plan.name)],
            list(grid.values()))


def _alternate(shape: ModelShape, plans: list, expert_plans: list, ep: int, common: dict,
               rank_by: str) -> tuple[list, list, list]:
    """_choose_pair by alternating: start from the experts sharded as torchtitan does
    (ZeRO-3 over the expert world), rank every dense plan with them, then every expert plan
    with the best dense one, and again, until a round keeps the expert plan it started
    from (its dense ranking is then of the chosen pair); after MAX_PAIR_ROUNDS it keeps
    the last expert plan. len(plans) + len(expert_plans) estimates a round."""
    expert = BASELINES["zero3"].resolve(expert_plans[0].world_size,
                                        expert_plans[0].ranks_per_node)
    rounds: list[tuple[str, str]] = []
    for _ in range(MAX_PAIR_ROUNDS):
        dense = [estimate_plan(shape, p, expert_plan=expert, ep=ep, **common) for p in plans]
        pick = _best(dense, rank_by)
        experts = [estimate_plan(shape, pick.plan, expert_plan=q, ep=ep, **common)
                   for q in expert_plans]
        best = _best(experts, rank_by)
        rounds.append((pick.plan.name, best.expert_plan.name))
        if best.expert_plan == expert:  # the dense ranking above holds for this pair
            break
        expert = best.expert_plan
    else:  # not settled: the last expert plan's dense ranking, and the experts' with its best
        dense = [estimate_plan(shape, p, expert_plan=expert, ep=ep, **common) for p in plans]
        pick = _best(dense, rank_by)
        experts = [estimate_plan(shape, pick.plan, expert_plan=q, ep=ep, **common)
                   for q in expert_plans]
        rounds.append((pick.plan.name, expert.name))
    return dense, _fitting_first(experts, rank_by), rounds


def _fitting_first(estimates: list, rank_by: str) -> list:
    """The fitting estimates ranked (fastest first), then the others, smallest first."""
    return (_rank((e for e in estimates if e.fits), rank_by)
            + sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total))


def _best(estimates: list, rank_by: str):
    """The fastest that fits, else the smallest."""
    fitting = _rank((e for e in estimates if e.fits), rank_by)
    return fitting[0] if fitting else min(estimates, key=lambda e: e.memory.total)


auto_plan = choose_plan

_TITAN_AC = {"full": "full"}  # "selective"/"memory_budget" keep more: costed as "none"
_TITAN_DTYPE = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}


def plan(
    model_args=None, *, model_name: str | None = None, seq_len: int,
    micro_batch_size: int, num_micro_batches: int | None = 1, world_size: int,
    ranks_per_node: int, gpu_memory_bytes: float | None = None,
    activation_checkpoint: str = "none", param_dtype: str = "bfloat16",
    bandwidth_table=None, tensor_parallel_degree: Union[int, str] = 1,
    global_batch_size: int | None = None, loss_parallel: bool = True,
    compression=None, pipeline: Pipeline | None = None, expert_parallel_degree: int = 1,
    context_parallel_degree: int = 1,
) -> PlanReport:
    """Entry point for the torchtitan integration (plan = "auto"); names follow its config.

    model_args: torchtitan TransformerModelArgs (preferred: exact shapes), else model_name
      ("llama3:8B", "llama3_8b", "debugmodel", ...). activation_checkpoint: torchtitan's mode
      ("full" is costed as full recompute; "selective" etc. conservatively as "none").
    param_dtype: torchtitan's mixed_precision_param ("bfloat16" or "float32").
    gpu_memory_bytes: per rank; None = no memory filter (fastest plan).
    bandwidth_table: a profile JSON path (python -m amsp_dtensor.plan.profile) or None.
    tensor_parallel_degree: [parallelism] tensor_parallel_degree, or "auto" (needs
      global_batch_size). global_batch_size: [training] global_batch_size, in sequences
      (then num_micro_batches is derived per TP degree and must be None or left at 1).
    loss_parallel: not [parallelism] disable_loss_parallel.
    compression: None, a Compression, or its text ("grads=int8,weights=bf16"): from
      [amsp] compress_grads / compress_weights.
    pipeline: a Pipeline under [parallelism] pipeline_parallel_degree > 1 (world_size and
      ranks_per_node are then one stage's; the micro-batches are the pipeline's).
    expert_parallel_degree: [parallelism] expert_parallel_degree; a model with experts
      (deepseek_v3's, qwen3's MoE args) gets an expert plan too (.expert_plan).
    context_parallel_degree: [parallelism] context_parallel_degree (choose_plan's cp).
    Returns the PlanReport; .plan is the chosen ResolvedPlan (of the data-parallel world
    when .tp > 1).
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
    batch = {"micro_batches": num_micro_batches}
    if pipeline is not None:
        batch = {}
    elif global_batch_size is not None:
        if num_micro_batches not in (None, 1):
            raise ValueError("give global_batch_size or num_micro_batches, not both")
        batch = {"global_batch_tokens": global_batch_size * seq_len}
    return choose_plan(
        model, seq_len=seq_len, micro_batch=micro_batch_size, world_size=world_size,
        ranks_per_node=ranks_per_node,
        memory_budget_bytes=gpu_memory_bytes if gpu_memory_bytes else float("inf"),
        bandwidth=bandwidth_table, mixed_precision=precision,
        activation_checkpointing=_TITAN_AC.get(activation_checkpoint, "none"),
        tp=tensor_parallel_degree, loss_parallel=loss_parallel,
        compression=compression, pipeline=pipeline, ep=expert_parallel_degree,
        cp=context_parallel_degree, **batch,
    )
