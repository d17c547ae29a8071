"""Count the bytes of every torch.distributed collective, for the baselines.

The baselines are torch's own code (DDP, ZeroRedundancyOptimizer, FSDP2), which the AMSP
recorder does not see, so we wrap the Python entry points they go through:
``all_gather_single`` / ``reduce_scatter_single`` (FSDP2, and the deprecated
``*_into_tensor`` / ``*_tensor`` forms that forward to them), ``all_reduce`` (FSDP2's HSDP
all-reduce, DDP via the Python ``allreduce_hook`` comm hook registered by bench_systems)
and ``broadcast`` (ZeroRedundancyOptimizer). Both the ``torch.distributed`` attribute and
the ``distributed_c10d`` module global are replaced, so internal forwards are counted once.

Byte convention = the AMSP recorder's (amsp_dtensor/observe/recorder.py): the whole
collective buffer (AG output, RS input, AR/broadcast tensor). A group is inter-node when
its ranks lie on more than one node (node = global rank // ranks per node).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# name -> (op label, index of the buffer argument, keyword of the buffer)
_WRAPPED = {
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
}


@dataclass(frozen=True)
class Collective:
    op: str
    group_size: int
    nbytes: int
    inter_node: bool

    def key(self) -> tuple:
        return (self.op, self.group_size, self.nbytes, self.inter_node)


class CommCounter:
    """Collectives issued while ``active`` (one thread-safe list)."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self.events: list[Collective] = []
        self.active = False
        self._lock = threading.Lock()
        self._groups: dict[int, tuple[int, bool]] = {}

    def _group(self, group) -> tuple[int, bool]:
        key = id(group)
        if key not in self._groups:
            pg = group if group is not None else c10d._get_default_group()
            ranks = dist.get_process_group_ranks(pg)
            nodes = {r // self.ranks_per_node for r in ranks}
            self._groups[key] = (len(ranks), len(nodes) > 1)
        return self._groups[key]

    def add(self, op: str, tensor: torch.Tensor, group) -> None:
        size, inter = self._group(group)
        if size <= 1:
            return
        ev = Collective(op, size, tensor.numel() * tensor.element_size(), inter)
        with self._lock:
            self.events.append(ev)

    def bytes_by_locality(self) -> dict[str, int]:
        out = {"intra": 0, "inter": 0}
        for e in self.events:
            out["inter" if e.inter_node else "intra"] += e.nbytes
        return out

    def counter(self) -> Counter:
        return Counter(e.key() for e in self.events)

    @contextlib.contextmanager
    def recording(self):
        self.events = []
        self.active = True
        try:
            yield self
        finally:
            self.active = False


_installed: CommCounter | None = None


def install(ranks_per_node: int) -> CommCounter:
    """Wrap the collectives once per process; returns the counter they report to."""
    global _installed
    if _installed is not None:
        return _installed
    counter = CommCounter(ranks_per_node)
    for name, (op, pos, kw) in _WRAPPED.items():
        original = getattr(c10d, name)

        def wrapper(*args, __orig=original, __op=op, __pos=pos, __kw=kw, **kwargs):
            if counter.active:
                tensor = kwargs[__kw] if __kw in kwargs else args[__pos]
                counter.add(__op, tensor, kwargs.get("group", _positional_group(__op, args)))
            return __orig(*args, **kwargs)

        wrapper.__wrapped__ = original
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)
    _installed = counter
    return counter


def _positional_group(op: str, args: tuple):
    # signatures: all_gather_single(out, in, group), reduce_scatter_single(out, in, op, group),
    # all_reduce(tensor, op, group), broadcast(tensor, src, group)
    index = {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 2, "broadcast": 2}[op]
    return args[index] if len(args) > index else None
