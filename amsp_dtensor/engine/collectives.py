"""Every collective the engine issues goes through here, so the recorder sees it, and
every one comes back as a ``PendingComm`` that owns the buffers it reads and writes.

Our own gradient and optimizer-state paths call ``Collectives``; FSDP2's parameter path
is observed through its custom-comm hooks (``set_custom_all_gather`` /
``set_custom_reduce_scatter``) with subclasses of its default implementations that only
add recording. All reductions are plain SUM: gloo rejects PREMUL_SUM/AVG-style ops, and
the engine applies the gradient divide factor once, on the fp32 master grads.

[Note: buffers in flight]
A collective issued with ``async_op=True`` reads its input and writes its output on the
backend's own threads (gloo) or streams (NCCL) until it is waited for. Two rules make
that safe, and this module is where both are kept:

1. Ownership. Every tensor handed to an asynchronous collective is referenced by the
   ``PendingComm`` that ``wait()`` completes, until that wait: its ``input`` (what the
   caller handed in), its ``result`` (what it writes) and ``held`` (intermediate buffers
   of a compressed form: the encoded chunks). Nothing relies on c10d's ``Work`` to keep a
   buffer alive, and the caller may drop its own references right after issuing.
   tests/test_buffers_in_flight.py issues every stage through a backend whose ``Work``
   holds no reference, and fails if one of these is dropped.
2. No shared buffer. A collective never writes a buffer that anyone else still reads or
   writes while it is in flight: the engine writes in place only into buffers it owns.
   The one buffer it is handed by another library, FSDP2's reduce-scatter output in the
   all-reduce hook, is FSDP2's until the hook returns, and FSDP2 reads it afterwards when
   it casts it to the parameters' dtype for ``.grad``
   (``compat.fsdp_reads_reduce_output_after_hook``): the engine may keep it and read it,
   but in that case a collective that writes in place (the replica all-reduce) runs on a
   copy of it (unit.py, ``AMSPUnit._own``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import compat
from .mesh import MeshInfo
from .recorder import CommEvent, Timer, active_recorders, emit


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingComm:
    """An issued async collective, with the buffers it owns until ``wait()`` (Note: buffers
    in flight); ``wait()`` completes it, records it (Note: comm timing in recorder.py),
    runs its finishing step if it has one (``then``), and returns ``result``.

    ``input``: the buffer the caller handed to the collective (for a compressed form, the
    values before encoding); ``result``: the buffer alive now that holds the output (what
    is received into, then, after a finishing step, the finished values); ``held``: the
    buffers in between (encoded chunks). Memory accounting reads ``input`` and ``result``."""

    __slots__ = ("work", "event_args", "timer", "input", "result", "held", "recorders",
                 "done_at", "_finish")

    def __init__(self, work, event_args: dict | None, result: torch.Tensor,
                 input: torch.Tensor | None = None):
        self.work = work
        self.event_args = event_args
        self.timer = Timer()
        self.input = input
        self.result = result
        self.held: tuple[torch.Tensor, ...] = ()
        self.done_at: float | None = None
        self._finish = None
        # The event belongs to the recorders active at issue time, even if it completes
        # later (the post-step all-gather lands in the next forward).
        self.recorders = active_recorders()

    def then(self, finish, input: torch.Tensor | None = None) -> "PendingComm":
        """Give this collective a local finishing step: ``wait()`` returns
        ``finish(received)`` (computed once). ``input`` (the values the collective's input
        was encoded from) becomes ``input``; the collective's own input is kept in
        ``held``. Returns self."""
        assert self._finish is None, "a PendingComm has one finishing step"
        self.held = (*self.held, self.input)
        self.input = input
        self._finish = finish
        return self

    def done(self) -> bool:
        """Whether ``wait()`` would return without blocking on the collective (a finishing
        step may still run, and a compressed all-reduce's issues its all-gather then).
        The first call that sees it completed stamps its completion time."""
        if self.work is None:
            return True
        if not self.work.is_completed():
            return False
        if self.done_at is None:
            self.done_at = time.perf_counter()
        return True

    def wait(self) -> torch.Tensor:
        start = end = time.perf_counter()
        if self.work is not None:
            if self.done_at is None and self.work.is_completed():
                self.done_at = start
            self.work.wait()
            end = time.perf_counter()
            self.work = None
        if self.event_args is not None:
            # completed before the wait began: at its first stamp, and nothing was exposed
            # (the wait's own overhead is not communication); else when the wait returned
            early = self.done_at is not None
            done, blocked = (self.done_at, 0.0) if early else (end, end - start)
            event = CommEvent(seconds=done - self.timer.start, blocked_seconds=blocked,
                              **self.event_args)
            for recorder in self.recorders:
                recorder.add(event)
            self.event_args = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self.result = finish(self.result)
            self.held = ()
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
    """Collectives over named dims of one AMSP mesh, recorded as CommEvents (named by
    ``MeshInfo.label``: "os", or on an expert mesh "expert_os")."""

    def __init__(self, info: MeshInfo):
        self.info = info

    def _event_args(self, op: str, dim: str, nbytes: int, phase: str,
                    codec: str | None = None) -> dict | None:
        if not active_recorders():
            return None
        return dict(
            op=op,
            dim=self.info.label(dim),
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
            dim=self.info.label("p_hpz"),
            group_size=dist.get_world_size(group),
            nbytes=nbytes,
            inter_node=self.info.group_crosses_nodes(group),
            phase=phase,
        )

    def _start(self, kind: str, output: torch.Tensor, input: torch.Tensor, dim: str,
               phase: str, nbytes: int, codec: str | None = None, **kwargs) -> PendingComm:
        work = LAUNCH[kind](output, input, self.info.group(dim), **kwargs)
        return PendingComm(work, self._event_args(kind, dim, nbytes, phase, codec), output,
                           input)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, dim: str, phase: str,
                   codec: str | None = None) -> PendingComm:
        return self._start("all_gather", output, input, dim, phase, _nbytes(output), codec)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, dim: str,
                       phase: str) -> PendingComm:
        return self._start("reduce_scatter", output, input, dim, phase, _nbytes(input))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, dim: str, phase: str,
                   codec: str | None = None,
                   splits: tuple[list[int], list[int]] | None = None) -> PendingComm:
        """Row i of ``input`` (k rows) to rank i of the group; row j of ``output`` from
        rank j (compression.py's reduce-scatter). With ``splits`` = (output sizes, input
        sizes), pieces of those sizes along dim 0 instead (Muon's owners)."""
        kwargs = {} if splits is None else {"output_split_sizes": splits[0],
                                            "input_split_sizes": splits[1]}
        return self._start("all_to_all", output, input, dim, phase, _nbytes(input), codec,
                           **kwargs)

    def all_reduce(self, tensor: torch.Tensor, dim: str, phase: str,
                   op=dist.ReduceOp.SUM) -> PendingComm:
        """``op`` (SUM, or MAX for an inf-norm) over ``dim``, in place: ``tensor`` is both
        input and result."""
        return self._start("all_reduce", tensor, tensor, dim, phase, _nbytes(tensor), reduce_op=op)


# The asynchronous c10d calls behind Collectives, by op: (output, input, group) -> Work
# (all_reduce also takes the reduce op).
# One table, so that a test can stand in a backend whose Work keeps no buffer alive
# (tests/test_buffers_in_flight.py).
LAUNCH = {
    "all_gather": lambda out, inp, group: compat.all_gather_single(
        out, inp, group=group, async_op=True),
    "reduce_scatter": lambda out, inp, group: compat.reduce_scatter_single(
        out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True),
    "all_to_all": lambda out, inp, group, output_split_sizes=None, input_split_sizes=None:
        dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group,
                               async_op=True),
    "all_reduce": lambda out, inp, group, reduce_op=dist.ReduceOp.SUM: dist.all_reduce(
        inp, op=reduce_op, group=group, async_op=True),
}


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
