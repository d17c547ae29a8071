"""Kernel-launching aten ops of one training step: AMSP at the ZeRO-3 schedule against
FSDP2's fully_shard, on the same model.

    python -m tools.kernel_count --tensors 5,26 --blocks 4 --world 4

Both on gloo ranks, fully sharded (FSDP2 per block and on the root with torch AdamW; AMSP
with p = g = os = world and AMSPOptimizer over AdamW), on ``--blocks`` blocks of N bias-free
``dim x dim`` linears. After one warm-up step, one step is counted on rank 0 with a
TorchDispatchMode: every op below autograd except those that launch no kernel (views,
``empty*``, ``detach``, ``set_`` / ``resize_``, profiler ranges); a DTensor op counts once.
Prints both counts, their ratio, and the top ops where they differ.
"""

from __future__ import annotations

import argparse
import collections
import os

import torch
import torch.nn as nn

NO_KERNEL = {"aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
             "aten.detach", "aten.set_", "aten.resize_", "aten.lift_fresh", "aten.alias"}


def launches_kernel(func) -> bool:
    """False for ops that only make views or metadata, or allocate without writing."""
    name = f"{func.namespace}.{func._schema.name.split('::')[-1]}"
    if name in NO_KERNEL or func.namespace == "profiler":  # record_function ranges
        return False
    # a view returns an alias of an input without writing it (in-place ops write theirs)
    return not any(r.alias_info is not None and not r.alias_info.is_write
                   for r in func._schema.returns)


def counting_mode():
    from amsp_dtensor import compat

    class CountOps(compat.torch_dispatch_mode_base()):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if launches_kernel(func):
                self.counts[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return CountOps()


def make_model(dim: int, tensors: int, blocks: int) -> nn.Sequential:
    """``blocks`` blocks of ``tensors`` bias-free ``dim x dim`` linears, each with a ReLU."""
    def block() -> nn.Sequential:
        layers = []
        for _ in range(tensors):
            layers += [nn.Linear(dim, dim, bias=False), nn.ReLU()]
        return nn.Sequential(*layers)

    return nn.Sequential(*(block() for _ in range(blocks)))


def _step(model, optim, x):
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _count(rank, world, system, dim, tensors, blocks, foreach):
    import amsp_dtensor as amsp

    torch.manual_seed(0)
    model = make_model(dim, tensors, blocks)
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    else:
        plan = amsp.ShardingPlan(world, world, world)
        mesh = amsp.init_mesh(plan, ranks_per_node=int(os.environ["LOCAL_WORLD_SIZE"]),
                              device_type="cpu")
        for block in model:
            amsp.fully_shard(block, mesh=mesh, plan=plan)
        amsp.fully_shard(model, mesh=mesh, plan=plan)
        optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3, foreach=foreach)
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(rank))
    _step(model, optim, x)  # warm-up: lazy init, optimizer state
    mode = counting_mode()
    with mode:
        _step(model, optim, x)
    return dict(mode.counts)


def _both(rank, world, dim, tensor_counts, blocks, foreach):
    return {(system, n): _count(rank, world, system, dim, n, blocks, foreach)
            for n in tensor_counts for system in ("fsdp2", "amsp")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="5,26", help="tensors per block, comma-separated")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--no-foreach", dest="foreach", action="store_false",
                    help="the optimizers' per-tensor loop instead of foreach kernels")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from amsp_dtensor.testing.multiproc import run_on_ranks

    counts = [int(n) for n in args.tensors.split(",")]
    rank0 = run_on_ranks(_both, args.world, args.ranks_per_node, args.dim, counts,
                         args.blocks, args.foreach, timeout=600)[0]
    print(f"kernel-launching ops in one step, rank 0 of {args.world}, {args.blocks} blocks, "
          f"AdamW foreach={args.foreach}, ZeRO-3 schedule (AMSP p = g = os = {args.world})")
    print(f"{'tensors/block':>13} {'FSDP2':>7} {'AMSP':>7} {'AMSP/FSDP2':>10}")
    for n in counts:
        fsdp, ours = rank0[("fsdp2", n)], rank0[("amsp", n)]
        total_f, total_a = sum(fsdp.values()), sum(ours.values())
        print(f"{n:>13} {total_f:>7} {total_a:>7} {total_a / total_f:>10.2f}")
    for n in counts:
        fsdp, ours = collections.Counter(rank0[("fsdp2", n)]), collections.Counter(rank0[("amsp", n)])
        more, fewer = ours - fsdp, fsdp - ours
        print(f"\n{n} tensors/block: AMSP more: "
              + ", ".join(f"{op} +{c}" for op, c in more.most_common(8))
              + "\n" + " " * (len(str(n)) + 16) + "AMSP fewer: "
              + ", ".join(f"{op} -{c}" for op, c in fewer.most_common(8)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
