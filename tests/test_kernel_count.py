"""tools/kernel_count.py's rule for which ops launch a kernel, and its counting mode on a
known sequence of ops (the multi-rank comparison itself is a benchmark command)."""

import torch

from tools.kernel_count import counting_mode, launches_kernel

aten = torch.ops.aten


def test_views_and_allocations_launch_no_kernel():
    for op in (aten.view.default, aten.t.default, aten.as_strided.default, aten.slice.Tensor,
               aten.empty.memory_format, aten.detach.default, aten.alias.default):
        assert not launches_kernel(op), op
    for op in (aten.mm.default, aten.add_.Tensor, aten.copy_.default, aten.div.Tensor,
               aten._foreach_add_.List):
        assert launches_kernel(op), op


def test_the_mode_counts_what_ran():
    a, b = torch.ones(4, 4), torch.ones(4, 4)
    mode = counting_mode()
    with mode:
        c = (a @ b.t()).view(16)  # mm counted; t and view are not
        c.add_(1)
    assert dict(mode.counts) == {"aten.mm": 1, "aten.add_": 1}
