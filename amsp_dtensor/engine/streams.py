"""CUDA stream order for the engine's own work, by events (a no-op on CPU, where streams
do not exist).

[Note: stream order]
Four streams meet in a step: the compute stream (autograd, the optimizer), FSDP2's
reduce-scatter stream (its output is a unit's P-shard grads), the engine's *grad stream*
(the gradient path) and FSDP2's all-gather copy-in stream. A tensor made on one stream
and read on another is safe only if the stream that made it cannot reuse its memory
before the reads have run: the caching allocator hands a freed block back to the stream
it was allocated on at once, and that stream's next kernels may write it. FSDP2 orders
this with events and keeps references until the waits are queued (its
``_post_reduce_event``, ``reduce_scatter_states``); the engine does the same:

1. FSDP units: FSDP2 calls our all-reduce hook on the grad stream, after making it wait
   for the reduce-scatter stream. The hook's input was allocated on the reduce-scatter
   stream, and the engine packs it or keeps it (the partial G when s_g = s_p), possibly
   past the hook. When the hook returns, the reduce-scatter stream waits for an event
   recorded on the grad stream (``release_to``): every later kernel on it, the only ones
   that could reuse that memory, runs after what the grad stream has queued so far. The
   root also keeps the hook's input until the next hook (``Deferred.kept``): FSDP2 still
   reads it on the grad stream after our hook returns (its cast to the parameters' dtype
   for ``.grad``), and the reduce-scatter it runs next allocates before that hook's wait.
   Later reads of a kept buffer on the grad stream are covered too: each later hook ends
   with the same wait, and after the backward the compute stream waits for the grad
   stream (rule 3) while FSDP2's reduce-scatter stream waits for the compute stream
   before each reduce-scatter. Cost: the next unit's reduce-scatter starts after this
   hook's grad-stream work, which includes waiting for the previous unit's first stage
   (issued two units of backward compute earlier).
2. s_p = 1 units: the hook flattens the unit's grads (made on the compute stream) on the
   grad stream, after making it wait for the compute stream. The grads are not freed
   there: the root keeps them with an event recorded after the flatten (``Deferred``)
   until the next unit's hook or the end of backward, where the compute stream waits for
   the event and the references are dropped, as FSDP2 keeps its reduce-scatter inputs
   until the next post-backward. The compute stream never waits inside the hook, so the
   next unit's backward compute is not queued behind the engine's collectives; on CUDA
   one unit's grads live one hook longer (on CPU nothing is kept).
3. End of backward and before the step: the compute stream waits for the grad stream
   (``join_compute``). The synced G, made on the grad stream, is then read by the
   optimizer and freed by ``zero_grad()`` on the compute stream; its memory can only be
   reused by a grad-stream allocation, and every stretch of grad-stream work starts by
   waiting for the compute stream (``on_grad_stream``; FSDP2's hook stream waits for the
   reduce-scatter stream, which waits for the compute stream), so after those reads.
   Collectives still in flight keep their own buffers (their PendingComm holds them
   until ``wait``: collectives.py's Note: buffers in flight).
4. The post-step all-gather and the unpack of the new P rows run on the compute stream.
   FSDP2 copies a unit's shard into its all-gather input on its copy-in stream, which
   waits for the compute stream only in the root's pre-forward. A unit whose update lands
   later (in its own pre-forward, ``overlap_param_update=True``) therefore makes the
   copy-in stream wait for an event recorded right after the unpack
   (``order_before_copy_in``), before FSDP2's pre-forward (our hook is prepended to
   FSDP2's) can copy the shard. tools/gpu_check.py delays the unpack on the GPU to check
   this wait is there.

No ``record_stream``: with events, when memory is freed depends only on the references
the engine holds, so the byte counts of observe/ hold on CUDA as on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import compat

_GRAD_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def grad_stream(device_type: str):
    """The engine's grad stream on the current CUDA device (None off CUDA)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    if index not in _GRAD_STREAMS:
        _GRAD_STREAMS[index] = torch.cuda.Stream(index)
    return _GRAD_STREAMS[index]


@contextlib.contextmanager
def on_grad_stream(stream):
    """Run the body on ``stream`` after the work queued so far on the current stream."""
    if stream is None:
        yield
        return
    producer = torch.cuda.current_stream()
    if producer is not stream:
        stream.wait_event(producer.record_event())
    with torch.cuda.stream(stream):
        yield


def current_stream(grad_stream):
    """The current CUDA stream where the engine has a grad stream; None elsewhere."""
    return None if grad_stream is None else torch.cuda.current_stream()


def release_to(owner, stream) -> None:
    """Rule 1: ``owner`` (the stream that allocated what ``stream`` has read) waits for
    the work queued on ``stream`` so far."""
    if owner is not None and stream is not None and owner is not stream:
        owner.wait_event(stream.record_event())


@dataclass(frozen=True)
class Deferred:
    """Tensors another stream allocated and the grad stream has read, kept by the root
    until that stream's wait for the reads is queued (rules 1 and 2)."""

    tensors: tuple
    owner: "torch.cuda.Stream | None"  # waits for ``event`` on release; None: nothing to wait
    event: "torch.cuda.Event | None"  # recorded on the grad stream after the reads

    @staticmethod
    def after_reads(owner, reader, tensors) -> "Deferred | None":
        """Rule 2: ``owner`` made ``tensors``; ``reader`` has just queued its reads of them.
        None when there is no grad stream (CPU): nothing needs keeping."""
        if reader is None or owner is None or owner is reader:
            return None
        return Deferred(tuple(tensors), owner, reader.record_event())

    @staticmethod
    def kept(stream, tensors) -> "Deferred | None":
        """Rule 1: only the reference is kept (the owner already waits at each hook's end)."""
        return None if stream is None else Deferred(tuple(tensors), None, None)

    def release(self) -> None:
        """Queue the owner's wait; the caller drops this afterwards."""
        if self.owner is not None:
            self.owner.wait_event(self.event)


def join_compute(stream) -> None:
    """Rule 3: the current (compute) stream waits for the work queued on ``stream``."""
    if stream is None:
        return
    compute = torch.cuda.current_stream()
    if compute is not stream:
        compute.wait_event(stream.record_event())


def order_before_copy_in(module) -> None:
    """Rule 4: after unpacking a unit's new P rows on the compute stream, FSDP2's copy-in
    stream for this unit waits for them."""
    if not torch.cuda.is_available():
        return
    copy_in = compat.fsdp_copy_in_stream(module)
    if copy_in is not None:
        copy_in.wait_event(torch.cuda.current_stream().record_event())
