"""tools/bench_report (the frontier), tools/bench_worker's schedule and pruning, the
planner's possible picks, tools/bench_memory, and re-rendering through the launcher: on
hand-made results, no processes started."""

from __future__ import annotations

import json
import math

import pytest
import torch.distributed as dist

from tools import bench_report as R

MB = 1e6


def _result(config, rep, times, peak, losses, state=10 * MB, inter=0, waited=None,
            reported=None):
    return {"config": config, "rep": rep, "mode": "real", "step_times": times,
            "losses": losses, "peak_bytes_per_rank": [peak - 1 * MB, peak, peak - 2 * MB, peak],
            "state_bytes_per_rank": [{"param": state, "grad": 0, "optim": 0}] * 4,
            "reported_bytes_per_rank": [reported] * 4,
            "waited_s_per_rank": ([{"in_step": w, "after_step": 0.01} for w in waited]
                                  if waited else [None] * 4),
            "comm": ({"counted": {"intra": 5, "inter": inter}, "recorder": {"intra": 5,
                                                                            "inter": inter},
                      "counted_events": [["all_reduce", 2, inter, True, 1]],
                      "recorder_events": [["reduce_scatter", "os", 2, inter, True, "sync"],
                                          ["all_gather", "os", 2, inter, True, "step"]]}
                     if rep == 0 else None)}


# config -> (step time per rep, peak MB per rep), tokens per step = 1000
SPEC = {
    "ddp": ([1.0, 1.0, 1.0], [130, 130, 130]),
    "ds_z1": ([1.25, 1.25, 1.25], [96, 96, 96]),
    "zero3": ([4.0, 5.0, 4.5], [50, 50, 50]),
    "zero3_keep": ([3.2, 3.2, 3.2], [70, 70, 70]),
    "hsdp:2": ([2.0, 2.0, 2.0], [74, 74.5, 74]),
    "mfsdp_z3": ([4.0, 4.0, 4.0], [57, 57, 57]),
    "amsp:p4-g4-os4": ([4.0, 4.0, 4.0], [56, 56, 56]),
    "amsp:p2-g2-os4": ([2.0, 2.5, 1.0], [73, 73, 73]),
    "amsp:p1-g1-os2": ([1.0, 1.0, 1.0], [106, 106.0004, 106]),
}


def _data():
    results = []
    for rep in range(3):
        for key, (times, peaks) in SPEC.items():
            waited = [0.1, 0.3, 0.2, 0.0] if key.startswith("amsp") else None
            loss = [8.0, 7.5 + (1e-7 if key == "hsdp:2" else 3e-7 if key == "ds_z1" else 0.0)]
            results.append(_result(key, rep, [times[rep]], peaks[rep] * MB, loss, waited=waited,
                                   reported={"rss_delta": 80 * MB} if key == "ds_z1" else None))
    meta = {"tokens_per_step": 1000, "nodes": 2, "ranks_per_node": 2, "world": 4,
            "args": {"reps": 3, "steps": 1, "warmup": 2, "warmup_later": None,
                     "flavor": "debugmodel", "seq": 64, "micro_batch": 1, "micro_batches": 4,
                     "prune": 0.0},
            "model": {"params": 6163712}, "machine": "x86_64, 2 CPUs", "link": "tbf 1gbit",
            "bw": "1gbit between nodes", "link_short": "1gbit", "wall_s": 100.0}
    return {"meta": meta, "results": results}


def _rows():
    return {r["key"]: r for r in R.summarize(_data())}


def test_summary_median_spread_peak_and_waited():
    rows = _rows()
    z3 = rows["zero3"]
    assert z3["tps"] == pytest.approx(1000 / 4.5)  # median of 250, 200, 222.2
    assert (z3["tps_min"], z3["tps_max"]) == (pytest.approx(200), pytest.approx(250))
    assert z3["reps"] == 3 and z3["steps"] == 1 and z3["family"] == "fsdp2"
    # peak: max over ranks and over repetitions (a cap fits only if every rep fitted)
    assert rows["hsdp:2"]["peak"] == 74.5 * MB
    assert rows["amsp:p2-g2-os4"]["waited"] == pytest.approx(0.3)  # max over ranks
    assert rows["amsp:p2-g2-os4"]["waited_after"] == pytest.approx(0.01)
    assert rows["ddp"]["waited"] is None and rows["ds_z1"]["reported"] == {"rss_delta": 80 * MB}
    assert [rows[k]["label"] for k in ("zero3_keep", "hsdp:2", "ds_z1", "mfsdp_z3")] == \
        ["FSDP2 keep", "FSDP2 HSDP shard 2", "DS ZeRO-1", "MFSDP ZeRO-3"]
    # noop / serial runs of the overlap ablation are not frontier rows
    data = _data()
    data["results"].append(dict(data["results"][0], mode="noop", step_times=[0.01]))
    assert R.summarize(data)[0]["tps_max"] == pytest.approx(1000)


def test_caps_are_the_distinct_peaks():
    rows = list(_rows().values())
    caps = R.select_caps(rows)
    # 106 and 106.0004 MB are one cap (within 1 kB), the larger; ascending
    assert [round(c / MB, 1) for c in caps] == [50, 56, 57, 70, 73, 74.5, 96, 106, 130]
    assert caps[7] == 106.0004 * MB and R.select_caps([]) == []


def test_frontier_best_per_cap_and_ratio_against_every_other_system():
    rows = list(_rows().values())
    fr = {round(f["cap"] / MB, 1): f for f in R.frontier(rows, R.select_caps(rows))}
    # 50 MB: only FSDP2 reshard fits: no AMSP plan
    assert fr[50]["baseline"]["key"] == "zero3" and fr[50]["ratio"] is None
    # 57 MB: Megatron-FSDP (250 tok/s) beats FSDP2 reshard (222); AMSP p4-g4-os4 250: 1.0x
    assert fr[57]["baseline"]["key"] == "mfsdp_z3" and fr[57]["ratio"] == pytest.approx(1.0)
    # 73 MB: FSDP2 keep (312.5 tok/s) vs AMSP p2-g2-os4 (500): 1.6x
    assert fr[73]["baseline"]["key"] == "zero3_keep" and fr[73]["ratio"] == pytest.approx(1.6)
    # 106 MB: AMSP p1-g1-os2 1000 vs DeepSpeed ZeRO-1 800
    assert fr[106]["ratio"] == pytest.approx(1.25)
    assert fr[106]["per_family"]["fsdp2"]["key"] == "hsdp:2"
    assert fr[106]["per_family"]["ds_z1"]["key"] == "ds_z1"
    assert fr[106]["per_family"]["ds_mics"] is None
    assert fr[130]["baseline"]["key"] == "ddp" and fr[130]["ratio"] == pytest.approx(1.0)
    only = R.frontier([rows[-1]], [106.1 * MB])[0]  # only AMSP fits -> inf
    assert math.isinf(only["ratio"]) and R._ratio_s(only["ratio"]) == "only AMSP fits"


def test_planner_rank_slowdown_and_share():
    rows = list(_rows().values())
    caps = R.select_caps(rows)
    fr = R.frontier(rows, caps)
    picks = {repr(c): None for c in caps}
    picks[repr(caps[1])] = "p4-g4-os4"      # 56: the only fitting plan -> rank 1
    picks[repr(caps[4])] = "p4-g4-os4"      # 73: rank 2 of 2, 500/250 - 1 = 100% slower
    picks[repr(caps[7])] = "p1-g1-os2"      # 106: rank 1 of 3
    picks[repr(caps[8])] = "p2-g2-os4"      # 130: rank 2 of 3, 1000/500 - 1
    picks[repr(caps[3])] = "p1-g1-os2"      # 70: does not fit (106 MB measured)
    prows = {round(p["cap"] / MB): p for p in R.planner_rows(rows, fr, picks)}
    assert prows[50]["counted"] is False and "nothing fits" in prows[50]["note"]
    assert (prows[56]["rank"], prows[56]["of"], prows[56]["slowdown"]) == (1, 1, 0.0)
    assert prows[73]["rank"] == 2 and prows[73]["slowdown"] == pytest.approx(1.0)
    assert not prows[73]["within"] and prows[106]["within"]
    assert prows[70]["rank"] is None and "does not fit (measured 106.0 MB)" in prows[70]["note"]
    assert prows[57]["note"] == "refuses, but a plan fits as measured"
    # caps with an AMSP plan: 56, 57, 70, 73, 74.5, 96, 106, 130 -> within: 56, 106
    assert R.planner_share(list(prows.values())) == (2, 8)


def test_chart_series_is_each_family_best_under_the_cap(tmp_path):
    rows = list(_rows().values())
    series = R.chart_series(rows)
    xs, ys = series["amsp"]
    assert xs[0] == 56 and ys[0] == pytest.approx(250)
    assert ys[xs.index(73)] == pytest.approx(500) and ys[6] == pytest.approx(1000)
    assert all(b >= a for a, b in zip(ys, ys[1:]))  # a frontier never falls
    assert xs[-1] == pytest.approx(130 * 1.04) and ys[-1] == ys[-2]
    assert series["ddp"][0][0] == 130 and "ds_mics" not in series
    fx, fy = series["fsdp2"]  # reshard, keep, HSDP shard 2
    assert fx[0] == 50 and [round(y) for y in fy[:-1]] == [222, 222, 222, 312, 312, 500, 500,
                                                          500, 500]
    R.chart(rows, _data()["meta"], str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_targets_say_met_or_missed_with_numbers_and_the_loss_gaps():
    rows = list(_rows().values())
    fr = R.frontier(rows, R.select_caps(rows))
    prows = R.planner_rows(rows, fr, {repr(f["cap"]): None for f in fr})
    loss = R.loss_check(rows)
    assert loss["max_diff"] == pytest.approx(3e-7) and loss["ok"] and loss["worst"] == "ds_z1"
    assert loss["peers_max"] == pytest.approx(3e-7)
    text = "\n".join(R.targets(rows, fr, prows, loss))
    # 50 (no AMSP plan), 70 (250 vs FSDP2 keep 312.5) and 96 MB (500 vs DS ZeRO-1 800)
    assert "MISSED at 3 of 9 caps: 50.0 MB (no AMSP plan fits); 70.0 MB (0.80x against " \
           "FSDP2 keep); 96.0 MB (0.62x against DS ZeRO-1)." in text
    assert "at one cap or more: met at 1 cap(s); highest 1.60x at 73.0 MB (AMSP p2-g2-os4 " \
           "500 vs FSDP2 keep 312 tokens/s)" in text
    assert "0 of 8 caps" in text and "agree within 1e-05); the peers' largest: 3.0e-07" in text
    rows[5]["losses"] = [8.0, 7.5 + 4e-5]  # Megatron-FSDP off by more than the tolerance
    loss = R.loss_check(rows)
    assert not loss["ok"] and loss["over"] == [("MFSDP ZeRO-3", pytest.approx(4e-5))]
    assert "DISAGREE within 1e-05); the peers' largest: 4.0e-05; over the tolerance, so not " \
           "the same training: MFSDP ZeRO-3 (4.0e-05)." in "\n".join(R.targets(rows, fr, prows,
                                                                               loss))
    amsp_only = [r for r in rows if r["family"] == "amsp"]
    fr = R.frontier(amsp_only, R.select_caps(amsp_only))
    prows = R.planner_rows(amsp_only, fr, {repr(f["cap"]): None for f in fr})
    text = "\n".join(R.targets(amsp_only, fr, prows, R.loss_check(amsp_only)))
    assert "measured no other configuration" in text and ">= 1.5x" not in text


def test_section_and_document_keep_other_scales_and_overlap():
    data = _data()
    caps = R.select_caps(R.summarize(data))
    data["planner"] = {"variants": [
        {"name": "profile", "desc": "table", "picks": {repr(c): "p1-g1-os2" for c in caps}},
        {"name": "link", "desc": "alpha-beta", "picks": {repr(c): "p2-g2-os4" for c in caps}}],
        "estimates": {"p1-g1-os2": 100 * MB}, "reserve_bytes": 0, "reserve_note": "n"}
    data["meta"].update(skipped=["ds_mics:2: runs/peers/ds0196 is not installed"],
                        pruned=["zero3_keep"])
    data["meta"]["args"].update(prune=0.1, warmup_later=1)
    sec = R.section(data, "python -m tools.bench_frontier --nodes 2", "frontier_2x2.png")
    assert sec.startswith("<!-- frontier-2x2:begin -->")
    assert sec.endswith("<!-- frontier-2x2:end -->")
    assert "| 73.0 | FSDP2 keep | 312 | AMSP p2-g2-os4 | 500 | 1.60x | p1-g1-os2 |" in sec
    assert "2 warm-up steps (1 in repetitions after the first), then 1 timed step(s); cut " \
           "after repetition 0" in sec and ": FSDP2 keep. Sweep wall time 100 s." in sec
    assert "Not installed here, skipped: ds_mics:2: runs/peers/ds0196 is not installed" in sec
    assert "The planner with link (alpha-beta): 3 of 8 caps within 10% (38%)" in sec
    assert "| DS ZeRO-1 | 96.0 | 10.0 (10.0/0.0/0.0) | see_memory_usage MA" in sec
    assert "| MFSDP ZeRO-3 | 57.0 | 10.0 (10.0/0.0/0.0) | no memory report" in sec
    assert "| 130.0 | 1000 (DDP) | 500 (HSDP shard 2) | 800 (ZeRO-1) | - |" in sec
    other = "<!-- frontier-4x2:begin -->\n## 4x2, measured before\n<!-- frontier-4x2:end -->"
    overlap = "<!-- overlap:begin -->\n## Overlap\n| kept | verbatim |\n<!-- overlap:end -->"
    old = "# old title\n\n" + other + "\n\nstale\n\n" + sec.replace("500", "499") + \
        "\n\n" + overlap + "\n\ntrailing\n"
    doc = R.assemble(old, "# Header\n", sec)
    assert doc == "# Header\n\n" + sec + "\n\n" + other + "\n\n" + overlap + "\n"
    assert R.assemble("", "# H", sec) == "# H\n\n" + sec + "\n"
    # another link rate at the same scale is a section of its own, after the 1gbit one
    data["meta"]["bw"] = "200mbit between nodes"
    slow = R.section(data, "python -m tools.bench_frontier --bw 200mbit", "frontier_2x2-200mbit.png")
    assert R.scale_tag(data["meta"]) == "2x2-200mbit"
    assert slow.startswith("<!-- frontier-2x2-200mbit:begin -->")
    assert R.assemble(doc, "# Header\n", slow) == \
        "# Header\n\n" + sec + "\n\n" + slow + "\n\n" + other + "\n\n" + overlap + "\n"
    assert R.assemble(doc, "# H", overlap="<!-- overlap:begin -->\nnew\n<!-- overlap:end -->"
                      ).endswith("\n\n<!-- overlap:begin -->\nnew\n<!-- overlap:end -->\n")


def test_from_json_renders_through_the_old_command_without_running(tmp_path, monkeypatch):
    from tools import bench as B

    data = _data()
    data["meta"]["command"] = "flock x python -m tools.bench_frontier --nodes 2"
    src = tmp_path / "frontier_2x2.json"
    src.write_text(json.dumps(data))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Kept\n\nby hand\n\n<!-- overlap:begin -->\nO\n<!-- overlap:end -->\n")
    monkeypatch.setattr(B, "planner_data", lambda d: {})
    assert B.main(["frontier", "--from-json", str(src), "--doc", str(doc),
                   "--png-dir", str(tmp_path)]) == 0
    text = doc.read_text()
    assert text.startswith("# Kept\n\nby hand\n\n<!-- frontier-2x2:begin -->")  # its header
    assert R.header_of("") == R.header_of("<!-- overlap:begin -->\n<!-- overlap:end -->") == \
        "# Benchmarks"  # a new document's
    assert "flock x python -m tools.bench_frontier --nodes 2" in text
    assert text.rstrip().endswith("<!-- overlap:begin -->\nO\n<!-- overlap:end -->")
    assert (tmp_path / "frontier_2x2.png").stat().st_size > 0


def test_sweep_schedule_and_the_options_the_workers_get():
    from tools import bench as B
    from tools import bench_systems as S
    from tools import bench_worker as W

    assert S.shard_sizes(4, 2) == [2] and S.shard_sizes(8, 2) == [2, 4]
    assert S.shard_sizes(16, 4) == [2, 4, 8]
    keys = S.sweep(4, 2)
    assert keys[:4] == ["ddp", "zero3", "zero3_keep", "hsdp:2"]
    assert keys[4:12] == ["ds_z1", "ds_z2", "ds_z3", "ds_hpz:2", "ds_mics:2", "mfsdp_z3",
                          "mfsdp_hfsdp:2", "amsp:p1-g1-os1"]
    assert len([k for k in keys if k.startswith("amsp:")]) == 9
    keys8 = S.sweep(8, 2)
    assert {"hsdp:4", "ds_mics:4", "mfsdp_hfsdp:4"} <= set(keys8) and "ds_hpz:4" not in keys8
    assert len([k for k in keys8 if k.startswith("amsp:")]) == 16
    assert {S.family(k) for k in keys8} == set(S.FAMILIES)
    args = B.parser().parse_args(["frontier", "--warmup-later", "1", "--prune", "0.1",
                                  "--keep", "a", "--steps", "1"])
    again = argparse_roundtrip(W, args)
    for dest in W.WORKLOAD:
        assert getattr(again, dest) == getattr(args, dest), dest
    assert W.schedule(["a", "b", "c@noop"], 2) == [
        (0, "a", ""), (0, "b", ""), (0, "c", "noop"), (1, "a", ""), (1, "b", ""),
        (1, "c", "noop")]
    with pytest.raises(SystemExit, match="hsdp:4"):  # no shard-4 HSDP on 2 nodes x 2
        B.main(["frontier", "--configs", "hsdp:4,amsp:p1-g1-os1", "--no-profile"])


def argparse_roundtrip(W, args):
    import argparse

    ap = argparse.ArgumentParser()
    W.add_workload_args(ap)
    return ap.parse_args(W.workload_argv(args))


def test_dominated_configurations_are_pruned_within_their_system_or_against_all():
    from tools import bench_worker as W

    def res(config, step, peak):
        return W.Result(config, 0, "real", [step], [], [peak, peak], [], [], [])

    results = [res("zero3", 4.0, 40), res("zero3_keep", 3.0, 50), res("hsdp:2", 2.0, 75),
               res("amsp:p1-g4-os4", 2.4, 81), res("amsp:p1-g1-os4", 1.4, 81),
               res("amsp:p2-g2-os4", 2.4, 69), res("amsp:p1-g8-os8", 2.7, 69),
               res("ds_z3", 5.0, 45), res("ds_z1", 2.0, 90)]
    # p1-g4-os4: p1-g1-os4 at the same peak is 1.7x faster; p1-g8-os8: p2-g2-os4 1.125x;
    # DeepSpeed ZeRO-3 is only compared with its own configurations, not FSDP2's
    assert W.dominated(results, 0.10, 1000) == ["amsp:p1-g4-os4", "amsp:p1-g8-os8"]
    assert W.dominated(results, 0.20, 1000) == ["amsp:p1-g4-os4"]
    assert W.dominated(results, 0.0, 1000) == []
    assert W.dominated(results, 0.10, 1000, frozenset({"amsp:p1-g8-os8"})) == ["amsp:p1-g4-os4"]
    # against every system: DeepSpeed ZeRO-1 (500 tok/s at 90 MB) vs AMSP p1-g1-os4 (714 at
    # 81 MB) is 1.43x; DeepSpeed ZeRO-3 (200 at 45 MB) vs FSDP2 reshard (250 at 40 MB) 1.25x
    assert W.dominated(results, 0.0, 1000, margin_all=0.3) == ["amsp:p1-g4-os4", "ds_z1"]
    assert W.dominated(results, 0.0, 1000, margin_all=0.2) == ["amsp:p1-g4-os4", "ds_z3",
                                                              "ds_z1"]
    assert W.dominated(results, 0.0, 1000, frozenset({"ds_z1"}), 0.3) == ["amsp:p1-g4-os4"]
    # another process set's configurations count as rivals only (never cut here): MiCS
    # (333 tok/s at 100 MB) against AMSP p1-g1-os4's 714 at 81 MB
    mics = [res("ds_mics:2", 3.0, 100)]
    assert W.dominated(mics, 0.1, 1000, margin_all=0.3, rivals=results) == ["ds_mics:2"]
    assert W.dominated(mics, 0.1, 1000, rivals=results) == []


def test_possible_picks_are_every_pick_the_planner_makes_at_any_budget():
    """Asked at every plan's estimate, the planner gives the same picks as on a fine grid
    of budgets over the whole range (2 nodes x 2 ranks, alpha-beta at 1 Gbit/s)."""
    from amsp_dtensor.plan.cost.planner import NoPlanFits
    from tools import bench as B

    args = B.parser().parse_args(["frontier"])
    models = B.time_models(2, None, 125e6)
    assert [m.name for m in models] == ["link"]
    picks = B.possible_picks(args, 4, 2, models)
    _, report = B.planner_choice(args, 4, 2, 2.0 ** 60, models[0].bandwidth)
    estimates = sorted(c.memory.total for c in report.candidates)
    lo, hi, n = 0.9 * estimates[0], 1.1 * estimates[-1], 40
    on_grid = set()
    for i in range(n):
        try:
            on_grid.add("amsp:" + B.planner_choice(args, 4, 2, lo * (hi / lo) ** (i / (n - 1)),
                                                   models[0].bandwidth)[0])
        except NoPlanFits:
            continue
    assert len(on_grid) >= 3 and picks == on_grid


def test_the_planner_with_measured_memory_is_the_planner_when_peaks_are_its_estimates():
    """measured_memory_picks ranks the plans as choose_plan does: with every plan's
    "measured" peak equal to its estimate, its pick at each cap is choose_plan's own at
    that budget (2 nodes x 2 ranks, alpha-beta); a normal error moves some picks, the
    same ones for the same seed."""
    from tools import bench as B

    args = B.parser().parse_args(["frontier"])
    tm = B.time_models(2, None, 125e6)[0]
    _, report = B.planner_choice(args, 4, 2, 2.0 ** 60, tm.bandwidth)
    rows = [{"key": f"amsp:{c.plan.name}", "family": "amsp", "peak": float(c.memory.total)}
            for c in report.candidates]
    caps = sorted({r["peak"] for r in rows})
    picks = B.measured_memory_picks(report, rows, caps, tm.rank_by)
    assert picks == {repr(cap): B._pick(args, 4, 2, cap, tm) for cap in caps}
    assert len(set(picks.values())) >= 3
    noisy = B.measured_memory_picks(report, rows, caps, tm.rank_by, sd_mb=0.5, seed=1)
    assert noisy != picks
    assert noisy == B.measured_memory_picks(report, rows, caps, tm.rank_by, sd_mb=0.5, seed=1)


def _record_samples(mem, what) -> list:
    """Make every sample of ``mem`` also append what() to the returned list."""
    seen = []
    sample = mem.sample

    def recording(*a, **k):
        seen.append(what())
        sample()

    mem.sample = recording
    return seen


def test_peak_memory_samples_the_head_the_backwards_and_the_step(monkeypatch):
    """The bench's peak is sampled at every block boundary, at the output head (logits,
    loss gradient), after every backward and after the optimizer step before zero_grad:
    a spike that lives only at one of those points is caught."""
    import torch
    import torch.nn as nn

    from tools import bench_memory as BM
    from tools import bench_systems as S

    phase = {"now": None}

    def fake_in_use() -> int:  # 1 GB alive only between the step and zero_grad
        return 10**9 if phase["now"] == "step" else 0

    monkeypatch.setattr(BM, "in_use_bytes", fake_in_use)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Linear(4, 4)})
            self.output = nn.Linear(4, 3)

        def forward(self, x):
            return self.output(self.layers["0"](x))

    model = Tiny()
    mem = BM.PeakMemory()
    samples = _record_samples(mem, lambda: phase["now"])
    mem.attach([model.layers["0"]], head=model.output)

    class Opt:
        def step(self):
            phase["now"] = "step"

        def zero_grad(self, set_to_none=True):
            phase["now"] = None

    system = S.System()
    system.model, system.optim = model, Opt()
    monkeypatch.setattr(S, "lm_loss", lambda m, t, l: m(t).float().pow(2).mean())
    batches = [(torch.randn(2, 4), None), (torch.randn(2, 4), None)]
    system.train_step(batches, probe=mem.sample)
    # block: fwd in/out + bwd entry; head: the same; 2 micro-batches; + 2 backwards + step
    assert len(samples) == 2 * (3 + 3) + 2 + 1
    assert samples[-1] == "step"  # the step's sample is taken before zero_grad
    assert mem.peak_delta == 10**9  # the spike alive only inside the step was caught


def test_every_op_samples_after_each_op_forward_and_backward(monkeypatch):
    """Inside ``every_op()`` memory is sampled after every aten op, so a tensor that lives
    only between two ops (never at a hook point) sets the peak."""
    import torch

    from tools import bench_memory as BM

    live = {"bytes": 0}
    monkeypatch.setattr(BM, "in_use_bytes", lambda: live["bytes"])
    mem = BM.PeakMemory()
    calls = _record_samples(mem, lambda: live["bytes"])
    x = torch.randn(8, 8, requires_grad=True)
    with mem.every_op():
        live["bytes"] = 123  # alive only while the next ops run
        y = (x @ x).relu().sum()
        live["bytes"] = 0
        y.backward()
    assert len(calls) >= 6  # matmul, relu, sum forward; their backward ops
    assert mem.peak_delta == 123
    calls.clear()
    (x * 2).sum().backward()  # outside the block: no sampling
    assert calls == []


def test_compressed_amsp_rows_before_and_after():
    """A compressed AMSP configuration is not an exact plan: the frontier, targets and the
    planner compare exact plans (before); its own table adds it (after); its loss gap is
    reported, outside the agreement check (compression is lossy)."""
    data = _data()
    for rep in range(3):  # p2-g2-os4 with int8 grads: 400 tok/s at 74 MB, loss off by 2e-4
        data["results"].append(_result("amsp:p2-g2-os4+g-int8", rep, [2.5], 74 * MB,
                                       [8.0, 7.5002]))
        data["results"].append(_result("amsp:p1-g1-os2+g-int8", rep, [0.8], 107 * MB,
                                       [8.0, 7.5001]))
    every = {r["key"]: r for r in R.summarize(data)}
    assert every["amsp:p2-g2-os4+g-int8"]["compressed"] and not every["amsp:p2-g2-os4"]["compressed"]
    assert every["amsp:p2-g2-os4+g-int8"]["label"] == "AMSP p2-g2-os4 +g-int8"
    sec = R.section(data, "cmd", "f.png")
    assert sec.replace("\n### AMSP with compressed", "").count("### ") == \
        R.section(_data(), "cmd", "f.png").count("### ")  # one section more, nothing else
    table = sec[sec.index("before and after"):sec.index("### Each system")]
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table.splitlines()
            if line.startswith("| 7") or line.startswith("| 1")}
    # 74.5 MB: best other HSDP shard 2 (500); exact AMSP p2-g2-os4 median 500 -> 1.00x;
    # with compressed: p2-g2-os4 +g-int8 at 400 is slower, the exact plan stays
    assert rows["74.5"][3:6] == ["AMSP p2-g2-os4", "500", "1.00x"]
    assert rows["74.5"][6:9] == ["AMSP p2-g2-os4", "500", "1.00x |"]
    # 130 MB: DDP 1000; exact p1-g1-os2 1000 -> 1.00x; compressed p1-g1-os2 1250 -> 1.25x
    assert rows["130.0"][5] == "1.00x" and rows["130.0"][6:9] == ["AMSP p1-g1-os2 +g-int8", "1250", "1.25x |"]
    assert "AMSP p2-g2-os4 +g-int8 2.0e-04, AMSP p1-g1-os2 +g-int8 1.0e-04" in table
    # the agreement check stays over the exact configurations
    assert "largest |loss - ddp's| = 3.0e-07" in sec
    series = R.chart_series(list(every.values()))  # its own line in the chart
    assert series["amsp_c"][1][:2] == [pytest.approx(400), pytest.approx(400)]
    assert max(series["amsp"][1]) == pytest.approx(1000)


def test_meshes_share_the_groups_of_earlier_meshes_over_the_same_ranks(fake_four_ranks,
                                                                         monkeypatch):
    """The sweep's meshes draw their process groups from one pool: a mesh over ranks an
    earlier mesh grouped gets that group, where torch alone would make another (and keep
    its idle threads); two groups over the same ranks within one mesh stay two, as in a
    job of that configuration alone."""
    from torch.distributed import device_mesh

    from amsp_dtensor.engine.mesh import mesh_info
    from tools import bench_systems as S

    import torch.distributed.distributed_c10d as c10d

    monkeypatch.setattr(c10d, "new_group", c10d.new_group)  # the pool replaces it: restored
    made = []
    torch_new_group = device_mesh.new_group
    monkeypatch.setattr(device_mesh, "new_group",
                        lambda ranks=None, **kw: made.append(tuple(ranks)) or
                        torch_new_group(ranks=ranks, **kw))
    meshes = S.Meshes(4, 2)
    hsdp = meshes.of("hsdp:2")
    assert sorted(made) == [(0, 1), (0, 2), (1, 3), (2, 3)]  # every rank makes every subgroup
    mfsdp = meshes.get((2, 2, 1), ("outer", "fsdp", "tp"))
    assert mfsdp.get_group("outer") is hsdp.get_group("replicate")
    assert mfsdp.get_group("fsdp") is hsdp.get_group("shard")
    assert sorted(made[4:]) == [(0,), (1,), (2,), (3,)]  # only the size-1 "tp" groups are new

    os2 = mesh_info(meshes.of("amsp:p1-g1-os2"))
    # its os dim and its flattened shard dim hold the same two ranks: two groups, as alone
    assert os2.group("os") is hsdp.get_group("shard")
    assert os2.group("shard") is not os2.group("os")
    assert dist.get_process_group_ranks(os2.group("shard")) == [0, 1]
    before = len(made)
    again = mesh_info(meshes.of("amsp:p2-g2-os2"))
    assert len(made) == before  # every group of a second plan over the same ranks is shared
    assert again.group("shard") is os2.group("shard")
