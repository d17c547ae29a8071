"""torchtitan 0.2.2's own MoE training (its FSDP2 + expert parallelism, no AMSP) on CPU,
through titan/cpu_compat.py's shims (1) (token permutation without triton) and (10)
(histc on int64 expert ids); tools/titan_moe_cpu.sh runs the full reference trainings.

End to end, torchtitan's own deepseek_v3 debugmodel with EP 2 is the reference that
tests/test_titan_moe.py compares AMSP with (both shims, the all-to-all token dispatch, the
load-balancing hook); qwen3 debugmodel_moe (64 experts, ~30 s a step on 2 cores) is left to
the scripts.
"""

from __future__ import annotations

import pytest
import torch



@pytest.fixture(scope="module")
def shims():
    from amsp_dtensor.titan import cpu_compat

    if not cpu_compat.apply():
        pytest.skip("an accelerator exists: torchtitan runs its own kernels, no shim applies")


def test_histc_counts_integer_expert_ids_exactly(shims):
    import torchtitan.models.moe.moe as moe

    ids = torch.randint(0, 64, (2 * 256 * 8,), generator=torch.Generator().manual_seed(0))
    counts = moe.torch.histc(ids, bins=64, min=0, max=64)  # the router's call
    assert counts.dtype == torch.int64  # as CUDA's histc returns it
    assert torch.equal(counts, torch.bincount(ids, minlength=64))
    x = torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(moe.torch.histc(x, bins=2, min=0, max=1), torch.histc(x, bins=2, min=0, max=1))


def test_permute_indices_without_triton(shims):
    try:
        import triton  # noqa: F401

        pytest.skip("triton is installed: shim (1) leaves torchtitan's kernels alone")
    except ImportError:
        pass
    from torchtitan.models.moe.kernels import generate_permute_indices

    # the example of its docstring: 2 ranks x 4 local experts, groups aligned to 8
    group = torch.tensor([4, 2, 1, 3, 1, 2, 3, 4])
    for use_cpu in (False, True):  # False: models/moe/utils.py's _permute call
        indices, sizes, offsets = generate_permute_indices(group, 4, 2, 40, 8, use_cpu=use_cpu)
        pad = [-1] * 3
        assert indices.tolist() == ([0, 1, 2, 3, 10] + pad + [4, 5, 11, 12] + pad + [-1]
                                    + [6, 13, 14, 15] + pad + [-1] + [7, 8, 9, 16, 17, 18, 19]
                                    + [-1] * 9)
        assert sizes.tolist() == [8, 8, 8, 8] and offsets.tolist() == [8, 16, 24, 32]
