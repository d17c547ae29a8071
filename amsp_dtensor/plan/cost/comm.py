"""Communication model: the per-step schedule of collectives for a plan, and its time.

The schedule is the one the engine issues (docs/layouts.md, the per-step schedule), per FSDP
unit U with padded(U, s) = e * sum_params s*ceil(d0/s)*cols (cost/padding.py):

  s_p > 1, every micro-batch:   AG over "p"  nbytes padded(U,s_p)   forward
                                AG over "p"  nbytes padded(U,s_p)   backward (not the root
                                             unit; not with reshard_after_forward=False)
                                RS over "p"  nbytes padded(U,s_p)   backward
  s_g > s_p, every micro-batch: RS over "g"  nbytes padded(U,s_g)/s_p  backward ("sync" on
                                             the last micro-batch)
  last micro-batch (sync):      s_g == s_os:        AR over "rep" padded(U,s_os)/s_os
                                s_g == s_p < s_os:  RS over "os"  padded(U,s_os)/s_p,
                                                    AR over "rep" padded(U,s_os)/s_os
                                (AR only when W/s_os > 1)
  after step, s_os > s_p:       AG over "g" (s_g > s_p) or "os": padded(U,s_os)/s_p  step
  clip_grad_norm_:              AR over "shard" (s_os ranks) of 4 bytes               step

With experts (mixture of experts): the expert units' schedule is the same on the expert
plan over the expert world (predicted_expert_events), and expert parallelism adds its
token all-to-alls over "ep" (predicted_ep_events). With context parallelism the cp ranks
are data-parallel ranks of the plan (the schedule above over the world with them in it),
and the model exchanges keys and values over "cp" (predicted_cp_events).

Compression (opt-in, ``compression=Compression(grads=, weights=)``, plan/compression.py):
only a stage whose group spans nodes, and whose dtype the codec applies to, changes;
C(m) = chunk_nbytes(codec, m) is one compressed chunk of m elements:
  RS over "g"   -> all_to_all over "g",  k*C(m), k = s_g/s_p,  m = padded(U,s_g)/s_g
  RS over "os"  -> all_to_all over "os", k*C(m), k = s_os/s_p, m = padded(U,s_os)/s_os
  AR over "rep" -> all_to_all over "rep" rep*C(m) then all_gather over "rep" rep*C(m),
                   n = padded(U,s_os)/s_os, m = ceil(n/rep)           (both "sync")
  post-step AG  -> all_gather k*C(m), k = s_os/s_p, m = padded(U,s_os)/s_os  (weights)
(padded here in elements). Phases and counts are those of the stage replaced.

These are the four terms of the AMSP paper's communication model: T_p = the "p" traffic
(M*L*[2*t(AG) + t(RS)]), T_g = the "g" reduce-scatters of the first M-1 micro-batches (the
paper's all-reduce of buckets; a reduce-scatter here), T_os0 = the once-per-step sync across
replicas, T_os1 = the all-gather of updated params over the OS subgroup (the paper's
broadcast, same bytes).

Rank layout (mesh order, "p" innermost): rank = rep_i*s_os + os_i*s_g + g_i*s_p + p_i,
so every group is an arithmetic progression of ranks: "p" stride 1, "g" stride s_p, "os"
stride s_g, "rep" stride s_os, "shard" stride 1 (size s_os). Node = rank // ranks_per_node.

Time of one collective, t(op, nbytes, group): either the alpha-beta ring model (AlphaBeta)
or the paper's way, a measured effective-bandwidth table interpolated in log(size) per op
and group shape (cost/bandwidth.py).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache
from dataclasses import asdict, dataclass
from typing import Iterable, Protocol, Sequence, Union

from ..sharding_plan import EXPERT_DIM_PREFIX, ResolvedPlan, ShardingPlan
from ..compression import Compression, chunk_nbytes, codec_applies
from .padding import padded_numel

__all__ = [
    "GroupShape",
    "PlannedComm",
    "group_shape",
    "dim_group",
    "predicted_events",
    "predicted_expert_events",
    "predicted_cp_events",
    "predicted_ep_events",
    "error_feedback_elements",
    "event_counter",
    "recorded_counter",
    "TimeModel",
    "AlphaBeta",
    "step_comm_time",
    "time_breakdown",
    "bytes_by_locality",
]

Shapes = Sequence[Sequence[int]]


@dataclass(frozen=True)
class GroupShape:
    """A process group as the cost model sees it: an arithmetic progression of ranks."""

    size: int  # ranks in the group
    stride: int  # rank distance between group neighbours
    ranks_per_node: int  # s0: group ranks on one node
    nodes: int  # s1: nodes the group spans

    @property
    def inter_node(self) -> bool:
        return self.nodes > 1


@lru_cache(maxsize=4096)
def group_shape(size: int, stride: int, world_size: int, ranks_per_node: int) -> GroupShape:
    """Shape of the groups {b, b+stride, ..} of `size` ranks tiling the world (worst group)."""
    nodes = 1
    for base in range(world_size):
        if (base // stride) % size:
            continue  # not the first rank of its group
        spanned = {(base + i * stride) // ranks_per_node for i in range(size)}
        nodes = max(nodes, len(spanned))
    return GroupShape(size, stride, max(1, size // nodes), nodes)


def dim_group(plan: ResolvedPlan, dim: str) -> GroupShape:
    """The group of one mesh dim of a plan (see the module docstring for the layout)."""
    W, R = plan.world_size, plan.ranks_per_node
    size_stride = {
        "p": (plan.s_p, 1),
        "g": (plan.s_g // plan.s_p, plan.s_p),
        "os": (plan.s_os // plan.s_g, plan.s_g),
        "rep": (W // plan.s_os, plan.s_os),
        "shard": (plan.s_os, 1),
    }
    if dim not in size_stride:
        raise ValueError(f"unknown mesh dim {dim!r}; expected one of {sorted(size_stride)}")
    size, stride = size_stride[dim]
    return group_shape(size, stride, W, R)


@dataclass(frozen=True)
class PlannedComm:
    """One kind of collective in a step, issued `count` times (same fields as CommEvent)."""

    op: str
    dim: str
    group_size: int
    nbytes: int
    inter_node: bool
    phase: str
    count: int = 1
    unit: int = -1  # FSDP unit index (-1: not per unit)
    stride: int = 1  # rank stride of the group (for bandwidth-table lookup)
    group_nodes: int = 1  # nodes the group spans
    codec: str | None = None  # the codec of a compressed stage (plan/compression.py)
    raw_nbytes: int = 0  # compressed stage: bytes of the data it encodes, uncompressed

    def key(self) -> tuple:
        """Matches CommEvent.key(): (op, dim, group_size, nbytes, inter_node, phase)."""
        return (self.op, self.dim, self.group_size, self.nbytes, self.inter_node, self.phase)

    @property
    def group(self) -> GroupShape:
        return GroupShape(
            self.group_size, self.stride, self.group_size // self.group_nodes, self.group_nodes
        )

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count

    def as_dict(self) -> dict:
        return asdict(self)


def _as_resolved(plan, world_size=None, ranks_per_node=None) -> ResolvedPlan:
    if isinstance(plan, ResolvedPlan):
        return plan
    if isinstance(plan, ShardingPlan):
        if world_size is None:
            raise ValueError("a ShardingPlan needs world_size (and ranks_per_node) to resolve")
        return plan.resolve(world_size, ranks_per_node or world_size)
    raise TypeError(f"plan must be a ResolvedPlan or ShardingPlan, got {type(plan).__name__}")


@lru_cache(maxsize=4096)
def _padded(shapes: tuple, s: int) -> int:
    return padded_numel(shapes, s)


def predicted_events(
    plan: Union[ResolvedPlan, ShardingPlan],
    unit_param_shapes: Sequence[Shapes],
    micro_batches: int,
    dtype_bytes: int,
    root_unit_index: "int | Iterable[int] | None",
    reshard_after_forward: Union[bool, int] = True,
    clip: bool = False,
    *,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    reduce_dtype_bytes: int | None = None,
    compression: Compression | None = None,
) -> list[PlannedComm]:
    """The collectives of one optimizer step (M micro-batches), per unit, with counts.

    plan: a ResolvedPlan (or a ShardingPlan plus world_size/ranks_per_node).
    unit_param_shapes: for each FSDP unit, the shapes of its params (dim0 first).
    dtype_bytes: e, the element size of the param dtype (2 bf16, 4 fp32).
    root_unit_index: index of the root unit in unit_param_shapes (kept unsharded after
      forward by FSDP2, so it has no backward all-gather), or several such indices
      (torchtitan also keeps [norm, output] unsharded); -1 or None if there is none.
    reshard_after_forward: True (default), False (no backward AG), or an int k (ZeRO++ hpZ:
      the backward AG runs over the k contiguous ranks that keep a secondary copy).
    clip: add clip_grad_norm_'s scalar all-reduce.
    reduce_dtype_bytes: element size of the gradient collectives (MixedPrecisionPolicy's
      reduce_dtype: the reduce-scatters and the sync); default dtype_bytes.
    compression: Compression(grads=, weights=) (plan/compression.py) or None: the
      cross-node gradient stages and post-step all-gather become compressed collectives
      (module docstring); None, or both fields None, gives the exact schedule.
    Use event_counter() to compare with a recorder's events.
    """
    p = _as_resolved(plan, world_size, ranks_per_node)
    M = int(micro_batches)
    if M < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    e = int(dtype_bytes)
    r = int(reduce_dtype_bytes or dtype_bytes)
    W = p.world_size
    groups = {dim: dim_group(p, dim) for dim in ("p", "g", "os", "rep", "shard")}
    out: list[PlannedComm] = []

    cg, cw = _codecs(compression)

    def add(op, dim, nbytes, phase, count, unit, group=None, codec=None, raw=0):
        if count <= 0:
            return
        g = group or groups[dim]
        out.append(
            PlannedComm(op, dim, g.size, int(nbytes), g.inter_node, phase, count, unit,
                        g.stride, g.nodes, codec, int(raw))
        )

    def squeezed(codec, dim, dtype_bytes) -> bool:  # is this stage compressed?
        return groups[dim].inter_node and codec_applies(codec, dtype_bytes)

    n_units = len(unit_param_shapes)
    if root_unit_index is None:
        kept = set()
    elif isinstance(root_unit_index, int):
        kept = {root_unit_index % n_units} if n_units else set()
    else:
        kept = {int(i) % n_units for i in root_unit_index}
    for u, shapes in enumerate(unit_param_shapes):
        if not shapes:  # a pipeline stage's root holding neither end: no collectives
            continue
        key = tuple(tuple(int(d) for d in shape) for shape in shapes)
        pad_p = e * _padded(key, p.s_p)
        red_p = r * _padded(key, p.s_p)
        pad_g = r * _padded(key, p.s_g)
        pad_os = r * _padded(key, p.s_os)
        ag_os = e * _padded(key, p.s_os)
        is_root = u in kept
        if p.s_p > 1:
            add("all_gather", "p", pad_p, "forward", M, u)
            if not is_root and reshard_after_forward is not False:
                if reshard_after_forward is True or int(reshard_after_forward) == p.s_p:
                    add("all_gather", "p", pad_p, "backward", M, u)
                elif int(reshard_after_forward) > 1:
                    k = int(reshard_after_forward)
                    add("all_gather", "p", pad_p, "backward", M, u,
                        group_shape(k, 1, W, p.ranks_per_node))
            add("reduce_scatter", "p", red_p, "backward", M, u)
        rep = W // p.s_os
        if p.s_g > p.s_p:
            if squeezed(cg, "g", r):
                k, m = p.s_g // p.s_p, _padded(key, p.s_g) // p.s_g
                nb = k * chunk_nbytes(cg, m)
                add("all_to_all", "g", nb, "backward", M - 1, u, codec=cg, raw=r * k * m)
                add("all_to_all", "g", nb, "sync", 1, u, codec=cg, raw=r * k * m)
            else:
                add("reduce_scatter", "g", pad_g // p.s_p, "backward", M - 1, u)
                add("reduce_scatter", "g", pad_g // p.s_p, "sync", 1, u)
        if p.s_g == p.s_p < p.s_os:
            if squeezed(cg, "os", r):
                k, m = p.s_os // p.s_p, _padded(key, p.s_os) // p.s_os
                add("all_to_all", "os", k * chunk_nbytes(cg, m), "sync", 1, u, codec=cg,
                    raw=r * k * m)
            else:
                add("reduce_scatter", "os", pad_os // p.s_p, "sync", 1, u)
        if rep > 1:
            if squeezed(cg, "rep", r):
                m = -(-(_padded(key, p.s_os) // p.s_os) // rep)
                nb = rep * chunk_nbytes(cg, m)
                add("all_to_all", "rep", nb, "sync", 1, u, codec=cg, raw=r * rep * m)
                add("all_gather", "rep", nb, "sync", 1, u, codec=cg, raw=r * rep * m)
            else:
                add("all_reduce", "rep", pad_os // p.s_os, "sync", 1, u)
        if p.s_os > p.s_p:
            dim = "g" if p.s_g > p.s_p else "os"
            if squeezed(cw, dim, e):
                k, m = p.s_os // p.s_p, _padded(key, p.s_os) // p.s_os
                add("all_gather", dim, k * chunk_nbytes(cw, m), "step", 1, u, codec=cw,
                    raw=e * k * m)
            else:
                add("all_gather", dim, ag_os // p.s_p, "step", 1, u)
    if clip and p.s_os > 1:
        add("all_reduce", "shard", 4, "step", 1, -1)
    return out


def predicted_expert_events(
    expert_plan: ResolvedPlan,
    ep: int,
    dp_ranks_per_node: int,
    unit_param_shapes: Sequence[Shapes],
    micro_batches: int,
    dtype_bytes: int,
    reshard_after_forward: Union[bool, int] = True,
    clip: bool = False,
    **kwargs,
) -> list[PlannedComm]:
    """The collectives of one step of the routed experts' units on their own mesh (the
    engine's Note on expert parallelism): ``predicted_events`` of the expert plan, resolved
    over the expert world (the data-parallel world / ``ep``), on each unit's EP-local
    shapes, named as the engine records them ("expert_p", ...); with ``clip``, the
    experts' part of the global norm summed over one expert copy ("expert_shard") and over
    the ep ranks ("ep": inside a node when ``ep`` divides ``dp_ranks_per_node``). The
    expert units are never kept unsharded after forward (no root among them). EP's own
    token all-to-alls are the model's, not the engine's: they are not included."""
    events = predicted_events(expert_plan, unit_param_shapes, micro_batches, dtype_bytes,
                              None, reshard_after_forward, clip, **kwargs)
    out = [PlannedComm(**{**e.as_dict(), "dim": EXPERT_DIM_PREFIX + e.dim}) for e in events]
    if clip and ep > 1:
        out.append(_ep_comm("all_reduce", ep, dp_ranks_per_node, 4, "step", 1))
    return out


def _ep_comm(op: str, ep: int, dp_ranks_per_node: int, nbytes: int, phase: str,
             count: int, dim: str = "ep") -> PlannedComm:
    """A collective over the "ep" group (or the "cp" group: ``dim``): ep consecutive
    data-parallel ranks, inside a node when ep divides the node's data-parallel ranks, else
    over ep / (those ranks) nodes."""
    nodes = 1 if dp_ranks_per_node % ep == 0 else ep // dp_ranks_per_node
    return PlannedComm(op, dim, ep, int(nbytes), nodes > 1, phase, count, -1, 1, nodes)


def predicted_ep_events(
    ep: int,
    dp_ranks_per_node: int,
    moe_layers: int,
    tokens: int,
    top_k: int,
    dim: int,
    n_experts: int,
    micro_batches: int,
    dtype_bytes: int,
    count_bytes: int = 8,
    recompute: bool = False,
) -> list[PlannedComm]:
    """Expert parallelism's own all-to-alls over "ep" in one step (M micro-batches), as
    torchtitan's ExpertParallel issues them per MoE layer and micro-batch (``tokens``: this
    rank's tokens per micro-batch; activations of ``dtype_bytes``):

      forward   the token counts per expert: n_experts * count_bytes (int64)   x1
                the routed tokens out and the expert outputs back:
                tokens * top_k * dim * e each                                   x2
      backward  the gradients of both, the same bytes                           x2

    Each rank sends exactly tokens * top_k rows (every token goes to its top_k experts);
    what it sends back is what it received, which follows the routing: the bytes above
    are that rank's under balanced routing, and the EP group's sum over its ranks in any
    case (tokens are neither made nor lost). ``recompute`` (full activation
    checkpointing): backward runs each block's forward again, its three all-to-alls
    with it. None with ep 1."""
    if ep <= 1 or moe_layers == 0:
        return []
    M, L = int(micro_batches), int(moe_layers)
    routed = int(tokens) * int(top_k) * int(dim) * int(dtype_bytes)
    counts = n_experts * count_bytes
    again = 1 if recompute else 0
    out = [
        _ep_comm("all_to_all", ep, dp_ranks_per_node, counts, "forward", M * L),
        _ep_comm("all_to_all", ep, dp_ranks_per_node, routed, "forward", 2 * M * L),
        _ep_comm("all_to_all", ep, dp_ranks_per_node, routed, "backward", (2 + 2 * again) * M * L),
    ]
    if recompute:
        out.append(_ep_comm("all_to_all", ep, dp_ranks_per_node, counts, "backward", M * L))
    return out


def predicted_cp_events(
    cp: int,
    dp_ranks_per_node: int,
    layers: int,
    samples: int,
    seq_len: int,
    kv_dim: int,
    micro_batches: int,
    dtype_bytes: int,
    recompute: bool = False,
) -> list[PlannedComm]:
    """Context parallelism's own K/V exchange over "cp" in one step (M micro-batches), as
    torchtitan's apply_cp_to_forward issues it for FlexAttention (torch's
    flex_cp_allgather) per attention layer and micro-batch (``samples``: sequences per
    rank and micro-batch, of ``seq_len`` tokens whole; ``kv_dim``: kv heads x head dim;
    activations of ``dtype_bytes``):

      forward   K and V all-gathered over the sequence: samples * seq_len * kv_dim * e
                each (the gathered buffer, the recorder's convention)                 x2
      backward  their gradients reduce-scattered, the same bytes                      x2

    ``recompute`` (full activation checkpointing): backward runs each block's forward
    again, its two all-gathers with it. None with cp 1."""
    if cp <= 1 or layers == 0:
        return []
    M, L = int(micro_batches), int(layers)
    kv = int(samples) * int(seq_len) * int(kv_dim) * int(dtype_bytes)
    out = [_ep_comm("all_gather", cp, dp_ranks_per_node, kv, "forward", 2 * M * L, "cp"),
           _ep_comm("reduce_scatter", cp, dp_ranks_per_node, kv, "backward", 2 * M * L, "cp")]
    if recompute:
        out.append(_ep_comm("all_gather", cp, dp_ranks_per_node, kv, "backward", 2 * M * L,
                            "cp"))
    return out


def _codecs(compression) -> tuple:
    if compression is None:
        return None, None
    if not isinstance(compression, Compression):
        raise TypeError(f"compression must be a Compression or None, got {compression!r}")
    return compression.grads, compression.weights


def error_feedback_elements(
    plan: ResolvedPlan, unit_param_shapes: Sequence[Shapes], compression: Compression | None,
    reduce_dtype_bytes: int,
) -> int:
    """Elements of the error-feedback residuals one rank keeps across steps (in the grad
    dtype): one per compressed gradient stage per unit, the size of that stage's input:
    the reduce-scatter over "g", padded(U,s_g)/s_p; over "os", padded(U,s_os)/s_p; the
    all-reduce over "rep", rep*ceil(n/rep), n = padded(U,s_os)/s_os (elements). The stages
    compressed are exactly those predicted_events compresses."""
    cg, _ = _codecs(compression)
    r = int(reduce_dtype_bytes)
    if not codec_applies(cg, r):
        return 0
    W = plan.world_size
    rep = W // plan.s_os
    inter = {dim: dim_group(plan, dim).inter_node for dim in ("g", "os", "rep")}
    total = 0
    for shapes in unit_param_shapes:
        key = tuple(tuple(int(d) for d in shape) for shape in shapes)
        if plan.s_g > plan.s_p and inter["g"]:
            total += _padded(key, plan.s_g) // plan.s_p
        if plan.s_g == plan.s_p < plan.s_os and inter["os"]:
            total += _padded(key, plan.s_os) // plan.s_p
        if rep > 1 and inter["rep"]:
            total += rep * -(-(_padded(key, plan.s_os) // plan.s_os) // rep)
    return total


def event_counter(events: Iterable[PlannedComm]) -> Counter:
    """Counter of key() -> occurrences, expanding counts (compare to recorded_counter)."""
    c: Counter = Counter()
    for ev in events:
        c[ev.key()] += ev.count
    return c


def recorded_counter(events: Iterable) -> Counter:
    """Counter of a recorder's CommEvents (anything with .key())."""
    return Counter(ev.key() for ev in events)


def bytes_by_locality(events: Iterable[PlannedComm]) -> dict[str, int]:
    """Buffer bytes per step, split intra/inter node (recorder convention)."""
    out = {"intra": 0, "inter": 0}
    for ev in events:
        out["inter" if ev.inter_node else "intra"] += ev.total_bytes
    return out


class TimeModel(Protocol):
    def time(self, op: str, nbytes: int, group: GroupShape) -> float: ...


# Ring algorithm traffic per rank as a multiple of the buffer bytes (nbytes convention of
# the recorder: AG output, RS input, AR tensor, BC tensor, all-to-all input), and latency
# steps (an all-to-all as n-1 exchanges, like a ring).
def ring_factor(op: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        # all_to_all: each rank keeps 1/n of its input buffer and sends the rest
        return (n - 1) / n
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def ring_steps(op: str, n: int) -> int:
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "all_reduce" else (n - 1)


@dataclass(frozen=True)
class AlphaBeta:
    """t = steps(op, n) * alpha + ring_factor(op, n) * nbytes / bandwidth.

    Defaults describe the paper's cluster (A800, NVLink ~150 GB/s bus bandwidth per GPU in a
    node; 4x HDR IB = 100 GB/s per node of 8, i.e. 12.5 GB/s per GPU across nodes). A group
    that spans nodes runs at the inter-node per-GPU share (every rank of a node communicates
    at once in the schedule, so they share the node's NICs).
    """

    intra_bw: float = 150e9
    inter_bw: float = 12.5e9
    intra_alpha: float = 5e-6
    inter_alpha: float = 15e-6

    def time(self, op: str, nbytes: int, group: GroupShape) -> float:
        n = group.size
        if n <= 1:
            return 0.0
        bw = self.inter_bw if group.inter_node else self.intra_bw
        alpha = self.inter_alpha if group.inter_node else self.intra_alpha
        return ring_steps(op, n) * alpha + ring_factor(op, n) * nbytes / bw


def step_comm_time(events: Iterable[PlannedComm], model: TimeModel) -> float:
    """Sum of count * t(op, nbytes, group): the paper's T_comm with no overlap."""
    return sum(ev.count * model.time(ev.op, ev.nbytes, ev.group) for ev in events)


def time_breakdown(events: Iterable[PlannedComm], model: TimeModel) -> dict[str, float]:
    """The paper's terms: T_p, T_g, T_os0 (sync), T_os1 (param all-gather after step)."""
    out = {"T_p": 0.0, "T_g": 0.0, "T_os0": 0.0, "T_os1": 0.0, "T_other": 0.0}
    for ev in events:
        t = ev.count * model.time(ev.op, ev.nbytes, ev.group)
        if ev.dim == "p":
            out["T_p"] += t
        elif ev.phase == "backward":
            out["T_g"] += t
        elif ev.phase == "sync":
            out["T_os0"] += t
        elif ev.phase == "step" and ev.op == "all_gather":
            out["T_os1"] += t
        else:
            out["T_other"] += t
    return out
