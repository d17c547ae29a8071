"""Where P, G and OS live: DTensor placements on the ("rep", "p", "g", "os") mesh, and
the row arithmetic that packs them into flat collective buffers.

    state   placements on (rep, p, g, os)                 held per rank
    P       (Replicate, Shard(0), Replicate, Replicate)   1/s_p of each param
    G       (Partial,   Shard(0), Shard(0),  Partial)     1/s_g, partial sums until the
                                                          last backward of a step
    OS      (Replicate, Shard(0), Shard(0),  Shard(0))    1/s_os: fp32 master + states;
                                                          also G after the step's sync

Shard(0) on several mesh dims nests in mesh-dim order (DTensor's rule): a param's rows are
chunked over "p" first, then each P chunk over "g", then over "os". So a rank's G and OS
rows always lie inside its own P rows (the nesting rule, docs/design.md) and moving
between the layouts never needs data from another P shard.

Chunking follows torch.chunk/DTensor: n rows over k ranks gives chunks of ceil(n/k) rows,
the last ones shorter or empty. Collectives need equal-sized per-rank pieces, so each
chunk travels in a slot of ``cap`` rows (zero padded): at most one row of padding per
tensor per rank beyond the ideal share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from .. import compat

P_PLACEMENTS = (Replicate(), Shard(0), Replicate(), Replicate())
G_PLACEMENTS = (Partial(), Shard(0), Shard(0), Partial())
OS_PLACEMENTS = (Replicate(), Shard(0), Shard(0), Shard(0))

__all__ = [
    "P_PLACEMENTS",
    "G_PLACEMENTS",
    "OS_PLACEMENTS",
    "chunk_rows",
    "os_member_rows",
    "ParamRows",
    "FlatLayout",
]


def chunk_rows(n_rows: int, k: int) -> list[tuple[int, int]]:
    """(start, length) of each of k chunks of n rows, torch.chunk / DTensor style."""
    size = math.ceil(n_rows / k) if n_rows else 0
    return [(min(i * size, n_rows), max(0, min(size, n_rows - i * size))) for i in range(k)]


def os_member_rows(n_rows: int, s_p: int, k: int, members: list[tuple[int, int]]) -> list[int]:
    """Rows of a tensor of ``n_rows`` rows held by each of ``members`` ((p, i): P shard p,
    OS chunk i of it, as MeshInfo.shard_members gives them): P shard p is split into k
    OS chunks, and (p, i) holds chunk i, so the members sorted by (p, i) tile the rows."""
    return [chunk_rows(chunk_rows(n_rows, s_p)[p][1], k)[i][1] for p, i in members]


@dataclass(frozen=True)
class ParamRows:
    """One tensor's rows inside a flat buffer: ``rows`` real rows in a slot of ``cap``."""

    rows: int
    cap: int
    cols: int  # elements per row (numel / dim0)

    @property
    def slot_numel(self) -> int:
        return self.cap * self.cols


class FlatLayout:
    """A unit's tensors laid end to end, each in a slot of ``cap`` rows.

    ``split(k, index)`` gives the layout of one of k sub-chunks (what rank ``index`` of a
    k-rank subgroup keeps after a reduce-scatter), and ``pack``/``unpack`` move data
    between a whole-layout buffer and the [k, sub-layout] buffer a collective wants.
    """

    def __init__(self, params: list[ParamRows]):
        self.params = params
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.slot_numel
        self.numel = offset
        self._plans: dict[int, _Chunked] = {}
        # every slot full (rows = cap > 0): the views are the buffer cut end to end, which
        # one C++ call makes (compat.unflatten_dense); meta tensors give it the shapes
        self._dense = [torch.empty(p.rows, p.cols, device="meta") for p in params] if (
            params and all(p.rows == p.cap and p.rows * p.cols > 0 for p in params)) else None

    @property
    def dense(self) -> bool:
        """Every slot is full (no padding) and holds elements: the buffer is the tensors
        laid end to end."""
        return self._dense is not None

    @staticmethod
    def for_shapes(shapes: list[torch.Size], rows: list[int] | None = None, caps=None):
        params = []
        for i, shape in enumerate(shapes):
            dim0 = shape[0] if len(shape) else 1
            cols = math.prod(shape[1:]) if len(shape) > 1 else 1
            r = dim0 if rows is None else rows[i]
            c = r if caps is None else caps[i]
            params.append(ParamRows(r, c, cols))
        return FlatLayout(params)

    def split(self, k: int, index: int) -> "FlatLayout":
        subs = []
        for p in self.params:
            _, length = chunk_rows(p.rows, k)[index]
            subs.append(ParamRows(length, math.ceil(p.cap / k), p.cols))
        return FlatLayout(subs)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """(rows, cols) views of the real rows of each tensor in ``flat``."""
        if self._dense is not None:
            return compat.unflatten_dense(flat, self._dense)
        return [
            flat[off : off + p.rows * p.cols].view(p.rows, p.cols)
            for off, p in zip(self.offsets, self.params)
        ]

    def _chunked(self, k: int) -> "_Chunked":
        """The pack/unpack plan of this layout over k sub-chunks, computed once."""
        plan = self._plans.get(k)
        if plan is None:
            plan = self._plans[k] = _Chunked(self, k)
        return plan

    def pack(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        """[k, sub.numel] buffer: row i holds sub-chunk i of every tensor, zero padded."""
        plan = self._chunked(k)
        if plan.chunk_cat:
            # FSDP2's copy-in: one kernel for the whole unit (same values as the loop below)
            out = flat.new_empty(k, plan.sub_numel)
            compat.chunk_cat(self.views(flat), k, out)
            return out
        out = flat.new_zeros(k, plan.sub_numel)
        sub_off = 0
        for src, p in zip(self.views(flat), self.params):
            sub_cap = math.ceil(p.cap / k)
            for i, (start, length) in enumerate(chunk_rows(p.rows, k)):
                if length:
                    out[i, sub_off : sub_off + length * p.cols].copy_(
                        src[start : start + length].reshape(-1)
                    )
            sub_off += sub_cap * p.cols
        return out

    def unpack_into(self, gathered: torch.Tensor, k: int, dests: list[torch.Tensor]) -> None:
        """Inverse of pack: write the [k, sub.numel] buffer's chunks into ``dests``
        ((rows, cols)-viewable tensors, one per param, possibly of another dtype)."""
        plan = self._chunked(k)
        if plan.split_copy and all(d.dtype == gathered.dtype and d.is_contiguous() for d in dests):
            # FSDP2's copy-out: one kernel writes every param's k chunks
            torch.split_with_sizes_copy(gathered, plan.widths, dim=1,
                                        out=[d.view(k, w) for d, w in zip(dests, plan.widths)])
            return
        sub_off = 0
        for dest, p in zip(dests, self.params):
            dest_rows = dest.view(p.rows, p.cols)
            sub_cap = math.ceil(p.cap / k)
            for i, (start, length) in enumerate(chunk_rows(p.rows, k)):
                if length:
                    dest_rows[start : start + length].copy_(
                        gathered[i, sub_off : sub_off + length * p.cols].view(length, p.cols)
                    )
            sub_off += sub_cap * p.cols


class _Chunked:
    """How a layout's tensors split into k sub-chunks: the width of each tensor's slot in
    a packed row, and whether one fused kernel can pack and unpack (same values as the
    per-chunk copies, which handle the rest).

    ``chunk_cat`` (pack): torch.chunk's chunks of a tensor's real rows are ceil(rows/k)
    rows, padded to the slot's ceil(cap/k) rows; ``torch._chunk_cat`` pads each chunk to
    ceil(rows/k) rows, so the two agree when those are equal (and rows > 0).
    ``split_copy`` (unpack): every tensor's rows fill its k slots exactly (rows = k x
    ceil(cap/k)), so a tensor is its [k, width] slots with no padding to skip.
    """

    def __init__(self, layout: FlatLayout, k: int):
        caps = [math.ceil(p.cap / k) for p in layout.params]
        self.widths = [c * p.cols for c, p in zip(caps, layout.params)]
        self.sub_numel = sum(self.widths)
        self.chunk_cat = bool(layout.params) and all(
            p.rows > 0 and math.ceil(p.rows / k) == c for p, c in zip(layout.params, caps))
        self.split_copy = bool(layout.params) and all(
            p.rows == k * c for p, c in zip(layout.params, caps))


def gather_full(dtensor) -> torch.Tensor:
    """The whole tensor of an OS- or G-layout DTensor on an AMSP mesh.

    Works around torch 2.13: ``DTensor.full_tensor()`` (redistribute to Replicate) puts
    the rows of a tensor sharded by Shard(0) on two or more mesh dims of size > 1 in the
    wrong order, although each rank's local rows and offsets are right
    (``distribute_tensor(t, mesh, OS_PLACEMENTS).full_tensor() != t`` for plan p2-g2-os4
    on 4 ranks). We gather (offset, piece) from the ranks holding one full copy instead:
    the "shard" group, and under tensor (expert) parallelism the "tp" ("ep") group too.
    """
    import torch.distributed as dist

    from ..compat import global_offset
    from .mesh import mesh_info

    info = mesh_info(dtensor.device_mesh)
    pieces = [(tuple(global_offset(dtensor)), dtensor.to_local().detach().cpu())]
    for dim in ("shard", info.mp_dim) if info.tp > 1 else ("shard",):
        gathered = [None] * info.size(dim)
        dist.all_gather_object(gathered, pieces, group=info.group(dim))
        pieces = [piece for rank_pieces in gathered for piece in rank_pieces]
    full = torch.empty(dtensor.shape, dtype=dtensor.dtype)
    for offset, piece in pieces:
        if piece.numel():
            full[tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))].copy_(piece)
    return full.to(dtensor.device)
