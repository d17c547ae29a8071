"""Check the cost model against a real CPU run of the engine
(docs/planner.md, "Validation against real runs").

    torchrun --nproc_per_node 4 -m amsp_dtensor.plan.validate --plan 2,2,4 \
        --ranks-per-node 2 --table bw.json --out result.json

One process group per plan (ru_maxrss is a per-process high-water mark, so every plan
needs fresh processes). The model is torchtitan's llama3 debugmodel (fp32 mode by default, --dtype bf16), trained
with AMSPOptimizer(AdamW) for --steps steps of --micro-batches micro-batches.

Memory: baseline = ru_maxrss after `import torch`, amsp_dtensor, torchtitan,
init_process_group, init_mesh and one tiny warm-up training step and collective of each
kind (the runtime, which the planner does not model, like a CUDA context on a GPU); peak = ru_maxrss at the end; measured = peak - baseline, per rank.
Predicted = estimate_memory(...).total (states + activations + temporaries).

Communication: every torch.distributed collective the engine (and FSDP2 inside it) calls
is made synchronous and timed: a barrier of the whole world (not timed: removes rank skew
and keeps every rank's compute off the shared cores while it runs), then the collective,
then wait, then another untimed world barrier (no rank goes back to compute before all
are done; see CommTimer). A step's measured time = sum over its calls of the slowest
rank's time; the summary takes the median over the timed steps (all but the first).
Predicted = step_comm_time(predicted_events(...), table) with the profile table. Same
regime as the profiler: a group's collective timed from a common start, nobody computing.

    python -m amsp_dtensor.plan.validate summarize [--table t.json] [--memory] runs.json..
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time

from amsp_dtensor import compat
from amsp_dtensor.observe.dist_calls import describe_call


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


RSS_IMPORT_TORCH = None


class CommTimer:
    """Make dist collectives synchronous and time them (see module docstring)."""

    # the deprecated tensor forms and this torch's base names (compat's Note: the tensor
    # collectives' names): FSDP2's and ours
    NAMES = tuple(dict.fromkeys(("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
                                 "broadcast", *compat.TENSOR_COLLECTIVES.values())))

    def __init__(self):
        self.active = False
        self.barrier_after = True
        self.log = []  # (op, group ranks, nbytes, seconds) of each timed call

    def install(self):
        import torch.distributed as dist

        for name in self.NAMES:
            setattr(dist, name, self._wrap(getattr(dist, name)))

    def _wrap(self, orig):
        import torch.distributed as dist

        timer = self

        def timed(*args, **kwargs):
            if not timer.active:
                return orig(*args, **kwargs)
            async_op = kwargs.pop("async_op", False)
            dist.barrier()  # whole world: nobody computes beside the timed collective
            t0 = time.perf_counter()
            work = orig(*args, async_op=True, **kwargs)
            work.wait()
            dt = time.perf_counter() - t0
            # Untimed: nobody goes back to compute until every member is done. Without
            # it, ranks that finish first take the 2 cores for the next unit's compute
            # while the last rank waits to be scheduled, and its time grows by 5-50 ms
            # of run-queue delay (4 processes on 2 cores), which is not communication.
            # The profiler's samples end the same way (the all-reduce of the sample).
            if timer.barrier_after:
                dist.barrier()
            # (op, group ranks, nbytes in the recorder's convention, seconds)
            timer.log.append((*describe_call(orig, args, kwargs), dt))
            return work if async_op else None

        return timed


def _probe_inside(dist, mesh=None) -> dict:
    """The profiler's measurement (world barrier, one op, world max; mean of 12) done
    inside the trained engine process, on the world group."""
    import statistics

    import torch

    world = dist.get_world_size()
    n = 3409920 // 4
    out = {}
    groups = {"world": None}
    if mesh is not None and mesh["rep"].size() == world:
        groups["mesh_rep"] = mesh.get_group("rep")
    for (gname, group), op in [(g, o) for g in groups.items()
                                for o in ("all_reduce", "reduce_scatter")]:
        samples = []
        for _ in range(12):
            x = torch.ones(n)
            y = torch.empty(n // world)
            dist.barrier()
            t0 = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(x, group=group)
            else:
                compat.reduce_scatter_single(y, x, group=group)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            samples.append(dt.item())
        out[f"{gname}/{op}"] = statistics.fmean(samples)
    return out


def _warm_runtime(Transformer, margs_cls) -> None:
    """One tiny training step (1 layer, dim 64, seq 32) and one small collective of each
    kind, before the memory baseline: the runtime's lazily loaded code and thread pools
    (libtorch/oneDNN kernels, autograd, AdamW's foreach path, gloo) then count as runtime,
    not as model memory, as a CUDA context would on a GPU."""
    import torch
    import torch.distributed as dist

    tiny = Transformer(margs_cls(dim=64, n_layers=1, n_heads=4, vocab_size=128, max_seq_len=32))
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-4)
    tokens = torch.randint(0, 128, (2, 33))
    logits = tiny(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    torch.nn.utils.clip_grad_norm_(tiny.parameters(), 1.0)
    opt.step()
    world = dist.get_world_size()
    x = torch.ones(64 * world)
    dist.all_reduce(x)
    compat.all_gather_single(torch.empty(64 * world * world), x)
    compat.reduce_scatter_single(torch.empty(64), x)
    dist.broadcast(x, src=0)
    del tiny, opt, logits


def main(argv=None) -> int:
    global RSS_IMPORT_TORCH
    import torch

    RSS_IMPORT_TORCH = _maxrss()
    ap = argparse.ArgumentParser(prog="torchrun ... -m amsp_dtensor.plan.validate")
    ap.add_argument("--plan", required=True, help="s_p,s_g,s_os")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32",
                    help="param dtype (fp32 default: bf16 matmuls are very slow on CPU)")
    ap.add_argument("--probe", action="store_true",
                    help="after training, time isolated AR/RS of 3.4 MB on the world group "
                    "in this process (profiler regime), to compare with the table")
    ap.add_argument("--no-barrier-after", action="store_true",
                    help="let ranks return to compute as soon as their own part of a timed "
                    "collective is done (the measured time then includes run-queue delay "
                    "when ranks outnumber cores)")
    ap.add_argument("--cold-runtime", action="store_true",
                    help="skip the tiny warm-up step before the memory baseline")
    ap.add_argument("--table", help="bandwidth table JSON for the time prediction")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    timer = CommTimer()
    timer.barrier_after = not args.no_barrier_after
    timer.install()  # before FSDP/engine modules look anything up
    import torch.distributed as dist

    from amsp_dtensor.titan.cpu_compat import apply

    apply()
    import copy

    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, llama3_args

    import amsp_dtensor as amsp
    from amsp_dtensor.plan.cost.bandwidth import load_table
    from amsp_dtensor.plan.cost.comm import predicted_events, step_comm_time, time_breakdown
    from amsp_dtensor.plan.cost.memory import estimate_memory
    from amsp_dtensor.plan.cost.models import MODELS

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    R = args.ranks_per_node
    s_p, s_g, s_os = (int(x) for x in args.plan.split(","))
    sharding = amsp.ShardingPlan(s_p, s_g, s_os)
    resolved = sharding.resolve(world, R)
    mesh = amsp.init_mesh(sharding, ranks_per_node=R, device_type="cpu")
    if not args.cold_runtime:
        _warm_runtime(Transformer, margs_cls=type(llama3_args["debugmodel"]))
    rss_baseline = _maxrss()

    margs = copy.deepcopy(llama3_args["debugmodel"])
    margs.max_seq_len = args.seq_len
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
        compat.recompute_rope_table(model)  # keep the complex buffer complex
    for block in model.layers.values():
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    amsp.set_gradient_divide_factor(model, 1.0)
    rss_trace = {"sharded_model": _maxrss() - rss_baseline}
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.1)
    rss_trace["optimizer"] = _maxrss() - rss_baseline

    M, b, s = args.micro_batches, args.micro_batch, args.seq_len
    g = torch.Generator().manual_seed(rank)
    step_wall, losses, calls_by_step = [], [], []
    for step in range(args.steps):
        optim.wait_param_update()
        timer.log = []
        timer.active = step > 0
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(M):
            tokens = torch.randint(0, margs.vocab_size, (b, s + 1), generator=g)
            ctx = amsp.no_sync(model) if micro < M - 1 else contextlib.nullcontext()
            with ctx:
                pred = model(tokens[:, :-1])
                loss = cross_entropy_loss(pred, tokens[:, 1:]) / (b * s * M * world)
                del pred
                rss_trace.setdefault(f"step{step}_mb{micro}_forward", _maxrss() - rss_baseline)
                loss.backward()
                rss_trace.setdefault(f"step{step}_mb{micro}_backward", _maxrss() - rss_baseline)
            total += loss.item()
        optim.clip_grad_norm_(1.0)
        optim.step()
        optim.wait_param_update()
        optim.zero_grad()
        rss_trace.setdefault(f"step{step}_optim", _maxrss() - rss_baseline)
        step_wall.append(time.perf_counter() - t0)
        if step > 0:
            calls_by_step.append([c[3] for c in timer.log])
        losses.append(total)
    timer.active = False
    peak = _maxrss()
    probe = _probe_inside(dist, mesh) if args.probe else None

    model_shape = MODELS["llama3_debugmodel"]
    est = estimate_memory(model_shape, resolved, s, b, args.dtype)
    e = 2 if args.dtype == "bf16" else 4
    events = predicted_events(resolved, model_shape.unit_param_shapes(), M, e,
                              model_shape.root_unit_index, clip=True)
    predicted_comm = breakdown = None
    if args.table:
        table = load_table(args.table)
        predicted_comm = step_comm_time(events, table)
        breakdown = time_breakdown(events, table)
    mine = {
        "rank": rank,
        "rss_import_torch": RSS_IMPORT_TORCH,
        "rss_baseline": rss_baseline,
        "rss_peak": peak,
        "measured_peak_bytes": peak - rss_baseline,
        "measured_comm_seconds": [sum(calls) for calls in calls_by_step],
        "measured_comm_calls": [len(calls) for calls in calls_by_step],
        "step_wall_seconds": step_wall,
        "losses": losses,
        "rss_trace": rss_trace,
        "probe": probe,
        "last_step_calls": timer.log,
        "call_seconds_by_step": calls_by_step,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        result = {
            "plan": resolved.name, "world_size": world, "ranks_per_node": R,
            "seq_len": s, "micro_batch": b, "micro_batches": M, "dtype": args.dtype,
            "predicted_memory": est.as_dict(),
            "predicted_comm_seconds": predicted_comm,
            "predicted_breakdown": breakdown,
            "predicted_calls": sum(e.count for e in events),
            "ranks": gathered,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    del optim, model
    compat.destroy_process_group_at_exit()
    return 0


def summarize(paths, table_path=None) -> list[dict]:
    """Rows of predicted vs measured from validate JSON files (prediction recomputed with
    `table_path` when given, else the one stored by the run)."""
    import statistics

    from amsp_dtensor.plan.cost.bandwidth import load_table
    from amsp_dtensor.plan.cost.comm import predicted_events, step_comm_time
    from amsp_dtensor.plan.cost.models import MODELS
    from amsp_dtensor.plan import ShardingPlan

    table = load_table(table_path) if table_path else None
    rows = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        plan = ShardingPlan.from_name(r["plan"]).resolve(r["world_size"], r["ranks_per_node"])
        m = MODELS["llama3_debugmodel"]
        e = 2 if r.get("dtype") == "bf16" else 4
        predicted = r["predicted_comm_seconds"]
        if table is not None:
            events = predicted_events(plan, m.unit_param_shapes(), r["micro_batches"], e,
                                      m.root_unit_index, clip=True)
            predicted = step_comm_time(events, table)
        ranks = r["ranks"]
        # A step's comm time: sum over its collectives of the slowest rank's time (every
        # call starts after a world barrier, so a call lasts until its slowest member is
        # done; the profiler's samples are the same world max of one op).
        steps = _timed_calls(path, ranks)
        per_step = [sum(max(call) for call in step) for step in steps]
        measured_comm = statistics.median(per_step)
        peak = max(x["measured_peak_bytes"] for x in ranks)
        rows.append({
            "plan": r["plan"],
            "predicted_peak": r["predicted_memory"]["total"],
            "predicted_parts": r["predicted_memory"],
            "measured_peak": peak,
            "peak_error": (r["predicted_memory"]["total"] - peak) / peak,
            "predicted_comm": predicted,
            "measured_comm": measured_comm,
            "comm_error": None if predicted is None else (predicted - measured_comm) / measured_comm,
            "comm_per_step": per_step,
            "calls": ranks[0]["measured_comm_calls"][0],
            "step_wall": statistics.median(ranks[0]["step_wall_seconds"][1:]),
        })
    return rows


def _timed_calls(path, ranks) -> list[list[tuple[float, ...]]]:
    """Per timed step, per call: the ranks' seconds. Every rank must have timed the same
    calls in every step (the engine's schedule is fixed), or the run is not comparable."""
    if not all("call_seconds_by_step" in x for x in ranks) or not all(
            isinstance(call[1], list) for call in ranks[0]["last_step_calls"]):
        raise ValueError(f"{path}: no per-call times (written by an older validate); rerun it")
    n_calls = len(ranks[0]["last_step_calls"])
    shapes = {tuple(len(step) for step in x["call_seconds_by_step"]) for x in ranks}
    if len(shapes) != 1 or any(n != n_calls for n in next(iter(shapes))):
        raise ValueError(f"{path}: ranks or steps timed different numbers of collectives "
                         f"({sorted(shapes)}; last step of rank 0: {n_calls})")
    return [list(zip(*(x["call_seconds_by_step"][i] for x in ranks)))
            for i in range(len(ranks[0]["call_seconds_by_step"]))]


def call_breakdown(path, table_path) -> list[dict]:
    """Per kind of call (op, group size, stride, nbytes) of one run: the table's time
    against the measured time (slowest rank, mean over calls and timed steps)."""
    import collections
    import statistics

    from amsp_dtensor.plan.cost.bandwidth import load_table
    from amsp_dtensor.plan.cost.comm import group_shape

    table = load_table(table_path)
    with open(path) as f:
        r = json.load(f)
    ranks = r["ranks"]
    steps = _timed_calls(path, ranks)
    by_kind = collections.defaultdict(list)
    for i, (op, group_ranks, nbytes, _) in enumerate(ranks[0]["last_step_calls"]):
        stride = group_ranks[1] - group_ranks[0] if len(group_ranks) > 1 else 1
        kind = (op, len(group_ranks), stride, nbytes)
        by_kind[kind] += [max(step[i]) for step in steps]
    n_steps = len(steps)
    rows = []
    for (op, size, stride, nbytes), seconds in by_kind.items():
        shape = group_shape(size, stride, r["world_size"], r["ranks_per_node"])
        rows.append({"op": op, "group_size": size, "stride": stride, "nbytes": nbytes,
                     "calls_per_step": len(seconds) // n_steps,
                     "predicted": table.time(op, nbytes, shape),
                     "measured": statistics.fmean(seconds)})
    return rows


def print_summary(rows, memory=True, comm=True) -> None:
    head = f"{'plan':<12}"
    if memory:
        head += f"{'P MiB':>7}{'G MiB':>7}{'OS MiB':>7}{'act':>6}{'temp':>6}{'pred MiB':>9}{'meas MiB':>9}{'err':>7}"
    if comm:
        head += f"{'pred ms':>9}{'meas ms':>9}{'err':>7}{'calls':>6}"
    print(head)
    for row in rows:
        line = f"{row['plan']:<12}"
        if memory:
            parts = row["predicted_parts"]
            line += "".join(f"{parts[k] / 2**20:{w}.1f}" for k, w in
                            (("param", 7), ("grad", 7), ("optim", 7), ("activations", 6),
                             ("temp", 6)))
            line += (f"{row['predicted_peak'] / 2**20:9.1f}{row['measured_peak'] / 2**20:9.1f}"
                     f"{100 * row['peak_error']:+6.1f}%")
        if comm:
            line += (f"{row['predicted_comm'] * 1e3:9.1f}{row['measured_comm'] * 1e3:9.1f}"
                     f"{100 * row['comm_error']:+6.1f}%{row['calls']:6d}")
        print(line)


def print_call_breakdown(path, table_path) -> None:
    print(f"\n{path}: per kind of call, ms per call")
    print(f"{'op':<15}{'n':>3}{'stride':>7}{'bytes':>10}{'/step':>6}{'pred':>7}{'meas':>7}")
    for c in call_breakdown(path, table_path):
        print(f"{c['op']:<15}{c['group_size']:3d}{c['stride']:7d}{c['nbytes']:10d}"
              f"{c['calls_per_step']:6d}{c['predicted'] * 1e3:7.1f}{c['measured'] * 1e3:7.1f}")


def summarize_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m amsp_dtensor.plan.validate summarize")
    ap.add_argument("--table", help="bandwidth table: recompute the time prediction with it "
                    "and print the per-call breakdown")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--memory", action="store_true", help="memory columns only")
    only.add_argument("--comm", action="store_true", help="communication columns only")
    ap.add_argument("runs", nargs="+", help="JSON files written by validate --out")
    args = ap.parse_args(argv)
    try:
        rows = summarize(args.runs, args.table)
        comm = not args.memory
        if comm and any(r["predicted_comm"] is None for r in rows):
            ap.error("a run has no time prediction: pass --table, or --memory")
        print_summary(rows, memory=not args.comm, comm=comm)
        if comm and args.table:
            for path in args.runs:
                print_call_breakdown(path, args.table)
    except (OSError, ValueError, KeyError) as err:
        ap.error(str(err) if not isinstance(err, KeyError) else f"not a validate result: {err}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        sys.exit(summarize_main(sys.argv[2:]))
    sys.exit(main())
