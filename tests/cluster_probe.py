"""The emulated cluster's check worker (tests/test_cluster.py runs it; so can you, under
``python -m tools.cluster run ... -- tests/cluster_probe.py``).

Modes: ``bw`` (default), gloo bandwidth rank 0 -> a rank of its node and of another node,
and the bytes this node's eth0 saw meanwhile (same-node traffic stays on loopback);
``check``, all-reduce the ranks and assert the sum; ``fail``, check, then rank --fail-rank
exits with --exit-code; ``sleep``, sleep forever without importing torch (teardown tests).
Rank 0 prints one JSON line ``PROBE {...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _iface_bytes(iface: str) -> int:
    total = 0
    for kind in ("tx_bytes", "rx_bytes"):
        try:
            with open(f"/sys/class/net/{iface}/statistics/{kind}") as f:
                total += int(f.read())
        except OSError:
            return -1
    return total


def _pingpong(dist, torch, peer: int, nbytes: int, reps: int) -> float:
    """Best one-way MB/s for `nbytes` from rank 0 to `peer` (peer acks with 1 element)."""
    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    ack = torch.zeros(1)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(ack, peer)
        elif rank == peer:
            dist.recv(buf, 0)
            dist.send(ack, 0)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="bw", choices=("bw", "check", "fail", "sleep"))
    ap.add_argument("--mbytes", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fail-rank", type=int, default=1)
    ap.add_argument("--exit-code", type=int, default=3)
    ap.add_argument("--marker", default="", help="ignored; lets tests find our processes")
    args = ap.parse_args()

    if args.mode == "sleep":
        print(f"sleeping rank {os.environ.get('RANK')}", flush=True)
        while True:
            time.sleep(3600)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == world * (world - 1) / 2, t
    if args.mode == "fail" and rank == args.fail_rank:
        print(f"rank {rank} fails on purpose with exit code {args.exit_code}", flush=True)
        os._exit(args.exit_code)
    result = {"world": world, "ranks_per_node": rpn,
              "iface": os.environ.get("GLOO_SOCKET_IFNAME"),
              "master": os.environ.get("MASTER_ADDR")}
    if args.mode == "bw":
        nbytes = int(args.mbytes * 1e6)
        iface = os.environ.get("GLOO_SOCKET_IFNAME", "eth0")
        for name, peer in (("intra", 1 if rpn > 1 else None),
                           ("inter", rpn if world > rpn else None)):
            if peer is None:
                continue
            dist.barrier()
            before = _iface_bytes(iface)
            mbps = _pingpong(dist, torch, peer, nbytes, args.reps)
            dist.barrier()
            result[f"{name}_MBps"] = round(mbps, 1)
            result[f"{name}_iface_MB_seen_by_rank0"] = round(
                (_iface_bytes(iface) - before) / 1e6, 2)
    if args.mode == "fail":
        dist.barrier()  # the failing rank never arrives: peers block until torn down
    dist.destroy_process_group()
    if rank == 0:
        print("PROBE " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
