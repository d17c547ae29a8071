"""Counting the kernel-launching ops of a region (a TorchDispatchMode).

Every op below autograd counts except those that launch no kernel: views, ``empty*``,
``detach``, ``set_`` / ``resize_``, profiler ranges. A DTensor op counts once (the mode
sees it before DTensor's own dispatch runs its local ops). Used by
tests/test_kernel_count.py and tools/host_bench.py.
"""

from __future__ import annotations

import collections

NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
             "aten.detach", "aten.set_", "aten.resize_", "aten.lift_fresh", "aten.alias"}


def launches_kernel(func) -> bool:
    """False for ops that only make views or metadata, or allocate without writing."""
    from ..compat import op_schema

    schema = op_schema(func)
    name = f"{func.namespace}.{schema.name.split('::')[-1]}"
    if name in NO_KERNEL or func.namespace == "profiler":  # record_function ranges
        return False
    # a view returns an alias of an input without writing it (in-place ops write theirs)
    return not any(r.alias_info is not None and not r.alias_info.is_write
                   for r in schema.returns)


def counting_mode():
    """A dispatch mode whose ``counts`` (a Counter by op packet name) grow while it is on."""
    from .. import compat

    class CountOps(compat.torch_dispatch_mode_base()):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if launches_kernel(func):
                self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return CountOps()
