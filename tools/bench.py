"""The benchmark: every system's configuration space on the emulated cluster, one command.

    flock /tmp/amsp_cpu.lock python -m tools.bench frontier --nodes 2 --ranks-per-node 2 --bw 1gbit
    flock /tmp/amsp_cpu.lock python -m tools.bench overlap --bw 1gbit,200mbit
    flock /tmp/amsp_cpu.lock python -m tools.bench compression --nodes 2 --bw 1gbit,200mbit
    python -m tools.bench install-peers        # DeepSpeed, Megatron-FSDP under runs/peers/

Results go to runs/bench/, the sections and charts to docs/benchmarks.md (its header and
other sections kept); ``--from-json FILE`` re-renders. ``python -m tools.bench_frontier`` /
``tools.bench_overlap`` are the two subcommands under their older names.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import typing
from pathlib import Path

from amsp_dtensor.plan.cost import AlphaBeta, choose_plan
from amsp_dtensor.plan.cost.bandwidth import parse_table
from amsp_dtensor.plan.cost.models import from_torchtitan_args
from amsp_dtensor.plan.cost.planner import NoPlanFits, ranked
from tools import bench_peers
from tools import bench_report as R
from tools import bench_worker as W
from tools.bench_systems import OVERLAP, model_args, sweep
from tools.cluster import ClusterSpec, LinkSpec, run_cluster

REPO = Path(__file__).resolve().parents[1]
PROFILE_ARGS = ("--dtype float32 --ops all_gather,reduce_scatter,all_reduce --rounds 1 "
                "--max-bytes 4M --repeats 3 --target-ms 30")


def _shape(args):
    return dataclasses.replace(from_torchtitan_args(args.flavor, model_args(args.flavor, args.seq)),
                               layout="titan")


def _costing(args) -> dict:
    """choose_plan's / estimate_plan's settings for this workload: fp32, gloo, the post-step
    all-gather overlapping the next forward, torchtitan's units (as the workers run AMSP)."""
    return dict(seq_len=args.seq, micro_batch=args.micro_batch, micro_batches=args.micro_batches,
                mixed_precision="fp32", attention="flash", clip=False, reserve_bytes=0,
                backend="gloo", overlap_param_update=True)


def pair_name(estimate) -> str:
    """A plan estimate as the key suffix its configuration runs under: the plan, and with
    experts "+e-" and the expert plan."""
    e = estimate.expert_plan
    return estimate.plan.name + (f"+e-{e.name}" if e is not None else "")


def planner_choice(args, world: int, rpn: int, budget: float, bandwidth, rank_by: str = "step"):
    """(plan name, choose_plan's report) for this workload (_costing; with the moe flavour
    the plan pair, as pair_name). Raises NoPlanFits when nothing fits the budget."""
    report = choose_plan(_shape(args), memory_budget_bytes=budget, world_size=world,
                         ranks_per_node=rpn, bandwidth=bandwidth,
                         ep=W.expert_parallel(args) or 1, rank_by=rank_by, **_costing(args))
    return pair_name(report.best), report


def estimates_of(args, world: int, rpn: int, report) -> dict[str, float]:
    """The planner's memory estimate of every AMSP plan (with the moe flavour every plan
    pair: the grid choose_plan costed, report.pairs), by pair_name."""
    if not W.expert_parallel(args):
        return {c.plan.name: c.memory.total for c in report.candidates}
    if not report.pairs:
        raise SystemExit(f"the planner alternated over more than PAIR_GRID_LIMIT pairs at "
                         f"{world} ranks; the benchmark needs every pair's estimate")
    return {pair_name(e): e.memory.total for e in report.pairs}


def _pick(args, world: int, rpn: int, budget: float, tm: "TimeModel") -> str | None:
    """The planner's plan at ``budget`` under time model ``tm``, None where nothing fits."""
    try:
        return planner_choice(args, world, rpn, budget, tm.bandwidth, tm.rank_by)[0]
    except NoPlanFits:
        return None


class TimeModel(typing.NamedTuple):
    """One way the planner is asked: its bandwidth model and what it ranks by."""

    name: str
    desc: str
    bandwidth: object
    rank_by: str = "step"


def time_models(rpn: int, profile: dict | None, link_rate: float | None) -> list[TimeModel]:
    """This cluster's profile table when there is one, ranked by step time and by the
    communication sum, and alpha-beta at the shaped link rate (one rank's share of its
    node's link). [Note: the emulated cluster's step] says why the second."""
    models = []
    if profile:  # (a copy: parse_table normalizes the entries in place)
        table = parse_table(copy.deepcopy(profile))
        models.append(TimeModel("profile", "the profile table of this cluster "
                                "(amsp_dtensor.plan.profile, run on it before the sweep)", table))
    if link_rate:
        link = AlphaBeta(intra_bw=1e9, inter_bw=link_rate / rpn, intra_alpha=20e-6,
                         inter_alpha=50e-6)
        models.append(TimeModel("link", f"alpha-beta: {link.inter_bw / R.MB:.1f} MB/s per rank "
                                f"across nodes (the {link_rate / R.MB:.0f} MB/s link shared by "
                                f"{rpn} ranks), {link.intra_bw / R.MB:.0f} MB/s inside a node",
                                link))
    if profile:
        models.append(TimeModel("profile, no overlap", "the profile table, plans ranked by "
                                "their communication sum: choose_plan(rank_by='comm')", table,
                                "comm"))
    return models


# [Note: the emulated cluster's step] The planner's step time overlaps the collectives
# with GPU-rate compute. On the emulated cluster 4 or 8 ranks share 2 CPU cores and gloo
# moves and reduces the bytes on those same cores, so nothing overlaps: over the 2x2 MoE
# sweep at 1 Gbit a step measured 1.26 s + 1.14 x the planner's communication sum (median
# error 9%, at most 21%), while its overlapped step time was off by 1.5x to 3.6x. Ranking
# by the communication sum (rank_by="comm", the paper's objective) is the planner's own
# setting for such a machine; the sweep reports it beside the other two.


def possible_picks(args, world: int, rpn: int, models: list) -> set[str]:
    """Every plan some time model picks at some budget, as configuration keys. The set of
    plans that fit changes only where the budget crosses a plan's estimate, so asking at
    each estimate finds every pick. The sweep never prunes these: the planner's slowdown
    compares its pick's median with the best plan's, over full repetitions."""
    picks = set()
    for tm in models:
        _, report = planner_choice(args, world, rpn, 2.0 ** 60, tm.bandwidth, tm.rank_by)
        # with experts: the pairs' estimates (a pair fits where both of its plans do)
        for budget in sorted({*estimates_of(args, world, rpn, report).values()}):
            plan = _pick(args, world, rpn, budget, tm)  # None: rounding at the boundary
            if plan:
                picks.add("amsp:" + plan)
    return picks


# [Note: the planner with measured memory] The frontier's caps are the measured peaks, so
# the best plan under a cap usually peaks exactly at it, and the planner finds it only if
# its estimate of that plan is not above the plan's own peak while every faster plan's is
# above the cap. planner_data therefore also asks the planner with the measured peaks in
# place of its memory estimates (its time model, its ranking), and with those peaks off by
# a normal error of MEMORY_SD_MB: what the time model alone achieves, and how exact a
# memory estimate has to be for the share the time model allows.
MEMORY_SD_MB = 0.5
MEMORY_DRAWS = 5


def measured_memory_picks(report, rows: list[dict], caps: list[float], rank_by: str,
                          sd_mb: float = 0.0, seed: int = 0) -> dict:
    """The planner's pick at each cap (as planner_rows takes them) from ``report``'s plans
    in its own order, with each measured AMSP plan's peak (plus a normal error of
    ``sd_mb``, drawn with ``seed``) in place of its memory estimate."""
    rnd = random.Random(seed)
    peaks = {r["key"].split(":", 1)[1]: r["peak"] for r in rows if r["family"] == "amsp"}
    memory = {k: v + rnd.gauss(0.0, sd_mb) * R.MB for k, v in sorted(peaks.items())}
    plans = [e for e in report.pairs or report.candidates if pair_name(e) in memory]
    picks = {}
    for cap in caps:  # ranked among those that fit, as choose_plan ranks (ties are relative)
        fit = ranked([e for e in plans if memory[pair_name(e)] <= cap], rank_by)
        picks[repr(cap)] = pair_name(fit[0]) if fit else None
    return picks


def planner_data(data: dict) -> dict:
    """The planner beside the measurement: its memory estimate of every AMSP plan, and its
    pick at every cap per time model (profile, alpha-beta). The reserve is 0: the peaks
    are measured above the in-use bytes before each build, so the runtime a reserve stands
    for is outside them."""
    meta = data["meta"]
    args = argparse.Namespace(**meta["args"])
    world, rpn = meta["world"], meta["ranks_per_node"]
    models = time_models(rpn, data.get("profile"), meta.get("link_rate"))
    if not models:
        return {}
    _, report = planner_choice(args, world, rpn, 2.0 ** 60, models[0].bandwidth)
    estimates = estimates_of(args, world, rpn, report)
    rows = R.summarize(data)
    gaps = [r["peak"] - estimates[r["key"][5:]] for r in rows
            if r["family"] == "amsp" and r["key"][5:] in estimates]
    caps = R.select_caps(rows)
    variants = [{"name": tm.name, "desc": tm.desc,
                 "picks": {repr(cap): _pick(args, world, rpn, cap, tm) for cap in caps}}
                for tm in models]
    note = (f"the median over the {len(gaps)} AMSP plans of measured peak - estimate is "
            f"{statistics.median(gaps) / R.MB:.1f} MB" if gaps else "no AMSP plan measured")
    out = {"estimates": estimates, "reserve_bytes": 0.0, "reserve_note": note,
           "variants": variants}
    if gaps:  # Note above
        out["measured_memory"] = {
            "time_model": models[0].name, "gap_mb": [min(gaps) / R.MB, max(gaps) / R.MB],
            "sd_mb": MEMORY_SD_MB,
            "exact": measured_memory_picks(report, rows, caps, models[0].rank_by),
            "noisy": [measured_memory_picks(report, rows, caps, models[0].rank_by,
                                            MEMORY_SD_MB, seed)
                      for seed in range(MEMORY_DRAWS)]}
    return out


def run_sets(args, runs: list[str], out_dir: Path, link) -> dict:
    """Run `runs` on the cluster, one torchrun set per peer process set (MiCS needs another
    DeepSpeed), and merge their results; meta from the first set, wall time summed."""
    sets: dict[str, list[str]] = {}
    for run in runs:
        sets.setdefault(bench_peers.env_of(run), []).append(run)
    merged, rivals = None, []
    for env, mine in sets.items():
        out = out_dir / f"result_{env}.json"
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=link,
                           netns=not args.no_netns, timeout_s=args.timeout)
        rc = run_cluster(spec, ["-m", "tools.bench_worker", *W.workload_argv(args), "--env", env,
                                "--runs", ",".join(mine), "--out", str(out), *rivals])
        if not out.exists():
            raise SystemExit(f"the {env} process set failed (exit {rc}); no report written")
        data = json.loads(out.read_text())
        if not data["meta"].get("complete", True):
            print(f"the {env} process set stopped (exit {rc}) after {len(data['results'])} "
                  "runs; reporting those", file=sys.stderr)
            data["meta"]["incomplete"] = [f"{env} set stopped (exit {rc}) after "
                                          f"{len(data['results'])} runs"]
        rivals = ["--rivals", str(out)]  # the next set prunes against this one's too
        if merged is None:
            merged = data
        else:
            merged["results"] += data["results"]
            for k in ("configs", "pruned", "incomplete"):
                merged["meta"][k] = merged["meta"].get(k, []) + data["meta"].get(k, [])
            merged["meta"]["wall_s"] += data["meta"]["wall_s"]
            merged["meta"]["loadavg"] += data["meta"]["loadavg"]
    return merged


def frontier(args, argv: list[str]) -> int:
    world, rpn = args.nodes * args.ranks_per_node, args.ranks_per_node
    ep = W.expert_parallel(args)
    every = sweep(world, rpn, ep)
    keys = [k for item in W.comma_list(args.configs) for k in (every if item == "all" else [item])]
    # an AMSP plan of the sweep may also run with compressed cross-node stages (+g-/+w-)
    def exact(k: str) -> str:  # the key without its compression settings
        return "+".join(x for i, x in enumerate(k.split("+")) if i == 0 or x.startswith("e-"))

    unknown = [k for k in keys if exact(k) not in every]
    if unknown:
        raise SystemExit(f"--configs: {unknown} not in the sweep of {world} ranks, {rpn} per "
                         f"node; its keys: {','.join(every)}")
    skipped = [m for m in map(bench_peers.missing, keys) if m]
    if ep:  # the moe flavour's sweep holds no peer: say why, one line each
        skipped += [f"{name}: {bench_peers.moe_refusal(k)}" for name, k in
                    (("DeepSpeed MoE", "ds_"), ("Megatron-FSDP", "mfsdp"))]
    for line in skipped:
        print("skipped:", line, flush=True)
    keys = [k for k in keys if not bench_peers.missing(k)]
    link = LinkSpec(bw=args.bw)
    inter_bw = None if args.no_netns else link.rate_bytes()
    profile = None
    with tempfile.TemporaryDirectory(prefix="amsp_bench_") as tmp:
        os.chmod(tmp, 0o755)
        if not args.no_profile:
            t0, table = time.time(), Path(tmp) / "profile.json"
            run_cluster(ClusterSpec(nodes=args.nodes, ranks_per_node=rpn, link=link,
                                    netns=not args.no_netns, timeout_s=300),
                        ["-m", "amsp_dtensor.plan.profile", "--out", str(table),
                         *shlex.split(PROFILE_ARGS)])
            if not table.exists():
                raise SystemExit("the bandwidth profile failed; no report written")
            profile, profile_s = json.loads(table.read_text()), time.time() - t0
        if args.prune > 0 or args.prune_all > 0:
            picks = possible_picks(args, world, rpn, time_models(rpn, profile, inter_bw))
            args.keep = ",".join(sorted(set(W.comma_list(args.keep)) | (picks & set(keys))))
            print(f"never pruned (the planner's possible picks): {args.keep}", flush=True)
        t0 = time.time()
        data = run_sets(args, keys, Path(tmp), link)
    meta = data["meta"]
    meta.update(sweep_wall_s=time.time() - t0, skipped=skipped, link_rate=inter_bw,
                bw="loopback, no shaping" if args.no_netns else f"{args.bw} between nodes",
                link_short="loopback, no shaping" if args.no_netns else
                f"inter-node link {args.bw} (tbf), intra-node loopback",
                command=f"flock /tmp/amsp_cpu.lock timeout {int(args.timeout) + 60} "
                        "python -m tools.bench_frontier " + shlex.join(argv))
    meta["wall_s"] = meta["sweep_wall_s"]
    if profile is not None:
        data["profile"] = profile
        meta["profile_command"] = "python -m amsp_dtensor.plan.profile --out <table> " + PROFILE_ARGS
        meta["profile_s"] = profile_s
    out = Path(args.out_json or REPO / "runs" / "bench" / f"frontier_{R.scale_tag(meta)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out}")
    return render("frontier", data, args)


def render(what: str, data: dict, args) -> int:
    """Put ``data`` (a result file of `what`) into --doc; a frontier also gets its chart."""
    doc = Path(args.doc)
    if what == "overlap":
        section = {"overlap": R.overlap_section(data["runs"], data["command"])}
    elif what == "compression":
        section = {"compression": R.compression_section(data["runs"], data["commands"])}
    else:
        data["planner"] = planner_data(data)
        png = Path(args.png_dir) / f"frontier_{R.scale_tag(data['meta'])}.png"
        png.parent.mkdir(parents=True, exist_ok=True)
        R.chart(R.summarize(data), data["meta"], str(png))
        sec = R.section(data, data["meta"]["command"], os.path.relpath(png, doc.parent))
        print(sec[:sec.find("### Each system")])
        section = {"frontier_section": sec}
    doc.write_text(R.assemble(doc.read_text() if doc.exists() else "", **section))
    return 0


def planned_at_hsdp(args, world: int, rpn: int, inter: float) -> str:
    """The planner's plan at the memory it estimates for HSDP (shard = a node)."""
    link = AlphaBeta(intra_bw=1e9, inter_bw=inter)
    _, probe = planner_choice(args, world, rpn, 2.0 ** 60, link)
    return planner_choice(args, world, rpn, probe.baselines["hsdp"].memory.total, link)[0]


COMPRESSIONS = ("+g-bf16", "+g-int8", "+g-int8+w-bf16")


def planned_runs(what: str, rpn: int, plans: list[str]) -> list[str]:
    """overlap: each plan under every OVERLAP setting and in noop / serial mode, then FSDP2
    and HSDP (shard = a node) in all three modes; compression: three plans, each exact and
    under COMPRESSIONS, the first measured twice (a repetition's first run warms the process)."""
    if what == "compression":
        runs = [f"amsp:{p}{c}" for p in plans[:3] for c in ("", *COMPRESSIONS)]
        return [runs[0] + "@real", *runs]
    runs = [f"amsp:{p}{'' if c == 'all_on' else '/' + c}{m}" for p in plans
            for c, m in [*[(c, "") for c in OVERLAP], ("all_on", "@noop"), ("all_on", "@serial")]]
    return runs + [f"{key}{m}" for key in ("zero3", f"hsdp:{rpn}") for m in ("", "@noop", "@serial")]


def planned(what: str, args, argv: list[str]) -> int:
    """Per link rate: the planner's plan at HSDP's memory and --plans, run as planned_runs.
    overlap.json holds this command's runs; compression.json every cluster and rate so far."""
    world, rpn = args.nodes * args.ranks_per_node, args.ranks_per_node
    out = Path(args.out_json or REPO / "runs" / "bench" / f"{what}.json")
    command = "flock /tmp/amsp_cpu.lock python -m " + {
        "overlap": "tools.bench_overlap ", "compression": "tools.bench compression "}[what] \
        + shlex.join(argv)
    saved = {"command": command, "runs": []} if what == "overlap" else \
        json.loads(out.read_text()) if out.exists() else {"commands": [], "runs": {}}
    for bw in W.comma_list(args.bw)[:1 if args.no_netns else None]:
        link = LinkSpec(bw=bw)
        plan = planned_at_hsdp(args, world, rpn, 1e9 if args.no_netns else link.rate_bytes())
        plans = [plan, *[p for p in W.comma_list(args.plans) if p != plan]]
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix=f"amsp_{what}_") as tmp:
            os.chmod(tmp, 0o755)
            data = run_sets(args, planned_runs(what, rpn, plans), Path(tmp), link)
        if what == "overlap":
            data["meta"].update(bw=bw, link_short=f"inter-node link {bw} (tbf), intra-node "
                                f"loopback; planned plan {plan}")
            saved["runs"].append(data)
            print(R.overlap_table(data))
        else:
            data["meta"].update(bw=bw, planned=plan, wall_s=time.time() - t0)
            saved["runs"][f"{args.nodes}x{rpn} {bw}"] = data
            print(R.compression_section({bw: data}, [command]), flush=True)
            saved["commands"] = [c for c in saved["commands"] if c != command] + [command]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(saved, indent=1))
    return render(what, saved, args)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("frontier", "overlap", "compression", "install-peers"))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bw", default="1gbit", help="inter-node link rate (tc syntax); overlap: "
                    "a comma list, one run each")
    ap.add_argument("--no-netns", action="store_true", help="loopback only, no shaping")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds per process set")
    W.add_workload_args(ap)
    ap.add_argument("--configs", default="all", help="frontier: configuration keys; 'all' is "
                    "the sweep (e.g. all,amsp:p1-g1-os2+g-int8 adds a compressed AMSP plan)")
    ap.add_argument("--plans", default=None, help="overlap (default p1-g1-os2), compression "
                    "(default p1-g1-os2,p1-g1-os4,p2-g2-os4; the first two not planned): AMSP "
                    "plans beside the planner's")
    ap.add_argument("--no-profile", action="store_true",
                    help="no bandwidth profile before the sweep (the planner then uses "
                         "alpha-beta at the link rate only)")
    ap.add_argument("--out-json", default=None, help="raw results (default under runs/bench/)")
    ap.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--png-dir", default=str(REPO / "docs"))
    ap.add_argument("--from-json", help="only render the report from this result file")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.what == "install-peers":
        return bench_peers.install()
    if args.from_json:
        return render(args.what, json.loads(Path(args.from_json).read_text()), args)
    if args.what in ("overlap", "compression"):
        args.warmup = 1 if "--warmup" not in argv else args.warmup
        args.plans = args.plans or ("p1-g1-os2" if args.what == "overlap"
                                    else "p1-g1-os2,p1-g1-os4,p2-g2-os4")
        return planned(args.what, args, argv[1:])
    return frontier(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
