"""tools/bench_report: the numbers the benchmark page derives (no processes started).

Reference values are worked out by hand for 2 nodes x 2 ranks and a 12,327,424-byte buffer
(the debug model's fp32 params / 2, i.e. one HSDP/AMSP shard).
"""

from __future__ import annotations

import pytest

from tools import bench_report as R

SHARD = 12_327_424


def test_allreduce_and_rs_plus_ag_send_the_same_bytes():
    # HSDP: all-reduce of the grad shard over 2 replicas (one per node)
    hsdp = [["all_reduce", 2, SHARD, True, 1]]
    # AMSP p2-g2-os4: reduce-scatter over the 2-rank OS group, then all-gather back;
    # recorder events carry (op, dim, group, nbytes, inter, phase)
    amsp = [["reduce_scatter", "os", 2, SHARD, True, "sync"],
            ["all_gather", "os", 2, SHARD, True, "step"]]
    assert R._wire_inter(hsdp, amsp=False) == SHARD  # 2 * (2-1)/2 * SHARD
    assert R._wire_inter(amsp, amsp=True) == SHARD  # (1/2 + 1/2) * SHARD


def test_intra_node_groups_do_not_count_and_counts_multiply():
    events = [["all_gather", 2, 1000, False, 5], ["all_gather", 4, 1000, True, 3]]
    assert R._wire_inter(events, amsp=False) == pytest.approx(3 * 1000 * 3 / 4)


def _result(system, rep, times, inter, peak, state, losses, predicted=None, recorder=None):
    comm = {"counted": {"intra": 0, "inter": inter},
            "counted_events": [["all_reduce", 4, inter, True, 1]]}
    if recorder is not None:
        comm["recorder"] = recorder
        comm["recorder_events"] = []
    return {"system": system, "rep": rep, "step_times": times, "losses": losses,
            "peak_bytes_per_rank": [peak] * 4,
            "state_bytes_per_rank": [{"param": state, "grad": 0, "optim": 0}] * 4,
            "comm": comm if rep == 0 else None,
            "predicted": {"bytes": predicted} if predicted else None}


def test_summary_medians_spreads_and_verdict():
    meta = {"tokens_per_step": 1000, "amsp_plan": "p2-g2-os4",
            "planner": {"chosen_bytes_inter": 24, "chosen_bytes_intra": 0}}
    results = []
    for rep, (t_z3, t_amsp) in enumerate([(4.0, 2.0), (5.0, 2.5), (4.5, 1.0)]):
        results.append(_result("zero3", rep, [t_z3], 279, 50, 25, [8.0, 7.5]))
        results.append(_result("amsp:p2-g2-os4", rep, [t_amsp], 24, 52, 37, [8.0, 7.5 + 1e-7],
                               predicted={"intra": 0, "inter": 24},
                               recorder={"intra": 0, "inter": 24}))
    data = {"meta": meta, "results": results}
    rows = {r["system"]: r for r in R.summarize(data)}
    z3, amsp = rows["zero3"], rows["amsp:p2-g2-os4"]
    assert z3["tps"] == pytest.approx(1000 / 4.5)  # median of 250, 200, 222.2
    assert (z3["tps_min"], z3["tps_max"]) == (pytest.approx(200), pytest.approx(250))
    assert amsp["tps"] == pytest.approx(500) and amsp["match"]
    assert amsp["inter"] == 24 and amsp["loss_diff"] == pytest.approx(1e-7)
    text = "\n".join(R.verdict(list(rows.values()), meta))
    assert "AMSP / ZeRO-3 (FSDP2) tokens/s = 2.25x (target >= 1.5x: met)" in text
    assert "EXACT match" in text
    assert "no overlap of min-max ranges" in text  # 400-1000 vs 200-250


def test_bench_passes_every_workload_option_to_its_workers():
    """tools/bench.py forwards the workload options to tools/bench_worker: one definition
    of them, every one forwarded, values preserved."""
    import argparse

    from tools import bench_worker as W

    only = argparse.ArgumentParser()
    W.add_workload_args(only)
    dests = {a.dest for a in only._actions if a.dest != "help"}
    assert dests == set(W.WORKLOAD_DESTS)
    args = W.parse_args(["--seq", "128", "--steps", "3", "--plans", "p1-g1-os2",
                         "--intra-bw", "2e9", "--out", "x"])
    again = W.parse_args(W.workload_argv(args) + ["--out", "x"])
    assert {d: getattr(again, d) for d in dests} == {d: getattr(args, d) for d in dests}
    assert (again.seq, again.steps, again.plans, again.intra_bw) == (128, 3, "p1-g1-os2", 2e9)
