"""Memory-capped frontier: the fastest configuration of each system under each memory cap.

One command per scale runs tools/frontier_worker on the emulated cluster (tools/cluster:
one network namespace per node, tbf-shaped links), every configuration of every system
in one torchrun set, tears the nodes down, asks the planner for its pick at every cap,
keeps the raw JSON in runs/frontier/ (git-ignored) and rewrites docs/benchmarks.md: the
header, this scale's section (another scale's section and the overlap section of
tools/bench_overlap are kept as they are) and the chart docs/frontier_<N>x<R>.png:

    flock /tmp/amsp_cpu.lock timeout 1000 python -m tools.bench_frontier \
        --nodes 2 --ranks-per-node 2 --bw 1gbit
    flock /tmp/amsp_cpu.lock timeout 3040 python -m tools.bench_frontier \
        --nodes 4 --ranks-per-node 2 --bw 1gbit --prune 0.1 --timeout 3000

``--from-json runs/frontier/frontier_2x2.json`` re-renders (planner picks included)
without running anything; ``--no-netns`` runs on plain loopback (quick, unshaped).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tools import frontier_report as R
from tools import frontier_worker as F

REPO = Path(__file__).resolve().parents[1]


def planner_data(data: dict, reserve_bytes: float | None = None) -> dict:
    """The planner beside the measurement: its memory estimate of every AMSP plan, and its
    pick at every cap for each time model: the profile table of this cluster when the run
    has one (data["profile"]), alpha-beta at the shaped link rate, and the first of these
    with a fitted reserve and with mid-point budgets.

    The reserve (choose_plan's ``reserve_bytes``) is 0 unless given: a peak here is
    measured above the in-use bytes before the system is built, so the process's runtime,
    which a reserve stands for, is outside it by construction (as in the planner's CPU
    validation). The fitted variant adds the median over the measured AMSP plans of
    measured peak - estimate (at least 0), to show what a calibrated reserve would do."""
    from amsp_dtensor.plan.cost.planner import NoPlanFits
    from tools import bench_systems as S
    from tools import bench_worker as W

    meta = data["meta"]
    args = argparse.Namespace(**meta["args"])
    world, rpn = meta["world"], meta["ranks_per_node"]
    model_args = S.model_args(args.flavor, args.seq)
    timings = time_models(args, rpn, data.get("profile"), meta.get("link_rate"))
    # everything fits an unlimited budget: the memory estimate of every plan (the same for
    # every time model) and the first model's predicted step times, for the analysis
    args.mem_budget_gib = 2.0 ** 20
    _, summary, _ = W.planner_choice(args, model_args, world, rpn,
                                     bandwidth=timings[0][2] if timings else None)
    estimates = {c["plan"]: c["memory"] for c in summary["candidates"]}
    predicted = {c["plan"]: c["step_s"] for c in summary["candidates"]} if timings else {}
    rows = R.summarize(data)
    gaps = [r["peak"] - estimates[r["key"].split(":", 1)[1]] for r in rows
            if r["family"] == "amsp" and r["key"].split(":", 1)[1] in estimates]
    med = statistics.median(gaps) if gaps else 0.0
    fitted = max(0.0, med)
    gap_note = (f"the median over the {len(gaps)} AMSP plans of measured peak - the "
                f"planner's estimate is {med / R.MB:.1f} MB (range {min(gaps) / R.MB:.1f} to "
                f"{max(gaps) / R.MB:.1f} MB)" if gaps else "no AMSP plan measured")
    if reserve_bytes is None:
        reserve_bytes = 0.0
        note = ("0: the peaks are measured above the in-use bytes before each system is "
                "built, so the runtime a reserve stands for is outside them; " + gap_note)
    else:
        note = "given with --planner-reserve-mb; " + gap_note
    # (name, description, time model, reserve, budget rule)
    models = [(name, desc, model, reserve_bytes, "cap") for name, desc, model in timings]
    caps = R.select_caps(rows, data.get("cap_mode", "peaks"))
    # the measured frontier is the same from one cap up to the next; a cap exactly at a
    # measured peak leaves the planner's memory model no slack for that plan, so the first
    # model is also asked at the mid-point of each interval (the largest cap: itself)
    mids = {repr(c): (c + n) / 2 for c, n in zip(caps, caps[1:])}
    if models:
        name, desc, model, _, _ = models[0]
        models.append((f"{name}, fitted reserve", desc + f"; reserve {fitted / R.MB:.1f} MB "
                       "(the median gap, at least 0)", model, fitted, "cap"))
        models.append((f"{name}, mid-point budgets", desc + "; budget = the mid-point "
                       "between this cap and the next", model, reserve_bytes, "mid"))
    variants = []
    for name, desc, model, reserve, rule in models:
        picks = {}
        for cap in caps:
            budget = mids.get(repr(cap), cap) if rule == "mid" else cap
            args.mem_budget_gib = budget / 2**30
            try:
                plan, _, _ = W.planner_choice(
                    args, model_args, world, rpn, bandwidth=model,
                    reserve_bytes=int(reserve))
                picks[repr(cap)] = plan.name
            except NoPlanFits:
                picks[repr(cap)] = None
        variants.append({"name": name, "desc": desc, "picks": picks})
    return {"estimates": estimates, "reserve_bytes": reserve_bytes, "reserve_note": note,
            "predicted_step_s": predicted, "variants": variants}


def time_models(args, rpn: int, profile: dict | None, link_rate: float | None) -> list:
    """[(name, description, time model)]: the profile table of this cluster when there is
    one, and alpha-beta at the shaped link rate when the link is shaped."""
    from amsp_dtensor.plan.cost import AlphaBeta

    models = []
    if profile:
        models.append(("profile", "the profile table of this cluster (amsp_dtensor.plan.profile, "
                       "run on it before the sweep)", _table(profile)))
    if link_rate:
        # alpha-beta's inter_bw is one rank's share of its node's link (cost/comm.py)
        link = AlphaBeta(intra_bw=args.intra_bw, inter_bw=link_rate / rpn,
                         intra_alpha=20e-6, inter_alpha=50e-6)
        models.append(("link", f"alpha-beta: {link.inter_bw / R.MB:.1f} MB/s per rank across "
                       f"nodes (the {link_rate / R.MB:.0f} MB/s link shared by {rpn} ranks), "
                       f"{link.intra_bw / R.MB:.0f} MB/s inside a node", link))
    return models


def possible_picks(args, world: int, rpn: int, models: list) -> list[str]:
    """Every plan some time model of `models` picks at some memory budget, as sweep keys.

    [Note: possible picks are never pruned]
    The set of plans that fit changes only where the budget crosses a plan's estimate, so
    asking the planner at each estimate (reserve 0; a reserve shifts every crossing by the
    same amount) gives every pick it can make at any cap. The sweep exempts these from
    --prune: the planner's slowdown at a cap compares its pick's median with the best
    plan's, and one repetition of the pick against three of the best would let a single
    noisy sample decide the comparison."""
    from amsp_dtensor.plan.cost.planner import NoPlanFits
    from tools import bench_systems as S
    from tools import bench_worker as W

    args = copy.copy(args)
    model_args = S.model_args(args.flavor, args.seq)
    picks = set()
    for _, _, model in models:
        args.mem_budget_gib = 2.0 ** 20
        _, summary, _ = W.planner_choice(args, model_args, world, rpn, bandwidth=model)
        for budget in sorted({c["memory"] for c in summary["candidates"]}):
            args.mem_budget_gib = budget / 2**30
            try:
                plan, _, _ = W.planner_choice(args, model_args, world, rpn, bandwidth=model)
            except NoPlanFits:  # rounding at the boundary: the next estimate asks again
                continue
            picks.add(plan.name)
    return sorted(f"amsp:{name}" for name in picks)


def sweep_keep(args, profile: dict | None, link_rate: float | None) -> str:
    """--keep for the sweep: the configurations `args` keeps already, and the planner's
    possible picks (profile and alpha-beta) among the configurations it sweeps. The planner
    reads the workload as the workers parse it, defaults included, as planner_data does
    after the sweep."""
    from tools import bench_worker as W

    world, rpn = args.nodes * args.ranks_per_node, args.ranks_per_node
    worker_args = F.parse_args(F.frontier_argv(args) + ["--out", "-"])
    swept = set(F.sweep_keys(args.configs, world, rpn))
    picks = possible_picks(worker_args, world, rpn,
                           time_models(worker_args, rpn, profile, link_rate))
    own = set(W.comma_list(args.keep))
    return ",".join(sorted(own | {k for k in picks if k in swept}))


def _table(profile: dict):
    """A BandwidthTable from the profile's JSON dict (load_table reads a path)."""
    from amsp_dtensor.plan.cost.bandwidth import load_table

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(profile, f)
    try:
        return load_table(f.name)
    finally:
        os.unlink(f.name)


# short: every group shape of every plan, the ops the engine issues, fp32, one round
PROFILE_ARGS = ("--dtype float32 --ops all_gather,reduce_scatter,all_reduce --rounds 1 --max-bytes 4M "
                "--repeats 3 --target-ms 30")

HEADER = """# Benchmarks: AMSP vs DDP, ZeRO-1, ZeRO-3, MiCS (HSDP) and ZeRO++ hpZ under a memory cap

Generated (do not edit by hand): each scale's section by `tools/bench_frontier.py`, the
overlap section by `tools/bench_overlap.py`; the exact command is at the top of each
section, and `--from-json runs/frontier/frontier_<N>x<R>.json` re-renders one without
running. Running one scale rewrites this header and its own section and keeps the others.

The question is the paper's (Chen et al., arXiv 2311.00257, evaluation): given the memory
per rank, is the fastest AMSP plan that fits faster than the fastest configuration of
ZeRO-3, MiCS or ZeRO++ that fits, and does the planner find that plan? So every system's
configuration space is swept on the same emulated cluster, and for every memory cap each
system's fastest configuration under the cap is compared:

- DDP; ZeRO-1 (`ZeroRedundancyOptimizer` under DDP); FSDP2 ZeRO-3 with
  `reshard_after_forward` True ("reshard") and False ("keep"); HSDP (MiCS) with every
  shard-group size the topology allows other than 1 and the world (shard = world is
  ZeRO-3), replicate = world / shard; ZeRO++ hpZ (FSDP2, `reshard_after_forward` = ranks
  per node); AMSP with every valid plan (`amsp_dtensor.plan.enumerate_plans`). Settings
  of each: tools/bench_systems.py (gradient accumulation without sync where each system
  allows it, explicit prefetch of the next block, the same AdamW, data and seed).
- Tokens/s = tokens per step / timed step time (each step the max over ranks), median and
  min-max over the repetitions (configurations interleaved in each). Peak memory per rank
  = glibc malloc bytes in use minus before the build, sampled at every block boundary, at
  the output head, after every backward and after the optimizer step before `zero_grad`,
  and in the warm-up steps (untimed) after every aten op (tools/bench_memory.py), max over
  ranks and repetitions. Both commands run 2 warm-up steps: the first step's backward runs
  before the optimizer's states exist, so per-op samples of it alone miss the steady-state
  backward peak (measured so, p1-g1-os1 peaked at 108.9 MB at 4x2 against 114.9 MB at
  2x2, with the same states per rank). A run with `--warmup 1` needs `--mem-steps 1`:
  in repetition 0, one untimed step after the timed ones, sampled per op.
  A configuration fits a cap when its peak is at or under it. The caps are the distinct measured peaks; each system's
  frontier is a step function of the cap, drawn in the chart of each section.
- "AMSP waited s/step" = sum of the time the issuing thread of a rank waited in the
  collectives of the recorded timed step (`amsp.record_comms`, `blocked_seconds`), max
  over ranks; "(+x)" is the post-step all-gather, waited right after the step (in training
  it overlaps the next forward). The baselines' own code has no such timer.
- The planner's pick is checked against the measured AMSP plans: its rank among those that
  fit the cap (by measured tokens/s) and its slowdown vs the fastest of them. Its time
  model: a bandwidth profile (`amsp_dtensor.plan.profile`) taken on the same emulated cluster
  just before the sweep; alpha-beta at the shaped link rate is shown beside it. The
  planner's memory model counts tensors (states, activations, temporaries in backward; the
  optimizer step's buffers, with gloo's staging copies: `backend="gloo"`), for torchtitan's
  units as the workers cut them. Its reserve (choose_plan's `reserve_bytes`) is 0: the
  peaks are measured above the in-use bytes before each system is built, so the runtime a
  reserve stands for is outside them. Each section also shows the picks with a reserve
  fitted on that run (the median of measured peak - estimate), and, since a cap exactly
  at a plan's measured peak leaves that plan no slack in the model, with the budget at the
  mid-point between the cap and the next. Where the sweep cuts repetitions of
  configurations far from their system's frontier (`--prune`, the 4x2 command), it never
  cuts a plan the planner can pick at some cap (asked at every plan's estimate before the
  sweep), so each slowdown compares medians of full repetitions.

Commands (one per scale; on an idle host here about 11 and 38 minutes, longer when it is
busy: each section gives its sweep's wall time, and its tokens/s compare within the section
only). Where AMSP's fastest plan under a cap shards as the best baseline does (p8-g8-os8
shards P, G and OS over all ranks, as ZeRO-3 reshard does), their ratio is host noise, not
a difference between the systems: two 4x2 sweeps measured that pair at 1.22x and 0.74x.
With only these configurations and more repetitions (`--nodes 4 --ranks-per-node 2
--bw 1gbit --configs zero3,amsp:p8-g8-os8,amsp:p4-g4-os8 --reps 6 --no-profile --doc
/tmp/pair.md --png-dir /tmp`, 552 s), p8-g8-os8 ran 360 (351-387) tokens/s, ZeRO-3 reshard 353
(331-377) and p4-g4-os8 413 (381-440): 1.02x and 1.17x, where the full 4x2 sweep below
has 0.74x and 0.88x.

```
flock /tmp/amsp_cpu.lock timeout 1000 python -m tools.bench_frontier --nodes 2 --ranks-per-node 2 --bw 1gbit
flock /tmp/amsp_cpu.lock timeout 3040 python -m tools.bench_frontier --nodes 4 --ranks-per-node 2 --bw 1gbit --prune 0.1 --timeout 3000
```

**Emulated nodes** (tools/cluster). One network namespace per node plus one "switch"
namespace holding a Linux bridge; each node's `eth0` (198.18.0.<i+1>/24) is a veth into
the bridge, both ends shaped with `tbf rate <bw>` (this kernel has no `sch_netem`, so no
delay is emulated). torchrun runs in each namespace with `GLOO_SOCKET_IFNAME=eth0`; a
connection to a rank of the same namespace goes over that namespace's loopback, unshaped.
Measured with `python -m tools.cluster run --nodes 2 --ranks-per-node 2 --bw 1gbit -- -m
tools.cluster.probe --mbytes 16` (gloo send/recv, best of 3): same node 1080 MB/s, other
node 119.7 MB/s (the 1 Gbit/s line rate). Intra-node "bandwidth" is CPU-bound: TCP over
loopback on the same 2 cores that compute, shared by all ranks of all nodes.

**All fp32.** This CPU (AVX2, no AVX512-BF16/AMX) runs the model ~20x slower in bf16 than
in fp32, which would bury communication under compute, so params, grads, collectives and
AdamW states are fp32 everywhere: FSDP2/DDP keep 16 B/param/shard of states (the param is
the master), and so does AMSP at equal factors: 4/s_p + 4/s_g + 8/s_os (in fp32 the P shard
is its own master).

**Workload.** torchtitan llama3 `debugmodel` (6.16M params), seq 64, one sequence per rank
per micro-batch, M = 4 micro-batches per step, 1 Gbit/s between nodes. Compute per step
scales with params x tokens and communication with params only, so the tokens per
micro-batch set the share of communication: here the fully sharded systems spend most of
a step on the per-micro-batch all-gathers and reduce-scatters, the regime the paper
describes at scale, while DDP's once-per-step all-reduce stays cheap. Loss agreement
(same data, same initial weights, to ~1e-7) shows every configuration trains the same
model; it cannot show a wrong gradient scale (AdamW's first updates are nearly
scale-invariant; the engine's tests compare gradients with single-process training).

`tools/bench.py` (one AMSP plan against one configuration per baseline at one budget, with
the byte-exact check of the planner's schedule) writes its report to runs/bench/; the
bytes per step of every configuration, with the cost model's prediction, are in the
tables below.
"""


def write(data: dict, doc: str, png_dir: str, command: str) -> str:
    """Render this scale's section into `doc` (other sections kept) and its chart."""
    meta = data["meta"]
    name = f"frontier_{meta['nodes']}x{meta['ranks_per_node']}.png"
    rows = R.summarize(data)
    Path(png_dir).mkdir(parents=True, exist_ok=True)
    R.chart(rows, meta, str(Path(png_dir) / name))
    rel = os.path.relpath(Path(png_dir) / name, Path(doc).parent)
    path = Path(doc)
    old = path.read_text() if path.exists() else ""
    sec = R.section(data, command, rel)
    path.write_text(R.assemble(old, sec, HEADER))
    return sec


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_frontier", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bw", default="1gbit", help="inter-node link rate (tc syntax)")
    ap.add_argument("--delay", default="0ms", help="one-way delay (needs netem in the kernel)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only, no shaping")
    ap.add_argument("--timeout", type=float, default=960.0, help="seconds for the whole run")
    from tools import bench_worker as W

    W.add_workload_args(ap)
    F.add_frontier_args(ap)
    ap.add_argument("--caps", default="peaks", choices=("peaks", "grid"),
                    help="memory caps: every distinct measured peak, or a geometric grid")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the bandwidth profile before the sweep (the planner then "
                         "uses alpha-beta at the link rate only)")
    ap.add_argument("--profile-args", default=PROFILE_ARGS,
                    help="options of amsp_dtensor.plan.profile for that run")
    ap.add_argument("--planner-reserve-mb", type=float, default=None,
                    help="the planner's reserve (default 0: the peaks exclude the runtime; "
                         "a fitted one is shown as a variant)")
    ap.add_argument("--out-json", default=None,
                    help="raw results (default runs/frontier/frontier_<N>x<R>.json)")
    ap.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--png-dir", default=str(REPO / "docs"))
    ap.add_argument("--from-json", help="only render the report from this result file")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    reserve = None if args.planner_reserve_mb is None else args.planner_reserve_mb * R.MB

    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        data["cap_mode"] = args.caps
        data["planner"] = planner_data(data, reserve)
        Path(args.from_json).write_text(json.dumps(data, indent=1))
        sec = write(data, args.doc, args.png_dir, data["meta"]["command"])
        print(sec[:sec.find("### Why")])
        return 0

    from tools.cluster import ClusterSpec, LinkSpec, run_cluster

    F.sweep_keys(args.configs, args.nodes * args.ranks_per_node, args.ranks_per_node)
    link = LinkSpec(bw=args.bw, delay=args.delay)
    inter_bw = link.rate_bytes()
    profile = None
    with tempfile.TemporaryDirectory(prefix="amsp_frontier_") as tmp:
        os.chmod(tmp, 0o755)
        if not args.no_profile:
            table = Path(tmp) / "profile.json"
            spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                               link=link, netns=not args.no_netns, timeout_s=300)
            t0 = time.time()
            rc = run_cluster(spec, ["-m", "amsp_dtensor.plan.profile", "--out", str(table),
                                    *shlex.split(args.profile_args)])
            if rc != 0 or not table.exists():
                print(f"bandwidth profile failed (exit {rc})", file=sys.stderr)
                return rc or 1
            profile = json.loads(table.read_text())
            profile_s = time.time() - t0
        if args.prune > 0:  # [Note: possible picks are never pruned]
            args.keep = sweep_keep(args, profile, None if args.no_netns else inter_bw)
            print(f"never pruned (the planner's possible picks): {args.keep}", flush=True)
        out = Path(tmp) / "result.json"
        worker = ["-m", "tools.frontier_worker", *F.frontier_argv(args),
                  "--inter-bw", str(inter_bw if not args.no_netns else args.intra_bw),
                  "--out", str(out)]
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=link,
                           netns=not args.no_netns, timeout_s=args.timeout)
        rc = run_cluster(spec, worker)
        if not out.exists():
            print(f"frontier run failed (exit {rc}); no report written", file=sys.stderr)
            return rc or 1
        data = json.loads(out.read_text())
    meta = data["meta"]
    if profile is not None:
        data["profile"] = profile
        meta["profile_command"] = ("python -m amsp_dtensor.plan.profile --out <table> "
                                   + args.profile_args)
        meta["profile_s"] = profile_s
    meta["link_rate"] = None if args.no_netns else inter_bw
    meta["bw"] = "loopback, no shaping" if args.no_netns else f"{args.bw} between nodes"
    meta["link_short"] = ("loopback, no shaping" if args.no_netns else
                          f"inter-node link {args.bw} (tbf), intra-node loopback")
    meta["command"] = (f"flock /tmp/amsp_cpu.lock timeout {int(args.timeout) + 40} "
                       "python -m tools.bench_frontier " + shlex.join(argv))
    data["cap_mode"] = args.caps
    data["planner"] = planner_data(data, reserve)
    out_json = Path(args.out_json or REPO / "runs" / "frontier" /
                    f"frontier_{args.nodes}x{args.ranks_per_node}.json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(data, indent=1))
    sec = write(data, args.doc, args.png_dir, meta["command"])
    print(sec[:sec.find("### Why")])
    if rc != 0:
        print(f"note: the nodes exited with {rc} after rank 0 wrote its results",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
