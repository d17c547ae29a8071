"""The benchmark's torchrun worker: any configuration's steps, one typed ``Result`` each.

For rep in reps, for each run ``KEY[@MODE]`` (interleaved): rebuild from the same seed,
``warmup`` untimed steps (``--warmup-later`` after repetition 0), then the timed steps in
comm mode MODE, each the interval between step ends (in noop mode an untimed barrier starts
each step). Repetition 0 samples memory after every op in its last warm-up step (the
first step allocates the optimizer states, so the second is the first whole one) and records
the collectives of its last step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import time

import torch
import torch.distributed as dist

from amsp_dtensor.titan.units import routed_experts
from tools import bench_comm, bench_memory, bench_systems as S

@dataclasses.dataclass
class Result:
    config: str
    rep: int
    mode: str
    step_times: list[float]           # timed steps, each the max over ranks, seconds
    losses: list[float]               # every step (warm-up first), global mean
    peak_bytes_per_rank: list[int]    # tools/bench_memory, above the in-use bytes before the build
    state_bytes_per_rank: list[dict | None]     # P/G/OS bytes held (rep 0)
    reported_bytes_per_rank: list[dict | None]  # what the system itself reports (peers)
    # AMSP: time blocked in collectives, in the timed step and after it (the post-step
    # all-gathers' wait), and the step's by mesh dim (exposed_by_dim)
    waited_s_per_rank: list[dict | None]
    comm: dict | None = None          # the recorded step's collectives (rep 0, real)
    wall_s: float = 0.0


def exposed_by_dim(events) -> dict[str, list]:
    """{mesh dim label: [seconds the step was blocked in its collectives, whether they
    cross nodes]} of the recorder's events (recorder.CommEvent.blocked_seconds: FSDP2's
    all-gathers and reduce-scatters and the engine's own; EP's all-to-alls are the model's
    and untimed)."""
    out: dict[str, list] = {}
    for e in events:
        slot = out.setdefault(e.dim, [0.0, False])
        slot[0] += e.blocked_seconds
        slot[1] = slot[1] or e.inter_node
    return out


def comma_list(spec: str) -> list[str]:
    return [item.strip() for item in spec.split(",") if item.strip()]


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options the launcher takes and passes to every worker (one set of defaults)."""
    ap.add_argument("--flavor", default="debugmodel",
                    help="a torchtitan llama3 flavour, or 'moe' (bench_systems.moe_args)")
    ap.add_argument("--ep", type=int, default=None,
                    help="the moe flavour's expert-parallel degree (default 2): consecutive "
                         "ranks, inside a node or spanning whole nodes")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=4, help="M: grad-accumulation steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (repetition 0)")
    ap.add_argument("--warmup-later", type=int, default=None,
                    help="untimed steps in later repetitions (default: --warmup)")
    ap.add_argument("--warmup-micro-batches", type=int, default=None,
                    help="micro-batches of each measurement's first warm-up step (default M; "
                         "2 runs an accumulating and a syncing one, which is all a first step "
                         "has to create: the optimizer states and every buffer)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prune", type=float, default=0.0,
                    help="after repetition 0, no more repetitions of a configuration that "
                         "another of its system beats by this margin (0.1: >= 1.1x its "
                         "tokens/s) at no more peak memory; 0 = off")
    ap.add_argument("--prune-all", type=float, default=0.0,
                    help="after repetition 0, also cut a configuration that any other system's "
                         "beats by this margin at no more peak memory; 0 = off")
    ap.add_argument("--keep", default="", help="configurations --prune and --prune-all never cut")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)


WORKLOAD = ("flavor", "ep", "seq", "micro_batch", "micro_batches", "warmup", "warmup_later",
            "warmup_micro_batches", "steps", "reps", "prune", "prune_all", "keep", "lr", "seed")


def expert_parallel(args) -> int:
    """The expert-parallel degree of the workload: 0 for a dense flavour (where --ep is
    refused), --ep or 2 for the moe flavour."""
    if args.flavor != S.MOE_FLAVOR:
        if args.ep is not None:
            raise SystemExit(f"--ep {args.ep}: flavour {args.flavor} has no experts; give "
                             f"--flavor {S.MOE_FLAVOR} or drop --ep")
        return 0
    return 2 if args.ep is None else args.ep


def workload_argv(args) -> list[str]:
    return [x for d in WORKLOAD if getattr(args, d, None) is not None
            for x in ("--" + d.replace("_", "-"), str(getattr(args, d)))]


def schedule(runs: list[str], reps: int) -> list[tuple[int, str, str]]:
    """[(rep, key, mode)] in run order: runs interleaved in each repetition."""
    return [(rep, *run.partition("@")[::2]) for rep in range(reps) for run in runs]


def dominated(results: list[Result], margin: float, tokens: int, keep=frozenset(),
              margin_all: float = 0.0, rivals: list[Result] = ()) -> list[str]:
    """Configurations of `results` to cut after repetition 0, never one in `keep`: another
    of the same system peaks at no more memory and runs >= (1 + margin) x its tokens/s, or
    any other configuration (``rivals`` too: another process set's) does so by
    `margin_all`. Times and peaks are reduced over ranks, so every rank gets the same list."""
    def facts(rs):
        return [(r.config, S.family(r.config), max(r.peak_bytes_per_rank),
                 tokens * len(r.step_times) / sum(r.step_times)) for r in rs if r.step_times]

    every = facts([*results, *rivals])

    def beaten(k, fam, peak, tps):
        return any(o != k and p <= peak and (
            (margin > 0 and f == fam and t >= (1 + margin) * tps)
            or (margin_all > 0 and t >= (1 + margin_all) * tps)) for o, f, p, t in every)

    return [k for k, *fact in facts(results) if k not in keep and beaten(k, *fact)]


class Worker:
    def __init__(self, args):
        self.args = args
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.rpn = int(os.environ["LOCAL_WORLD_SIZE"])
        self.counter = bench_comm.install(self.rpn)
        self.model_args = S.model_args(args.flavor, args.seq)
        self.meshes = S.Meshes(self.world, self.rpn, expert_parallel(args))

    def measure(self, key: str, mode: str, rep: int, steps: int) -> Result:
        a = self.args
        record = rep == 0 and mode == "real"
        warmup = a.warmup if rep == 0 or a.warmup_later is None else a.warmup_later
        total = warmup + steps
        # the first step may be short, unless it is the one whose memory is sampled per op
        short = warmup > record and a.warmup_micro_batches or a.micro_batches
        data = [S.make_batches(s, self.world, self.rank, short if s == 0 else a.micro_batches,
                               a.micro_batch, a.seq, self.model_args.vocab_size)
                for s in range(total)]
        t_build = time.time()
        mem = bench_memory.PeakMemory()
        system = S.make_system(key, self.model_args, a.seed, a.lr, self.meshes, a)
        inner = getattr(system.model, "module", system.model)
        mem.attach(S.blocks_of(inner), head=inner.output)
        amsp = hasattr(system, "amsp")
        held = {"state": None, "reported": None}

        def grab():
            held["state"], held["reported"] = system.state_bytes(), system.reported_bytes()

        ends, starts, losses, comm, waited = [], [], [], None, None
        dist.barrier()
        bench_comm.set_mode(mode)
        try:
            for s in range(total):
                last = s == total - 1
                if mode == "noop":
                    with bench_comm.mode("real"):
                        dist.barrier()
                starts.append(time.perf_counter() if mode == "noop" or not ends else ends[-1])
                rec_cm = system.amsp.record_comms() if amsp and last and mode == "real" else None
                rec = rec_cm.__enter__() if rec_cm else None
                per_op = mem.every_op() if record and s == warmup - 1 else contextlib.nullcontext()
                with self.counter.recording() if record and last else contextlib.nullcontext(), per_op:
                    losses.append(system.train_step(
                        data[s], probe=mem.sample, before_step=grab if record and last else lambda: None))
                    ends.append(time.perf_counter())
                    n_in_step = len(rec.events) if rec else 0
                    system.finish()  # (after the timer) lands in this step's record
                if rec_cm:
                    rec_cm.__exit__(None, None, None)
                    blocked = [getattr(e, "blocked_seconds", 0.0) for e in rec.events]
                    waited = {"in_step": sum(blocked[:n_in_step]),
                              "after_step": sum(blocked[n_in_step:]),
                              "by_dim": exposed_by_dim(rec.events[:n_in_step])}
                if record and last:
                    comm = {"counted": self.counter.bytes_by_locality()}
                    if rec:
                        comm["recorder"] = rec.bytes_by_locality()
                        comm["recorder_wire"] = wire_by_locality(rec.events)
                mem.sample()
        finally:
            bench_comm.set_mode("real")
        mem.detach()
        times = [ends[i] - starts[i] for i in range(warmup, total)]
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        lt = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(lt)
        per_rank = [None] * self.world
        dist.all_gather_object(per_rank, (mem.peak_delta, held["state"], held["reported"], waited))
        system.close()
        del system, inner
        settle()
        dist.barrier()
        return Result(config=key, rep=rep, mode=mode, step_times=t.tolist(),
                      losses=(lt / self.world).tolist(),
                      peak_bytes_per_rank=[r[0] for r in per_rank],
                      state_bytes_per_rank=[r[1] for r in per_rank],
                      reported_bytes_per_rank=[r[2] for r in per_rank],
                      waited_s_per_rank=[r[3] for r in per_rank], comm=comm,
                      wall_s=time.time() - t_build)


def settle() -> None:
    """Collect the last system's garbage, then freeze what survived."""
    # [Note: a collection scans only what the last measurement made]
    # With torch, torchtitan and the peers imported a process holds ~500k objects, and a full
    # collection took 0.3 CPU-s: two per measurement (here and PeakMemory's baseline), on 8
    # ranks sharing 2 cores, were ~2 s of each measurement's wall time, and a collection the
    # interpreter starts itself can land inside a timed step. gc.freeze() moves the survivors
    # to a generation no collection scans, so the next ones look only at the objects the next
    # system makes (the systems themselves are collected as before).
    gc.collect()
    gc.freeze()


def rss_bytes() -> int:
    """This process's resident set. The sweep's ranks must fit the machine together: at 8
    ranks, AMSP's configurations once each left about 30 MB allocated per rank (glibc's
    in-use bytes, printed beside it), and 60 of them filled 24 GB; that was a cycle through
    a post-accumulate-grad hook, which torch's collector never frees (compat.py, [Note:
    post-accumulate-grad hooks and the garbage collector])."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def wire_by_locality(events) -> dict[str, float]:
    """Bytes this rank sends (ring factor x buffer: a compressed all-reduce records two
    buffers where the exact one records one tensor, so only wire bytes compare)."""
    from amsp_dtensor.plan.cost.nccl import wire_bytes

    out = {"intra": 0.0, "inter": 0.0}
    for e in events:
        out["inter" if e.inter_node else "intra"] += wire_bytes(e.op, e.nbytes, e.group_size)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--runs", required=True, help="KEY[@MODE],... (mode: real, noop, serial)")
    ap.add_argument("--env", default="main", help="the peers' process set (bench_peers.ENVS)")
    ap.add_argument("--rivals", default=None, help="an earlier process set's results: its "
                    "repetition 0 counts for --prune-all")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from tools import bench_peers

    bench_peers.activate(args.env)
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    w = Worker(args)
    runs = comma_list(args.runs)
    keep = frozenset(comma_list(args.keep))
    # [Note: the measurements share their process groups]
    # A gloo group keeps a thread that wakes while idle. With a group per mesh dim per
    # configuration (224 threads per rank for the 4x2 sweep) the idle groups held the load
    # average near 100 on 2 cores and slowed every step by 20-40%. The meshes now draw
    # their groups from one pool (GroupPool), which makes a group over some ranks only
    # when no earlier mesh made one, so the process holds as many groups as its largest
    # mesh needs (41 threads per rank for the 4x2 sweep). They are all made here, before
    # the first measurement, so that every configuration runs with the same groups alive.
    t0 = time.time()
    for run in runs:
        w.meshes.of(run.partition("@")[0])
    settle()
    dist.barrier()
    setup = {"groups_s": time.time() - t0, "threads_rank0": len(os.listdir("/proc/self/task"))}
    tokens = w.world * args.micro_batch * args.micro_batches * args.seq
    results: list[Result] = []
    pruned: list[str] | None = None
    t_start, load_start = time.time(), os.getloadavg()[0]
    whole = S.build_model(w.model_args, args.seed)
    n_params = sum(p.numel() for p in whole.parameters())
    n_expert = sum(p.numel() for ex in map(routed_experts, S.blocks_of(whole)) if ex is not None
                   for p in ex.parameters())
    del whole
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, " \
              f"torch {torch.__version__}"

    def write(done: bool) -> None:
        """Rank 0's results so far (rewritten after every run, so that a run stopped by the
        launcher's timeout still leaves the repetitions it finished)."""
        meta = {"args": vars(args), "world": w.world, "ranks_per_node": w.rpn,
                "nodes": w.world // w.rpn, "configs": runs,
                "model": {"flavor": args.flavor, "params": n_params, "ep": w.meshes.ep,
                          "expert_params": n_expert},
                "tokens_per_step": tokens, "pruned": pruned or [], "kept": sorted(keep),
                "setup": setup, "link": os.environ.get("AMSP_CLUSTER_LINK", "unknown"),
                "machine": machine, "wall_s": time.time() - t_start, "complete": done,
                "loadavg": [load_start, os.getloadavg()[0]]}
        with open(args.out + ".tmp", "w") as f:
            json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, f,
                      indent=1)
        os.replace(args.out + ".tmp", args.out)

    for rep, key, mode in schedule(runs, args.reps):
        if rep > 0 and pruned is None:
            rep0 = lambda rs: [r for r in rs if r.rep == 0 and r.mode == "real"]  # noqa: E731
            rivals = [Result(**r) for r in json.load(open(args.rivals))["results"]] \
                if args.rivals and args.prune_all > 0 else []
            pruned = dominated(rep0(results), args.prune, tokens, keep, args.prune_all,
                               rep0(rivals))
            if w.rank == 0 and (args.prune > 0 or args.prune_all > 0):
                print(f"pruned after repetition 0 (margins {args.prune}, all systems "
                      f"{args.prune_all}): {pruned}", flush=True)
        if key in (pruned or []):
            continue
        r = w.measure(key, mode or "real", rep, args.steps)
        results.append(r)
        if w.rank == 0:
            st = sorted(r.step_times)
            print(f"rep {rep} {key + ('@' + mode if mode else ''):>24}: step "
                  f"{st[len(st) // 2]:.3f}s peak {max(r.peak_bytes_per_rank) / 1e6:.1f} MB loss "
                  f"{r.losses[-1]:.5f} ({r.wall_s:.1f}s, total {time.time() - t_start:.0f}s, "
                  f"rank 0 RSS {rss_bytes() / 1e9:.2f} GB, in use {bench_memory.in_use_bytes() / 1e9:.2f} GB)",
                  flush=True)
            write(done=False)
    if w.rank == 0:
        write(done=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
