"""The engine's observable behaviour as one JSON file, to compare two commits byte for byte.

    python -m amsp_dtensor.testing.fingerprint --out before.json     # at one commit
    python -m amsp_dtensor.testing.fingerprint --out after.json      # at another
    cmp before.json after.json

At a commit that predates this file, run this file by its path with that checkout first
on the path: ``PYTHONPATH=<old checkout> python <this checkout>/amsp_dtensor/testing/fingerprint.py``.

For every valid plan at 4 ranks (2 nodes x 2) and 8 ranks (2 nodes x 4), with fp32 and
bf16 parameters and with the post-step all-gather landed in step() or overlapped with
the next forward, it trains the tiny llama for 2 steps of 2 micro-batches (clip 1.0,
AdamW) and writes, per rank: every collective each step recorded, in the order they
completed (op, mesh dim, group size, bytes, crosses nodes, phase); memory_by_state after
the first micro-batch and after each step; the gradient bytes at every unit's hook
(track_backward_memory); and the losses and global norms as exact float hex. Only the
public API is used, so the same file runs at any commit that has it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist

RANKS_PER_NODE = {4: 2, 8: 4}  # world size -> ranks per node
STEPS, MICRO_BATCHES = 2, 2


def _case(rank, world, plan, dtype, overlap, meshes):
    import amsp_dtensor as amsp
    from amsp_dtensor.testing.scenarios import global_batches, local_micro_batch, make_model
    from amsp_dtensor.testing.tiny_llama import loss_fn

    sharding = amsp.ShardingPlan(*plan)
    if plan not in meshes:  # one mesh per plan: its variants share its process groups
        meshes[plan] = amsp.init_mesh(sharding, ranks_per_node=RANKS_PER_NODE[world],
                                      device_type="cpu")
    mesh = meshes[plan]
    model = make_model(dtype)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                               overlap_param_update=overlap)
    out = {"events": [], "memory": [], "backward_memory": [], "losses": [], "norms": []}
    for step in range(STEPS):
        batch = global_batches(step, world, MICRO_BATCHES, model.cfg)
        recorder = amsp.CommRecorder()
        total = torch.zeros(1)
        with amsp.record_comms(recorder), amsp.track_backward_memory(model) as tracker:
            for micro in range(MICRO_BATCHES):
                mb = local_micro_batch(batch, rank, world, micro)
                last = micro == MICRO_BATCHES - 1
                with contextlib.nullcontext() if last else amsp.no_sync(model):
                    loss = loss_fn(model(mb[:, :-1]), mb[:, 1:]) / MICRO_BATCHES
                    loss.backward()
                total += loss.detach().float()
                if micro == 0:
                    out["memory"].append(amsp.memory_by_state(model, optim))
            out["norms"].append(optim.clip_grad_norm_(1.0).item().hex())
            optim.step()
            out["memory"].append(amsp.memory_by_state(model, optim))
            optim.zero_grad()
        optim.wait_param_update()
        out["events"].append([list(e.key()) for e in recorder.events])
        out["backward_memory"].append([[s.unit, s.micro, s.sync, s.bytes] for s in tracker.samples])
        dist.all_reduce(total)
        out["losses"].append((total.item() / world).hex())
    return out


def _all_cases(rank, world, per_node):
    from amsp_dtensor.plan import enumerate_plans

    # [Note: one mesh per plan] Each mesh makes its own gloo groups, and a gloo group keeps
    # threads alive until the process ends: a mesh per case (4 per plan) left 749 threads
    # per rank at 8 ranks by the end and held the machine's load near 1000.
    out, meshes = {}, {}
    for plan in enumerate_plans(world, per_node):
        key = (plan.s_p, plan.s_g, plan.s_os)
        for dtype in (torch.float32, torch.bfloat16):
            for overlap in (False, True):
                name = f"p{key[0]}-g{key[1]}-os{key[2]}-{str(dtype)[6:]}-overlap{int(overlap)}"
                out[name] = _case(rank, world, key, dtype, overlap, meshes)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--worlds", default="4,8")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from amsp_dtensor.testing.multiproc import run_on_ranks

    result = {}
    for world in (int(w) for w in args.worlds.split(",")):
        per_rank = run_on_ranks(_all_cases, world, RANKS_PER_NODE[world], RANKS_PER_NODE[world],
                                timeout=1800)
        result[f"world{world}"] = {f"rank{r}": cases for r, cases in enumerate(per_rank)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=0, sort_keys=True)
    n = sum(len(next(iter(w.values()))) for w in result.values())
    print(f"fingerprint: {n} cases over worlds {args.worlds} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
