"""Recorder of collectives issued by the engine (ours and FSDP2's, via its comm hooks).

Byte convention (also used by the cost model): ``nbytes`` is the size of the whole
collective buffer: the all-gather OUTPUT, the reduce-scatter and all-to-all INPUT, the
all-reduce or broadcast tensor. Per-rank traffic of a ring is ``nbytes * (n - 1) / n`` for AG/RS and
twice that for AR; the cost model derives it, the recorder records the buffer only.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from .. import compat

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


@dataclass(frozen=True)
class CommEvent:
    op: str  # one of OPS
    dim: str  # mesh dim: "p", "g", "os", "rep", "shard" (p x g x os), "p_hpz" (hpZ group)
    group_size: int
    nbytes: int  # see module docstring
    inter_node: bool  # True when the group's ranks are on more than one node
    phase: str  # "forward", "backward", "sync" (last-backward grad sync), "step", "other"
    seconds: float = 0.0  # issue -> completion (see the Note below)
    blocked_seconds: float = 0.0  # time the issuing thread spent waiting for it
    codec: str | None = None  # amsp.set_compression's codec the buffer was sent in, if any

    def key(self) -> tuple:
        """What a schedule comparison looks at (no timing)."""
        return (self.op, self.dim, self.group_size, self.nbytes, self.inter_node, self.phase)


# [Note: comm timing]
# ``seconds`` runs from issue to completion, where completion is the first moment the
# engine saw the collective done: ``PendingComm.done()`` (the step polls it to pick the
# units whose gradients have landed) or the start of its wait, if it had completed by
# then, else the time its wait returned. It is an upper bound: a collective that finished
# while compute ran is charged until the engine next looked. (No callback on the
# collective's future stamps it: that would run Python on the backend's own thread.)
# ``blocked_seconds`` is the time the issuing thread spent inside the wait: the part of
# the collective compute did not hide. Summed over a step, that is the exposed
# communication seen from this rank (TensorBoard's comm/exposed_seconds).


def overlap_summary(events) -> dict[str, float]:
    """{"comm_seconds", "exposed_seconds", "hidden_fraction"} of some CommEvents:
    hidden = 1 - exposed / comm (NaN when nothing was timed)."""
    comm = sum(e.seconds for e in events)
    exposed = sum(e.blocked_seconds for e in events)
    hidden = 1.0 - min(exposed, comm) / comm if comm > 0 else float("nan")
    return {"comm_seconds": comm, "exposed_seconds": exposed, "hidden_fraction": hidden}


class CommRecorder:
    """Collects CommEvents while active. Use via ``record_comms()``."""

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self._lock = threading.Lock()

    def add(self, event: CommEvent) -> None:
        with self._lock:
            self.events.append(event)

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def bytes_by_locality(self) -> dict[str, int]:
        out = {"intra": 0, "inter": 0}
        for e in self.events:
            out["inter" if e.inter_node else "intra"] += e.nbytes
        return out


_active: list[CommRecorder] = []


def active_recorders() -> list[CommRecorder]:
    return list(_active)


def emit(event: CommEvent) -> None:
    for recorder in _active:
        recorder.add(event)


@contextlib.contextmanager
def record_comms(recorder: CommRecorder | None = None,
                 model_collectives: bool = False) -> Iterator[CommRecorder]:
    """``with record_comms() as rec: ...`` records every collective the engine issues;
    with ``model_collectives=True`` also the model's own all-to-alls over a watched group
    (the Note on the model's collectives: expert parallelism's token dispatch)."""
    rec = recorder or CommRecorder()
    _active.append(rec)
    try:
        watch = model_collectives and _watched
        with (_ModelCollectives(rec) if watch else contextlib.nullcontext()):
            yield rec
    finally:
        _active.remove(rec)


# [Note: the model's own collectives]
# Expert parallelism's token all-to-alls and context parallelism's K/V exchange belong to
# the model (torchtitan's ExpertParallel and apply_cp_to_forward, or testing/tiny_moe.py
# and testing/tiny_llama.py), not to the engine: functional collectives (all_to_all_single
# for the token counts, all_to_all_single_autograd for the tokens and, in backward, their
# gradients) over the expert mesh's "ep" group, and torch's flex_cp_allgather (K and V
# all-gathered over the sequence; in backward their gradients reduce-scattered) over the
# "cp" group. mesh.py watches those groups when it builds them; while something records,
# a dispatch mode sees every such op (compat.model_collective_ops) and records those over
# a watched group as CommEvents of that dim ("ep", "cp"), with the byte convention above
# and phase "forward" or "backward" (activation checkpointing's recomputation counts as
# backward, as the bytes it moves do). They are untimed: the model waits for them, not
# the engine.
# Opt-in (``record_comms(model_collectives=True)``: the tests, the simulation): a dispatch
# mode runs Python at every op of the step, and torch.compile compiles no frame under one
# ("found no compiled frames ... non-infra torch dispatch mode present"), so the
# recording a training job does every step for its metrics never enters it; nor does
# any recording while no group is watched.
_watched: dict[str, tuple[str, int, bool]] = {}


def watch_group(owner, group, dim: str, size: int, inter_node: bool) -> None:
    """Record the model's functional all-to-alls over ``group`` as ``dim`` while
    ``owner`` (the mesh the group belongs to) lives. torch reuses a group's name once
    the process groups are destroyed, so a later job's watch may carry the name of an
    earlier one: the earlier owner's finalizer removes only its own entry."""
    name = group.group_name
    entry = (dim, size, inter_node)
    _watched[name] = entry
    weakref.finalize(owner, _unwatch, name, entry)


def _unwatch(name: str, entry: tuple) -> None:
    if _watched.get(name) is entry:
        del _watched[name]


class _ModelCollectives(compat.torch_dispatch_mode_base()):
    def __init__(self, recorder: CommRecorder):
        super().__init__()
        self.recorder = recorder
        self.ops = compat.model_collective_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        how = self.ops.get(func)
        if how is not None:
            op, buffer, tensors, at, keyword = how
            name = (kwargs or {}).get(keyword, args[at] if len(args) > at else None)
            seen = _watched.get(name)
            if seen is not None:
                dim, size, inter = seen
                phase = "backward" if compat.in_backward() else "forward"
                scale = size if buffer == "output" else 1  # the byte convention above
                for index in tensors:
                    t = args[index]
                    self.recorder.add(CommEvent(op, dim, size, t.numel() * t.element_size()
                                                * scale, inter, phase))
        return func(*args, **(kwargs or {}))


class Timer:
    """Wall time from issue to completion; used by the collectives wrappers."""

    __slots__ = ("start",)

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
