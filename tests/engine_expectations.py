"""What the engine SHOULD do, written from the schedule and the memory model in
docs/design.md, independently of the engine's code (no amsp_dtensor imports beyond the
test model)."""

from __future__ import annotations

import math
from collections import Counter

from amsp_dtensor.testing.tiny_llama import TinyLlama


def unit_shapes():
    """[(is_root, [shape, ...])] for TinyLlama sharded per block then at the root."""
    model = TinyLlama()
    units = [(False, [tuple(p.shape) for p in layer.parameters()]) for layer in model.layers]
    block_ids = {id(p) for layer in model.layers for p in layer.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in block_ids]
    return units + [(True, root)]


def _rows_cols(shape):
    return (shape[0] if shape else 1), (math.prod(shape[1:]) if len(shape) > 1 else 1)


def padded(shapes, s, elem):
    """Bytes of a unit's tensors with each dim 0 padded to a multiple of s."""
    total = 0
    for shape in shapes:
        rows, cols = _rows_cols(shape)
        total += s * math.ceil(rows / s) * cols
    return total * elem


def _inter(dim, plan, world, per_node):
    s_p, s_g, s_os = plan
    size = {"p": s_p, "g": s_g // s_p, "os": s_os // s_g, "rep": world // s_os, "shard": s_os}[dim]
    stride = {"p": 1, "g": s_p, "os": s_g, "rep": s_os, "shard": 1}[dim]
    span = (size - 1) * stride + 1  # ranks covered by the group holding rank 0
    return size, span > per_node


def expected_step_events(plan, world, per_node, micro_batches, elem, clip=True, grad_elem=None):
    """Counter of (op, dim, group_size, nbytes, inter_node, phase) for one step. ``elem``:
    bytes of a parameter element (all-gathers); ``grad_elem``: of a gradient element (every
    reduction; the policy's reduce_dtype), default ``elem``."""
    s_p, s_g, s_os = plan
    grad_elem = grad_elem or elem
    events = Counter()

    def add(op, dim, nbytes, phase):
        size, inter = _inter(dim, plan, world, per_node)
        events[(op, dim, size, nbytes, inter, phase)] += 1

    for micro in range(micro_batches):
        last = micro == micro_batches - 1
        for is_root, shapes in unit_shapes():
            if s_p > 1:
                add("all_gather", "p", padded(shapes, s_p, elem), "forward")
                if not is_root:  # FSDP2 keeps the root unsharded after forward
                    add("all_gather", "p", padded(shapes, s_p, elem), "backward")
                add("reduce_scatter", "p", padded(shapes, s_p, grad_elem), "backward")
            if s_g > s_p:
                add("reduce_scatter", "g", padded(shapes, s_g, grad_elem) // s_p, "sync" if last else "backward")
            if last:
                if s_g == s_p and s_os > s_p:
                    add("reduce_scatter", "os", padded(shapes, s_os, grad_elem) // s_p, "sync")
                if world // s_os > 1:
                    add("all_reduce", "rep", padded(shapes, s_os, grad_elem) // s_os, "sync")
    if clip and s_os > 1:
        add("all_reduce", "shard", 4, "step")
    if s_os > s_p:
        for _, shapes in unit_shapes():
            add("all_gather", "g" if s_g > s_p else "os", padded(shapes, s_os, elem) // s_p, "step")
    return events


def os_bytes(elem):
    """OS bytes per parameter for AdamW: two fp32 moments, plus an fp32 master unless the
    params are fp32 (then they are their own master)."""
    return 8 if elem == 4 else 12


def ideal_bytes(plan, elem):
    """The paper's memory model per rank: (P, G, OS) = (e/s_p, e/s_g, o/s_os) * Phi, and the
    padding allowance of one row per tensor. o = 12 (fp32 master + two Adam moments) with
    bf16 params; 8 with fp32 params, whose P shard is its own master."""
    s_p, s_g, s_os = plan
    shapes = [s for _, unit in unit_shapes() for s in unit]
    phi = sum(math.prod(s) for s in shapes)
    row = sum(_rows_cols(s)[1] for s in shapes)  # one row of every tensor, in elements
    return {
        "phi": phi,
        "param": elem * phi / s_p,
        "grad": elem * phi / s_g,
        "optim": os_bytes(elem) * phi / s_os,
        "row_elems": row,
    }
