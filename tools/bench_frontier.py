"""``python -m tools.bench_frontier ARGS`` = ``python -m tools.bench frontier ARGS``."""

import sys

from tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["frontier", *sys.argv[1:]]))
