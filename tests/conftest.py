"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from amsp_dtensor import compat


@pytest.fixture
def fake_four_ranks():
    """Rank 0 of a 4-rank job on torch's fake process group (no other processes)."""
    if dist.is_initialized():
        pytest.skip("needs its own (fake) default process group")
    compat.init_fake_process_group(rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()
