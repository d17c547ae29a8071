"""The torchrun worker of tools/bench.py: every system, interleaved, several repetitions.

Order: for rep in reps: for system in systems: build from the same seed, run
``warmup`` steps, then ``steps`` timed steps; in rep 0 the last timed step also counts
collectives (tools/bench_comm for every system, amsp.record_comms for AMSP; AMSP's
post-step all-gather is waited for after the timer stops so it lands in that record).
Rank 0 writes one JSON with per-rep step times (max over ranks), per-step global losses,
bytes per step, state bytes and peak memory per rank, and the planner's prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import time

import torch
import torch.distributed as dist

from tools import bench_comm, bench_memory, bench_systems as S


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The options tools/bench.py takes and passes on to every worker: one definition,
    one set of defaults (those of the documented benchmark)."""
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=4, help="M: grad-accumulation steps")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps first (FSDP2/HSDP settle only by the third step)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", default="ddp,zero1,zero3,hsdp,hpz,amsp")
    ap.add_argument("--plans", default="", help="extra AMSP plans, e.g. p2-g4-os4,p1-g1-os4")
    ap.add_argument("--mem-budget-gib", default="hsdp",
                    help="planner budget per rank (GiB), or 'hsdp': the planner's estimate of "
                         "HSDP's memory for the same model and batch")
    ap.add_argument("--intra-bw", type=float, default=1.0e9,
                    help="bytes/s inside a node, for the planner (probe: ~1.1e9 loopback)")
    ap.add_argument("--amsp-layout", default="titan", choices=("titan", "blocks"),
                    help="AMSP units: torchtitan's (tok_embeddings, blocks, [norm, output], "
                         "root) or each block + root")


WORKLOAD_DESTS = ("flavor", "seq", "micro_batch", "micro_batches", "warmup", "steps", "reps",
                  "systems", "plans", "mem_budget_gib", "intra_bw", "amsp_layout")


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The worker's command-line form of the workload options in `args`."""
    argv = []
    for dest in WORKLOAD_DESTS:
        argv += ["--" + dest.replace("_", "-"), str(getattr(args, dest))]
    return argv


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The options every worker takes besides the workload (seed, planner inputs, output)."""
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inter-bw", type=float, default=125e6, help="bytes/s, for the planner")
    ap.add_argument("--attention", default="flash", help="planner's activation model")
    ap.add_argument("--out", required=True)


def machine_facts() -> str:
    """The machine line every report prints."""
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}")


def write_results(path: str, meta: dict, results: list) -> None:
    """Rank 0's result file, read back by the report."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {path}", flush=True)


def comma_list(spec: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: the items of a comma-separated option, blanks dropped."""
    return [item.strip() for item in spec.split(",") if item.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    add_run_args(ap)
    return ap.parse_args(argv)


def parse_plan(name: str, world: int, rpn: int):
    from amsp_dtensor.plan import ShardingPlan

    try:
        return ShardingPlan.from_name(name).resolve(world, rpn)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def planner_choice(args, model_args, world, rpn, reserve_bytes: int = 0, bandwidth=None):
    """(plan, report dict, note) from amsp_dtensor.plan.cost.planner.choose_plan.
    ``reserve_bytes``: memory outside the modelled tensors, added to every plan's estimate
    (choose_plan's reserve_bytes); ``bandwidth``: choose_plan's time model (e.g. a profile
    table) instead of alpha-beta at --intra-bw / --inter-bw. Raises NoPlanFits when nothing
    fits the budget."""
    import dataclasses

    from amsp_dtensor.plan.cost import AlphaBeta, choose_plan
    from amsp_dtensor.plan.cost.models import from_torchtitan_args

    if bandwidth is None:
        bandwidth = AlphaBeta(intra_bw=args.intra_bw, inter_bw=args.inter_bw,
                              intra_alpha=20e-6, inter_alpha=50e-6)
    common = dict(
        seq_len=args.seq, micro_batch=args.micro_batch,
        micro_batches=args.micro_batches, world_size=world, ranks_per_node=rpn,
        bandwidth=bandwidth,
        mixed_precision="fp32", attention=args.attention, clip=False,
        reserve_bytes=int(reserve_bytes),
        # as the workers run AMSP: gloo (its all-gathers stage their output) and the
        # post-step all-gather overlapping the next forward (bench_systems.AMSPSystem)
        backend="gloo", overlap_param_update=True)
    # the units as the workers cut AMSP (bench_systems.amsp_units): torchtitan's by default
    shape = dataclasses.replace(from_torchtitan_args(args.flavor, model_args),
                                layout=getattr(args, "amsp_layout", "titan"))
    if str(args.mem_budget_gib) == "hsdp":
        probe = choose_plan(shape, memory_budget_bytes=2**50, **common)
        budget = probe.baselines["hsdp"].memory.total
        budget_note = "the planner's estimate of HSDP's memory"
    else:
        budget = float(args.mem_budget_gib) * 2**30
        budget_note = f"{args.mem_budget_gib} GiB"
    report = choose_plan(shape, memory_budget_bytes=budget, **common)
    best = report.best
    summary = {
        "chosen": best.plan.name,
        "budget_bytes": int(budget), "budget_note": budget_note,
        "chosen_bytes_inter": best.bytes_inter, "chosen_bytes_intra": best.bytes_intra,
        "time_model": report.time_model,
        "candidates": [
            {"plan": c.plan.name, "comm_s": c.comm_seconds, "step_s": c.step_seconds,
             "memory": c.memory.total,
             "fits": c.fits, "bytes_intra": c.bytes_intra, "bytes_inter": c.bytes_inter}
            for c in report.candidates],
    }
    return best.plan, summary, f"planner choice {best.plan.name}"


def predicted_bytes(system_key, plan, model, blocks, args, world, rpn):
    """The cost model's bytes per step for a system (same schedule formulas as the planner)."""
    from amsp_dtensor.plan.cost.check import unit_param_shapes_of
    from amsp_dtensor.plan.cost.comm import bytes_by_locality, event_counter, predicted_events
    from amsp_dtensor.plan import ShardingPlan

    if system_key.startswith("amsp"):
        units, root = S.amsp_unit_shapes(model, getattr(args, "amsp_layout", "blocks"))
    else:
        units, root = unit_param_shapes_of(model, blocks)
    rs = True
    if system_key.startswith("amsp"):
        rp = plan
    else:
        if system_key.startswith("hsdp:"):  # HSDP with another shard-group size
            spec = (int(system_key.split(":", 1)[1]),) * 3
        else:
            spec = {"ddp": (1, 1, 1), "zero1": (1, 1, world), "zero3": (world,) * 3,
                    "zero3_keep": (world,) * 3, "hsdp": (rpn,) * 3,
                    "hpz": (world,) * 3}[system_key]
        rp = ShardingPlan(*spec).resolve(world, rpn)
        if system_key == "hpz":
            rs = rpn
        elif system_key == "zero3_keep":
            rs = False
    events = predicted_events(rp, units, args.micro_batches, 4, root,
                              reshard_after_forward=rs, clip=False)
    counts = event_counter(events)
    return {"plan": rp.name, "bytes": bytes_by_locality(events),
            "events": sorted([list(k) + [n] for k, n in counts.items()], key=str)}


def make_batches(step: int, args, world: int, rank: int, vocab: int):
    g = torch.Generator().manual_seed(10_000 + step)
    data = torch.randint(0, vocab, (args.micro_batches, world * args.micro_batch, args.seq + 1),
                         generator=g)
    mine = data[:, rank * args.micro_batch:(rank + 1) * args.micro_batch]
    return [(mine[i, :, :-1].contiguous(), mine[i, :, 1:].contiguous())
            for i in range(args.micro_batches)]


def memory_steps(system, mem, steps_batches) -> None:
    """Untimed steps (one per entry of `steps_batches`) with `mem` sampling after every
    op, for the peak only: run after steps that created the optimizer's states, they see
    the steady-state backward and step."""
    for batches in steps_batches:
        with mem.every_op():
            system.train_step(batches, probe=mem.sample)
        mem.sample()


def run_one(key, plan, args, model_args, meshes, counter, world, rank, rpn, record=True,
            mem_steps=0):
    """Build `key`, run its warm-up and timed steps, return its result dict.

    ``mem_steps``: in a recorded run, that many more untimed steps after the timed
    ones, with memory sampled after every op (their losses are not reported). With
    one warm-up step, the per-op samples otherwise see only a backward that runs
    before the optimizer's states exist, and a plan whose peak is in backward would
    be measured low (its samples at hook points are lower bounds)."""
    gc.collect()
    mem = bench_memory.PeakMemory()
    model = S.build_model(model_args, args.seed)
    predicted = predicted_bytes(key, plan, model, S.blocks_of(model), args, world, rpn)
    system = S.make_system(key, model, args.lr, meshes, plan, amsp_layout=args.amsp_layout)
    inner = system.model if not hasattr(system.model, "module") else system.model.module
    mem.attach(S.blocks_of(inner), head=inner.output)
    times, losses = [], []
    total = args.warmup + args.steps
    state = None
    comm = None
    waited = None

    def grab_state():
        nonlocal state
        state = system.state_bytes()  # grads present, optimizer states exist

    for step in range(total):
        batches = make_batches(step, args, world, rank, model_args.vocab_size)
        # collectives are counted in the last timed step of rep 0 (bytes repeat every step)
        recorded = record and step == total - 1
        amsp_rec = system.amsp.record_comms() if recorded and key.startswith("amsp") else None
        rec = amsp_rec.__enter__() if amsp_rec else None
        with counter.recording() if recorded else contextlib.nullcontext():
            # warm-up steps (untimed) also sample memory after every op
            op_level = mem.every_op() if step < args.warmup else contextlib.nullcontext()
            t0 = time.perf_counter()
            with op_level:
                loss = system.train_step(batches, grab_state if step == args.warmup else None,
                                         probe=mem.sample)
            dt = time.perf_counter() - t0
            # events are recorded when waited: these were waited inside the timed step
            n_in_step = len(rec.events) if rec is not None else 0
            if recorded and key.startswith("amsp"):
                # the post-step all-gather normally completes in the next forward; wait
                # for it here (untimed) so it lands in this step's record
                system.optim.wait_param_update()
        if amsp_rec:
            amsp_rec.__exit__(None, None, None)
        if recorded:
            comm = {"counted": counter.bytes_by_locality(),
                    "counted_events": sorted(
                        [list(k) + [n] for k, n in counter.counter().items()], key=str)}
            if rec is not None:
                comm["recorder"] = rec.bytes_by_locality()
                comm["recorder_events"] = sorted([list(e.key()) for e in rec.events], key=str)
                # time this rank's thread waited in collectives (the recorder's
                # blocked_seconds): inside the timed step, and the post-step all-gather
                # waited at once after it (in training it overlaps the next forward)
                blocked = [getattr(e, "blocked_seconds", 0.0) for e in rec.events]
                waited = {"in_step": sum(blocked[:n_in_step]),
                          "after_step": sum(blocked[n_in_step:])}
        if step >= args.warmup:
            times.append(dt)
        mem.sample()
        losses.append(loss)
    if record and mem_steps:
        memory_steps(system, mem, [make_batches(total + i, args, world, rank,
                                                model_args.vocab_size)
                                   for i in range(mem_steps)])
    if key.startswith("amsp"):
        system.optim.wait_param_update()
    mem.detach()
    # reductions outside the recorded window
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    lt = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(lt)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"peak": mem.peak_delta, "state": state,
                                      "waited": waited})
    out = {"system": key if not key.startswith("amsp") else f"amsp:{plan.name}",
           "step_times": t.tolist(), "losses": (lt / world).tolist(),
           "peak_bytes_per_rank": [r["peak"] for r in per_rank],
           "state_bytes_per_rank": [r["state"] for r in per_rank],
           "comm": comm, "predicted": predicted}
    if any(r["waited"] is not None for r in per_rank):
        out["waited_s_per_rank"] = [r["waited"] for r in per_rank]
    system.close()
    del system, model
    gc.collect()
    dist.barrier()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = int(os.environ["LOCAL_WORLD_SIZE"])
    counter = bench_comm.install(rpn)
    model_args = S.model_args(args.flavor, args.seq)
    meshes = S.MeshCache(world, rpn)

    plan, planner, note = planner_choice(args, model_args, world, rpn)
    runs = []  # (key, plan)
    for key in comma_list(args.systems):
        runs.append((key, plan if key == "amsp" else None))
    for name in [p for p in args.plans.split(",") if p.strip()]:
        extra = parse_plan(name, world, rpn)
        if extra != plan:
            runs.append((f"amsp:{extra.name}", extra))

    results = []
    t_start = time.time()
    for rep in range(args.reps):
        for key, p in runs:
            r = run_one(key, p, args, model_args, meshes, counter, world, rank, rpn,
                        record=rep == 0)
            r["rep"] = rep
            results.append(r)
            if rank == 0:
                med = sorted(r["step_times"])[len(r["step_times"]) // 2] if r["step_times"] else 0
                inter = r["comm"]["counted"]["inter"] / 1e6 if r["comm"] else float("nan")
                print(f"rep {rep} {r['system']:>16}: step {med:.3f}s loss {r['losses'][-1]:.4f} "
                      f"inter {inter:.1f} MB", flush=True)
    if rank == 0:
        n_params = sum(p.numel() for p in S.build_model(model_args, args.seed).parameters())
        meta = {
            "args": vars(args), "world": world, "ranks_per_node": rpn,
            "nodes": world // rpn, "model": {"flavor": args.flavor, "params": n_params,
                                             "args": repr(model_args)},
            "tokens_per_step": world * args.micro_batch * args.micro_batches * args.seq,
            "planner": planner, "planner_note": note, "amsp_plan": plan.name,
            "link": os.environ.get("AMSP_CLUSTER_LINK", "unknown"),
            "machine": machine_facts(),
            "wall_s": time.time() - t_start,
        }
        write_results(args.out, meta, results)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
