"""The int8 and bf16 codecs (compression.encode / decode / _with_feedback) give, byte for
byte, what the straightforward form of the codec gives: the reference below (a padded fp32
copy per block row, scale = max |x| / 127 or 1, round, clamp, cast; dequantize by reading
the bytes back). Covers rows of whole blocks (read in place) and of partial ones, all-zero
blocks, bf16 inputs and residuals, and error feedback."""

from __future__ import annotations

import pytest
import torch

from amsp_dtensor.engine import compression as C
from amsp_dtensor.plan.compression import INT8_BLOCK, chunk_nbytes, int8_blocks


def ref_encode(rows, codec):
    k, m = rows.shape
    if codec == "bf16":
        return rows.to(torch.bfloat16).view(torch.uint8).view(k, 2 * m)
    blocks = int8_blocks(m)
    padded = rows.new_zeros(k, blocks * INT8_BLOCK, dtype=torch.float32)
    padded[:, :m] = rows
    padded = padded.view(k, blocks, INT8_BLOCK)
    scale = padded.abs().amax(dim=2) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / scale.unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    out = torch.empty(k, chunk_nbytes(codec, m), dtype=torch.uint8)
    out[:, : blocks * INT8_BLOCK] = q.view(torch.uint8).view(k, -1)
    out[:, blocks * INT8_BLOCK:] = scale.view(torch.uint8).view(k, -1)
    return out


def ref_decode(chunks, codec, m):
    k = chunks.shape[0]
    if codec == "bf16":
        return chunks.contiguous().view(torch.bfloat16).view(k, m).float()
    blocks = int8_blocks(m)
    q = chunks[:, : blocks * INT8_BLOCK].contiguous().view(torch.int8).view(k, blocks, INT8_BLOCK)
    scale = chunks[:, blocks * INT8_BLOCK:].contiguous().view(torch.float32).view(k, blocks, 1)
    return (q.float() * scale).view(k, -1)[:, :m]


def bits(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t


@pytest.mark.parametrize("codec", ["int8", "bf16"])
@pytest.mark.parametrize("m", [INT8_BLOCK * 3, 1000, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_matches_the_reference_byte_for_byte(codec, m, dtype):
    g = torch.Generator().manual_seed(m)
    rows = (torch.randn(3, m, generator=g) * 10).to(dtype)
    rows[1, : min(m, INT8_BLOCK)] = 0  # an all-zero block: scale 1
    chunks = C.encode(rows, codec)
    assert torch.equal(chunks, ref_encode(rows, codec))
    assert torch.equal(bits(C.decode(chunks, codec, m)), bits(ref_decode(chunks, codec, m)))
    residual = (torch.randn(3, m, generator=g) * 0.01).to(dtype)
    expected = residual.clone()
    target = rows.float() + expected.float()
    want = ref_encode(target, codec)
    expected.copy_(target - ref_decode(want, codec, m))
    assert torch.equal(C._with_feedback(rows, residual, codec), want)
    assert torch.equal(bits(residual), bits(expected))


def test_decode_reads_a_strided_block_of_chunks():
    rows = torch.randn(4, 2 * INT8_BLOCK)
    chunks = C.encode(rows, "int8")
    wide = torch.zeros(4, chunks.shape[1] + 8, dtype=torch.uint8)
    wide[:, :chunks.shape[1]] = chunks
    view = wide[:, :chunks.shape[1]]  # rows 4-byte aligned, not contiguous
    assert torch.equal(C.decode(view, "int8", 2 * INT8_BLOCK), ref_decode(chunks, "int8", 2 * INT8_BLOCK))
    odd = torch.zeros(4 * chunks.shape[1] + 1, dtype=torch.uint8)[1:].view(4, -1)
    odd.copy_(chunks)  # misaligned: the scales are copied out first
    assert torch.equal(C.decode(odd, "int8", 2 * INT8_BLOCK), ref_decode(chunks, "int8", 2 * INT8_BLOCK))
