"""Emulated multi-node cluster on one machine: network namespaces + tc-shaped veth links.

    python -m tools.cluster run --nodes 2 --ranks-per-node 2 --bw 1gbit --delay 0.1ms \
        -- tests/cluster_probe.py
    python -m tools.cluster run --no-netns --nodes 2 --ranks-per-node 2 -- -m <module> ...
    python -m tools.cluster clean     # delete namespaces left by a killed run

In Python: ``run_cluster(ClusterSpec(...), ["-m", "module", ...]) -> exit code``.
"""

from .launch import ClusterSpec, run_cluster  # noqa: F401
from .netns import LinkSpec, Network, clean_stale, netns_available, our_namespaces  # noqa: F401
