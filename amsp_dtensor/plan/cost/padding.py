"""Shard(0) padding, exactly as the engine (and FSDP2) lays out a tensor over s ranks.

A tensor with dim0 = d0 and cols = numel/d0 sharded over s ranks holds ceil(d0/s) rows on
every rank (the last ranks hold padding), so the whole padded tensor is s*ceil(d0/s)*cols
elements (padded(U, s) = e * sum_params s * ceil(d0/s) * cols).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

Shape = Sequence[int]

__all__ = ["dim0_cols", "padded_numel", "shard_numel", "numel"]


def dim0_cols(shape: Shape) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), int(math.prod(shape[1:])) if len(shape) > 1 else 1


def shard_numel(shapes: Iterable[Shape], s: int) -> int:
    """Elements one rank holds when every tensor is Shard(0) over s ranks (with padding)."""
    total = 0
    for shape in shapes:
        d0, cols = dim0_cols(shape)
        total += -(-d0 // s) * cols
    return total


def padded_numel(shapes: Iterable[Shape], s: int) -> int:
    """Elements of the whole padded unit over s ranks: s * shard_numel."""
    return s * shard_numel(shapes, s)


def numel(shapes: Iterable[Shape]) -> int:
    return sum(math.prod(shape) for shape in shapes)
