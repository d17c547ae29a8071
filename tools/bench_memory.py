"""Peak CPU memory of one system's training steps, from glibc's allocator counters.

CPU tensors have no allocator statistics and RSS keeps freed memory, so the peak is glibc's
``mallinfo2()`` bytes in use (arenas + mmap) sampled at every block's forward entry / exit
and backward entry, the output head's, after every backward and the optimizer step, and
inside ``every_op()`` after every aten op, minus the bytes in use before the build: a lower
bound (temporaries inside one op are missed), taken the same way for every system.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use_bytes() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class PeakMemory:
    """High-water mark of in-use bytes at hook points, relative to a baseline."""

    def __init__(self) -> None:
        gc.collect()
        self.baseline = in_use_bytes()
        self.peak = self.baseline
        self._handles = []

    def sample(self, *_args, **_kw) -> None:
        now = in_use_bytes()
        if now > self.peak:
            self.peak = now

    def attach(self, blocks, head=None) -> None:
        """Sample around every block, and around ``head`` (the output projection)."""
        for block in [*blocks, *([head] if head is not None else [])]:
            self._handles.append(block.register_forward_pre_hook(lambda *a: self.sample()))
            self._handles.append(block.register_forward_hook(self._after_forward))

    def _after_forward(self, module, inputs, output) -> None:
        self.sample()
        # backward entry of this block = the grad of its output arrives (a tensor hook, so
        # FSDP2's own backward hooks on the module are left alone)
        if getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: self.sample())

    @contextlib.contextmanager
    def every_op(self):
        """Also sample after every aten op dispatched inside the block (on this thread
        and the autograd engine's, which inherits the mode)."""
        from amsp_dtensor import compat

        sample = self.sample

        class _SampleAfterEachOp(compat.torch_dispatch_mode_base()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                sample()
                return out

        with _SampleAfterEachOp():
            yield

    @property
    def peak_delta(self) -> int:
        return self.peak - self.baseline

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
