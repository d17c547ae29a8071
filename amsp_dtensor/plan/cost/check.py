"""Compare the cost model with what the engine did: comm events and state bytes.

Used by tests/test_cost_engine.py and callable from the engine's own tests (which already
run every plan at W=4 and W=8): give the model's FSDP units and the recorded CommEvents of
one step and get back the differences (empty list = exact match).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from .comm import event_counter, predicted_events

__all__ = ["unit_param_shapes_of", "schedule_differences"]


def unit_param_shapes_of(model, blocks: Iterable) -> tuple[list[list[tuple]], int | None]:
    """(unit_param_shapes, root_unit_index) for a model wrapped unit by unit, then root.

    ``blocks``: the units in wrap order, each a module or a list of modules (one unit, as
    ``fully_shard([norm, output])``). Then the root's own params (those in no unit), as
    named_parameters() lists them, are the last unit: its index is returned (None when
    the root holds no params of its own).
    """
    units, seen = [], set()
    for block in blocks:
        shapes = []
        for module in (block if isinstance(block, (list, tuple)) else [block]):
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    shapes.append(tuple(p.shape))
        units.append(shapes)
    rest = [tuple(p.shape) for p in model.parameters() if id(p) not in seen]
    if not rest:
        return units, None
    units.append(rest)
    return units, len(units) - 1


def schedule_differences(
    plan, unit_param_shapes: Sequence, micro_batches: int, dtype_bytes: int,
    root_unit_index: int, recorded: Iterable, reshard_after_forward=True, clip: bool = False,
    reduce_dtype_bytes: int | None = None, compression=None,
) -> list[str]:
    """Lines 'key: predicted N, recorded M' for every (op, dim, group, nbytes, inter, phase)
    whose count differs. `recorded`: CommEvents or their key() tuples. compression: the
    Compression the engine ran with (amsp.set_compression), or None."""
    want = event_counter(predicted_events(plan, unit_param_shapes, micro_batches, dtype_bytes,
                                          root_unit_index, reshard_after_forward, clip,
                                          reduce_dtype_bytes=reduce_dtype_bytes,
                                          compression=compression))
    got = Counter(ev if isinstance(ev, tuple) else ev.key() for ev in recorded)
    return [f"{key}: predicted {want.get(key, 0)}, recorded {got.get(key, 0)}"
            for key in sorted(set(want) | set(got), key=str) if want.get(key, 0) != got.get(key, 0)]
