"""A time model per collective that follows NCCL's own tuning model.

NCCL picks, for every call, the (algorithm, protocol) pair with the smallest predicted
time ``latency + bytes / bandwidth`` from a table it fills at communicator creation
(``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in NVIDIA/nccl ``src/graph/tuning.cc``).
This module evaluates the same formulas for one process group of the plan, given the
group's shape (ranks, nodes spanned, ranks per node) and the cluster's hardware:

- algorithms: ring for every collective; tree for all-reduce (its latency grows with
  log2 of the node count, only the inter-node hops pay the network latency); PAT for
  all-gather / reduce-scatter when the group has one rank per node (NCCL enables PAT only
  then). Protocols LL, LL128, Simple, each with NCCL's bandwidth factor and cap;
- latency: NCCL's base latency per (algorithm, protocol) plus its per-hop hardware latency,
  NVLink for the hops inside a node and the network for the hops between nodes; a ring
  over nodes pays the network latency on nNodes-1 of its steps (2(nNodes-1) for
  all-reduce) and the NVLink latency (at least the per-step network post overhead) on
  the others;
- bandwidth: a group inside one node runs at the GPU's NVLink bus bandwidth; a group
  that spans nodes is limited by the node's NICs. NCCL's own model sees one communicator
  alone, which can use min(ranks per node, NICs) NICs. In a training step every group of
  a mesh dim runs its collective at the same time, so the R/s0 groups of a node share
  its NICs: a group with s0 ranks per node gets s0/R of the node's NIC bandwidth. This
  sharing (``share_nics=True``) is the one deliberate difference from NCCL's model;
  ``share_nics=False`` gives NCCL's per-communicator view.

Constants are the values in recent tuning.cc (the version with PAT): latencies in
microseconds, bandwidths in GB/s. Where a constant depends on the GPU generation or
the CPU vendor, the defaults take Ampere (A100/A800, the paper's cluster) and x86 Intel.
What is left out: CollNet and NVLS (need SHARP / NVSwitch multicast, off on the paper's
cluster), the nNodes <= 2 case where NCCL reads the graph's intra bandwidth (we use the
NIC limit there too), and NCCL's per-size channel and thread tuning.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from .comm import GroupShape, ring_factor

__all__ = ["NcclModel", "Choice", "wire_bytes", "node_nic_bytes", "PAPER_CLUSTER"]

LL, LL128, SIMPLE = "LL", "LL128", "Simple"
PROTOCOLS = (LL, LL128, SIMPLE)
RING, TREE, PAT = "ring", "tree", "pat"

# tuning.cc, baseLatencies (us), per algorithm: (LL, LL128, Simple)
BASE_LAT = {TREE: (6.8, 14.0, 8.4), RING: (6.6, 14.0, 8.4), PAT: (8.0, 8.0, 8.0)}
# tuning.cc, hwLatencies (us): per hardware (NVLink, network), per algorithm
HW_LAT_NVLINK = {TREE: (0.6, 1.25, 4.0), RING: (0.6, 1.9, 3.4), PAT: (0.0, 0.0, 4.0)}
HW_LAT_NET = {TREE: (5.0, 8.5, 14.0), RING: (2.7, 4.0, 14.0), PAT: (0.0, 0.0, 14.0)}
# tuning.cc, Ampere rows; index by nodes: 1, 2, >2
LL_MAX_BW_SINGLE_NODE = 87.7          # llMaxBws[Ampere][N1] (one node: GPU type decides)
LL_MAX_BW_INTEL = (39.0, 39.0, 20.4)  # llMaxBws[Intel][N1/N2/N4] (several nodes: CPU decides)
PER_CH_MAX_RING_LL128 = 20.0          # perChMaxRingLL128Bws[Ampere]
PER_CH_MAX_TREE_LL128 = 20.0          # perChMaxTreeLL128Bws[Ampere]
PER_CH_MAX_TREE = (24.0, 23.6, 17.8)  # perChMaxTreeBws[Ampere][N1/N2/N4]
NET_OVERHEAD_US = 1.0                 # getNetOverhead(): x86 Intel; x3 for Simple
# ncclTopoGetAlgoTime: tree bandwidth correction by log2(bytes/64), sizes 64 B .. 256 MB
TREE_CORRECTION = {
    LL: (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
         1.0, 1.0, 1.0),
    LL128: (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
            .9, .9, 1.0, 1.0),
    SIMPLE: (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
             .8, .9, .9),
}
RING_PLATEAU = 1.4  # all-reduce ring/Simple across nodes, sm80+: latency x 1.4


def _log2i(n: float) -> int:
    n = int(n)
    return n.bit_length() - 1 if n > 0 else 0


@dataclass(frozen=True)
class Choice:
    """NCCL's pick for one call: algorithm, protocol, latency (s), bandwidth, time (s)."""

    algorithm: str
    protocol: str
    latency: float  # seconds
    bus_bw: float  # bytes/s, NCCL's "bus bandwidth" (algorithm bandwidth x ring factor)
    alg_bw: float  # bytes/s: nbytes / (time - latency)
    seconds: float


@dataclass(frozen=True)
class NcclModel:
    """t(op, nbytes, group) from NCCL's tuning formulas (module docstring).

    nvlink_bw: bus bandwidth of one GPU inside a node (bytes/s; NCCL's graph bwIntra x
      channels); nic_bw: one NIC (bytes/s); nics_per_node, gpus_per_node: the node;
    channels: NCCL channels per communicator (only the per-channel caps use it);
    share_nics: give a node-spanning group its s0/R share of the node's NICs (True) or
    NCCL's view of one communicator alone (False).
    """

    nvlink_bw: float = 150e9
    nic_bw: float = 25e9
    nics_per_node: int = 4
    gpus_per_node: int = 8
    channels: int = 16
    share_nics: bool = True

    def __post_init__(self) -> None:
        for name in ("nvlink_bw", "nic_bw"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
        for name in ("nics_per_node", "gpus_per_node", "channels"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    # -- the group's raw bandwidth --------------------------------------------------
    def inter_bw(self, group: GroupShape) -> float:
        """NIC bandwidth (bytes/s) one group spanning nodes can use."""
        s0 = group.ranks_per_node
        alone = min(s0, self.nics_per_node) * self.nic_bw
        if not self.share_nics:
            return alone
        shared = self.nics_per_node * self.nic_bw * s0 / self.gpus_per_node
        return min(alone, shared)

    def base_bw(self, group: GroupShape) -> float:
        """NCCL's nChannels x bw of the group's graph, bytes/s."""
        if group.nodes <= 1:
            return self.nvlink_bw
        return min(self.nvlink_bw, self.inter_bw(group))

    # -- NCCL's table for one group ---------------------------------------------------
    def candidates(self, op: str, nbytes: int, group: GroupShape) -> list[Choice]:
        n, nodes = group.size, group.nodes
        ppn = n / nodes
        idx = 0 if nodes == 1 else (1 if nodes == 2 else 2)
        ll_max = LL_MAX_BW_SINGLE_NODE if nodes == 1 else LL_MAX_BW_INTEL[idx]
        ch = self.channels
        base = self.base_bw(group) / 1e9  # GB/s
        if op == "all_reduce":
            nsteps, algos = 2 * (n - 1), (TREE, RING)
        elif op in ("all_gather", "reduce_scatter"):
            nsteps = n - 1
            algos = (RING, PAT) if (ppn == 1 and nodes > 1) else (RING,)
        elif op == "broadcast":
            nsteps, algos = n, (RING,)
        elif op == "all_to_all":
            return [self._all_to_all(nbytes, group)]
        else:
            raise ValueError(f"unknown op {op!r}")
        out = []
        for a in algos:
            for pi, p in enumerate(PROTOCOLS):
                if a == PAT and p != SIMPLE:
                    continue
                bus = base
                if a == RING and p == LL:
                    bus = min(ll_max, bus * 0.5)
                if a == RING and p == LL128:
                    bus = min(bus * 0.92, ch * PER_CH_MAX_RING_LL128)
                if a == TREE:
                    bus = min(bus * 0.92, ch * PER_CH_MAX_TREE[idx])
                if a == TREE and p == LL:
                    bus = min(bus / 3.8, ll_max)
                if a == TREE and p == LL128:
                    bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                              ch * PER_CH_MAX_TREE_LL128)
                if a == PAT:
                    bus *= 0.75
                # bus -> algorithm bandwidth (PAT's all-gather/reduce-scatter: none)
                if a == RING:
                    alg = bus * n / nsteps
                elif a == TREE:
                    alg = bus * 0.5
                else:
                    alg = bus
                lat = BASE_LAT[a][pi]
                intra = HW_LAT_NVLINK[a][pi]
                inter = HW_LAT_NET[TREE if ppn == 1 else a][pi]
                if a == RING:
                    if op == "broadcast":
                        lat += (HW_LAT_NET if nodes > 1 else HW_LAT_NVLINK)[a][pi]
                    else:
                        if nodes > 1:
                            intra = max(intra, NET_OVERHEAD_US * (3 if p == SIMPLE else 1))
                        n_inter = 0 if nodes == 1 else (
                            2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
                        lat += (nsteps - n_inter) * intra + n_inter * inter
                elif a == TREE:
                    lat += 2 * ((n // nodes - 1) * intra + _log2i(nodes) * inter)
                else:  # PAT
                    lat += _log2i(nodes) * (inter / 3.5) + n * 2.8
                # ncclTopoGetAlgoTime refinements
                log_size = _log2i(nbytes >> 6)
                if a == TREE and log_size < len(TREE_CORRECTION[p]):
                    alg *= TREE_CORRECTION[p][log_size]
                if (a == RING and p == SIMPLE and nodes > 1 and op == "all_reduce"
                        and nbytes / (ch * n) >= 64):
                    lat *= RING_PLATEAU
                t_us = lat + nbytes / (1000.0 * alg)
                rf = ring_factor(op, n) if op != "broadcast" else 1.0
                out.append(Choice(a, p, lat * 1e-6, alg * 1e9 * rf, alg * 1e9, t_us * 1e-6))
        return out

    def _all_to_all(self, nbytes: int, group: GroupShape) -> Choice:
        """NCCL runs an all-to-all as grouped point-to-point sends (no algorithm or
        protocol table): every rank sends (n-1)/n of its input buffer, 1/n to each peer.
        Modelled as ring Simple's latency over n-1 steps (a conservative bound: the sends
        are issued together) and two concurrent transfers: (s0-1)/n of the buffer over
        NVLink and (n-s0)/n through the NICs. Unlike a ring reduce-scatter, nothing is
        reduced inside the node before it leaves, so the group's s0 ranks on a node all
        send their own off-node share through the group's NIC share: each rank gets
        1/s0 of it."""
        n, nodes = group.size, group.nodes
        s0 = max(1, n // nodes)
        pi = PROTOCOLS.index(SIMPLE)
        intra_lat = HW_LAT_NVLINK[RING][pi]
        if nodes > 1:
            intra_lat = max(intra_lat, NET_OVERHEAD_US * 3)
        n_inter = nodes - 1 if nodes > 1 else 0
        lat = (BASE_LAT[RING][pi] + (n - 1 - n_inter) * intra_lat
               + n_inter * HW_LAT_NET[RING][pi]) * 1e-6
        t_intra = (s0 - 1) / n * nbytes / self.nvlink_bw
        t_inter = 0.0
        if nodes > 1:
            per_rank = min(self.nvlink_bw, self.inter_bw(group) / s0)
            t_inter = (n - s0) / n * nbytes / per_rank
        transfer = max(t_intra, t_inter)
        alg = nbytes / transfer if transfer > 0 else float("inf")
        return Choice("p2p", SIMPLE, lat, alg * ring_factor("all_to_all", n), alg,
                      lat + transfer)

    def choose(self, op: str, nbytes: int, group: GroupShape) -> Choice | None:
        if group.size <= 1 or nbytes <= 0:
            return None
        return _fastest(self, op, int(nbytes), group)

    def time(self, op: str, nbytes: int, group: GroupShape) -> float:
        c = self.choose(op, nbytes, group)
        return 0.0 if c is None else c.seconds

    def alone(self) -> "NcclModel":
        """The same cluster seen as NCCL's tuning model sees one communicator."""
        return replace(self, share_nics=False)

    def describe(self) -> str:
        return (f"NCCL tuning model, NVLink {self.nvlink_bw / 1e9:g} GB/s/GPU, "
                f"{self.nics_per_node}x{self.nic_bw / 1e9:g} GB/s NICs per "
                f"{self.gpus_per_node} GPUs")


@functools.lru_cache(maxsize=1 << 16)
def _fastest(model: NcclModel, op: str, nbytes: int, group: GroupShape) -> Choice:
    """NCCL's pick for one call. The planner asks the same few (op, size, group) questions
    hundreds of thousands of times per search (every layer of every candidate plan), so
    the answers are kept: the model and group are frozen dataclasses, Choice immutable."""
    return min(model.candidates(op, nbytes, group), key=lambda c: c.seconds)


# The paper's cluster: A800 (NVLink ~150 GB/s bus bandwidth measured by nccl-tests on 8
# GPUs), 8 per node, 4x HDR InfiniBand (200 Gb/s = 25 GB/s each).
PAPER_CLUSTER = NcclModel()


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for one call (bus bytes: ring factor x buffer bytes)."""
    if group_size <= 1:
        return 0.0
    if op == "broadcast":
        return float(nbytes)
    return ring_factor(op, group_size) * nbytes


def node_nic_bytes(op: str, nbytes: int, group: GroupShape, ranks_per_node: int) -> float:
    """Bytes leaving one node through its NICs for one call of every group of the dim.

    Each of the node's R/s0 groups must move to the other nodes what they lack:
    (s1-1)/s1 of the buffer for AG/RS (the minimum, which the ring reaches), twice that
    for an all-reduce; an all-to-all reduces nothing on the way, so each of the group's
    s0 ranks on the node sends its own (s1-1)/s1 of its buffer: s0 times that."""
    if group.nodes <= 1:
        return 0.0
    f = {"all_reduce": 2.0, "all_to_all": float(group.ranks_per_node)}.get(op, 1.0)
    groups_per_node = ranks_per_node / group.ranks_per_node
    return groups_per_node * f * (group.nodes - 1) / group.nodes * nbytes


# Group shapes of the comparison in docs/planner.md: (ranks, ranks per node, nodes).
COMPARISON_SHAPES = ((8, 8, 1), (128, 1, 128), (64, 8, 8), (128, 8, 16))
COMPARISON_SIZES = (4, 1 << 16, 1 << 20, 1 << 24, 1 << 28)


def comparison_table(model: NcclModel | None = None, ops=("all_reduce", "all_gather")) -> str:
    """Markdown: per group shape, op and size, this model's pick next to NCCL's own model
    of the same communicator alone (share_nics=False)."""
    model = model or NcclModel()
    ref = model.alone()
    lines = ["| group | op | bytes | model: algo/proto | latency us | busbw GB/s | time us "
             "| NCCL alone: algo/proto | latency us | busbw GB/s | time us |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, s0, nodes in COMPARISON_SHAPES:
        g = GroupShape(n, 1 if nodes == 1 else s0 if s0 > 1 else model.gpus_per_node, s0,
                       nodes)
        name = f"{nodes} node x {s0}" if nodes == 1 else f"{nodes} nodes x {s0}"
        for op in ops:
            for nb in COMPARISON_SIZES:
                a, b = model.choose(op, nb, g), ref.choose(op, nb, g)
                lines.append(
                    f"| {name} | {op} | {nb:,} | {a.algorithm}/{a.protocol} | "
                    f"{a.latency * 1e6:.1f} | {a.bus_bw / 1e9:.1f} | {a.seconds * 1e6:.1f} | "
                    f"{b.algorithm}/{b.protocol} | {b.latency * 1e6:.1f} | "
                    f"{b.bus_bw / 1e9:.1f} | {b.seconds * 1e6:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m amsp_dtensor.plan.cost.nccl: the table in docs/planner.md
    print(comparison_table())
