"""Overlap ablation: how much of a training step's communication is hidden behind compute.

One command runs tools/overlap_worker on the emulated cluster (tools/cluster) once per
inter-node bandwidth, keeps the raw JSON in runs/overlap/ (git-ignored), and writes a
table per bandwidth and a chart (docs/overlap.png) into the overlap section of
docs/benchmarks.md, between the markers ``<!-- overlap:begin -->`` and
``<!-- overlap:end -->``; the rest of that file is left as it is:

    flock /tmp/amsp_cpu.lock timeout 1200 python -m tools.bench_overlap --bw 1gbit,200mbit

Every step is timed three ways (tools/comm_modes): T_real (real collectives), T_noop
(collectives replaced by their local copies: compute only) and T_serial (every
collective waited right after it is issued). Exposed communication = T_real - T_noop;
overlap efficiency = (T_serial - T_real) / (T_serial - T_noop).

``--no-netns`` runs on plain loopback (quick, unshaped); ``--from-json`` re-renders from
saved result files (runs/overlap/overlap.json, or per-bandwidth files, comma-separated).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from tools import bench_worker as W
from tools import overlap_worker as O
from tools.bench_systems import SYSTEM_LABELS
from tools.cluster import ClusterSpec, LinkSpec, run_cluster

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- overlap:begin -->", "<!-- overlap:end -->"
TARGET_SPEEDUP, TARGET_EFFICIENCY, TARGET_BW = 1.25, 0.6, "200mbit"


# ---------------------------------------------------------------- numbers


def _stats(values: list[float]) -> dict:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"med": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"med": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _per_rep(results: list[dict], system: str, config: str, mode: str) -> dict[int, float]:
    """rep -> mean step time (each step already the max over ranks)."""
    return {r["rep"]: statistics.mean(r["step_times"]) for r in results
            if r["system"] == system and r["config"] == config and r["mode"] == mode
            and r["step_times"]}


def _label(system: str, meta: dict) -> str:
    if system.startswith("amsp:"):
        plan = system.split(":", 1)[1]
        return f"AMSP {plan} ({'planned' if plan == meta.get('amsp_plan') else 'given'})"
    return SYSTEM_LABELS.get(system, system)


def summarize(data: dict) -> list[dict]:
    """One row per (system, config) measured in real mode, in run order.

    Per repetition: exposed = real - noop, efficiency = (serial - real) / (serial - noop),
    speed-up = real(none) / real, all paired within the repetition; then median and
    min-max over repetitions. noop / serial come from the row's own configuration when it
    was measured, else from the plan's "all_on" (shared, flagged)."""
    meta, results = data["meta"], data["results"]
    seen: list[tuple[str, str]] = []
    for r in results:
        if r["mode"] == "real" and (r["system"], r["config"]) not in seen:
            seen.append((r["system"], r["config"]))
    rows = []
    for system, config in seen:
        real = _per_rep(results, system, config, "real")
        shared = False
        noop = _per_rep(results, system, config, "noop")
        serial = _per_rep(results, system, config, "serial")
        if not noop or not serial:
            noop = _per_rep(results, system, "all_on", "noop")
            serial = _per_rep(results, system, "all_on", "serial")
            shared = config != "all_on"
        none = _per_rep(results, system, "none", "real")
        reps = sorted(real)
        exposed, eff, speedup = [], [], []
        for k in reps:
            if k in noop:
                exposed.append(real[k] - noop[k])
            if k in noop and k in serial and serial[k] - noop[k] > 0:
                eff.append((serial[k] - real[k]) / (serial[k] - noop[k]))
            if k in none:
                speedup.append(none[k] / real[k])
        blocked = [r["recorded_blocked_s"] for r in results
                   if r["system"] == system and r["config"] == config and r["mode"] == "real"
                   and r.get("recorded_blocked_s") is not None]
        losses = [r["losses"] for r in results if r["system"] == system
                  and r["config"] == config and r["mode"] == "real"]
        amsp = system.startswith("amsp:")
        rows.append({
            "system": system, "config": config, "amsp": amsp,
            "label": _label(system, meta) + (f": {O.CONFIG_LABELS.get(config, config)}"
                                             if amsp else ""),
            "real": _stats(list(real.values())), "noop": _stats(list(noop.values())),
            "serial": _stats(list(serial.values())), "shared": shared,
            "exposed": _stats(exposed), "efficiency": _stats(eff),
            "speedup": _stats(speedup) if amsp and none else None,
            "recorded": _stats(blocked) if blocked else None,
            "losses": losses[0] if losses else [],
        })
    return rows


def loss_spread(rows: list[dict], system: str) -> float:
    """Largest difference of the real-mode losses between the configurations of a plan
    (rep 0): the switches must change the schedule, not the numbers."""
    ls = [r["losses"] for r in rows if r["system"] == system and r["losses"]]
    if len(ls) < 2:
        return 0.0
    return max(abs(a - b) for other in ls[1:] for a, b in zip(ls[0], other))


def _fmt(s: dict, digits: int = 3) -> str:
    if s is None or s["n"] == 0:
        return "n/a"
    if s["n"] == 1:
        return f"{s['med']:.{digits}f}"
    sep = " to " if s["min"] < 0 else "-"  # "-0.50-0.61" would read as a minus
    return f"{s['med']:.{digits}f} ({s['min']:.{digits}f}{sep}{s['max']:.{digits}f})"


def table(data: dict) -> str:
    rows = summarize(data)
    head = ("| plan / system: configuration | T_real s | T_noop s | T_serial s | exposed s "
            "(T_real - T_noop) | overlap efficiency | speed-up vs none | recorded exposed s |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        mark = " *" if r["shared"] else ""
        lines.append(
            f"| {r['label']} | {_fmt(r['real'])} | {_fmt(r['noop'])}{mark} | "
            f"{_fmt(r['serial'])}{mark} | {_fmt(r['exposed'])} | {_fmt(r['efficiency'], 2)} | "
            f"{_fmt(r['speedup'], 2) if r['speedup'] else 'n/a'} | "
            f"{_fmt(r['recorded']) if r['recorded'] else 'n/a'} |")
    return "\n".join(lines)


def targets(data: dict) -> list[str]:
    """The targets on the planned plan (they apply at 200 Mbit/s; other links: reference)."""
    meta = data["meta"]
    rows = summarize(data)
    planned = f"amsp:{meta['amsp_plan']}"
    by = {(r["system"], r["config"]): r for r in rows}
    on, none = by.get((planned, "all_on")), by.get((planned, "none"))
    applies = meta.get("bw") == TARGET_BW
    tag = "target" if applies else f"target (set for {TARGET_BW}; here for reference)"
    lines = []
    if on is None:
        return [f"AMSP's planned plan {meta['amsp_plan']} was not run with all switches on."]
    if none is not None and on["speedup"] is not None:
        s = on["speedup"]
        ok = "met" if s["med"] >= TARGET_SPEEDUP else "MISSED"
        lines.append(
            f"Planned plan {meta['amsp_plan']}: T_real(none) / T_real(all on) = "
            f"{_fmt(s, 2)} ({tag} >= {TARGET_SPEEDUP}x: {ok}); T_real all on "
            f"{_fmt(on['real'])} s, none {_fmt(none['real'])} s.")
    e = on["efficiency"]
    ok = "met" if e["n"] and e["med"] >= TARGET_EFFICIENCY else "MISSED"
    lines.append(f"Planned plan {meta['amsp_plan']}, all on: overlap efficiency {_fmt(e, 2)} "
                 f"({tag} >= {TARGET_EFFICIENCY}: {ok}).")
    noop, serial = on["noop"]["med"], on["serial"]["med"]
    if noop > 0 and serial > noop:
        comm = serial - noop
        floor = max(noop, comm)  # perfect overlap still leaves the longer of the two
        eff_cap = min(noop, comm) / comm
        line = (f"Ceilings from the same medians: compute T_noop {noop:.3f} s, communication "
                f"when serialized T_serial - T_noop {comm:.3f} s. Perfect overlap still leaves "
                f"max of the two ({floor:.3f} s) per step, so the efficiency can reach at most "
                f"min / communication = {eff_cap:.2f}")
        if none is not None:
            cap = none["real"]["med"] / floor
            line += (f", and all on can beat none (T_real {none['real']['med']:.3f} s) by at "
                     f"most {cap:.2f}x")
        out_of_reach = [name for name, bad in (
            (f"efficiency {TARGET_EFFICIENCY}", eff_cap < TARGET_EFFICIENCY),
            (f"speed-up {TARGET_SPEEDUP}x", none is not None
             and none["real"]["med"] / floor < TARGET_SPEEDUP)) if bad]
        line += (f" (target {' and '.join(out_of_reach)} out of reach by construction here)."
                 if out_of_reach else ".")
        lines.append(line)
    return lines


# ---------------------------------------------------------------- chart + doc


def chart(runs: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(7.5 * len(runs), 6.5), squeeze=False)
    for ax, data in zip(axes[0], runs):
        rows = summarize(data)
        labels = [r["label"].replace(": ", "\n") for r in rows]
        x = range(len(rows))
        noop = [r["noop"]["med"] for r in rows]
        real = [r["real"]["med"] for r in rows]
        serial = [r["serial"]["med"] for r in rows]
        exposed = [max(0.0, a - b) for a, b in zip(real, noop)]
        hidden = [max(0.0, s - a) for s, a in zip(serial, real)]
        ax.bar(x, noop, color="tab:gray", label="compute (T_noop)")
        ax.bar(x, exposed, bottom=noop, color="tab:red", label="exposed comm (T_real - T_noop)")
        ax.bar(x, hidden, bottom=[n + e for n, e in zip(noop, exposed)], color="tab:green",
               alpha=0.6, label="hidden comm (T_serial - T_real)")
        err = [[r["real"]["med"] - r["real"]["min"] for r in rows],
               [r["real"]["max"] - r["real"]["med"] for r in rows]]
        ax.errorbar(x, real, yerr=err, fmt="none", ecolor="black", capsize=3, lw=1,
                    label="T_real min-max")
        ax.scatter(x, serial, marker="_", s=200, color="black", zorder=3, label="T_serial")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=70, fontsize=7)
        ax.set_ylabel("seconds per training step (median over repetitions)")
        meta = data["meta"]
        ax.set_title(f"{meta.get('link_short', meta.get('bw', ''))}", fontsize=9)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Overlap ablation: step time = compute + exposed comm; hidden comm on top "
                 "(bar top = T_serial)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def section(runs: list[dict], command: str, png_name: str = "overlap.png") -> str:
    """The markdown between BEGIN and END (markers included)."""
    first = runs[0]["meta"]
    a = first["args"]
    shared = not a.get("modes_per_config")
    parts = [BEGIN, "", "## Overlap ablation: how much communication is hidden", "",
             "Generated by `tools/bench_overlap.py` (do not edit this section by hand; rerun "
             "the command, or `--from-json runs/overlap/overlap.json` to re-render). "
             "`tools/bench_frontier.py` keeps this section when it rewrites the rest of the file.", "",
             "```", command, "```", "",
             f"- Machine: {first['machine']}; {first['nodes']} emulated nodes x "
             f"{first['ranks_per_node']} ranks (gloo, CPU), tools/cluster as above.",
             f"- Workload: the benchmark's (torchtitan llama3 `{a['flavor']}`, "
             f"{first['model']['params']:,} params, fp32, seq {a['seq']}, M = "
             f"{a['micro_batches']} micro-batches, AdamW; {first['tokens_per_step']} tokens per "
             f"step). AMSP units: "
             + ("torchtitan's (tok_embeddings, each block, [norm, output], root)"
                if a.get("amsp_layout") == "titan" else "each block, then the root")
             + f" (`--amsp-layout {a.get('amsp_layout')}`).",
             f"- Every number is one training step: each measurement rebuilds the system "
             f"from the same seed and runs {a['warmup']} warm-up step(s) + {a['steps']} timed "
             f"step(s) back to back in one mode; step time = interval between step ends (max "
             f"over ranks), so the post-step all-gather left in flight by a step is paid in the "
             f"next one, as in training; mean of the timed steps. {a['reps']} repetitions, all "
             "measurements interleaved in each; median (min-max) over repetitions.",
             "- T_real: real collectives. T_noop: every torch.distributed collective replaced "
             "by its local copies (all-gather: the input into every chunk; reduce-scatter: "
             "this rank's chunk), i.e. compute only; nothing then makes the ranks wait for "
             "each other, so an untimed real barrier starts each noop step on all ranks "
             "together. T_serial: every collective waited right "
             "after it is issued (tools/comm_modes.py). Exposed = T_real - T_noop; overlap "
             "efficiency = (T_serial - T_real) / (T_serial - T_noop), paired per repetition; "
             "speed-up vs none = T_real(none) / T_real, per repetition.",
             "- " + ("T_noop and T_serial are measured once per plan and repetition with all "
                     "switches on and shared by that plan's rows (marked *): they time compute "
                     "alone and fully serialized communication, which the switches (order of "
                     "issue and wait) do not change." if shared else
                     "T_noop and T_serial are measured for every configuration."),
             "- AMSP configurations: `amsp.set_overlap(model, grad_sync=, prefetch=, step=)` "
             "and `AMSPOptimizer(overlap_param_update=)`; \"none\" = all four off. Baselines: "
             "tools/bench_systems.py's FSDP2 ZeRO-3 and HSDP with explicit forward/backward "
             "prefetch of the next block (their normal settings).",
             "- Recorded exposed = sum of `blocked_seconds` of the AMSP recorder's events per "
             "timed step (time the issuing thread waited; max over ranks; n/a when the "
             "recorder has no such field).", ""]
    for data in runs:
        meta = data["meta"]
        rows = summarize(data)
        spreads = {r["system"]: loss_spread(rows, r["system"]) for r in rows if r["amsp"]}
        parts += [f"### {meta.get('bw', 'link')}: {meta.get('link_short', meta['link'])}", "",
                  f"AMSP plans: {meta['planner_note']} (planner told {meta['args']['inter_bw'] / 1e6:.0f} "
                  f"MB/s inter-node), given "
                  f"{meta['args']['plans'] or 'none'}. "
                  + (f"Timed steps per measurement: {meta['args']['steps_for']} (others "
                     f"{meta['args']['steps']}). " if meta["args"].get("steps_for") else "")
                  + f"Run wall time {meta['wall_s']:.0f} s"
                  + (f"; 1-minute load average {meta['loadavg_start']:.1f} at its start, "
                     f"{meta['loadavg_end']:.1f} at its end (its own 4 ranks count about "
                     f"4; more means other processes shared the 2 cores)"
                     if "loadavg_start" in meta else "") + ". "
                  "Losses in real mode across a plan's configurations differ by at most "
                  + ", ".join(f"{v:.1e} ({k.split(':', 1)[1]})" for k, v in spreads.items())
                  + ".", "", table(data), "", "Targets (measured):", ""]
        parts += [f"- {line}" for line in targets(data)]
        parts.append("")
    parts += [f"![overlap ablation]({png_name})", "", READING, "", END]
    return "\n".join(parts)


READING = """**Why so little is hidden here, and what a GPU run would change.**

- *Ceiling.* Even perfect overlap leaves max(compute, communication) per step. With this
  small model (6M params, 1024 tokens per step), communication is already longer than
  compute at 1 Gbit/s and several times longer at 200 Mbit/s (T_serial - T_noop vs T_noop
  above), so the efficiency cannot exceed compute / communication and all on cannot beat
  none by more than the "Ceilings" line says, whatever the engine does.
- *Where the inter-node traffic sits.* For the AMSP plans (and HSDP) the collectives that
  cross nodes run once per step: the gradient sync's cross-node stage in the last
  micro-batch's backward, and the post-step all-gather, which can only run behind the
  optimizer step and the next step's first forward. With M = 4 micro-batches that is about
  one micro-batch of compute (T_noop / M) plus the optimizer step: this bounds what
  grad_sync, step and param_update can hide on any hardware. prefetch hides the per
  micro-batch all-gathers of P, which stay inside a node (loopback here).
- *Two shared cores.* The 4 ranks and gloo's threads share 2 CPU cores; same-node traffic
  is TCP over loopback, i.e. memory copies on those cores, and shaped inter-node traffic
  costs CPU on both ends too. A collective running "behind" compute takes cycles from that
  compute, so overlapping saves less than the idle time it removes, and T_real can even
  exceed T_serial when several collectives run at once. The same sharing with any other
  process on the machine makes the repetitions spread (min-max columns; the load average
  above).
- *On GPUs* compute runs on the SMs while NCCL moves data with its own kernels on a
  separate stream (and NVLink / the NIC do the transfer), so overlapped communication costs
  compute little and T_real should fall between max(T_noop, T_serial - T_noop) and
  T_serial, not above it. The ceilings above still hold; a larger model or more tokens per
  micro-batch raises compute relative to communication and with it the part that can be
  hidden."""


def replace_section(doc_text: str, new_section: str) -> str:
    """doc_text with the BEGIN..END section replaced by new_section (appended if absent)."""
    pat = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if pat.search(doc_text):
        return pat.sub(lambda _m: new_section, doc_text, count=1)
    return doc_text.rstrip("\n") + "\n\n" + new_section + "\n"


def write(runs: list[dict], doc: str, png: str, command: str) -> None:
    chart(runs, png)
    path = Path(doc)
    old = path.read_text() if path.exists() else ""
    rel = os.path.relpath(png, path.parent) if path.parent else png
    path.write_text(replace_section(old, section(runs, command, rel)))


# ---------------------------------------------------------------- run


def steps_for_bw(spec: str, bw: str) -> str:
    """The worker's --steps-for at one bandwidth: "zero3@200mbit=1,hsdp=2" at 200mbit ->
    "zero3=1,hsdp=2", at 1gbit -> "hsdp=2"."""
    out = []
    for item in W.comma_list(spec):
        key, sep, n = item.partition("=")
        system, at, only = key.partition("@")
        if at and only.strip().lower() != bw.strip().lower():
            continue
        out.append(f"{system.strip()}{sep}{n}")
    return ",".join(out)


def load(spec: str) -> tuple[list[dict], str | None]:
    runs, command = [], None
    for name in [s for s in spec.split(",") if s.strip()]:
        data = json.loads(Path(name).read_text())
        if "runs" in data:
            runs += data["runs"]
            command = command or data.get("command")
        else:
            runs.append(data)
    return runs, command


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m tools.bench_overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bw", default="1gbit,200mbit",
                    help="comma list of inter-node link rates (tc syntax), one run each")
    ap.add_argument("--delay", default="0ms", help="one-way delay (needs netem in the kernel)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only, no shaping")
    ap.add_argument("--timeout", type=float, default=800.0,
                    help="seconds for each bandwidth's run")
    W.add_workload_args(ap)
    O.add_overlap_args(ap)
    ap.add_argument("--out-dir", default=str(REPO / "runs" / "overlap"),
                    help="raw results (runs/ is git-ignored)")
    ap.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--png", default=str(REPO / "docs" / "overlap.png"))
    ap.add_argument("--from-json", help="only render, from these result files (comma list)")
    args = ap.parse_args(argv)
    bws = W.comma_list(args.bw)
    if args.no_netns:
        bws = bws[:1]  # loopback: the bandwidth does not apply, one run
    total = int(args.timeout * len(bws)) + 30
    command = (f"flock /tmp/amsp_cpu.lock timeout {total} python -m tools.bench_overlap "
               + shlex.join(argv))

    if args.from_json:
        runs, saved = load(args.from_json)
        write(runs, args.doc, args.png, saved or command)
        for data in runs:
            print(table(data))
        return 0

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, rc_all = [], 0
    for bw in bws:
        link = LinkSpec(bw=bw, delay=args.delay)
        inter_bw = link.rate_bytes() if not args.no_netns else args.intra_bw
        with tempfile.TemporaryDirectory(prefix="amsp_overlap_") as tmp:
            os.chmod(tmp, 0o755)
            out = Path(tmp) / "result.json"
            bw_args = argparse.Namespace(**vars(args))
            bw_args.steps_for = steps_for_bw(args.steps_for, bw)
            worker = ["-m", "tools.overlap_worker", *O.overlap_argv(bw_args),
                      "--inter-bw", str(inter_bw), "--out", str(out)]
            spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=link,
                               netns=not args.no_netns, timeout_s=args.timeout)
            rc = run_cluster(spec, worker)
            try:
                data = json.loads(out.read_text())  # rank 0 writes it after the last step
            except (OSError, ValueError):
                print(f"overlap run at {bw} failed (exit {rc}); no results", file=sys.stderr)
                rc_all = rc or 1
                continue
            if rc != 0:
                print(f"overlap run at {bw}: exit {rc} after rank 0 wrote the results "
                      "(torchrun shutdown); results kept", file=sys.stderr)
        data["meta"]["bw"] = bw if not args.no_netns else "loopback"
        data["meta"]["link_short"] = ("loopback, no shaping" if args.no_netns else
                                      f"inter-node link {bw} (tbf), intra-node loopback")
        name = "loopback" if args.no_netns else re.sub(r"[^0-9a-z]", "", bw.lower())
        (out_dir / f"overlap_{name}.json").write_text(json.dumps(data, indent=1))
        runs.append(data)
        print(table(data))
        for line in targets(data):
            print("-", line)
    if not runs:
        print("no run succeeded; no report written", file=sys.stderr)
        return rc_all or 1
    (out_dir / "overlap.json").write_text(json.dumps({"command": command, "runs": runs},
                                                      indent=1))
    write(runs, args.doc, args.png, command)
    return rc_all


if __name__ == "__main__":
    sys.exit(main())
