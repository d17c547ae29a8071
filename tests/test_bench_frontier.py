"""tools/bench_frontier, tools/frontier_report, tools/frontier_worker: the sweep, the
frontier's arithmetic and the page, on hand-made results (no processes started)."""

from __future__ import annotations

import json
import math

import pytest

from tools import frontier_report as R

MB = 1e6


def _result(config, rep, times, peak, losses, state=10 * MB, inter=0, waited=None):
    system = config if not config.startswith("amsp") else config
    r = {"system": system, "config": config, "rep": rep, "step_times": times,
         "losses": losses, "peak_bytes_per_rank": [peak - 1 * MB, peak, peak - 2 * MB, peak],
         "state_bytes_per_rank": [{"param": state, "grad": 0, "optim": 0}] * 4,
         "comm": ({"counted": {"intra": 5, "inter": inter}, "recorder": {"intra": 5,
                                                                         "inter": inter},
                   "counted_events": [["all_reduce", 2, inter, True, 1]],
                   "recorder_events": [["reduce_scatter", "os", 2, inter, True, "sync"],
                                       ["all_gather", "os", 2, inter, True, "step"]]}
                  if rep == 0 else None),
         "predicted": {"bytes": {"intra": 5, "inter": inter}}}
    if waited is not None:
        r["waited_s_per_rank"] = [{"in_step": w, "after_step": 0.01} for w in waited]
    return r


# config -> (step time per rep, peak MB per rep), tokens per step = 1000
SPEC = {
    "ddp": ([1.0, 1.0, 1.0], [130, 130, 130]),
    "zero1": ([1.25, 1.25, 1.25], [96, 96, 96]),
    "zero3": ([4.0, 5.0, 4.5], [50, 50, 50]),
    "zero3_keep": ([3.2, 3.2, 3.2], [70, 70, 70]),
    "hsdp": ([2.0, 2.0, 2.0], [74, 74.5, 74]),
    "hpz": ([4.0, 4.0, 4.0], [57, 57, 57]),
    "amsp:p4-g4-os4": ([4.0, 4.0, 4.0], [56, 56, 56]),
    "amsp:p2-g2-os4": ([2.0, 2.5, 1.0], [73, 73, 73]),
    "amsp:p1-g1-os2": ([1.0, 1.0, 1.0], [106, 106.0004, 106]),
}


def _data():
    results = []
    for rep in range(3):
        for key, (times, peaks) in SPEC.items():
            waited = [0.1, 0.3, 0.2, 0.0] if key.startswith("amsp") else None
            loss = [8.0, 7.5 + (1e-7 if key == "hsdp" else 0.0)]
            results.append(_result(key, rep, [times[rep]], peaks[rep] * MB, loss,
                                   waited=waited))
    meta = {"tokens_per_step": 1000, "nodes": 2, "ranks_per_node": 2, "world": 4,
            "args": {"reps": 3, "steps": 1, "warmup": 2, "flavor": "debugmodel", "seq": 64,
                     "micro_batch": 1, "micro_batches": 4},
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
    assert z3["reps"] == 3 and z3["steps"] == 1 and z3["family"] == "zero3"
    # peak: max over ranks and over repetitions (a cap fits only if every rep fitted)
    assert rows["hsdp"]["peak"] == 74.5 * MB and rows["hsdp"]["peak_med"] == 74 * MB
    assert rows["amsp:p2-g2-os4"]["waited"] == pytest.approx(0.3)  # max over ranks
    assert rows["amsp:p2-g2-os4"]["waited_after"] == pytest.approx(0.01)
    assert rows["ddp"]["waited"] is None
    # ring model: an all-reduce over 2 sends the buffer once, RS + AG half of it twice
    assert rows["ddp"]["wire"] == rows["amsp:p2-g2-os4"]["wire"] == 0
    events = {"counted_events": [["all_reduce", 2, 1000, True, 3], ["all_gather", 4, 800, True, 1],
                                 ["all_gather", 2, 500, False, 9]],
              "recorder_events": [["reduce_scatter", "os", 2, 1000, True, "sync"],
                                  ["all_gather", "os", 2, 1000, True, "step"]]}
    assert R.wire_inter(events, amsp=False) == 3 * 1000 + 600
    assert R.wire_inter(events, amsp=True) == 1000
    assert [rows[k]["label"] for k in ("zero3_keep", "hsdp", "amsp:p1-g1-os2")] == \
        ["ZeRO-3 keep", "HSDP shard 2", "AMSP p1-g1-os2"]
    assert R.config_label("hsdp:4", 2) == "HSDP shard 4" and R.family("hsdp:4") == "mics"


def test_caps_are_the_distinct_peaks_or_a_geometric_grid():
    rows = list(_rows().values())
    caps = R.select_caps(rows)
    # 106 and 106.0004 MB are one cap (within 1 kB), the larger; ascending
    assert [round(c / MB, 1) for c in caps] == [50, 56, 57, 70, 73, 74.5, 96, 106, 130]
    assert caps[7] == 106.0004 * MB
    grid = R.select_caps(rows, "grid", n=5)
    assert grid[0] == 50 * MB and grid[-1] == pytest.approx(130 * MB)
    assert grid[1] / grid[0] == pytest.approx(grid[2] / grid[1])
    # 30 * (123 / 30) rounds to under 123: the largest peak is still a cap, exactly
    ends = [{"peak": 30e6}, {"peak": 123e6}]
    assert R.select_caps(ends, "grid", n=5)[-1] == 123e6
    with pytest.raises(ValueError):
        R.select_caps(rows, "nope")


def test_frontier_best_per_cap_and_ratio():
    rows = list(_rows().values())
    fr = {round(f["cap"] / MB, 1): f for f in R.frontier(rows, R.select_caps(rows))}
    # 50 MB: only ZeRO-3 fits: no AMSP plan
    assert fr[50]["baseline"]["key"] == "zero3" and fr[50]["ratio"] is None
    # 73 MB: ZeRO-3 keep (312.5 tok/s) vs AMSP p2-g2-os4 (500): 1.6x; with +5% memory HSDP
    # (74.5 MB) joins the baselines: 500 / 500
    assert fr[73]["baseline"]["key"] == "zero3_keep"
    assert fr[73]["amsp"]["key"] == "amsp:p2-g2-os4"
    assert fr[73]["ratio"] == pytest.approx(1.6)
    assert fr[73]["ratio_slack"] == pytest.approx(1.0)
    # 106 MB: AMSP p1-g1-os2 1000 vs ZeRO-1 800
    assert fr[106]["ratio"] == pytest.approx(1.25)
    assert fr[106]["per_family"]["mics"]["key"] == "hsdp"
    assert fr[130]["baseline"]["key"] == "ddp" and fr[130]["ratio"] == pytest.approx(1.0)
    # only AMSP fits -> inf
    only = R.frontier([rows[-1]], [106.1 * MB])[0]
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
    assert prows[130]["slowdown"] == pytest.approx(1.0)
    assert prows[70]["rank"] is None and "does not fit (measured 106.0 MB)" in prows[70]["note"]
    assert prows[57]["note"] == "refuses, but a plan fits as measured"
    good, total = R.planner_share(list(prows.values()))
    # caps with an AMSP plan: 56, 57, 70, 73, 74.5, 96, 106, 130 -> within: 56, 106
    assert (good, total) == (2, 8)


def test_chart_series_is_each_family_best_under_the_cap():
    rows = list(_rows().values())
    series = R.chart_series(rows)
    xs, ys = series["amsp"]
    assert xs[0] == 56 and ys[0] == pytest.approx(250)
    assert ys[xs.index(73)] == pytest.approx(500) and ys[6] == pytest.approx(1000)
    assert all(b >= a for a, b in zip(ys, ys[1:]))  # a frontier never falls
    assert xs[-1] == pytest.approx(130 * 1.04) and ys[-1] == ys[-2]
    assert series["ddp"][0][0] == 130 and set(series) == set(R.FAMILIES) | {"baseline"}
    bx, by = series["baseline"]  # the best baseline: ZeRO-3, hpZ, keep, HSDP, ZeRO-1, DDP
    assert bx[0] == 50 and [round(y) for y in by[:-1]] == [222, 222, 250, 312, 312, 500, 800,
                                                          800, 1000]


def test_targets_and_analysis_say_met_or_missed_with_numbers():
    rows = list(_rows().values())
    fr = R.frontier(rows, R.select_caps(rows))
    prows = R.planner_rows(rows, fr, {repr(f["cap"]): None for f in fr})
    loss = R.loss_check(rows)
    assert loss["max_diff"] == pytest.approx(1e-7) and loss["ok"] and loss["worst"] == "hsdp"
    text = "\n".join(R.targets(rows, fr, prows, loss))
    assert "MISSED at 3 of 9 caps" in text  # 50 (no AMSP plan), 70 and 96 MB
    assert "50.0 MB (no AMSP plan fits; the smallest, AMSP p4-g4-os4, peaks at 56.0 MB" in text
    assert "70.0 MB (0.800x, short by 0.15x)" in text and "96.0 MB (0.625x" in text
    assert "AMSP >= 1.5x the best baseline at one cap or more: met at 1 cap(s); highest " \
           "1.60x at 73.0 MB" in text
    assert "0 of 8 caps" in text and "MISSED" in text
    assert "agree within 1e-05" in text
    why = "\n".join(R.analysis(rows, fr))
    assert "AMSP p4-g4-os4 peaks at 56.0 MB" in why and "70.0 MB: ZeRO-3 keep" in why
    amsp_only = [r for r in rows if r["family"] == "amsp"]
    fr = R.frontier(amsp_only, R.select_caps(amsp_only))
    prows = R.planner_rows(amsp_only, fr, {repr(f["cap"]): None for f in fr})
    text = "\n".join(R.targets(amsp_only, fr, prows, R.loss_check(amsp_only)))
    assert "this run measured no baseline configuration" in text and ">= 1.5x" not in text


def test_section_and_document_keep_other_scales_and_overlap(tmp_path):
    data = _data()
    caps = R.select_caps(R.summarize(data))
    data["planner"] = {"variants": [
        {"name": "profile", "desc": "table", "picks": {repr(c): "p1-g1-os2" for c in caps}},
        {"name": "link", "desc": "alpha-beta", "picks": {repr(c): "p2-g2-os4" for c in caps}}],
        "estimates": {"p1-g1-os2": 100 * MB}, "reserve_bytes": 5 * MB,
        "reserve_note": "fitted"}
    sec = R.section(data, "python -m tools.bench_frontier --nodes 2", "frontier_2x2.png")
    begin, end = R.markers(2, 2)
    assert sec.startswith(begin) and sec.endswith(end)
    assert "| 73.0 | ZeRO-3 keep | 312 | AMSP p2-g2-os4 | 500 | 1.60x | 1.00x |" in sec
    assert "(frontier_2x2.png)" in sec and "100.0" in sec  # the planner's estimate column
    # per time model: 130 MB: p1-g1-os2 is the fastest (rank 1), p2-g2-os4 rank 2 of 3
    assert "| 130.0 | p1-g1-os2 (1000 tokens/s) | p1-g1-os2 (1 of 3, +0%) | " \
           "p2-g2-os4 (2 of 3, +100%) |" in sec
    assert "The planner with link (alpha-beta): 3 of 8 caps within 10% (38%)" in sec
    assert "sampled per op" not in sec
    data["meta"]["args"]["mem_steps"] = 1
    sec_mem = R.section(data, "python -m tools.bench_frontier --nodes 2", "frontier_2x2.png")
    assert "2 warm-up steps, then 1 timed step(s); in repetition 0, 1 more untimed step(s) " \
           "after the timed ones, sampled per op for the peak" in sec_mem
    data["meta"].update(pruned=["hpz"], kept=["amsp:p2-g2-os4", "amsp:p1-g1-os2"])
    data["meta"]["args"]["prune"] = 0.1
    sec_cut = R.section(data, "python -m tools.bench_frontier --nodes 2", "frontier_2x2.png")
    assert "at no more peak memory (off their system's frontier) ran no further " \
           "repetitions: hpZ (2nd shard 2). Never cut, so that the planner's slowdowns " \
           "compare full repetitions: the plans the planner can pick at some cap (AMSP " \
           "p2-g2-os4, AMSP p1-g1-os2)." in sec_cut
    other = "<!-- frontier-4x2:begin -->\n## 4x2, measured before\n<!-- frontier-4x2:end -->"
    overlap = "<!-- overlap:begin -->\n## Overlap\n| kept | verbatim |\n<!-- overlap:end -->"
    old = "# old title\n\nold text\n\n" + other + "\n\nstale\n\n" + \
        sec.replace("500", "499") + "\n\n" + overlap + "\n\ntrailing\n"
    doc = R.assemble(old, sec, "# Header\n")
    assert doc.startswith("# Header\n\n" + sec + "\n\n" + other + "\n\n" + overlap)
    assert "old title" not in doc and "stale" not in doc and doc.count(begin) == 1
    assert R.sections_of(doc) == {(2, 2): sec, (4, 2): other}
    # a document with nothing to keep
    assert R.assemble("", sec, "# H") == "# H\n\n" + sec + "\n"


def test_from_json_renders_without_running(tmp_path, monkeypatch):
    from tools import bench_frontier as B

    data = _data()
    data["meta"]["command"] = "flock x python -m tools.bench_frontier --nodes 2"
    src = tmp_path / "frontier_2x2.json"
    src.write_text(json.dumps(data))
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- overlap:begin -->\nO\n<!-- overlap:end -->\n")
    monkeypatch.setattr(B, "planner_data", lambda d, reserve=None: {"variants": [
        {"name": "link", "desc": "test", "picks": {repr(c): "p2-g2-os4" for c in
                                                   R.select_caps(R.summarize(d))}}],
        "estimates": {}, "reserve_bytes": 0, "reserve_note": "test"})
    assert B.main(["--from-json", str(src), "--doc", str(doc),
                   "--png-dir", str(tmp_path)]) == 0
    text = doc.read_text()
    assert text.startswith(B.HEADER.rstrip("\n"))
    assert "flock x python -m tools.bench_frontier --nodes 2" in text
    assert text.rstrip().endswith("<!-- overlap:begin -->\nO\n<!-- overlap:end -->")
    assert (tmp_path / "frontier_2x2.png").stat().st_size > 0
    assert "(frontier_2x2.png)" in text


def test_sweep_covers_every_configuration_and_schedule_cuts():
    from tools import frontier_worker as F

    assert F.hsdp_shard_sizes(4, 2) == [2] and F.hsdp_shard_sizes(8, 2) == [2, 4]
    assert F.hsdp_shard_sizes(16, 4) == [2, 4, 8]
    keys = F.sweep(4, 2)
    assert keys[:6] == ["ddp", "zero1", "zero3", "zero3_keep", "hsdp", "hpz"]
    assert len([k for k in keys if k.startswith("amsp:")]) == 9
    keys8 = F.sweep(8, 2)
    assert "hsdp:4" in keys8 and len([k for k in keys8 if k.startswith("amsp:")]) == 16
    runs = F.schedule(["a", "b", "c"], reps=3, steps=2, reps_for={"b": 1},
                      steps_for={"c": 1})
    assert runs == [(0, "a", 2), (0, "b", 2), (0, "c", 1), (1, "a", 2), (1, "c", 1),
                    (2, "a", 2), (2, "c", 1)]
    with pytest.raises(SystemExit):
        F.schedule(["a"], 3, 2, {"zz": 1}, {})
    with pytest.raises(SystemExit):
        F.parse_counts("zero3=0")
    assert F.sweep_keys("all", 4, 2) == keys
    assert F.sweep_keys("ddp, amsp:p2-g2-os4", 4, 2) == ["ddp", "amsp:p2-g2-os4"]
    with pytest.raises(SystemExit, match="hsdp:4"):  # no shard-4 HSDP on 2 nodes x 2
        F.sweep_keys("hsdp:4,amsp:p1-g1-os1", 4, 2)
    with pytest.raises(SystemExit, match="no AMSP plan"):
        F.sweep_keys("ddp,zero1", 4, 2)
    assert F.parse_counts("zero3=1, amsp:p4-g4-os4=2") == {"zero3": 1, "amsp:p4-g4-os4": 2}
    args = F.parse_args(["--out", "x", "--steps-for", "zero3=1", "--reps-for", "hpz=2",
                         "--mem-steps", "1"])
    assert (args.warmup, args.steps, args.reps, args.mem_steps) == (2, 2, 3, 1)
    again = F.parse_args(F.frontier_argv(args) + ["--out", "x"])
    for dest in ("steps_for", "reps_for", "configs", "steps", "reps", "plans", "mem_steps"):
        assert getattr(again, dest) == getattr(args, dest), dest


def test_dominated_configurations_are_pruned_within_their_system():
    from tools import frontier_worker as F

    def res(config, step, peak):
        return {"config": config, "step_times": [step], "peak_bytes_per_rank": [peak, peak]}

    results = [res("zero3", 4.0, 40), res("zero3_keep", 3.0, 50),
               res("amsp:p1-g4-os4", 2.4, 81), res("amsp:p1-g1-os4", 1.4, 81),
               res("amsp:p2-g2-os4", 2.4, 69), res("amsp:p1-g8-os8", 2.7, 69),
               res("hsdp", 2.0, 75), res("zero1", 2.0, 90)]
    # p1-g4-os4: p1-g1-os4 at the same peak is 1.7x faster; p1-g8-os8: p2-g2-os4 1.125x;
    # zero1 is only compared with ZeRO-1 configurations, HSDP with HSDP ones
    assert F.dominated(results, 0.10, 1000) == ["amsp:p1-g4-os4", "amsp:p1-g8-os8"]
    assert F.dominated(results, 0.20, 1000) == ["amsp:p1-g4-os4"]
    assert F.dominated(results, 0.0, 1000) == []
    # a kept configuration is never cut; the others are judged as before
    keep = frozenset({"amsp:p1-g8-os8"})
    assert F.dominated(results, 0.10, 1000, keep) == ["amsp:p1-g4-os4"]
    args = F.parse_args(["--out", "x", "--keep", "amsp:p1-g1-os2,hsdp"])
    assert F.parse_args(F.frontier_argv(args) + ["--out", "x"]).keep == args.keep


def test_possible_picks_are_every_pick_the_planner_makes_at_any_budget():
    """The planner asked at every plan's estimate gives the same picks as asked on a fine
    grid of budgets over the whole range (2 nodes x 2 ranks, alpha-beta at 1 Gbit/s)."""
    from amsp_dtensor.plan.cost.planner import NoPlanFits
    from tools import bench_frontier as B
    from tools import bench_systems as S
    from tools import bench_worker as W
    from tools import frontier_worker as F

    args = F.parse_args(["--out", "x"])
    models = B.time_models(args, 2, None, 125e6)
    assert [name for name, _, _ in models] == ["link"]
    picks = B.possible_picks(args, 4, 2, models)
    model_args = S.model_args(args.flavor, args.seq)
    args.mem_budget_gib = 2.0 ** 20
    _, summary, _ = W.planner_choice(args, model_args, 4, 2, bandwidth=models[0][2])
    estimates = sorted(c["memory"] for c in summary["candidates"])
    lo, hi, n = 0.9 * estimates[0], 1.1 * estimates[-1], 40
    on_grid = set()
    for i in range(n):
        args.mem_budget_gib = lo * (hi / lo) ** (i / (n - 1)) / 2**30
        try:
            plan, _, _ = W.planner_choice(args, model_args, 4, 2, bandwidth=models[0][2])
        except NoPlanFits:
            continue
        on_grid.add(f"amsp:{plan.name}")
    assert len(on_grid) >= 3 and picks == sorted(on_grid)
    assert set(picks) < {k for k in F.sweep(4, 2) if k.startswith("amsp:")}
    # the command's own options: the user's --keep joins them; --configs limits them
    own = B.parser().parse_args(["--prune", "0.1", "--keep", "hsdp"])
    assert B.sweep_keep(own, None, 125e6).split(",") == sorted(["hsdp", *picks])
    few = B.parser().parse_args(["--prune", "0.1", "--configs", f"ddp,{picks[0]}"])
    assert B.sweep_keep(few, None, 125e6) == picks[0]


def test_planner_misses_are_explained_by_memory_or_time_model():
    rows = list(_rows().values())
    caps = R.select_caps(rows)
    fr = R.frontier(rows, caps)
    picks = {repr(c): None for c in caps}
    picks[repr(caps[4])] = "p4-g4-os4"  # 73 MB: p2-g2-os4 is faster and estimated to fit
    picks[repr(caps[7])] = "p2-g2-os4"  # 106 MB: p1-g1-os2 estimated at 110 MB > cap
    prows = R.planner_rows(rows, fr, picks)
    est = {"p4-g4-os4": 55 * MB, "p2-g2-os4": 70 * MB, "p1-g1-os2": 104 * MB}
    # with a 6 MB reserve the faster plans are estimated over the cap: memory explains it
    text = "\n".join(R.planner_analysis(rows, prows, est, reserve=6 * MB))
    assert "Memory model: at 106.0 MB the fastest fitting plan, p1-g1-os2 (measured " \
           "106.0 MB), is estimated at 110.0 MB, over the cap" in text
    assert "at 73.0, 74.5 MB the fastest fitting plan, p2-g2-os4" in text
    assert "Time model" not in text
    # without it they fit the planner's model too: its time model ranked them lower
    lines = R.planner_analysis(rows, prows, est, reserve=0)
    assert lines[0].startswith("Memory model: measured peak above the planner's estimate + "
                               "reserve by more than 2 MB for p2-g2-os4 (73.0 vs 70.0 MB), "
                               "p1-g1-os2 (106.0 vs 104.0 MB)")
    assert lines[1].startswith("Time model: at 73.0 MB it ranks p4-g4-os4 (250 tokens/s "
                               "measured") and "above p2-g2-os4 (500 tokens/s" in lines[1]
    assert len(lines) == 3 and "the model predicts" not in lines[1]
    # with the model's step times: how far apart it put the two, and what was measured
    # (p4-g4-os4 ran 4.0 s in every rep, p2-g2-os4 2.0, 2.5, 1.0 s: 250 vs 400-1000)
    lines = R.planner_analysis(rows, prows, est, reserve=0,
                               predicted={"p4-g4-os4": 1.0, "p2-g2-os4": 1.05})
    assert lines[1].endswith("; the model predicts 1.000 s per step for p4-g4-os4 and 1.050 s "
                             "for p2-g2-os4 (5% apart); measured, p2-g2-os4 is 100% faster, "
                             "with min-max ranges that do not overlap (250-250 vs 400-1000 "
                             "tokens/s).")


def test_single_budget_report_renders_and_keeps_marked_sections(tmp_path):
    """tools/bench.py's report (its own file by default now) still renders, and a
    docs/benchmarks.md it is pointed at keeps the frontier and overlap sections."""
    from tools import bench_report

    def res(system, rep, t):
        comm = {"counted": {"intra": 0, "inter": 8}, "counted_events": [
            ["all_reduce", 4, 8, True, 1]]}
        if system.startswith("amsp"):
            comm.update(recorder={"intra": 0, "inter": 8}, recorder_events=[])
        return {"system": system, "rep": rep, "step_times": [t], "losses": [8.0, 7.9],
                "peak_bytes_per_rank": [50 * MB] * 4,
                "state_bytes_per_rank": [{"param": 1, "grad": 1, "optim": 1}] * 4,
                "comm": comm if rep == 0 else None, "predicted": None}

    meta = {"tokens_per_step": 1000, "amsp_plan": "p2-g2-os4", "machine": "m", "nodes": 2,
            "ranks_per_node": 2, "link": "l", "model": {"flavor": "debugmodel", "params": 1},
            "args": {"seq": 64, "micro_batch": 1, "micro_batches": 4, "reps": 2,
                     "warmup": 2, "steps": 1}, "wall_s": 1.0, "planner_note": "p"}
    data = {"meta": meta, "results": [res(s, rep, 1.0) for rep in range(2)
                                      for s in ("zero3", "hsdp", "amsp:p2-g2-os4")]}
    doc = tmp_path / "benchmarks.md"
    kept = "<!-- frontier-2x2:begin -->\nF\n<!-- frontier-2x2:end -->"
    doc.write_text("# old\n\n" + kept + "\n")
    bench_report.write(data, str(doc), str(tmp_path / "b.png"), "python -m tools.bench")
    text = doc.read_text()
    assert "| ZeRO-3 (FSDP2) |" in text and text.rstrip().endswith(kept)


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


def test_memory_steps_see_the_backward_once_optimizer_states_exist(monkeypatch):
    """A peak that needs the optimizer's states and a backward's gradients alive together
    is missed by a per-op-sampled first step (its backward runs before the states exist)
    and caught by bench_worker.memory_steps after it."""
    import torch
    import torch.nn as nn

    from tools import bench_memory as BM
    from tools import bench_systems as S
    from tools import bench_worker as W

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    seen = {"steps": 0, "grads_made_after": -1}
    optim.register_step_post_hook(lambda *a: seen.update(steps=seen["steps"] + 1))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: seen.update(grads_made_after=seen["steps"]))

    def fake_in_use() -> int:  # 1 GB while a backward's grads sit beside Adam's states
        grads = any(p.grad is not None for p in model.parameters())
        return 10**9 if grads and seen["grads_made_after"] >= 1 else 0

    monkeypatch.setattr(BM, "in_use_bytes", fake_in_use)
    monkeypatch.setattr(S, "lm_loss", lambda m, t, l: m(t).float().pow(2).mean())
    system = S.System()
    system.model, system.optim = model, optim
    batches = [(torch.randn(2, 4), None), (torch.randn(2, 4), None)]
    mem = BM.PeakMemory()
    with mem.every_op():  # a warm-up step: its backward runs before the states exist
        system.train_step(batches, probe=mem.sample)
    assert mem.peak_delta == 0
    W.memory_steps(system, mem, [batches])
    assert mem.peak_delta == 10**9
