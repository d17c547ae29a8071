"""Every torch.distributed collective of a step, counted and optionally faked.

The Python entry points are wrapped once per process, in ``torch.distributed`` and
``distributed_c10d``: this torch's base tensor forms (``*_single`` from torch 2.13, which the
deprecated forms forward to; ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` before),
so nothing counts twice.
``counter.recording()`` counts (op, group size, bytes as the AMSP recorder counts them,
crosses nodes). Modes (process-wide; switch only while nothing is in flight): ``real``;
``noop``, local copies of the same shapes (the step's time is its compute); ``serial``,
each collective waited when issued.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from amsp_dtensor import compat

MODES = ("real", "noop", "serial")
# name -> (op, index of the buffer among the call's tensor arguments, index of async_op)
_AG, _RS = compat.TENSOR_COLLECTIVES["all_gather"], compat.TENSOR_COLLECTIVES["reduce_scatter"]
_WRAPPED = {_AG: ("all_gather", 0, 3), _RS: ("reduce_scatter", 1, 4),
            "all_reduce": ("all_reduce", 0, 3), "broadcast": ("broadcast", 0, 3),
            "reduce": ("reduce", 0, 4), "all_gather": ("all_gather", 0, 3),
            "reduce_scatter": ("reduce_scatter", 1, 4)}
_state = {"mode": "real", "counter": None}
_lock = threading.Lock()


def _nbytes(x) -> int:
    if isinstance(x, (list, tuple)):  # the list forms: DeepSpeed's ZeRO-1/2 and MiCS use them
        return sum(_nbytes(t) for t in x)
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class CommCounter:
    """Collectives issued while ``recording()`` is active (thread-safe)."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self.events: list[tuple] = []
        self.active = False

    def add(self, op: str, group, nbytes: int) -> None:
        ranks = list(dist.get_process_group_ranks(group) if group is not None
                     else range(dist.get_world_size()))
        if len(ranks) > 1:
            inter = len({r // self.ranks_per_node for r in ranks}) > 1
            with _lock:
                self.events.append((op, len(ranks), nbytes, inter))

    def bytes_by_locality(self) -> dict[str, int]:
        out = {"intra": 0, "inter": 0}
        for _op, _n, nbytes, inter in self.events:
            out["inter" if inter else "intra"] += nbytes
        return out

    @contextlib.contextmanager
    def recording(self):
        self.events, self.active = [], True
        try:
            yield self
        finally:
            self.active = False


def _noop(name: str, tensors: list) -> None:
    if name == _AG:
        out, inp = tensors[0], tensors[1].reshape(-1)
        out.view(-1).view(-1, inp.numel()).copy_(inp.unsqueeze(0).expand(out.numel() // inp.numel(), -1))
    elif name == _RS:  # a chunk of the right size; values are moot
        out, inp = tensors[0], tensors[1]
        out.view(-1).copy_(inp.reshape(-1)[:out.numel()])


class _Done(dist.Work):
    """A Work that is already complete (FSDP2 checks isinstance(work, Work), then waits)."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result([])
        return fut


def _wrap(name: str, original):
    op, buf_i, async_i = _WRAPPED[name]

    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        counter = _state["counter"]
        tensors = [a for a in args if isinstance(a, (torch.Tensor, list))]
        tensors += [v for k, v in kwargs.items() if isinstance(v, (torch.Tensor, list))]
        if counter is not None and counter.active and len(tensors) > buf_i:
            counter.add(op, group, _nbytes(tensors[buf_i]))
        mode = _state["mode"]
        if mode == "real":
            return original(*args, **kwargs)
        is_async = kwargs.get("async_op", len(args) > async_i and args[async_i] is True)
        if mode == "noop":
            _noop(name, tensors)
            return _Done() if is_async else None
        work = original(*args, **kwargs)  # serial
        if work is not None:
            work.wait()
            return _Done()
        return work

    wrapper.__wrapped__ = original
    wrapper.__name__ = name
    return wrapper


def install(ranks_per_node: int) -> CommCounter:
    """Wrap the entry points once per process; returns the counter they report to."""
    with _lock:
        if _state["counter"] is None:
            for name in _WRAPPED:
                wrapper = _wrap(name, getattr(c10d, name))
                setattr(c10d, name, wrapper)
                setattr(dist, name, wrapper)
            _state["counter"] = CommCounter(ranks_per_node)
    return _state["counter"]


def set_mode(mode: str) -> str:
    """Switch every wrapped collective to `mode`; returns the previous one."""
    if mode not in MODES:
        raise ValueError(f"unknown comm mode {mode!r}; use one of {MODES}")
    if _state["counter"] is None:
        raise RuntimeError("tools.bench_comm.install() has not been called")
    previous, _state["mode"] = _state["mode"], mode
    return previous


@contextlib.contextmanager
def mode(name: str):
    """``with bench_comm.mode("noop"): step()``, then back to the previous mode."""
    previous = set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)
