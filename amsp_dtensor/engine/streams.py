"""CUDA stream order for the engine's own work (a no-op on CPU, where streams do not exist).

[Note: stream rules]
Three streams meet in a step, and every tensor that crosses between them is protected:

1. The gradient path runs on the engine's *grad stream*. FSDP2 calls our all-reduce hook
   on it (``set_all_reduce_hook(stream=...)``), after making it wait for its
   reduce-scatter stream; the s_p = 1 hooks switch to it after making it wait for the
   compute stream that produced the grads. Every input produced on another stream is
   ``record_stream``-ed onto the grad stream, so the allocator cannot hand its memory out
   while our collectives read it; buffers made there stay there.
2. At the end of backward the compute stream waits for the grad stream, and the synced
   G buffers (made on the grad stream, read by the optimizer on the compute stream and
   freed by ``zero_grad()`` there) are ``record_stream``-ed onto the compute stream.
3. The post-step all-gather and the unpack of the new P rows run on the compute stream.
   FSDP2 copies a unit's shard into its all-gather input on its own copy-in stream, which
   waits for the compute stream only in the root's pre-forward. A unit whose update lands
   later (in its own pre-forward, ``overlap_param_update=True``) therefore makes the
   copy-in stream wait for the compute stream right after the unpack, before FSDP2's
   pre-forward (our hook is prepended to FSDP2's) can copy the shard.
"""

from __future__ import annotations

import contextlib

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
def on_grad_stream(stream, *inputs: torch.Tensor):
    """Run the body on ``stream`` after the current stream's work; protect ``inputs``."""
    if stream is None:
        yield
        return
    producer = torch.cuda.current_stream()
    if producer is not stream:
        stream.wait_stream(producer)
    for tensor in inputs:
        tensor.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


def join_compute(stream, kept: list[torch.Tensor]) -> None:
    """End of backward: the compute stream waits for the grad stream; ``kept`` buffers
    (read and freed on the compute stream from now on) are protected there."""
    if stream is None:
        return
    compute = torch.cuda.current_stream()
    if compute is stream:
        return
    compute.wait_stream(stream)
    for tensor in kept:
        tensor.record_stream(compute)


def order_before_copy_in(module) -> None:
    """After unpacking a unit's new P rows on the compute stream: FSDP2's copy-in stream
    for this unit must see them (rule 3 above)."""
    if not torch.cuda.is_available():
        return
    copy_in = compat.fsdp_copy_in_stream(module)
    if copy_in is not None:
        copy_in.wait_stream(torch.cuda.current_stream())
