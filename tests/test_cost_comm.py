"""Comm schedule and time models against hand-computed numbers."""

from __future__ import annotations

import json
import math

import pytest

from amsp_dtensor.plan.cost.bandwidth import BandwidthTableError, load_table, parse_table, SCHEMA
from amsp_dtensor.plan.cost.comm import (
    AlphaBeta,
    GroupShape,
    dim_group,
    event_counter,
    group_shape,
    predicted_events,
    step_comm_time,
    time_breakdown,
)
from amsp_dtensor.plan import ShardingPlan, enumerate_plans


def _plan(p, g, o, w, r):
    return ShardingPlan(p, g, o).resolve(w, r)


def test_group_shapes_by_hand():
    # W=8, R=4: rank = rep*s_os + os*s_g + g*s_p + p
    plan = _plan(2, 4, 4, 8, 4)
    assert dim_group(plan, "p") == GroupShape(2, 1, 2, 1)  # {0,1}
    assert dim_group(plan, "g") == GroupShape(2, 2, 2, 1)  # {0,2}
    assert dim_group(plan, "rep") == GroupShape(2, 4, 1, 2)  # {0,4}: two nodes
    assert dim_group(plan, "shard") == GroupShape(4, 1, 4, 1)
    assert group_shape(8, 1, 8, 4) == GroupShape(8, 1, 4, 2)
    assert group_shape(4, 2, 16, 4) == GroupShape(4, 2, 2, 2)  # {0,2,4,6}


def test_schedule_by_hand():
    """One unit of one (10, 3) tensor, bf16, W=8 R=4, plan p2-g4-os4, M=3."""
    plan = _plan(2, 4, 4, 8, 4)
    ev = predicted_events(plan, [[(10, 3)]], 3, 2, root_unit_index=None, clip=True)
    # padded(U,2) = 2*ceil(10/2)*3 = 30 elems = 60 B; padded(U,4) = 4*3*3 = 36 elems = 72 B
    assert event_counter(ev) == {
        ("all_gather", "p", 2, 60, False, "forward"): 3,
        ("all_gather", "p", 2, 60, False, "backward"): 3,
        ("reduce_scatter", "p", 2, 60, False, "backward"): 3,
        ("reduce_scatter", "g", 2, 36, False, "backward"): 2,  # 72/2, stride 2 in a node
        ("reduce_scatter", "g", 2, 36, False, "sync"): 1,
        ("all_reduce", "rep", 2, 18, True, "sync"): 1,  # 72/4 over ranks {0,4}
        ("all_gather", "g", 2, 36, False, "step"): 1,
        ("all_reduce", "shard", 4, 4, False, "step"): 1,
    }


def test_schedule_root_ddp_zero1_and_hpz():
    units = [[(8, 2)], [(10, 2)]]  # unit 1 is the root
    # fp32 over 4: block 8*2 = 16 elems = 64 B; root 4*ceil(10/4)*2 = 24 elems = 96 B
    zero3 = event_counter(predicted_events(_plan(4, 4, 4, 4, 2), units, 1, 4, root_unit_index=1))
    assert zero3 == {
        ("all_gather", "p", 4, 64, True, "forward"): 1,
        ("all_gather", "p", 4, 64, True, "backward"): 1,
        ("reduce_scatter", "p", 4, 64, True, "backward"): 1,
        ("all_gather", "p", 4, 96, True, "forward"): 1,  # root: no backward all-gather
        ("reduce_scatter", "p", 4, 96, True, "backward"): 1,
    }
    # DDP in bf16: one all-reduce of each unit over all 4 ranks, whatever M
    ddp = event_counter(predicted_events(_plan(1, 1, 1, 4, 2), units, 4, 2, 1))
    assert ddp == {("all_reduce", "rep", 4, 32, True, "sync"): 1,
                   ("all_reduce", "rep", 4, 40, True, "sync"): 1}
    # ZeRO-1: reduce-scatter into the OS shards, all-gather the new params (padded to 12 rows)
    zero1 = event_counter(predicted_events(_plan(1, 1, 4, 4, 2), units, 2, 2, 1))
    assert zero1 == {("reduce_scatter", "os", 4, 32, True, "sync"): 1,
                     ("reduce_scatter", "os", 4, 48, True, "sync"): 1,
                     ("all_gather", "os", 4, 32, True, "step"): 1,
                     ("all_gather", "os", 4, 48, True, "step"): 1}
    hpz = event_counter(predicted_events(_plan(4, 4, 4, 4, 2), units, 1, 2, 1,
                                         reshard_after_forward=2))
    assert hpz[("all_gather", "p", 2, 32, False, "backward")] == 1  # intra-node copy
    no_reshard = event_counter(predicted_events(_plan(4, 4, 4, 4, 2), units, 1, 2, 1,
                                                reshard_after_forward=False))
    assert not [k for k in no_reshard if k[5] == "backward" and k[0] == "all_gather"]


def test_never_any_collective_but_p_and_g_before_the_last_micro_batch():
    """On non-last micro-batches only P traffic and the G reduce-scatter."""
    for plan in enumerate_plans(16, 4):
        for e in predicted_events(plan, [[(64, 8)]], 4, 2, None):
            if e.count > 1:
                assert e.dim in ("p", "g") and e.phase in ("forward", "backward"), e


def test_alpha_beta_by_hand():
    ab = AlphaBeta(intra_bw=100e9, inter_bw=10e9, intra_alpha=1e-5, inter_alpha=2e-5)
    g_intra, g_inter = GroupShape(4, 1, 4, 1), GroupShape(4, 4, 1, 4)
    assert ab.time("all_gather", 4e9, g_intra) == pytest.approx(3 * 1e-5 + 0.75 * 4e9 / 100e9)
    assert ab.time("all_reduce", 4e9, g_inter) == pytest.approx(6 * 2e-5 + 1.5 * 4e9 / 10e9)
    assert ab.time("broadcast", 1e9, g_intra) == pytest.approx(3e-5 + 1e9 / 100e9)
    assert ab.time("all_reduce", 1e9, GroupShape(1, 1, 1, 1)) == 0.0


def test_paper_terms():
    plan = _plan(2, 8, 8, 8, 4)
    ab = AlphaBeta()
    ev = predicted_events(plan, [[(64, 64)]] * 3, 4, 2, None)
    br = time_breakdown(ev, ab)
    assert sum(br.values()) == pytest.approx(step_comm_time(ev, ab))
    assert br["T_p"] > 0 and br["T_g"] > 0 and br["T_os1"] > 0
    # T_g covers the M-1 = 3 non-last micro-batches of every unit
    rs_g = ab.time("reduce_scatter", 2 * 64 * 64 // 2, dim_group(plan, "g"))
    assert br["T_g"] == pytest.approx(3 * 3 * rs_g)


def _table(points, op="all_gather", n=2, stride=1, nodes=1):
    return {"schema": SCHEMA, "entries": [{"op": op, "group_size": n, "stride": stride,
            "group_nodes": nodes, "inter_node": nodes > 1, "points": points}]}


def test_bandwidth_table_interpolates_in_log_size(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table([[1000, 1e-3], [100000, 1e-2]])))
    t = load_table(path)
    g = GroupShape(2, 1, 2, 1)
    assert t.time("all_gather", 10000, g) == pytest.approx(10 ** -2.5)
    assert t.time("all_gather", 10, g) == pytest.approx(1e-3)  # latency floor
    assert t.time("all_gather", 1e6, g) == pytest.approx(0.1)  # largest bandwidth kept
    # a shape the table lacks: alpha-beta fitted from the same op and locality
    g4 = GroupShape(4, 1, 4, 1)
    assert t.time("all_gather", 100000, g4) == pytest.approx(3 * 1e-3 + 0.75 * 100000 / 5e6)
    assert ("all_gather", 4, 1) in t.extrapolated
    with pytest.raises(BandwidthTableError, match="no all_reduce measurements"):
        t.time("all_reduce", 10, g)


@pytest.mark.parametrize("data, msg", [
    ([], "top level"),
    ({"schema": "x"}, "'schema' must be"),
    ({"schema": SCHEMA, "entries": []}, "non-empty"),
    (_table([[1000, -1]]), "points\\[0\\]"),
    (_table([[1000, 1e-3]], op="alltoall"), "op must be"),
    (_table([[1000, 1e-3]], n=0), "group_size"),
])
def test_malformed_tables(data, msg):
    with pytest.raises(BandwidthTableError, match=msg):
        parse_table(data, "t.json")


def test_unreadable_table(tmp_path):
    with pytest.raises(BandwidthTableError, match="cannot read"):
        load_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(BandwidthTableError, match="not JSON"):
        load_table(bad)
