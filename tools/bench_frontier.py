"""``python -m tools.bench_frontier ARGS`` is ``python -m tools.bench frontier ARGS``, the
command docs/benchmarks.md quotes for each scale."""

import sys

from tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["frontier", *sys.argv[1:]]))
