"""Kernel-launching ops of one training step: AMSP at the ZeRO-3 schedule against FSDP2's
fully_shard on the same model, both with torch AdamW (foreach), as rank 0 of 4.

This file doubles as a probe script. Run as a subprocess (its own process, so torch's fake
process group does not leak into other tests), it builds ``blocks`` blocks of N bias-free
``dim x dim`` linears, shards them with FSDP2 (per block and the root) and with AMSP (p =
g = os = 4, AMSPOptimizer over AdamW), runs one warm-up step and counts the next one with a
TorchDispatchMode: every op below autograd except those that launch no kernel (views,
``empty*``, ``detach``, ``set_`` / ``resize_``, profiler ranges); a DTensor op counts once.
The fake group moves no data, which changes no op count.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from amsp_dtensor.testing.op_count import counting_mode, launches_kernel

aten = torch.ops.aten
WORLD, DIM, BLOCKS, TENSORS = 4, 64, 4, (5, 26)


# ---------------------------------------------------------------------------------------
# the probe (runs in its own process: python tests/test_kernel_count.py)


def _count(system: str, tensors: int) -> dict[str, int]:
    import amsp_dtensor as amsp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(*(m for _ in range(tensors) for m in (
        nn.Linear(DIM, DIM, bias=False), nn.ReLU()))) for _ in range(BLOCKS)))
    if system == "fsdp2":
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in [*model, model]:
            fully_shard(block, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    else:
        plan = amsp.ShardingPlan(WORLD, WORLD, WORLD)
        mesh = amsp.init_mesh(plan, ranks_per_node=2, device_type="cpu")
        for block in [*model, model]:
            amsp.fully_shard(block, mesh=mesh, plan=plan)
        optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3, foreach=True)
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(0))

    def step():
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    step()  # warm-up: lazy init, optimizer states
    mode = counting_mode()
    with mode:
        step()
    return dict(mode.counts)


def _probe() -> dict:
    from amsp_dtensor import compat

    compat.init_fake_process_group(0, WORLD)
    out = {f"{system} {n}": _count(system, n) for n in TENSORS for system in ("fsdp2", "amsp")}
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def counts():
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


@pytest.mark.parametrize("tensors, most", [(5, 1.20), (26, 1.06)])
def test_amsp_launches_about_as_many_kernels_as_fsdp2(counts, tensors, most):
    """The same matmuls in both; AMSP's extra work per unit (its casts and the division of
    the synced G, once per unit, not per tensor) must stay a small, per-unit overhead: with
    foreach AdamW the ratio falls as the tensors per block grow."""
    fsdp, ours = counts[f"fsdp2 {tensors}"], counts[f"amsp {tensors}"]
    assert ours["aten.mm"] == fsdp["aten.mm"] >= 3 * BLOCKS * tensors - 1  # fwd, 2 in bwd
    ratio = sum(ours.values()) / sum(fsdp.values())
    extra = collections.Counter(ours) - collections.Counter(fsdp)
    print(f"{tensors} tensors/block: FSDP2 {sum(fsdp.values())}, AMSP {sum(ours.values())}, "
          f"{ratio:.2f}x; AMSP more: {extra.most_common(6)}")
    assert ratio <= most, (ratio, extra.most_common(8))


if __name__ == "__main__":  # the probe: one process, torch's fake process group
    print(json.dumps(_probe()))
