"""Compressed cross-node stages (``amsp.set_compression``): the codecs on tensors, and the
compressed forms of the gradient reduce-scatter, the replica all-reduce and the post-step
all-gather. plan/compression.py has the setting and the byte arithmetic the cost model
shares.

[Note: compressed reductions]
A reduction is never done on compressed values: each rank quantizes the chunk it sends to
each peer, an all-to-all delivers to every rank the k chunks of its own shard, and the
receiver dequantizes and sums them in fp32 (as ZeRO++'s qgZ and torchft do). A replica
all-reduce is that reduce-scatter followed by an all-gather of the compressed sums, which
every rank (the one that summed included) dequantizes: every replica holds the same
values, so replicas stay identical.

[Note: error feedback]
What quantization drops is kept per rank and added to the next input of the same stage
(``residual``, in the stage's dtype, one per compressed stage of a unit). So with sent_t
the dequantized values of step t, sum_t sent_t = sum_t x_t - residual_T: the error does
not accumulate, it lags. The all-gather half of an all-reduce adds its own error, on the
rank that summed the chunk, to that chunk of its residual. Weights need none: they are
re-sent from the exact fp32 masters every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..plan.compression import INT8_BLOCK, Compression, chunk_nbytes, int8_blocks
from .collectives import Collectives, PendingComm
from .handle import root_state

__all__ = ["Compression", "set_compression"]


def set_compression(model: nn.Module, *, grads: str | None = None,
                    weights: str | None = None, error_feedback: bool = True) -> Compression:
    """Compress the cross-node stages of the root ``model`` (off by default: exact).

    ``grads``: codec of the gradient stages whose group spans nodes (reduce-scatter over
    "g" or "os", the replica all-reduce), with error feedback; ``weights``: codec of the
    post-step all-gather when its group spans nodes. Codecs: "bf16", "int8" (blockwise,
    one fp32 scale per 256 elements), None (exact). Stages inside a node stay exact.
    ``error_feedback=False`` sends each step's gradients alone (to measure what the
    feedback does; the quantization error is then lost). Call between steps; ``weights``
    before building AMSPOptimizer. Changing ``grads`` or the feedback drops the
    residuals. A setting that compresses nothing, because no stage of the plan crosses
    nodes, warns once. Returns the setting now in force.
    """
    setting = Compression(grads=grads, weights=weights, error_feedback=error_feedback)
    return root_state(model).set_compression(setting)


# ---- codecs: [k, m] rows of values <-> [k, chunk_nbytes] rows of uint8 ----------------
def encode(rows: torch.Tensor, codec: str) -> torch.Tensor:
    """Each row of ``rows`` (k x m, any float dtype) as one compressed uint8 chunk.

    int8: per block of INT8_BLOCK values, scale = max |x| / 127 (1 where that is 0), the
    values round(x / scale) clamped to +-127; the int8 values and then the fp32 scales
    are written into the chunk bytes in place, and an fp32 row of whole blocks is read
    as it is (no padded copy)."""
    k, m = rows.shape
    if codec == "bf16":
        return rows.to(torch.bfloat16).view(torch.uint8).view(k, 2 * m)
    blocks = int8_blocks(m)
    width = blocks * INT8_BLOCK
    if m == width and rows.dtype == torch.float32 and rows.is_contiguous():
        padded = rows.view(k, blocks, INT8_BLOCK)
    else:
        padded = rows.new_zeros(k, width, dtype=torch.float32)
        padded[:, :m] = rows
        padded = padded.view(k, blocks, INT8_BLOCK)
    scale = padded.abs().amax(dim=2).div_(127.0)
    scale = torch.where(scale > 0, scale, 1.0)
    q = torch.div(padded, scale.unsqueeze(2)).round_().clamp_(-127, 127)
    out = torch.empty(k, chunk_nbytes(codec, m), dtype=torch.uint8, device=rows.device)
    values, scales = _int8_parts(out, k, blocks)
    values.copy_(q)  # float -> int8 of integral values: what .to(torch.int8) gives
    scales.copy_(scale.unsqueeze(2))
    return out


def _int8_parts(chunks: torch.Tensor, k: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of k int8 chunks: the values (k, blocks, INT8_BLOCK) as int8 and the scales
    (k, blocks, 1) as fp32, read in place (copies only if the bytes are misaligned)."""
    width = blocks * INT8_BLOCK
    try:
        scales = chunks[:, width:].view(torch.float32).view(k, blocks, 1)
    except RuntimeError:  # an fp32 view needs 4-byte aligned rows
        chunks = chunks.contiguous()
        scales = chunks[:, width:].contiguous().view(torch.float32).view(k, blocks, 1)
    values = chunks[:, :width].view(torch.int8).view(k, blocks, INT8_BLOCK)
    return values, scales


def decode(chunks: torch.Tensor, codec: str, m: int) -> torch.Tensor:
    """fp32 k x m values of k compressed chunks (``encode``'s inverse, up to rounding)."""
    k = chunks.shape[0]
    if codec == "bf16":
        return chunks.contiguous().view(torch.bfloat16).view(k, m).float()
    blocks = int8_blocks(m)
    q, scale = _int8_parts(chunks, k, blocks)
    return (q.float() * scale).view(k, -1)[:, :m]


def _with_feedback(rows: torch.Tensor, residual: torch.Tensor | None, codec: str) -> torch.Tensor:
    """Encode rows + residual; the residual becomes what the encoding dropped (None:
    error feedback off, the rows alone are encoded)."""
    if residual is None:
        return encode(rows, codec)
    target = rows.float() + residual.float()
    chunks = encode(target, codec)
    dropped = decode(chunks, codec, rows.shape[1])
    if residual.dtype == torch.float32:
        torch.sub(target, dropped, out=residual)
    else:
        residual.copy_(target - dropped)
    return chunks


# ---- the compressed collectives ------------------------------------------------------
def reduce_scatter(c: Collectives, packed: torch.Tensor, residual: torch.Tensor, dim: str,
                   phase: str, codec: str) -> PendingComm:
    """Compressed form of reduce-scatter(packed k x m over ``dim``): this rank's m-element
    sum, in packed's dtype (Note: compressed reductions)."""
    k, m = packed.shape
    chunks = _with_feedback(packed, residual, codec)
    received = torch.empty_like(chunks)
    pending = c.all_to_all(received, chunks, dim, phase, codec)
    return pending.then(lambda got: decode(got, codec, m).sum(0).to(packed.dtype), packed)


def all_reduce(c: Collectives, tensor: torch.Tensor, residual: torch.Tensor, dim: str,
               phase: str, codec: str) -> PendingComm:
    """Compressed form of all-reduce(tensor over ``dim``): a compressed reduce-scatter,
    then an all-gather of the compressed sums; ``residual`` is k x ceil(n/k)."""
    n, k = tensor.numel(), c.info.size(dim)
    m = residual_rows(n, k)
    rows = tensor.new_zeros(k * m)
    rows[:n] = tensor.view(-1)
    chunks = _with_feedback(rows.view(k, m), residual, codec)
    received = torch.empty_like(chunks)
    pending = c.all_to_all(received, chunks, dim, phase, codec)
    me = dist.get_rank(c.info.group(dim))

    def finish(got: torch.Tensor) -> torch.Tensor:
        total = decode(got, codec, m).sum(0, keepdim=True)
        mine = encode(total, codec)
        if residual is not None:
            residual[me] += (total - decode(mine, codec, m))[0].to(residual.dtype)
        gathered = mine.new_empty(k, mine.shape[1])
        c.all_gather(gathered.view(-1), mine.view(-1), dim, phase, codec).wait()
        return decode(gathered, codec, m).reshape(-1)[:n].to(tensor.dtype).view_as(tensor)

    return pending.then(finish, tensor)


def all_gather(c: Collectives, send: torch.Tensor, dim: str, phase: str,
               codec: str) -> PendingComm:
    """Compressed form of all-gather(send over ``dim``): k x numel in send's dtype, every
    row (this rank's own included) dequantized from the same bytes. ``input`` stays the
    encoded send buffer (what is in flight; ``send`` itself may be dropped once encoded)."""
    m, k = send.numel(), c.info.size(dim)
    mine = encode(send.view(1, m), codec)
    gathered = mine.new_empty(k, mine.shape[1])
    pending = c.all_gather(gathered.view(-1), mine.view(-1), dim, phase, codec)
    return pending.then(lambda got: decode(got.view(k, -1), codec, m).to(send.dtype),
                        pending.input)


def residual_norm(model: nn.Module) -> float:
    """L2 norm of this rank's error-feedback residuals (0.0 when nothing is compressed)."""
    total = sum(float(r.float().pow(2).sum()) for unit in root_state(model).units
                for r in unit.residuals.values())
    return total ** 0.5


def residual_rows(stage_input_numel: int, k: int) -> int:
    """Columns of an all-reduce residual: the input padded to k equal chunks."""
    return -(-stage_input_numel // k)
