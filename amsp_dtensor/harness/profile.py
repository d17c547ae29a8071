"""Measure the effective bandwidth of the collectives the planner may use; write a table.

    torchrun --nproc_per_node N -m amsp_dtensor.plan.profile --out table.json \
        [--ranks-per-node R] [--min-bytes 4] [--max-bytes 16M] [--backend gloo|nccl]

For every group shape that appears in any valid plan of this world (plan/cost/comm.py: "p",
"g", "os", "rep", "shard" groups and hpZ's intra-node group: arithmetic progressions of
ranks, contiguous or strided), every rank joins its group of that shape and all groups run
the collective at once, as in a training step (so groups that share a node's links contend
as they would). Ops: all_gather_single, reduce_scatter_single, all_reduce, broadcast.
Sizes: powers of 4 from --min-bytes to --max-bytes (nbytes = the recorder's convention:
AG output, RS input, AR/BC tensor). Time per op: after warm-up, samples of ONE op each,
started by a barrier of the whole world (so every group starts together and nobody
computes beside it, as a collective in a step starts) into an output buffer whose pages
are already resident, at least --repeats samples and up to ~--target-ms of them. FSDP2 and
the engine allocate a new output per op, but inside a running step the allocator hands
back resident memory (glibc's heap on CPU, the caching allocator on GPU); a never-touched
buffer would charge first-touch page faults to the network (gloo here: all-gather of
3.4 MB over 2 ranks 8.4 ms into fresh pages, 5.2 ms into resident ones). On CPU this
holds below glibc's 32 MiB mmap ceiling: larger outputs are fresh pages every time, and
the table under-predicts them. The smallest
size is one fp32 (clip_grad_norm_'s scalar all-reduce; gloo's time is not monotone in
size below ~1 MB, so the table must hold the sizes the engine issues). A pass keeps the
MEAN of the slowest rank's times (a step's comm time is a sum over many calls, so it
follows the mean of a skewed distribution, not its median); --rounds passes interleave
all points, and the table keeps the median over passes. The JSON schema is in
amsp_dtensor/plan/cost/bandwidth.py; the planner reads it with --bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from .. import compat
from ..plan import enumerate_plans
from ..plan.cost.bandwidth import SCHEMA
from ..plan.cost.comm import group_shape

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().rstrip("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 16M, 1G)") from None


def group_shapes(world_size: int, ranks_per_node: int) -> list[tuple[int, int]]:
    """(size, stride) of every group any valid plan (or hpZ) uses, size > 1."""
    shapes = set()
    for p in enumerate_plans(world_size, ranks_per_node):
        for size, stride in ((p.s_p, 1), (p.s_g // p.s_p, p.s_p), (p.s_os // p.s_g, p.s_g),
                             (world_size // p.s_os, p.s_os), (p.s_os, 1)):
            if size > 1:
                shapes.add((size, stride))
    k = min(ranks_per_node, world_size)
    if k > 1:
        shapes.add((k, 1))
    return sorted(shapes)


def groups_of(size: int, stride: int, world_size: int) -> list[list[int]]:
    return [[base + i * stride for i in range(size)]
            for base in range(world_size) if (base // stride) % size == 0]


def _run(op, group, buf_in, buf_out, src):
    if op == "all_gather":
        compat.all_gather_single(buf_out, buf_in, group=group)
    elif op == "reduce_scatter":
        compat.reduce_scatter_single(buf_out, buf_in, group=group)
    elif op == "all_reduce":
        dist.all_reduce(buf_in, group=group)
    else:
        dist.broadcast(buf_in, src=src, group=group)


def _numel(op, nbytes, n, elem) -> int:
    # AG/RS need a multiple of the group size; AR/BC can be a single element.
    quantum = n if op in ("all_gather", "reduce_scatter") else 1
    return max(quantum, (nbytes // elem) // quantum * quantum)


def _buffers(op, nbytes, n, dtype, device):
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = _numel(op, nbytes, n, elem)
    if op == "all_gather":
        return torch.ones(numel // n, dtype=dtype, device=device), torch.empty(numel, dtype=dtype, device=device), numel * elem
    if op == "reduce_scatter":
        return torch.ones(numel, dtype=dtype, device=device), torch.empty(numel // n, dtype=dtype, device=device), numel * elem
    return torch.ones(numel, dtype=dtype, device=device), None, numel * elem


def _world_max(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(op, group, src, nbytes, n, dtype, device, target_s, repeats, sync):
    """Mean over samples of one op's time on the slowest rank. Each sample: barrier of
    the whole world (all groups start together, nobody computes), one op, wait."""
    buf_in, buf_out, real = _buffers(op, nbytes, n, dtype, device)
    if buf_out is not None:
        buf_out.zero_()  # resident pages: see the module docstring
    for _ in range(2):  # warm-up (connections, allocator)
        _run(op, group, buf_in, buf_out, src)
    sync()
    samples = []
    spent = 0.0
    while len(samples) < repeats or (spent < target_s and len(samples) < 10 * repeats):
        dist.barrier()
        t0 = time.perf_counter()
        _run(op, group, buf_in, buf_out, src)
        sync()
        sample = _world_max(time.perf_counter() - t0, device)
        samples.append(sample)
        spent += sample
        # every rank must take the same number of samples: decide on the world's max
    return real, statistics.fmean(samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="torchrun ... -m amsp_dtensor.plan.profile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON table to write (rank 0)")
    ap.add_argument("--ranks-per-node", type=int,
                    default=int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None)
    ap.add_argument("--backend", choices=("gloo", "nccl"),
                    default="nccl" if torch.cuda.is_available() else "gloo")
    ap.add_argument("--min-bytes", type=_size, default=4)
    ap.add_argument("--max-bytes", type=_size, default=None,
                    help="default 16M on gloo, 1G on nccl (capped by free GPU memory)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--target-ms", type=float, default=100.0,
                    help="time to spend sampling one size (at least --repeats samples)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3,
                    help="passes over every (group, op, size); the table keeps the median "
                    "over passes of each pass's mean")
    args = ap.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        ap.error(f"unknown ops {bad}; choose from {OPS}")
    for name in ("repeats", "rounds", "min_bytes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    dist.init_process_group(args.backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    R = args.ranks_per_node or world
    if world % R:
        ap.error(f"world size {world} is not a multiple of --ranks-per-node {R}")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
        max_bytes = args.max_bytes or min(2**30, torch.cuda.mem_get_info(device)[0] // 4)
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731  (gloo ops are synchronous)
        max_bytes = args.max_bytes or 16 * 2**20
    dtype = getattr(torch, args.dtype)
    sizes = []
    s = args.min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    elem = torch.tensor([], dtype=dtype).element_size()
    started = time.time()
    # Every group shape's groups are created first, so the rounds can interleave them.
    shapes = []
    for size, stride in group_shapes(world, R):
        my_group, _ = dist.new_subgroups_by_enumeration(groups_of(size, stride, world))
        members = next(g for g in groups_of(size, stride, world) if rank in g)
        shapes.append((size, stride, my_group, members[0]))
    # Rounds: every (shape, op, size) is measured once per round, and the table keeps the
    # median over rounds of each round's mean. A transient disturbance of the host (other
    # processes, a noisy VM neighbour) then spoils one round of a few points, not the whole
    # curve of one group; a training step is judged the same way (validate.py: median
    # over steps of each step's sum).
    # (size, stride, op) -> {bytes: [each round's mean seconds]}
    means: dict[tuple, dict[int, list[float]]] = {}
    for _round in range(args.rounds):
        for size, stride, my_group, src in shapes:
            for op in ops:
                # tiny sizes round up to one element per rank: measure each real size once
                for nbytes in sorted({_numel(op, b, size, elem) * elem for b in sizes}):
                    real, seconds = measure(op, my_group, src, nbytes, size, dtype, device,
                                            args.target_ms / 1e3, args.repeats, sync)
                    means.setdefault((size, stride, op), {}).setdefault(real, []).append(seconds)
    entries = []
    for size, stride, _, _ in shapes:
        shape = group_shape(size, stride, world, R)
        for op in ops:
            points = sorted([real, statistics.median(rounds)]
                            for real, rounds in means[(size, stride, op)].items())
            entries.append({"op": op, "group_size": size, "stride": stride,
                            "group_ranks_per_node": shape.ranks_per_node,
                            "group_nodes": shape.nodes, "inter_node": shape.inter_node,
                            "points": points})
            if rank == 0:
                big_n, big_t = points[-1]
                print(f"{op:>14} n={size} stride={stride} nodes={shape.nodes}: "
                      f"{big_n / big_t / 1e9:7.3f} GB/s at {big_n / 2**20:.1f} MiB",
                      file=sys.stderr, flush=True)
    if rank == 0:
        table = {"schema": SCHEMA, "backend": args.backend, "device": str(device.type),
                 "world_size": world, "ranks_per_node": R,
                 "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "dtype": args.dtype, "statistic": "median over rounds of the mean",
                 "rounds": args.rounds, "repeats": args.repeats, "target_ms": args.target_ms,
                 "seconds_taken": round(time.time() - started, 1), "entries": entries}
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {args.out}: {len(entries)} entries in {time.time() - started:.0f}s",
              file=sys.stderr)
    compat.destroy_process_group_at_exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
