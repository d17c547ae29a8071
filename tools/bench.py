"""Head-to-head benchmark: DDP, ZeRO-1, ZeRO-3, HSDP, hpZ and AMSP on an emulated cluster.

One command builds the emulated nodes (tools/cluster), runs tools/bench_worker on every
rank (all systems, interleaved, several repetitions), tears the nodes down and writes the
table, the chart and a report (runs/bench/benchmarks.md by default: docs/benchmarks.md
is tools/bench_frontier's sweep of every configuration under every memory cap):

    flock /tmp/amsp_cpu.lock timeout 290 python -m tools.bench \
        --nodes 2 --ranks-per-node 2 --bw 1gbit

``--no-netns`` runs on plain loopback (quick, unshaped); ``--from-json`` re-renders the
report from a saved result file without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from tools import bench_report, bench_worker
from tools.cluster import ClusterSpec, LinkSpec, run_cluster

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--bw", default="1gbit", help="inter-node link rate (tc syntax)")
    ap.add_argument("--delay", default="0ms", help="one-way delay (needs netem in the kernel)")
    ap.add_argument("--no-netns", action="store_true", help="loopback only, no shaping")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds for the whole run")
    bench_worker.add_workload_args(ap)
    ap.add_argument("--out-json", default=str(REPO / "runs" / "bench" / "benchmarks.json"),
                    help="raw results (runs/ is git-ignored)")
    ap.add_argument("--doc", default=str(REPO / "runs" / "bench" / "benchmarks.md"))
    ap.add_argument("--png", default=str(REPO / "runs" / "bench" / "benchmarks.png"))
    ap.add_argument("--from-json", help="only render the report from this result file")
    args = ap.parse_args(argv)
    command = "python -m tools.bench " + shlex.join(argv)

    Path(args.doc).parent.mkdir(parents=True, exist_ok=True)
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        bench_report.write(data, args.doc, args.png, data["meta"].get("command", command))
        return 0

    link = LinkSpec(bw=args.bw, delay=args.delay)
    inter_bw = link.rate_bytes()
    with tempfile.TemporaryDirectory(prefix="amsp_bench_") as tmp:
        os.chmod(tmp, 0o755)
        out = Path(tmp) / "result.json"
        worker = [
            "-m", "tools.bench_worker", *bench_worker.workload_argv(args),
            "--inter-bw", str(inter_bw if not args.no_netns else args.intra_bw),
            "--out", str(out),
        ]
        spec = ClusterSpec(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=link,
                           netns=not args.no_netns, timeout_s=args.timeout)
        rc = run_cluster(spec, worker)
        if rc != 0 or not out.exists():
            print(f"benchmark run failed (exit {rc}); no report written", file=sys.stderr)
            return rc or 1
        data = json.loads(out.read_text())
    data["meta"]["link_short"] = ("loopback, no shaping" if args.no_netns else
                                  f"inter-node link {args.bw} (tbf), intra-node loopback")
    data["meta"]["command"] = f"flock /tmp/amsp_cpu.lock timeout {int(args.timeout) + 20} " \
                              + command
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(data, indent=1))
    bench_report.write(data, args.doc, args.png, data["meta"]["command"])
    print(bench_report.table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
