"""The torchrun worker of tools/bench_overlap.py: one training step timed three ways.

For every measurement the system is rebuilt from the same seed (bench_worker's model,
data and systems), then ``warmup`` + ``steps`` consecutive training steps run in one comm
mode (tools/comm_modes: real, noop, serial). Step times are the intervals between
consecutive step ends, so a collective left in flight by one step (AMSP's post-step
all-gather) is paid where it is waited, in the next step's forward, exactly as in
training; the window of timed steps starts with the last warm-up step's all-gather in
flight and ends with its own in flight (steady state). In noop mode nothing makes the
ranks wait for each other, so an untimed real barrier starts every step on all ranks
together (else one rank runs ahead and the others get its share of the cores). After the window the optimizer's
in-flight all-gather is waited for, the mode goes back to real, and only then do the
harness's own reductions run (max over ranks of every step time).

Per repetition, interleaved: for each AMSP plan (the planner's choice, then ``--plans``)
each overlap configuration in real mode, then noop and serial with all switches on (or
per configuration with ``--modes-per-config``); then each baseline (FSDP2 ZeRO-3, HSDP)
real, noop, serial. Rank 0 writes one JSON.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

from tools import bench_systems as S
from tools import bench_worker as W
from tools import comm_modes

# name -> (set_overlap kwargs, overlap_param_update); "all_on" = the engine's defaults
SWITCHES = ("grad_sync", "prefetch", "step")
CONFIGS: dict[str, tuple[dict, bool]] = {
    "all_on": ({}, True),
    "grad_sync_off": ({"grad_sync": False}, True),
    "prefetch_off": ({"prefetch": False}, True),
    "step_off": ({"step": False}, True),
    "param_update_off": ({}, False),
    "none": ({k: False for k in SWITCHES}, False),
}
CONFIG_LABELS = {
    "all_on": "all on", "grad_sync_off": "grad_sync off", "prefetch_off": "prefetch off",
    "step_off": "step off", "param_update_off": "param_update off", "none": "none",
}
BASELINES = ("zero3", "hsdp")


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    W.add_workload_args(ap)
    add_overlap_args(ap)
    W.add_run_args(ap)
    return ap.parse_args(argv)


OVERLAP_DEFAULTS = dict(warmup=1, steps=2, reps=3, systems="amsp,zero3,hsdp",
                        plans="p1-g1-os2")


def add_overlap_args(ap: argparse.ArgumentParser) -> None:
    """The harness's own options (tools/bench_overlap.py passes them on) and its defaults
    for the shared workload options."""
    ap.set_defaults(**OVERLAP_DEFAULTS)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"AMSP overlap configurations, of {list(CONFIGS)}")
    ap.add_argument("--modes", default=",".join(comm_modes.MODES),
                    help="comm modes to measure (a subset is for quick looks only: the "
                         "report needs all three)")
    ap.add_argument("--steps-for", default="",
                    help="timed steps for some systems instead of --steps, e.g. zero3=1 "
                         "(keys: amsp, amsp:<plan>, zero3, hsdp)")
    ap.add_argument("--modes-per-config", action="store_true",
                    help="measure noop and serial for every configuration (default: once per "
                         "plan and repetition, with all switches on, shared by the rows)")


def overlap_argv(args: argparse.Namespace) -> list[str]:
    argv = W.workload_argv(args) + ["--configs", args.configs, "--modes", args.modes,
                                    "--steps-for", args.steps_for]
    if args.modes_per_config:
        argv.append("--modes-per-config")
    return argv


def steps_for(spec: str) -> dict[str, int]:
    """"zero3=1,hsdp=2" -> {"zero3": 1, "hsdp": 2}."""
    out = {}
    for item in W.comma_list(spec):
        key, sep, n = item.partition("=")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise SystemExit(f"--steps-for {item!r}: use SYSTEM=N with N >= 1")
        out[key.strip()] = int(n)
    return out


def _configs(spec: str) -> list[str]:
    names = W.comma_list(spec)
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown overlap configuration(s) {bad}; use {list(CONFIGS)}")
    return names


def build(key: str, plan, config: str, args, model_args, meshes):
    model = S.build_model(model_args, args.seed)
    if not key.startswith("amsp"):
        return S.make_system(key, model, args.lr, meshes)
    overlap, param_update = CONFIGS[config]
    return S.AMSPSystem(model, args.lr, plan, meshes.amsp_mesh(plan), layout=args.amsp_layout,
                        overlap=overlap, overlap_param_update=param_update)


def measure(key: str, plan, config: str, mode: str, args, model_args, meshes, world, rank):
    """Build, run warm-up + timed steps in `mode`, return per-step times (max over ranks),
    losses (global mean) and, for AMSP in real mode, the recorder's blocked seconds."""
    gc.collect()
    system = build(key, plan, config, args, model_args, meshes)
    amsp = key.startswith("amsp")
    n_steps = steps_for(args.steps_for).get(key, args.steps)
    total = args.warmup + n_steps
    batches = [W.make_batches(s, args, world, rank, model_args.vocab_size) for s in range(total)]
    rec_cm = system.amsp.record_comms() if amsp else None
    rec = None
    losses = []
    dist.barrier()  # real: nothing of this system is in flight yet
    comm_modes.set_mode(mode)
    try:
        starts, ends = [], []
        for s in range(total):
            if s == args.warmup and rec_cm is not None:
                rec = rec_cm.__enter__()
            if mode == "noop":
                # without collectives the ranks never wait for each other: one would run
                # ahead and the rest would get its share of the 2 cores. A real barrier
                # (untimed; nothing is in flight in this mode) starts each step together.
                comm_modes.set_mode("real")
                dist.barrier()
                comm_modes.set_mode(mode)
                starts.append(time.perf_counter())
            else:
                # the previous step's end: what it left in flight is paid in this step
                starts.append(ends[-1] if ends else time.perf_counter())
            losses.append(system.train_step(batches[s]))
            ends.append(time.perf_counter())
        if amsp:
            system.optim.wait_param_update()  # nothing in flight before the switch back
    finally:
        if rec is not None:
            rec_cm.__exit__(None, None, None)
        comm_modes.set_mode("real")
    times = [ends[i] - starts[i] for i in range(args.warmup, total)]
    blocked = None
    if rec is not None:
        vals = [getattr(e, "blocked_seconds", None) for e in rec.events]
        if vals and all(v is not None for v in vals):
            blocked = sum(vals) / n_steps
    # harness reductions, real collectives
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    b = torch.tensor([-1.0 if blocked is None else blocked], dtype=torch.float64)
    dist.all_reduce(b, op=dist.ReduceOp.MIN)
    has_blocked = b.item() >= 0
    if has_blocked:
        b = torch.tensor([blocked], dtype=torch.float64)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
    overlap = getattr(system, "overlap", None)
    out = {"system": key if not amsp else f"amsp:{plan.name}", "config": config, "mode": mode,
           "step_times": t.tolist(), "losses": (lt / world).tolist(),
           "recorded_blocked_s": b.item() if has_blocked else None,
           "recorded_events": len(rec.events) if rec is not None else None,
           "overlap": (repr(overlap) if overlap is not None else None),
           "param_update": getattr(getattr(system, "optim", None), "overlap_param_update", None)}
    system.close()
    del system
    gc.collect()
    dist.barrier()
    return out


def plan_runs(args, plan, world, rpn) -> list[tuple[str, object]]:
    runs = []
    systems = W.comma_list(args.systems)
    if "amsp" in systems:
        runs.append(("amsp", plan))
        for name in [p for p in args.plans.split(",") if p.strip()]:
            extra = W.parse_plan(name, world, rpn)
            if extra != plan:
                runs.append((f"amsp:{extra.name}", extra))
    runs += [(k, None) for k in systems if k != "amsp"]
    return runs


def schedule(args, plan, world, rpn) -> list[tuple[str, object, str, str]]:
    """(key, plan, config, mode) of one repetition, in run order."""
    configs = _configs(args.configs)
    modes = W.comma_list(args.modes)
    bad = [m for m in modes if m not in comm_modes.MODES]
    if bad:
        raise SystemExit(f"unknown comm mode(s) {bad}; use {list(comm_modes.MODES)}")
    out = []
    others = [m for m in modes if m != "real"]
    for key, p in plan_runs(args, plan, world, rpn):
        if key.startswith("amsp"):
            for c in configs:
                if "real" in modes:
                    out.append((key, p, c, "real"))
                if args.modes_per_config:
                    out += [(key, p, c, m) for m in others]
            if not args.modes_per_config:
                out += [(key, p, "all_on", m) for m in others]
        else:
            out += [(key, None, "all_on", m) for m in modes]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    comm_modes.install()
    model_args = S.model_args(args.flavor, args.seq)
    meshes = S.MeshCache(world, rpn)
    plan, planner, note = W.planner_choice(args, model_args, world, rpn)
    runs = schedule(args, plan, world, rpn)
    results = []
    t_start = time.time()
    load_start = os.getloadavg()
    for rep in range(args.reps):
        for key, p, config, mode in runs:
            t0 = time.time()
            r = measure(key, p, config, mode, args, model_args, meshes, world, rank)
            r["rep"] = rep
            results.append(r)
            if rank == 0:
                st = r["step_times"]
                mean = sum(st) / len(st) if st else float("nan")
                extra = (f" blocked {r['recorded_blocked_s']:.3f}s"
                         if r["recorded_blocked_s"] is not None else "")
                print(f"rep {rep} {r['system']:>14} {config:>16} {mode:>6}: step {mean:.3f}s "
                      f"loss {r['losses'][-1]:.4f}{extra} ({time.time() - t0:.1f}s)", flush=True)
    if rank == 0:
        import amsp_dtensor as amsp

        n_params = sum(p.numel() for p in S.build_model(model_args, args.seed).parameters())
        meta = {
            "args": vars(args), "world": world, "ranks_per_node": rpn,
            "nodes": world // rpn, "model": {"flavor": args.flavor, "params": n_params},
            "tokens_per_step": world * args.micro_batch * args.micro_batches * args.seq,
            "planner": planner, "planner_note": note, "amsp_plan": plan.name,
            "link": os.environ.get("AMSP_CLUSTER_LINK", "unknown"),
            "machine": W.machine_facts(),
            "engine_switches": hasattr(amsp, "set_overlap"),
            "wall_s": time.time() - t_start,
            # 1-minute load average of the machine (this run's 4 ranks count ~4): more
            # means other processes took CPU during the measurements
            "loadavg_start": load_start[0], "loadavg_end": os.getloadavg()[0],
        }
        W.write_results(args.out, meta, results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
