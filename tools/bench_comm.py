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

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from amsp_dtensor.observe.dist_calls import describe_call

# the entry points every other form forwards to (see the module docstring)
_WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")


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

    def add(self, op: str, ranks: tuple[int, ...], nbytes: int) -> None:
        if len(ranks) <= 1:
            return
        inter = len({r // self.ranks_per_node for r in ranks}) > 1
        with self._lock:
            self.events.append(Collective(op, len(ranks), nbytes, inter))

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
    for name in _WRAPPED:
        original = getattr(c10d, name)

        def wrapper(*args, __orig=original, **kwargs):
            if counter.active:
                counter.add(*describe_call(__orig, args, kwargs))
            return __orig(*args, **kwargs)

        wrapper.__wrapped__ = original
        setattr(c10d, name, wrapper)
        setattr(dist, name, wrapper)
    _installed = counter
    return counter
