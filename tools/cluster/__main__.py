"""CLI: ``python -m tools.cluster {run,clean} ...`` (see tools/cluster/__init__.py)."""

from __future__ import annotations

import argparse
import sys

from . import launch, netns


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    ap = argparse.ArgumentParser(prog="python -m tools.cluster")
    sub = ap.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="build the emulated nodes, run torchrun on each, tear down",
                         usage="%(prog)s [options] -- <module or script.py> [args]")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--ranks-per-node", type=int, default=2)
    run.add_argument("--bw", default="1gbit", help="inter-node rate, tc syntax (1gbit, 200mbit)")
    run.add_argument("--delay", default="0.1ms", help="one-way inter-node delay (us/ms/s)")
    run.add_argument("--timeout", type=float, default=None, help="seconds; exit code 124")
    run.add_argument("--no-netns", action="store_true",
                     help="plain torchruns on loopback: quick runs, no shaping, no root")
    run.add_argument("--master-port", type=int, default=29500)
    run.add_argument("--no-prefix", action="store_true", help="do not prefix output with [n<i>]")
    sub.add_parser("clean", help="delete this tool's namespaces whose owner is gone")
    args = ap.parse_args(argv)

    if args.action == "clean":
        removed = netns.clean_stale()
        print(f"removed {len(removed)} namespace(s): {' '.join(removed)}")
        return 0
    if not args.no_netns:
        why = netns.netns_available()
        if why:
            ap.error(f"cannot build namespaces ({why}); use --no-netns for loopback runs")
    spec = launch.ClusterSpec(
        nodes=args.nodes, ranks_per_node=args.ranks_per_node,
        link=netns.LinkSpec(bw=args.bw, delay=args.delay), netns=not args.no_netns,
        timeout_s=args.timeout, master_port=args.master_port,
        prefix_output=not args.no_prefix)
    if not command:
        ap.error("nothing to run: append `-- <module or script.py> [args]`")
    return launch.run_cluster(spec, command)


if __name__ == "__main__":
    sys.exit(main())
