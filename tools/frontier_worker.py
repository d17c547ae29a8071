"""The torchrun worker of tools/bench_frontier.py: every configuration of every system.

One process set runs the whole sweep of one scale: for rep in reps: for config in configs:
tools/bench_worker.run_one (build from the same seed, ``warmup`` untimed steps, timed
steps; collectives, state bytes and the time AMSP waited in collectives are recorded in
the last step of repetition 0, which then runs ``--mem-steps`` untimed per-op-sampled
steps). A configuration may get fewer timed steps
(``--steps-for``) or repetitions (``--reps-for``) than the others; warm-up steps are the
same for all, so every configuration sees the same data in its first steps. Rank 0
writes one JSON (bench_worker's format, plus each result's config key).

Configurations (``sweep``): DDP; ZeRO-1; FSDP2 ZeRO-3 with reshard_after_forward True
(``zero3``) and False (``zero3_keep``); HSDP with every shard-group size s, 1 < s < world,
that is a divisor of the ranks per node or a multiple of it (``hsdp`` for s = ranks per
node, ``hsdp:<s>`` otherwise; s = world is ZeRO-3); ZeRO++ hpZ; every valid AMSP plan
(amsp_dtensor.plan.enumerate_plans).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist

from tools import bench_comm
from tools import bench_systems as S
from tools import bench_worker as W

FRONTIER_DEFAULTS = dict(warmup=2, steps=2, reps=3)


def hsdp_shard_sizes(world: int, rpn: int) -> list[int]:
    """Shard-group sizes HSDP can use on this topology, other than 1 (DDP) and the world
    (ZeRO-3): divisors of the world that stay in a node or fill whole nodes."""
    return [s for s in range(2, world) if world % s == 0
            and ((s <= rpn and rpn % s == 0) or s % rpn == 0)]


def sweep(world: int, rpn: int) -> list[str]:
    """Every configuration key of the sweep, baselines first (see the module docstring)."""
    from amsp_dtensor.plan import enumerate_plans

    keys = ["ddp", "zero1", "zero3", "zero3_keep"]
    keys += ["hsdp" if s == rpn else f"hsdp:{s}" for s in hsdp_shard_sizes(world, rpn)]
    keys += ["hpz"]
    keys += [f"amsp:{p.name}" for p in enumerate_plans(world, rpn)]
    return keys


def parse_counts(spec: str) -> dict[str, int]:
    """'zero3=1,amsp:p4-g4-os4=1' -> {'zero3': 1, 'amsp:p4-g4-os4': 1}."""
    out = {}
    for item in W.comma_list(spec):
        key, sep, n = item.rpartition("=")
        if not sep or not key or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"bad count {item!r}: write KEY=N with N >= 1")
        out[key] = int(n)
    return out


def add_frontier_args(ap: argparse.ArgumentParser) -> None:
    """The sweep's own options (tools/bench_frontier passes them on)."""
    ap.set_defaults(**FRONTIER_DEFAULTS)
    ap.add_argument("--configs", default="all",
                    help="comma-separated configuration keys, or 'all' (the sweep)")
    ap.add_argument("--steps-for", default="",
                    help="timed steps for some configurations instead of --steps, "
                         "e.g. zero3=1,amsp:p4-g4-os4=1")
    ap.add_argument("--reps-for", default="",
                    help="repetitions for some configurations instead of --reps")
    ap.add_argument("--mem-steps", type=int, default=0,
                    help="untimed steps after the timed ones in repetition 0, memory "
                         "sampled after every op (for runs with one warm-up step, whose "
                         "per-op samples would otherwise miss the steady-state backward)")
    ap.add_argument("--prune", type=float, default=0.0,
                    help="after repetition 0, run no more repetitions of a configuration "
                         "that another of the same system beats by this margin (e.g. 0.1: "
                         ">= 1.1x its tokens/s) at no more peak memory; 0 = off")
    ap.add_argument("--keep", default="",
                    help="comma-separated configuration keys --prune never cuts "
                         "(tools/bench_frontier adds the planner's possible picks)")


FRONTIER_DESTS = ("configs", "steps_for", "reps_for", "mem_steps", "prune", "keep")


def frontier_argv(args: argparse.Namespace) -> list[str]:
    argv = W.workload_argv(args)
    for dest in FRONTIER_DESTS:
        argv += ["--" + dest.replace("_", "-"), str(getattr(args, dest))]
    return argv


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    W.add_workload_args(ap)
    add_frontier_args(ap)
    W.add_run_args(ap)
    return ap.parse_args(argv)


def sweep_keys(configs: str, world: int, rpn: int) -> list[str]:
    """The configurations --configs names: 'all' is the whole sweep. A key outside the
    sweep of this topology, or a list without an AMSP plan (the report compares AMSP's
    frontier with the baselines'), is refused before anything runs."""
    every = sweep(world, rpn)
    if configs == "all":
        return every
    keys = W.comma_list(configs)
    unknown = [k for k in keys if k not in every]
    if unknown:
        raise SystemExit(f"--configs: {unknown} not in the sweep of {world} ranks, "
                         f"{rpn} per node; its keys: {','.join(every)}")
    if not any(k.startswith("amsp:") for k in keys):
        raise SystemExit("--configs names no AMSP plan: the frontier compares AMSP with "
                         "the baselines, so add one, e.g. "
                         + next(k for k in every if k.startswith("amsp:")))
    return keys


def schedule(keys: list[str], reps: int, steps: int, reps_for: dict, steps_for: dict):
    """[(rep, key, timed steps)] in run order: configurations interleaved in each rep."""
    unknown = sorted((set(reps_for) | set(steps_for)) - set(keys))
    if unknown:
        raise SystemExit(f"--reps-for/--steps-for name configurations not in the sweep: "
                         f"{unknown}")
    return [(rep, key, steps_for.get(key, steps))
            for rep in range(max([reps, *reps_for.values()]))
            for key in keys if rep < reps_for.get(key, reps)]


def dominated(results: list[dict], margin: float, tokens: int,
              keep: frozenset[str] = frozenset()) -> list[str]:
    """Configurations off their own system's frontier by `margin`, from one repetition's
    results: another configuration of the same system peaks at no more memory and runs
    >= (1 + margin) x its tokens/s; never one in `keep`. Step times and peaks in the
    results are the same on every rank (reduced over ranks), so every rank reaches the
    same list."""
    from tools.frontier_report import family

    if margin <= 0:
        return []
    facts = [(r["config"], family(r["config"]), max(r["peak_bytes_per_rank"]),
              tokens * len(r["step_times"]) / sum(r["step_times"])) for r in results]
    return [key for key, fam, peak, tps in facts
            if key not in keep
            and any(f == fam and k != key and p <= peak and t >= (1 + margin) * tps
                    for k, f, p, t in facts)]


def build_groups(key: str, meshes, plan) -> None:
    """Create (and cache in `meshes`) the device mesh configuration `key` will use."""
    if key in ("zero3", "zero3_keep", "hpz"):
        meshes.world_mesh()
    elif key == "hsdp":
        meshes.hsdp_mesh()
    elif key.startswith("hsdp:"):
        meshes.hsdp_mesh(int(key.split(":", 1)[1]))
    elif key.startswith("amsp:"):
        meshes.amsp_mesh(plan)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    counter = bench_comm.install(rpn)
    model_args = S.model_args(args.flavor, args.seq)
    meshes = S.MeshCache(world, rpn)

    keys = sweep_keys(args.configs, world, rpn)
    keep = frozenset(W.comma_list(args.keep))
    unknown = sorted(keep - set(keys))
    if unknown:
        raise SystemExit(f"--keep names configurations not in the sweep: {unknown}")
    plans = {k: W.parse_plan(k.split(":", 1)[1], world, rpn) for k in keys
             if k.startswith("amsp:")}
    runs = schedule(keys, args.reps, args.steps, parse_counts(args.reps_for),
                    parse_counts(args.steps_for))
    # Every process group of the sweep exists before the first measurement: each gloo
    # group keeps a polling thread per process (about 100 groups at 8 ranks, tens of
    # thousands of wake-ups per second on 2 cores), so configurations measured before the
    # others' groups were built would run with less background load than the rest.
    t0 = time.time()
    for key in keys:
        build_groups(key, meshes, plans.get(key))
    dist.barrier()
    setup = {"groups_s": time.time() - t0, "threads_rank0": len(os.listdir("/proc/self/task"))}
    tokens = world * args.micro_batch * args.micro_batches * args.seq
    results, pruned = [], []
    t_start = time.time()
    for rep, key, steps in runs:
        if rep > 0 and not pruned and args.prune > 0:
            pruned = dominated([r for r in results if r["rep"] == 0], args.prune, tokens,
                               keep) or ["(none)"]
            if rank == 0:
                print(f"pruned after rep 0 (margin {args.prune}): {pruned}", flush=True)
        if key in pruned:
            continue
        run_args = copy.copy(args)
        run_args.steps = steps
        t0 = time.time()
        r = W.run_one(key if not key.startswith("amsp:") else "amsp", plans.get(key),
                      run_args, model_args, meshes, counter, world, rank, rpn,
                      record=rep == 0, mem_steps=args.mem_steps)
        r.update(rep=rep, config=key, wall_s=time.time() - t0)
        results.append(r)
        if rank == 0:
            med = sorted(r["step_times"])[len(r["step_times"]) // 2] if r["step_times"] else 0
            peak = max(r["peak_bytes_per_rank"]) / 1e6
            print(f"rep {rep} {key:>16}: step {med:.3f}s peak {peak:.1f} MB loss "
                  f"{r['losses'][-1]:.5f} ({r['wall_s']:.1f}s, total "
                  f"{time.time() - t_start:.0f}s)", flush=True)
    if rank == 0:
        n_params = sum(p.numel() for p in S.build_model(model_args, args.seed).parameters())
        meta = {
            "args": vars(args), "world": world, "ranks_per_node": rpn,
            "nodes": world // rpn, "configs": keys,
            "model": {"flavor": args.flavor, "params": n_params, "args": repr(model_args)},
            "tokens_per_step": tokens, "pruned": [k for k in pruned if k != "(none)"],
            "kept": sorted(keep),
            "setup": setup,
            "link": os.environ.get("AMSP_CLUSTER_LINK", "unknown"),
            "machine": W.machine_facts(),
            "wall_s": time.time() - t_start,
        }
        W.write_results(args.out, meta, results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
