"""NCCL-like time model against numbers worked out by hand from NCCL's tuning formulas
(src/graph/tuning.cc: base + per-hop latencies, protocol bandwidth factors, tree
correction, ring plateau) for the paper's cluster: NVLink 150 GB/s per GPU, 4 x 25 GB/s
NICs per 8 GPUs, 16 channels, Ampere, x86 Intel."""

import pytest

from amsp_dtensor.plan.cost.comm import GroupShape
from amsp_dtensor.plan.cost.nccl import NcclModel, comparison_table, node_nic_bytes, wire_bytes

M = NcclModel()
IN_NODE = GroupShape(8, 1, 8, 1)
NODES_128x1 = GroupShape(128, 8, 1, 128)
NODES_16x8 = GroupShape(128, 1, 8, 16)
US = 1e-6


def test_small_all_reduce_in_a_node_is_ring_ll():
    c = M.choose("all_reduce", 4, IN_NODE)
    # ring LL: base 6.6 + 14 steps x NVLink LL 0.6; tree LL would be 6.8 + 2 x 7 x 0.6
    assert (c.algorithm, c.protocol) == ("ring", "LL")
    assert c.latency == pytest.approx((6.6 + 14 * 0.6) * US)


def test_large_all_reduce_in_a_node_is_ring_simple_at_nvlink_speed():
    nb = 1 << 28
    c = M.choose("all_reduce", nb, IN_NODE)
    assert (c.algorithm, c.protocol) == ("ring", "Simple")
    lat = 8.4 + 14 * 3.4
    alg = 150 * 8 / 14  # GB/s: bus x nRanks / nsteps
    assert c.seconds == pytest.approx((lat + nb / (1000 * alg)) * US)
    assert c.bus_bw == pytest.approx(150e9)


def test_all_reduce_over_128_nodes_is_a_tree_with_log2_latency():
    c = M.choose("all_reduce", 4, NODES_128x1)
    # tree LL: 6.8 + 2 x (0 intra hops + log2(128) x network LL 5.0); a ring would pay
    # 254 network hops
    assert (c.algorithm, c.protocol) == ("tree", "LL")
    assert c.latency == pytest.approx((6.8 + 2 * 7 * 5.0) * US)


def test_all_gather_with_one_rank_per_node_uses_pat():
    nb = 1 << 20
    c = M.choose("all_gather", nb, NODES_128x1)
    assert (c.algorithm, c.protocol) == ("pat", "Simple")
    lat = 8 + 7 * (14.0 / 3.5) + 128 * 2.8
    bw = 0.75 * 100 / 8  # GB/s: 1/8 of the node's 4 x 25 GB/s NICs, PAT factor 0.75
    assert c.seconds == pytest.approx((lat + nb / (1000 * bw)) * US)
    # NCCL's own view of this communicator alone: the GPU's nearest NIC, 25 GB/s
    alone = M.alone().choose("all_gather", nb, NODES_128x1)
    assert alone.seconds == pytest.approx((lat + nb / (1000 * 0.75 * 25)) * US)


def test_large_all_reduce_over_16_nodes_of_8():
    nb = 1 << 28
    c = M.choose("all_reduce", nb, NODES_16x8)
    # tree LL128: bus min(100 x .92, 16 x 17.8) then x 120/128; algbw = bus / 2; size
    # class log2(2^28 / 64) = 22 -> correction 1.0. latency 14 + 2 (7 x 1.25 + 4 x 8.5)
    assert (c.algorithm, c.protocol) == ("tree", "LL128")
    bus = 100 * 0.92 * 120 / 128
    lat = 14.0 + 2 * (7 * 1.25 + 4 * 8.5)
    assert c.seconds == pytest.approx((lat + nb / (1000 * bus / 2)) * US)
    # ring Simple for comparison: plateau x1.4 on 224 NVLink hops (at least the 3 us net
    # overhead) + 30 network hops; it loses here
    ring = [x for x in M.candidates("all_reduce", nb, NODES_16x8)
            if (x.algorithm, x.protocol) == ("ring", "Simple")][0]
    ring_lat = (8.4 + 224 * 3.4 + 30 * 14.0) * 1.4
    assert ring.seconds == pytest.approx((ring_lat + nb / (1000 * 100 * 128 / 254)) * US)
    assert ring.seconds > c.seconds


def test_node_spanning_groups_share_the_node_nics():
    assert M.inter_bw(GroupShape(64, 1, 8, 8)) == 100e9  # a full node: all 4 NICs
    assert M.inter_bw(GroupShape(128, 8, 1, 128)) == 12.5e9  # 8 groups share 4 NICs
    assert M.inter_bw(GroupShape(32, 4, 2, 16)) == 25e9
    assert M.alone().inter_bw(GroupShape(32, 4, 2, 16)) == 50e9  # NCCL: 2 NICs alone


def test_wire_and_node_bytes():
    assert wire_bytes("all_gather", 800, 8) == 700
    assert wire_bytes("all_reduce", 800, 8) == 1400
    assert wire_bytes("all_reduce", 800, 1) == 0
    # 128 nodes x 1: the node's 8 groups each send 127/128 of their buffer (x2 for AR)
    assert node_nic_bytes("all_reduce", 1280, NODES_128x1, 8) == pytest.approx(8 * 2 * 1270)
    assert node_nic_bytes("all_gather", 1280, NODES_16x8, 8) == pytest.approx(1200)
    assert node_nic_bytes("all_gather", 1280, IN_NODE, 8) == 0


def test_bad_cluster_values():
    for kwargs in (dict(nic_bw=float("inf")), dict(nvlink_bw=0), dict(nics_per_node=0),
                   dict(channels=1.5)):
        with pytest.raises(ValueError):
            NcclModel(**kwargs)


def test_comparison_table_covers_the_four_shapes():
    table = comparison_table()
    for name in ("1 node x 8", "128 nodes x 1", "8 nodes x 8", "16 nodes x 8"):
        assert f"| {name} | all_reduce | 268,435,456 |" in table
    # where the group fills its nodes, the model and NCCL's view agree exactly
    for line in table.splitlines():
        if line.startswith("| 8 nodes x 8") or line.startswith("| 1 node x 8"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[3:7] == cells[7:11]


def test_measured_table_overrides_where_it_has_data():
    from amsp_dtensor.plan.cost.bandwidth import parse_table
    from amsp_dtensor.plan.cost.planner import TableOverDefaults

    table = parse_table({"schema": "amsp_dtensor.bandwidth/1", "entries": [
        {"op": "all_gather", "group_size": 8, "stride": 1, "group_ranks_per_node": 8,
         "group_nodes": 1, "inter_node": False, "points": [[1000, 1e-3], [10**6, 2e-3]]}]})
    tm = TableOverDefaults(table, M)
    assert tm.time("all_gather", 10**6, IN_NODE) == pytest.approx(2e-3)  # measured
    assert tm.time("all_reduce", 10**6, IN_NODE) == M.time("all_reduce", 10**6, IN_NODE)
    assert tm.defaulted == {("all_reduce", 8, 1)}
