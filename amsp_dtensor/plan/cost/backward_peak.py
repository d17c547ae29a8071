"""Gradient bytes one rank holds at every unit's gradient hook during backward.

The prediction of the census ``amsp.track_backward_memory`` takes (observe/
backward_memory.py): the distinct gradient buffers alive at the end of each unit's
gradient hook, derived from the gradient path's documented design (grad.py,
docs/layouts.md) and the layouts' slot arithmetic, without using the engine's classes.

Sizes, per unit u, in elements (each tensor: d0 rows of ``cols`` elements; k_g = s_g/s_p
ranks split a P shard into G shards, k_os = s_os/s_p into OS shards):

    cap    = ceil(d0 / s_p)                P slot rows of a tensor (d0 when s_p = 1;
                                           FSDP2's padded shard, the same on every rank)
    P_u    = sum cap * cols                the hook input: this rank's P-shard grads
    G_u    = sum ceil(cap / k_g) * cols    one G shard (slot rows; = P_u when k_g = 1)
    OS_u   = sum ceil(cap / k_os) * cols   one OS shard (slot rows; = G_u unless
                                           s_g = s_p < s_os)

Every buffer is slot-sized, so although a rank's real rows depend on its place in the
mesh (the last chunks of a tensor may be shorter or empty), the bytes do not: the
prediction is the same for every rank (``rank`` is checked, not used further).

Timeline. Units fire in the order given (``unit_param_shapes``), once per micro-batch;
micro-batches 0..M-2 run under no_sync, micro-batch M-1 syncs. At the end of unit i's
hook in micro-batch m the rank holds (all in ``grad_bytes`` per element unless said):

1. H_i = P_u: the hook input (FSDP2's reduce-scatter output, or the flatten of the unit's
   grads when s_p = 1). FSDP2 views it as the unit's ``.grad`` only after the hook
   returns, and drops the previous unit's views at the start of the next hook, so no
   FSDP2 ``.grad`` is alive at the sample.
2. Unit i's own gradient-path buffers:
   - k_g > 1: the packed copy of the P-shard grads sent to the reduce-scatter over "g",
     k_g * G_u (P_u plus slot padding), and its output G_u, both in flight; plus the G
     accumulated over the earlier micro-batches, G_u, when m > 0.
   - k_g = 1, m = 0: nothing more (the hook input is taken as G without a copy).
   - k_g = 1, 0 < m < M-1: the accumulated G, P_u (the hook input is added into it).
   - k_g = 1, m = M-1 > 0: the accumulated G, P_u, is synced: if k_os > 1 it is packed
     for the reduce-scatter over "os" (k_os * OS_u in flight, output OS_u in flight) and
     the accumulated buffer is freed; else it stays, P_u (all-reduce over "rep" in flight
     when world > s_os, else stored as the synced G).
   - k_g = 1, m = M-1 = 0 (one micro-batch): as above, but the accumulated G is the hook
     input itself: k_os * OS_u + OS_u when k_os > 1, nothing more otherwise.
3. Each unit j fired earlier in this micro-batch (its first-stage reduce-scatter, over "g"
   or "os", was completed when the next unit's hook ran; the "rep" all-reduces stay in
   flight until the end of backward, their buffer counted once):
   G_j (accumulating) when m < M-1, the synced G, OS_j, when m = M-1.
4. Each unit j that fires later in this micro-batch: G_j accumulated over the earlier
   micro-batches when m > 0, nothing when m = 0.
5. With s_p = 1 only: the ``.grad`` (``param_bytes`` per element, whole tensors) of the
   params listed in ``early_grads[i]``: grads autograd has already produced for a unit
   whose hook has not fired yet (a unit is flattened once its last grad arrives). With
   s_p > 1 those grads live in FSDP2's unsharded params, outside the census.

P (``param_bytes`` per element): sum P_u over the units (FSDP2's padded shard, or the whole
params when s_p = 1), constant during backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sharding_plan import ResolvedPlan
from .padding import dim0_cols

__all__ = ["UnitSizes", "unit_sizes", "synced_grad_elements", "PredictedSample",
           "BackwardPeak", "predict_backward_grad_bytes"]


@dataclass(frozen=True)
class UnitSizes:
    """Elements of one unit's buffers on one rank (module docstring)."""

    p: int
    g: int
    os: int
    g_packed: int  # k_g * g: the send buffer of the reduce-scatter over "g"
    os_packed: int  # k_os * os: the send buffer of the reduce-scatter over "os"


def unit_sizes(shapes, plan: ResolvedPlan) -> UnitSizes:
    k_g, k_os = plan.s_g // plan.s_p, plan.s_os // plan.s_p
    p = g = os = 0
    for shape in shapes:
        d0, cols = dim0_cols(shape)
        cap = -(-d0 // plan.s_p)
        p += cap * cols
        g += -(-cap // k_g) * cols
        os += -(-cap // k_os) * cols
    return UnitSizes(p, g, os, k_g * g, k_os * os)


def synced_grad_elements(size: UnitSizes, plan: ResolvedPlan) -> int:
    """Elements of a unit's G once synced: reduced to the OS shard when the sync
    reduce-scatters over "os" (s_g = s_p < s_os), else the G shard itself."""
    k_g, k_os = plan.s_g // plan.s_p, plan.s_os // plan.s_p
    return size.os if (k_g == 1 and k_os > 1) else size.g


@dataclass(frozen=True)
class PredictedSample:
    unit_index: int  # position in the firing order
    micro: int
    sync: bool
    bytes: int


@dataclass(frozen=True)
class BackwardPeak:
    samples: list[PredictedSample]  # one per unit per micro-batch, in firing order
    param_bytes: int  # P on this rank

    @property
    def peak_grad_bytes(self) -> int:
        return max((s.bytes for s in self.samples), default=0)

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.peak_grad_bytes


def predict_backward_grad_bytes(
    unit_param_shapes, plan: ResolvedPlan, micro_batches: int, param_bytes: int,
    grad_bytes: int, rank: int = 0, early_grads=None,
) -> BackwardPeak:
    """The census at the end of every unit's gradient hook (module docstring).

    unit_param_shapes: per unit, in the order the units' gradient hooks fire, the global
    shapes of the params it owns. micro_batches: M (the first M-1 under no_sync).
    param_bytes / grad_bytes: bytes per element of P and of G (the reduce dtype).
    early_grads: per firing, shapes of params whose grads exist before their own unit's
    hook (counted with s_p = 1 only); None: none.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank={rank} outside a world of {plan.world_size}")
    n = len(unit_param_shapes)
    if early_grads is not None and len(early_grads) != n:
        raise ValueError(f"early_grads has {len(early_grads)} entries for {n} units")
    sizes = [unit_sizes(shapes, plan) for shapes in unit_param_shapes]
    k_g, k_os = plan.s_g // plan.s_p, plan.s_os // plan.s_p
    synced = [synced_grad_elements(s, plan) for s in sizes]
    samples = []
    for m in range(micro_batches):
        sync = m == micro_batches - 1
        for i, own in enumerate(sizes):
            held = own.p  # 1. hook input
            if k_g > 1:  # 2.
                held += own.g_packed + own.g + (own.g if m > 0 else 0)
            elif sync and k_os > 1:
                held += own.os_packed + own.os
            elif m > 0:
                held += own.p
            for j, other in enumerate(sizes):
                if j < i:  # 3.
                    held += synced[j] if sync else other.g
                elif j > i and m > 0:  # 4.
                    held += other.g
            total = grad_bytes * held
            if plan.s_p == 1 and early_grads is not None:  # 5.
                total += param_bytes * sum(
                    dim0_cols(shape)[0] * dim0_cols(shape)[1] for shape in early_grads[i])
            samples.append(PredictedSample(i, m, sync, total))
    return BackwardPeak(samples, param_bytes * sum(s.p for s in sizes))
