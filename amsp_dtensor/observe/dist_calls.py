"""What one torch.distributed collective call moves, in the recorder's byte convention.

For code that watches torch's collective entry points from outside the engine (the
engine records its own through Collectives): cost/validate.py times every call of a
step, tools/bench_comm.py counts the baselines' calls. nbytes follows
engine/recorder.py: the all-gather output, the reduce-scatter input, the all-reduce or
broadcast tensor.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist

# torch.distributed function name -> op (the *_into_tensor / *_tensor forms are the
# deprecated names of *_single)
OP_OF = {
    "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce", "broadcast": "broadcast",
}


def describe_call(fn, args: tuple, kwargs: dict) -> tuple[str, tuple[int, ...], int]:
    """(op, group's global ranks, nbytes) of the call ``fn(*args, **kwargs)``."""
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    op = OP_OF[fn.__name__]
    # Parameter names differ between the functions; in every one the first tensor is the
    # output (AG, RS) or the tensor (AR, BC), the second the input.
    tensors = [v for v in bound.values() if hasattr(v, "element_size")]
    buffer = tensors[1] if op == "reduce_scatter" else tensors[0]
    group = bound.get("group")
    ranks = (tuple(dist.get_process_group_ranks(group)) if group is not None
             else tuple(range(dist.get_world_size())))
    return op, ranks, buffer.numel() * buffer.element_size()
