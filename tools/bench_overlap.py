"""``python -m tools.bench_overlap ARGS`` is ``python -m tools.bench overlap ARGS``, the
command docs/benchmarks.md quotes for the overlap ablation."""

import sys

from tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["overlap", *sys.argv[1:]]))
