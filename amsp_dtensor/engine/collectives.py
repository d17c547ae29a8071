"""Every collective the engine issues goes through here, so the recorder sees it.

Our own gradient and optimizer-state paths call ``Collectives``; FSDP2's parameter path
is observed through its custom-comm hooks (``set_custom_all_gather`` /
``set_custom_reduce_scatter``) with subclasses of its default implementations that only
add recording. All reductions are plain SUM: gloo rejects PREMUL_SUM/AVG-style ops, and
the engine applies the gradient divide factor once, on the fp32 master grads.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import compat
from .mesh import MeshInfo
from ..observe.recorder import CommEvent, Timer, active_recorders, emit


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingComm:
    """An issued async collective; ``wait()`` completes it and records it (see the Note
    on comm timing in observe/recorder.py)."""

    __slots__ = ("work", "event_args", "timer", "result", "recorders", "done_at")

    def __init__(self, work, event_args: dict | None, result: torch.Tensor):
        self.work = work
        self.event_args = event_args
        self.timer = Timer()
        self.result = result
        self.done_at: float | None = None
        # The event belongs to the recorders active at issue time, even if it completes
        # later (the post-step all-gather lands in the next forward).
        self.recorders = active_recorders()
        if work is not None and event_args is not None and result.device.type == "cpu":
            try:
                work.get_future().then(self._mark_done)
            except RuntimeError:  # "Work::getFuture not implemented" (gloo's reduce_scatter)
                pass

    def _mark_done(self, _future) -> None:
        self.done_at = time.perf_counter()

    def done(self) -> bool:
        """Whether ``wait()`` would return without blocking on the collective."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        start = end = time.perf_counter()
        if self.work is not None:
            self.work.wait()
            end = time.perf_counter()
            self.work = None
        if self.event_args is not None:
            # done before the wait began: completed at its stamp and nothing was exposed
            # (the wait's own overhead is not communication); else when the wait returned
            early = self.done_at is not None and self.done_at <= start
            done, blocked = (self.done_at, 0.0) if early else (end, end - start)
            event = CommEvent(seconds=done - self.timer.start, blocked_seconds=blocked,
                              **self.event_args)
            for recorder in self.recorders:
                recorder.add(event)
            self.event_args = None
        return self.result


class _RecordedWork(dist.Work):
    """FSDP2's async all-gather (explicit prefetch on CPU) as a Work whose ``wait()``
    records the collective, with the time FSDP2 was blocked in it."""

    def __init__(self, work, event_args: dict, result: torch.Tensor):
        super().__init__()
        self.pending = PendingComm(work, event_args, result)

    def wait(self, timeout=None) -> bool:
        self.pending.wait()
        return True

    def is_completed(self) -> bool:
        work = self.pending.work
        return work is None or work.is_completed()


class Collectives:
    """Collectives over named dims of one AMSP mesh, recorded as CommEvents."""

    def __init__(self, info: MeshInfo):
        self.info = info

    def _event_args(self, op: str, dim: str, nbytes: int, phase: str,
                    codec: str | None = None) -> dict | None:
        if not active_recorders():
            return None
        return dict(
            op=op,
            dim=dim,
            group_size=self.info.size(dim),
            nbytes=nbytes,
            inter_node=self.info.crosses_nodes(dim),
            phase=phase,
            codec=codec,
        )

    def _fsdp_event_args(self, op: str, group, nbytes: int, phase: str) -> dict | None:
        """FSDP's collectives run over "p", or, with reshard_after_forward=int (hpZ),
        the backward all-gather over a smaller secondary group inside it: "p_hpz"."""
        if not active_recorders():
            return None
        if group is self.info.group("p"):
            return self._event_args(op, "p", nbytes, phase)
        return dict(
            op=op,
            dim="p_hpz",
            group_size=dist.get_world_size(group),
            nbytes=nbytes,
            inter_node=self.info.group_crosses_nodes(group),
            phase=phase,
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, dim: str, phase: str,
                   codec: str | None = None):
        work = compat.all_gather_single(output, input, group=self.info.group(dim), async_op=True)
        args = self._event_args("all_gather", dim, _nbytes(output), phase, codec)
        return PendingComm(work, args, output)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, dim: str, phase: str):
        work = compat.reduce_scatter_single(
            output, input, op=dist.ReduceOp.SUM, group=self.info.group(dim), async_op=True
        )
        return PendingComm(
            work, self._event_args("reduce_scatter", dim, _nbytes(input), phase), output
        )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, dim: str, phase: str,
                   codec: str | None = None):
        """Row i of ``input`` (k rows) to rank i of the group; row j of ``output`` from
        rank j (compression.py's reduce-scatter)."""
        work = dist.all_to_all_single(output, input, group=self.info.group(dim), async_op=True)
        args = self._event_args("all_to_all", dim, _nbytes(input), phase, codec)
        return PendingComm(work, args, output)

    def all_reduce(self, tensor: torch.Tensor, dim: str, phase: str, op=dist.ReduceOp.SUM):
        work = dist.all_reduce(tensor, op=op, group=self.info.group(dim), async_op=True)
        return PendingComm(work, self._event_args("all_reduce", dim, _nbytes(tensor), phase), tensor)


def _fsdp_phase() -> str:
    # FSDP all-gathers in forward and (after resharding) again in backward; a graph task
    # is running only during backward.
    return "backward" if compat.in_backward() else "forward"


class RecordingAllGather(compat.fsdp_all_gather_base()):
    """FSDP2's default all-gather plus a CommEvent ("p", or "p_hpz" for hpZ)."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if not active_recorders():  # nothing records: FSDP2's own call, nothing around it
            return super().__call__(output_tensor, input_tensor, group, async_op)
        args = self.collectives._fsdp_event_args(
            "all_gather", group, _nbytes(output_tensor), _fsdp_phase()
        )
        return _recorded(args, output_tensor, async_op, super().__call__,
                         output_tensor, input_tensor, group, async_op)


class RecordingReduceScatter(compat.fsdp_reduce_scatter_base()):
    """FSDP2's default reduce-scatter plus a CommEvent over the "p" dim."""

    def __init__(self, collectives: Collectives):
        self.collectives = collectives

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if not active_recorders():
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        args = self.collectives._fsdp_event_args(
            "reduce_scatter", group, _nbytes(input_tensor), "backward"
        )
        return _recorded(args, output_tensor, async_op, super().__call__,
                         output_tensor, input_tensor, group, op, async_op)


def _recorded(args, output, async_op, call, *call_args):
    """Run one of FSDP2's collectives; a synchronous one is recorded as fully blocking,
    an async one when FSDP2 waits for it."""
    timer = Timer()
    work = call(*call_args)
    if args is None:
        return work
    if async_op and work is not None:
        return _RecordedWork(work, args, output)
    elapsed = timer.elapsed()
    emit(CommEvent(seconds=elapsed, blocked_seconds=elapsed, **args))
    return work
