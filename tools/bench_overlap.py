"""``python -m tools.bench_overlap ARGS`` = ``python -m tools.bench overlap ARGS``."""

import sys

from tools.bench import main

if __name__ == "__main__":
    sys.exit(main(["overlap", *sys.argv[1:]]))
