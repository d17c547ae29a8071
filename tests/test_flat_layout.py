"""FlatLayout.pack / unpack_into: the fused kernels (torch._chunk_cat, split_with_sizes_copy)
give exactly the per-chunk copies' values, checked against a reference written from the
layout rule (chunk i of a tensor's rows, torch.chunk sizes, in a zero-padded slot of
ceil(cap / k) rows) over random layouts, with and without the fused path."""

from __future__ import annotations

import math
import random

import torch

from amsp_dtensor.engine.layouts import FlatLayout


def reference_pack(rows, caps, cols, values, k):
    """[k, slots] from each tensor's (rows x cols) values, chunked as torch.chunk does."""
    out = []
    for i in range(k):
        row = []
        for r, cap, c, v in zip(rows, caps, cols, values):
            chunks = torch.chunk(v, k) if r else ()
            chunk = chunks[i] if i < len(chunks) else v[:0]
            slot = torch.zeros(math.ceil(cap / k), c)
            slot[: chunk.shape[0]] = chunk
            row.append(slot.reshape(-1))
        out.append(torch.cat(row))
    return torch.stack(out)


def test_pack_and_unpack_match_the_layout_rule():
    rng = random.Random(0)
    fused = {"pack": 0, "unpack": 0}
    for _ in range(400):
        n, k = rng.randint(1, 4), rng.choice([1, 2, 3, 4, 8])
        rows = [rng.randint(0, 13) for _ in range(n)]
        caps = [r + rng.choice([0, 0, 1, 3]) for r in rows]
        cols = [rng.randint(1, 5) for _ in range(n)]
        layout = FlatLayout.for_shapes([torch.Size([r, c]) for r, c in zip(rows, cols)],
                                       rows=rows, caps=caps)
        values = [torch.randn(r, c) for r, c in zip(rows, cols)]
        flat = torch.zeros(layout.numel)  # padding rows are zero, as the engine's are
        for view, v in zip(layout.views(flat), values):
            view.copy_(v)
        packed = layout.pack(flat, k)
        assert torch.equal(packed, reference_pack(rows, caps, cols, values, k))
        dests = [torch.full((r, c), float("nan")) for r, c in zip(rows, cols)]
        layout.unpack_into(packed, k, dests)
        assert all(torch.equal(d, v) for d, v in zip(dests, values))
        plan = layout._chunked(k)
        fused["pack"] += plan.chunk_cat
        fused["unpack"] += plan.split_copy
    assert fused["pack"] > 100 and fused["unpack"] > 30  # both paths were exercised


def test_unpack_casts_into_another_dtype():
    layout = FlatLayout.for_shapes([torch.Size([4, 3]), torch.Size([2, 2])])
    values = [torch.randn(4, 3), torch.randn(2, 2)]
    flat = torch.cat([v.reshape(-1) for v in values])
    dests = [torch.empty(4, 3, dtype=torch.bfloat16), torch.empty(2, 2, dtype=torch.bfloat16)]
    layout.unpack_into(layout.pack(flat, 2), 2, dests)
    assert all(torch.equal(d, v.to(torch.bfloat16)) for d, v in zip(dests, values))


def test_views_are_the_buffer_cut_by_slots():
    """views(): each tensor's real rows at the start of its slot, sharing the buffer's
    storage, whether made in one call (every slot full: ``dense``) or tensor by tensor."""
    rng = random.Random(1)
    seen = {True: 0, False: 0}
    for _ in range(200):
        n = rng.randint(1, 4)
        rows = [rng.randint(0, 6) for _ in range(n)]
        caps = [r + rng.choice([0, 0, 0, 2]) for r in rows]
        cols = [rng.randint(1, 4) for _ in range(n)]
        layout = FlatLayout.for_shapes([torch.Size([r, c]) for r, c in zip(rows, cols)],
                                       rows=rows, caps=caps)
        assert layout.dense == all(r == cap > 0 for r, cap in zip(rows, caps))
        seen[layout.dense] += 1
        flat = torch.randn(layout.numel)
        starts = [sum(cap * c for cap, c in zip(caps[:i], cols[:i])) for i in range(n)]
        views = layout.views(flat)
        assert [tuple(v.shape) for v in views] == list(zip(rows, cols))
        for view, start, r, c in zip(views, starts, rows, cols):
            assert torch.equal(view, flat[start:start + r * c].view(r, c))
            if r * c:
                view.fill_(7.0)  # a view, not a copy: the buffer sees the write
                assert bool((flat[start:start + r * c] == 7.0).all())
    assert seen[True] > 20 and seen[False] > 20
