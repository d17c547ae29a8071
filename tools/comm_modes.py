"""Run the same training step with real, no-op or serialized collectives.

tools/overlap_worker.py times one training step three ways in the same processes:

  real    the collectives as issued (what the system normally does)
  noop    every collective replaced by its local copies only, same shapes: all-gather
          copies the input into each chunk of the output, reduce-scatter copies this rank's
          chunk of the input into the output, all-reduce and broadcast do nothing. Values
          become meaningless; the step's time is its compute (plus those copies).
  serial  every collective waited right after it is issued: nothing overlaps.

Exposed communication = T_real - T_noop; overlap efficiency =
(T_serial - T_real) / (T_serial - T_noop).

The switch wraps the torch.distributed Python entry points that every collective of FSDP2
and of the AMSP engine goes through, exactly as tools/bench_comm.py does:
``all_gather_single``, ``reduce_scatter_single`` (the deprecated ``*_into_tensor`` /
``*_tensor`` forms forward to them), ``all_reduce`` and ``broadcast``; both the
``torch.distributed`` attribute and the ``distributed_c10d`` module global are replaced,
and the callers look them up at call time. Other calls (barrier, all_gather_object, ...)
stay real. The mode is process-wide (not per thread): collectives issued from a helper
thread follow it too. Switch it only while no collective is in flight, and keep it
``real`` around a harness's own barriers and reductions.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

MODES = ("real", "noop", "serial")
_WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast")

_mode = "real"
_lock = threading.Lock()
_originals: dict[str, object] = {}


class CompletedWork(dist.Work):
    """A Work that is already done: ``wait()`` returns True at once. FSDP2 checks
    ``isinstance(work, dist.distributed_c10d.Work)`` and then calls ``wait()``."""

    def __init__(self, result: list | None = None):
        super().__init__()
        self._result = result if result is not None else []

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - torch's signature
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list:
        return self._result

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def synchronize(self) -> None:
        pass


def _arg(args, kwargs, index: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _noop(name: str, args, kwargs):
    """The local part of collective `name`, no communication."""
    if name == "all_gather_single":
        output, input = _arg(args, kwargs, 0, "output_tensor"), _arg(args, kwargs, 1, "input_tensor")
        group = _arg(args, kwargs, 2, "group")
        n = dist.get_world_size(group)
        flat_in = input.reshape(-1)
        chunks = output.view(-1).view(n, flat_in.numel())
        chunks.copy_(flat_in.unsqueeze(0).expand(n, -1))
        return [output]
    if name == "reduce_scatter_single":
        output, input = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
        group = _arg(args, kwargs, 3, "group")
        n, r = dist.get_world_size(group), dist.get_rank(group)
        k = output.numel()
        output.view(-1).copy_(input.reshape(-1)[r * k:(r + 1) * k])
        return [output]
    # all_reduce / broadcast: the tensor keeps this rank's value
    return [_arg(args, kwargs, 0, "tensor")]


def _async(name: str, args, kwargs) -> bool:
    index = {"all_gather_single": 3, "reduce_scatter_single": 4, "all_reduce": 3,
             "broadcast": 3}[name]
    return bool(_arg(args, kwargs, index, "async_op", False))


def _make_wrapper(name: str, original):
    def wrapper(*args, **kwargs):
        mode = _mode
        if mode == "real":
            return original(*args, **kwargs)
        if mode == "noop":
            result = _noop(name, args, kwargs)
            return CompletedWork(result) if _async(name, args, kwargs) else None
        # serial
        work = original(*args, **kwargs)
        if work is not None:
            work.wait()
            return CompletedWork()
        return work

    wrapper.__wrapped__ = original
    wrapper.__name__ = name
    wrapper._amsp_comm_mode = True
    return wrapper


def install() -> None:
    """Wrap the entry points once per process (idempotent). Mode starts as ``real``."""
    with _lock:
        if _originals:
            return
        for name in _WRAPPED:
            original = getattr(c10d, name)
            _originals[name] = original
            wrapper = _make_wrapper(name, original)
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)


def uninstall() -> None:
    """Put the original entry points back (only if nothing wrapped them after us)."""
    global _mode
    with _lock:
        for name, original in _originals.items():
            for mod in (c10d, dist):
                if getattr(getattr(mod, name), "_amsp_comm_mode", False):
                    setattr(mod, name, original)
        _originals.clear()
        _mode = "real"


def get_mode() -> str:
    return _mode


def set_mode(mode: str) -> str:
    """Switch every wrapped collective to `mode`; returns the previous mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown comm mode {mode!r}; use one of {MODES}")
    if not _originals:
        raise RuntimeError("tools.comm_modes.install() has not been called")
    previous, _mode = _mode, mode
    return previous


@contextlib.contextmanager
def mode(name: str):
    """``with comm_modes.mode("noop"): step()`` then back to the previous mode (also on
    an exception)."""
    previous = set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)
