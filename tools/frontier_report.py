"""The memory-capped frontier: numbers, chart and markdown of tools/bench_frontier.

Pure functions of tools/frontier_worker's JSON (no processes, no torch import), so that
tests/test_bench_frontier.py can check every number the page shows:

- ``summarize``: one row per configuration: tokens/s per repetition (tokens per step /
  mean timed step time, each step the max over ranks), median and min-max; peak memory per
  rank (max over ranks and repetitions: a configuration fits a cap only if it fitted in
  every repetition); model-state bytes; inter-/intra-node bytes; losses; the time AMSP
  waited in collectives.
- ``select_caps``: the memory caps (every distinct measured peak: the frontier changes
  only there), or a geometric grid between the smallest and largest peak.
- ``frontier``: per cap, each system's fastest configuration under the cap, the best
  baseline, AMSP's best and their ratio; ``planner_rows`` adds the planner's pick per cap,
  its measured rank among AMSP's fitting plans and its slowdown vs the best of them.
- ``section`` / ``assemble``: one scale's markdown section, and docs/benchmarks.md
  rebuilt from a header, every scale's section (another scale's is kept as it was) and
  the overlap section (kept verbatim).
"""

from __future__ import annotations

import math
import re
import statistics

MB = 1e6
BASELINE_FAMILIES = ("ddp", "zero1", "zero3", "mics", "hpz")
FAMILIES = BASELINE_FAMILIES + ("amsp",)
FAMILY_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero3": "ZeRO-3 (FSDP2)",
                 "mics": "MiCS (HSDP)", "hpz": "ZeRO++ hpZ", "amsp": "AMSP"}
FAMILY_COLORS = {"ddp": "tab:brown", "zero1": "tab:olive", "zero3": "tab:blue",
                 "mics": "tab:green", "hpz": "tab:purple", "amsp": "tab:red"}
TARGET_FLOOR, TARGET_WIN, PLANNER_TOL, PLANNER_SHARE = 0.95, 1.5, 0.10, 0.8
BASELINE_SLACK = 1.05  # the robustness column: baselines may use 5% more than the cap
LOSS_TOL = 1e-5
OVERLAP = ("<!-- overlap:begin -->", "<!-- overlap:end -->")
_SECTION = re.compile(r"<!-- frontier-(\d+)x(\d+):begin -->.*?<!-- frontier-\1x\2:end -->",
                      re.S)


def markers(nodes: int, rpn: int) -> tuple[str, str]:
    return f"<!-- frontier-{nodes}x{rpn}:begin -->", f"<!-- frontier-{nodes}x{rpn}:end -->"


# ---------------------------------------------------------------- configurations


def family(key: str) -> str:
    if key.startswith("amsp"):
        return "amsp"
    if key.startswith("hsdp"):
        return "mics"
    if key.startswith("zero3"):
        return "zero3"
    if key in ("ddp", "zero1", "hpz"):
        return key
    raise ValueError(f"unknown configuration {key!r}")


def config_label(key: str, rpn: int) -> str:
    if key.startswith("amsp:"):
        return f"AMSP {key.split(':', 1)[1]}"
    if key == "hsdp" or key.startswith("hsdp:"):
        s = int(key.split(":", 1)[1]) if ":" in key else rpn
        return f"HSDP shard {s}"
    return {"ddp": "DDP", "zero1": "ZeRO-1", "zero3": "ZeRO-3 reshard",
            "zero3_keep": "ZeRO-3 keep", "hpz": f"hpZ (2nd shard {rpn})"}[key]


def _max_waited(per_rank, part: str):
    vals = [w[part] for w in per_rank or [] if w]
    return max(vals) if vals else None


def wire_inter(comm: dict, amsp: bool) -> float | None:
    """Bytes one rank sends per step in groups that span nodes, ring model ((n-1)/n of the
    buffer for all-gather / reduce-scatter, 2(n-1)/n for all-reduce): an all-reduce and a
    reduce-scatter + all-gather of the same buffer send the same bytes."""
    from amsp_dtensor.plan.cost.comm import ring_factor

    events = comm.get("recorder_events") if amsp else comm.get("counted_events")
    if events is None:
        return None
    total = 0.0
    for ev in events:
        if amsp:  # (op, dim, group size, nbytes, inter-node, phase), one per collective
            op, _dim, n, nbytes, inter, _phase = ev
            count = 1
        else:  # (op, group size, nbytes, inter-node, count)
            op, n, nbytes, inter, count = ev
        if inter:
            total += count * nbytes * ring_factor(op, n)
    return total


def summarize(data: dict) -> list[dict]:
    """One row per configuration, in sweep order (see the module docstring)."""
    meta = data["meta"]
    rpn, tokens = meta["ranks_per_node"], meta["tokens_per_step"]
    by: dict[str, list[dict]] = {}
    for r in data["results"]:
        by.setdefault(r.get("config") or r["system"], []).append(r)
    rows = []
    for key, reps in by.items():
        reps = sorted(reps, key=lambda r: r["rep"])
        first = reps[0]
        tps = [tokens / statistics.mean(r["step_times"]) for r in reps if r["step_times"]]
        comm = first.get("comm") or {}
        amsp = key.startswith("amsp")
        measured = (comm.get("recorder") if amsp else None) or comm.get("counted") or {}
        predicted = (first.get("predicted") or {}).get("bytes")
        states = [s for s in first.get("state_bytes_per_rank") or [] if s]
        rows.append({
            "key": key, "family": family(key), "label": config_label(key, rpn),
            "tps": statistics.median(tps), "tps_min": min(tps), "tps_max": max(tps),
            "tps_reps": tps, "reps": len(tps),
            "steps": len(first["step_times"]),
            "step_s": tokens / statistics.median(tps),
            "peak": max(max(r["peak_bytes_per_rank"]) for r in reps),
            "peak_med": statistics.median(max(r["peak_bytes_per_rank"]) for r in reps),
            "state": max(sum(s.values()) for s in states) if states else None,
            "state_parts": states[0] if states else None,
            "inter": measured.get("inter"), "intra": measured.get("intra"),
            "wire": wire_inter(comm, amsp),
            "predicted": predicted,
            "match": predicted is not None and predicted == measured,
            "losses": first["losses"],
            "waited": _max_waited(first.get("waited_s_per_rank"), "in_step"),
            "waited_after": _max_waited(first.get("waited_s_per_rank"), "after_step"),
        })
    return rows


def loss_check(rows: list[dict]) -> dict:
    """Largest |loss - reference loss| over configurations and their common steps; the
    reference is DDP (or the first row)."""
    ref = next((r for r in rows if r["key"] == "ddp"), rows[0])
    worst, worst_key = 0.0, ref["key"]
    for r in rows:
        n = min(len(r["losses"]), len(ref["losses"]))
        d = max((abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n])), default=0.0)
        r["loss_diff"] = d
        if d > worst:
            worst, worst_key = d, r["key"]
    return {"reference": ref["key"], "losses": ref["losses"], "max_diff": worst,
            "worst": worst_key, "ok": worst <= LOSS_TOL}


# ---------------------------------------------------------------- the frontier


def select_caps(rows: list[dict], mode: str = "peaks", n: int = 12) -> list[float]:
    """Memory caps, ascending. "peaks": every distinct measured peak (peaks within 1 kB of
    the previous one are one cap, the largest of them, so that all of them fit it);
    "grid": n caps spaced geometrically from the smallest to the largest peak."""
    peaks = sorted(r["peak"] for r in rows)
    if not peaks:
        return []
    if mode == "peaks":
        caps: list[float] = []
        for p in peaks:
            if caps and p - caps[-1] <= 1e3:
                caps[-1] = p
            else:
                caps.append(p)
        return caps
    if mode == "grid":
        lo, hi = peaks[0], peaks[-1]
        if n < 2 or hi <= lo:
            return [hi]
        # the ends are the peaks themselves: lo * (hi / lo) can round to under hi, and
        # then the configuration with the largest peak would fit no cap
        return [lo, *(lo * (hi / lo) ** (i / (n - 1)) for i in range(1, n - 1)), hi]
    raise ValueError(f"cap mode {mode!r}: use 'peaks' or 'grid'")


def best_under(rows: list[dict], cap: float, families=FAMILIES) -> dict | None:
    fits = [r for r in rows if r["family"] in families and r["peak"] <= cap]
    return max(fits, key=lambda r: r["tps"]) if fits else None


def frontier(rows: list[dict], caps: list[float]) -> list[dict]:
    """Per cap: each family's fastest fitting configuration, the best baseline, AMSP's
    best, AMSP / best baseline (None: AMSP has no fitting plan; inf: no baseline fits),
    and the same ratio when baselines may use BASELINE_SLACK x the cap."""
    out = []
    for cap in caps:
        per = {f: best_under(rows, cap, (f,)) for f in FAMILIES}
        base = best_under(rows, cap, BASELINE_FAMILIES)
        base_slack = best_under(rows, cap * BASELINE_SLACK, BASELINE_FAMILIES)
        amsp = per["amsp"]
        out.append({"cap": cap, "per_family": per, "baseline": base, "amsp": amsp,
                    "ratio": _ratio(amsp, base), "baseline_slack": base_slack,
                    "ratio_slack": _ratio(amsp, base_slack)})
    return out


def _ratio(amsp, base):
    if amsp is None:
        return None
    if base is None:
        return math.inf
    return amsp["tps"] / base["tps"]


def planner_rows(rows: list[dict], fr: list[dict], picks: dict) -> list[dict]:
    """Per cap: the planner's pick (``picks``: cap -> plan name, or None when the planner
    found nothing that fits), its measured rank among AMSP's plans that fit the cap (1 =
    fastest), its slowdown vs the fastest (best tokens/s / pick's - 1) and whether it is
    within PLANNER_TOL. ``counted``: False where no AMSP plan fits (nothing to pick)."""
    amsp = {r["key"].split(":", 1)[1]: r for r in rows if r["family"] == "amsp"}
    out = []
    for f in fr:
        cap = f["cap"]
        pick = _pick_for(picks, cap)
        fitting = sorted((r for r in amsp.values() if r["peak"] <= cap),
                         key=lambda r: -r["tps"])
        row = {"cap": cap, "pick": pick, "counted": bool(fitting), "rank": None,
               "of": len(fitting), "slowdown": None, "within": False, "note": ""}
        if not fitting:
            row["note"] = ("refuses: nothing fits, as measured" if pick is None else
                           f"picks {pick}, but no AMSP plan fits as measured")
        elif pick is None:
            row["note"] = "refuses, but a plan fits as measured"
        elif pick not in amsp:
            row["note"] = f"{pick} was not measured"
        elif amsp[pick]["peak"] > cap:
            row["note"] = f"does not fit (measured {amsp[pick]['peak'] / MB:.1f} MB)"
        else:
            row["rank"] = [r["key"] for r in fitting].index(f"amsp:{pick}") + 1
            row["slowdown"] = fitting[0]["tps"] / amsp[pick]["tps"] - 1
            row["within"] = row["slowdown"] <= PLANNER_TOL + 1e-12
        out.append(row)
    return out


def _pick_for(picks: dict, cap: float):
    for k, v in picks.items():
        if abs(float(k) - cap) < 0.5:
            return v
    raise KeyError(f"no planner pick for cap {cap}")


def planner_table(fr: list[dict], variants: list[dict], vrows: list[list[dict]]) -> str:
    """cap | measured best AMSP plan | each time model's pick (rank, slowdown)."""
    head = ("| cap MB/rank | fastest AMSP plan that fits (measured) | "
            + " | ".join(f"pick: {v['name']}" for v in variants) + " |")
    lines = [head, "|" + "---|" * (2 + len(variants))]
    for i, f in enumerate(fr):
        a = f["amsp"]
        cells = []
        for vr in vrows:
            p = vr[i]
            if p["rank"] is not None:
                cells.append(f"{p['pick']} ({p['rank']} of {p['of']}, "
                             f"{p['slowdown'] * 100:+.0f}%)")
            else:
                cells.append(f"{p['pick'] or 'none'}: {p['note']}")
        lines.append(f"| {f['cap'] / MB:.1f} | "
                     + (f"{a['key'].split(':', 1)[1]} ({a['tps']:.0f} tokens/s)" if a else "-")
                     + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def planner_share(prows: list[dict]) -> tuple[int, int]:
    counted = [p for p in prows if p["counted"]]
    return sum(p["within"] for p in counted), len(counted)


def chart_series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Each family's frontier as a step line, and "baseline" = the best of all baselines:
    x = every distinct peak from the family's smallest on (MB), y = its best tokens/s
    under x; drawn with where='post'."""
    xs_all = select_caps(rows)
    top = xs_all[-1] if xs_all else 0.0
    out = {}
    for fam in FAMILIES + ("baseline",):
        mine = [r for r in rows if r["family"] == fam
                or (fam == "baseline" and r["family"] in BASELINE_FAMILIES)]
        if not mine:
            continue
        lo = min(r["peak"] for r in mine)
        xs = [x for x in xs_all if x >= lo]
        ys = [best_under(mine, x)["tps"] for x in xs]
        xs, ys = xs + [top * 1.04], ys + [ys[-1]]
        out[fam] = ([x / MB for x in xs], ys)
    return out


def chart(rows: list[dict], meta: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for fam, (xs, ys) in chart_series(rows).items():
        if fam == "baseline":
            ax.step(xs, ys, where="post", color="black", ls="--", lw=1.0, alpha=0.7,
                    label="best baseline")
            continue
        ax.step(xs, ys, where="post", color=FAMILY_COLORS[fam], alpha=0.8,
                lw=2.2 if fam == "amsp" else 1.4, label=f"{FAMILY_LABELS[fam]} frontier")
    for r in rows:
        c = FAMILY_COLORS[r["family"]]
        ax.errorbar([r["peak"] / MB], [r["tps"]],
                    yerr=[[r["tps"] - r["tps_min"]], [r["tps_max"] - r["tps"]]],
                    fmt="o" if r["family"] == "amsp" else "s", color=c, ms=5, capsize=2)
        ax.annotate(r["label"].replace("AMSP ", ""), (r["peak"] / MB, r["tps"]),
                    textcoords="offset points", xytext=(4, 3), fontsize=6.5, color=c)
    ax.set_xlabel("peak memory per rank, MB (malloc in use, max over ranks and repetitions)")
    ax.set_ylabel("tokens/s (median, min-max over repetitions)")
    ax.set_title(f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, "
                 f"{meta.get('link_short', '')}: the fastest configuration under each cap",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- markdown


def _mb(x) -> str:
    return "n/a" if x is None else f"{x / MB:.1f}"


def _ratio_s(x) -> str:
    if x is None:
        return "no AMSP plan fits"
    return "only AMSP fits" if math.isinf(x) else f"{x:.2f}x"


def _cut_text(meta: dict, rows: list[dict]) -> str:
    a = meta["args"]
    pruned = meta.get("pruned") or []
    fewer = [f"{r['label']} ({r['reps']} rep(s) x {r['steps']} timed step(s))" for r in rows
             if (r["reps"] != a["reps"] and r["key"] not in pruned) or r["steps"] != a["steps"]]
    if not fewer:
        return ("apart from the cut below, every configuration got all repetitions and timed "
                "steps" if pruned else "every configuration got all repetitions and timed steps")
    return "fewer for " + ", ".join(fewer)


def frontier_table(fr: list[dict], prows: list[dict]) -> str:
    head = ("| cap MB/rank | best baseline under the cap | tokens/s | AMSP's best | tokens/s | "
            "AMSP / best baseline | same, baselines +5% memory | planner's pick | its rank "
            "among AMSP plans that fit | slowdown vs best AMSP | AMSP waited s/step |")
    lines = [head, "|" + "---|" * 11]
    for f, p in zip(fr, prows):
        b, a = f["baseline"], f["amsp"]
        if p["rank"] is not None:
            rank, slow = f"{p['rank']} of {p['of']}", f"{p['slowdown'] * 100:.0f}%"
        else:
            rank, slow = p["note"], "n/a"
        waited = "n/a"
        if a is not None and a["waited"] is not None:
            waited = f"{a['waited']:.3f}" + (f" (+{a['waited_after']:.3f})"
                                             if a["waited_after"] else "")
        base = f"{b['label']} | {b['tps']:.0f}" if b else "- | -"
        best = f"{a['label']} | {a['tps']:.0f}" if a else "- | -"
        lines.append(f"| {f['cap'] / MB:.1f} | {base} | {best} | {_ratio_s(f['ratio'])} | "
                     f"{_ratio_s(f['ratio_slack'])} | {p['pick'] or 'none fits'} | {rank} | "
                     f"{slow} | {waited} |")
    return "\n".join(lines)


def family_table(fr: list[dict]) -> str:
    head = "| cap MB/rank | " + " | ".join(FAMILY_LABELS[f] for f in FAMILIES) + " |"
    lines = [head, "|" + "---|" * (len(FAMILIES) + 1)]
    for f in fr:
        cells = []
        for fam in FAMILIES:
            r = f["per_family"][fam]
            cells.append("-" if r is None else f"{r['tps']:.0f} ({r['label'].split(' ', 1)[-1]})"
                         if fam in ("amsp", "mics", "zero3") else f"{r['tps']:.0f}")
        lines.append(f"| {f['cap'] / MB:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def config_table(rows: list[dict], estimates: dict) -> str:
    head = ("| configuration | tokens/s median (min-max) | reps x timed steps | step s | "
            "peak MB/rank | planner estimate MB | states MB/rank (P/G/OS) | inter-node "
            "MB/step | MB sent/rank across nodes (ring) | intra-node MB/step | model "
            "predicts | AMSP waited s/step | loss, last step | max abs loss diff |")
    lines = [head, "|" + "---|" * 14]
    for r in sorted(rows, key=lambda r: r["peak"]):
        parts = r["state_parts"] or {}
        est = estimates.get(r["key"].split(":", 1)[1]) if r["family"] == "amsp" else None
        pred = "n/a" if not r["predicted"] else ("=" if r["match"] else
                                                 f"{_mb(r['predicted']['inter'])} / "
                                                 f"{_mb(r['predicted']['intra'])}")
        waited = "n/a" if r["waited"] is None else (
            f"{r['waited']:.3f}" + (f" (+{r['waited_after']:.3f})" if r["waited_after"] else ""))
        lines.append(
            f"| {r['label']} | {r['tps']:.0f} ({r['tps_min']:.0f}-{r['tps_max']:.0f}) | "
            f"{r['reps']} x {r['steps']} | {r['step_s']:.3f} | {r['peak'] / MB:.1f} | "
            f"{_mb(est)} | {_mb(r['state'])} ({_mb(parts.get('param'))}/"
            f"{_mb(parts.get('grad'))}/{_mb(parts.get('optim'))}) | {_mb(r['inter'])} | "
            f"{_mb(r['wire'])} | {_mb(r['intra'])} | {pred} | {waited} | "
            f"{r['losses'][-1]:.5f} | "
            f"{r.get('loss_diff', 0.0):.1e} |")
    return "\n".join(lines)


def targets(rows: list[dict], fr: list[dict], prows: list[dict], loss: dict) -> list[str]:
    """The frontier's targets as measured, each with its numbers."""
    lines = []
    with_base = [f for f in fr if f["baseline"] is not None]
    below = [f for f in with_base if f["ratio"] is None or f["ratio"] < TARGET_FLOOR]
    finite = [f for f in with_base if f["ratio"] is not None]
    worst = min(finite, key=lambda f: f["ratio"]) if finite else None
    if not with_base:
        # the largest cap is the largest peak, so a measured baseline always fits one
        lines.append("AMSP against the baselines: this run measured no baseline "
                     "configuration, so neither target can be judged.")
    elif not below:
        lines.append(f"AMSP >= {TARGET_FLOOR}x the best baseline at every cap where a "
                     f"baseline fits ({len(with_base)} caps): met; lowest "
                     f"{worst['ratio']:.2f}x at {worst['cap'] / MB:.1f} MB.")
    else:
        parts = []
        for f in below:
            if f["ratio"] is None:
                smallest = min((r for r in rows if r["family"] == "amsp"),
                               key=lambda r: r["peak"])
                parts.append(f"{f['cap'] / MB:.1f} MB (no AMSP plan fits; the smallest, "
                             f"{smallest['label']}, peaks at {smallest['peak'] / MB:.1f} MB; "
                             f"{f['baseline']['label']} runs {f['baseline']['tps']:.0f} "
                             "tokens/s)")
            else:
                parts.append(f"{f['cap'] / MB:.1f} MB ({f['ratio']:.3f}x, short by "
                             f"{TARGET_FLOOR - f['ratio']:.2g}x)")
        lines.append(f"AMSP >= {TARGET_FLOOR}x the best baseline at every cap where a "
                     f"baseline fits: MISSED at {len(below)} of {len(with_base)} caps: "
                     + "; ".join(parts) + ".")
    best = max((f for f in finite if not math.isinf(f["ratio"])), key=lambda f: f["ratio"],
               default=None)
    only = [f for f in fr if f["ratio"] is not None and math.isinf(f["ratio"])]
    if best is not None:
        ok = best["ratio"] >= TARGET_WIN
        wins = [f for f in finite if not math.isinf(f["ratio"]) and f["ratio"] >= TARGET_WIN]
        lines.append(
            f"AMSP >= {TARGET_WIN}x the best baseline at one cap or more: "
            + (f"met at {len(wins)} cap(s)" if ok else
               f"MISSED by {TARGET_WIN - best['ratio']:.2f}x")
            + f"; highest {best['ratio']:.2f}x at {best['cap'] / MB:.1f} MB "
              f"({best['amsp']['label']} {best['amsp']['tps']:.0f} vs "
              f"{best['baseline']['label']} {best['baseline']['tps']:.0f} tokens/s; with "
              f"baselines allowed +5% memory: {_ratio_s(best['ratio_slack'])})"
            + (f"; at {len(only)} cap(s) only AMSP fits (not counted)" if only else "")
            + ".")
    good, total = planner_share(prows)
    share = good / total if total else float("nan")
    lines.append(
        f"Planner's pick within {PLANNER_TOL:.0%} of the measured best AMSP plan: {good} of "
        f"{total} caps where an AMSP plan fits ({share:.0%}; target >= "
        f"{PLANNER_SHARE:.0%}: {'met' if total and share >= PLANNER_SHARE else 'MISSED'}).")
    lines.append(
        f"Loss agreement over all {len(rows)} configurations and their common steps: largest "
        f"|loss - {loss['reference']}'s| = {loss['max_diff']:.1e} ({loss['worst']}; "
        f"{'agree' if loss['ok'] else 'DISAGREE'} within {LOSS_TOL:.0e}).")
    return lines


def section(data: dict, command: str, png_name: str) -> str:
    """One scale's markdown between its markers."""
    meta = data["meta"]
    a = meta["args"]
    rows = summarize(data)
    loss = loss_check(rows)
    caps = select_caps(rows, data.get("cap_mode", "peaks"))
    fr = frontier(rows, caps)
    planner = data.get("planner") or {}
    variants = planner.get("variants") or [{"name": "none", "desc": "not run", "picks": {}}]
    vrows = [planner_rows(rows, fr, v["picks"]) if v["picks"] else
             planner_rows(rows, fr, {repr(c): None for c in caps}) for v in variants]
    prows = vrows[0]
    begin, end = markers(meta["nodes"], meta["ranks_per_node"])
    parts = [
        begin, "",
        f"## {meta['nodes']} nodes x {meta['ranks_per_node']} ranks ({meta['world']} ranks), "
        f"{meta.get('bw', '')}", "",
        "```", command, "```", "",
        f"- Machine: {meta['machine']}; {meta['nodes']} emulated nodes x "
        f"{meta['ranks_per_node']} ranks, gloo. Link: {meta['link']}.",
        f"- Workload: llama3 `{a['flavor']}` ({meta['model']['params']:,} params), fp32, seq "
        f"{a['seq']}, {a['micro_batch']} sequence per rank per micro-batch, M = "
        f"{a['micro_batches']}: {meta['tokens_per_step']} tokens per step; AdamW.",
        f"- {len(rows)} configurations, interleaved in each of {a['reps']} repetitions; "
        f"each rebuilt from the same seed, {a['warmup']} warm-up steps, then {a['steps']} "
        f"timed step(s)"
        + (f"; in repetition 0, {a['mem_steps']} more untimed step(s) after the timed "
           "ones, sampled per op for the peak (a step whose backward sees the optimizer's "
           "states)" if a.get("mem_steps") else "")
        + f"; {_cut_text(meta, rows)}. Sweep wall time {meta['wall_s']:.0f} s"
        + (f"; every configuration's process groups were built before the first "
           f"measurement ({meta['setup']['groups_s']:.0f} s; rank 0 then ran "
           f"{meta['setup']['threads_rank0']} threads, most of them gloo's per-group "
           "loops), so all run with the same background" if meta.get("setup") else "")
        + ".",
        f"- Caps: every distinct measured peak ({len(caps)} caps; between two of them the "
        "frontier does not change).",
    ]
    if meta.get("pruned"):
        parts.append(
            f"- Cut: after repetition 0, configurations that another configuration of the "
            f"same system beat by >= {a.get('prune', 0):.0%} in tokens/s at no more peak "
            f"memory (off their system's frontier) ran no further repetitions: "
            + ", ".join(config_label(k, meta["ranks_per_node"]) for k in meta["pruned"])
            + "." + (" Never cut, so that the planner's slowdowns compare full repetitions: "
                     "the plans the planner can pick at some cap ("
                     + ", ".join(config_label(k, meta["ranks_per_node"])
                                 for k in meta["kept"]) + ")." if meta.get("kept") else ""))
    if meta.get("profile_command"):
        parts.append(f"- Bandwidth profile for the planner, on the same emulated cluster "
                     f"before the sweep ({meta.get('profile_s', 0):.0f} s): "
                     f"`{meta['profile_command']}`.")
    parts += [
        "- Planner: `amsp_dtensor.plan.cost.planner.choose_plan` with the cap as its memory "
        "budget, fp32, plans ranked by its predicted step time; time model of the frontier "
        f"table: {variants[0]['desc']}; reserve_bytes = "
        f"{planner.get('reserve_bytes', 0) / MB:.1f} MB ({planner.get('reserve_note', '')}).",
        "",
        "### The frontier", "",
        frontier_table(fr, prows), "",
        f"![frontier {meta['nodes']}x{meta['ranks_per_node']}]({png_name})", "",
        "### Targets (measured)", "",
    ]
    parts += [f"- {line}" for line in targets(rows, fr, prows, loss)]
    for v, vr in list(zip(variants, vrows))[1:]:
        good, total = planner_share(vr)
        parts.append(f"- The planner with {v['name']} ({v['desc']}): {good} of {total} caps "
                     f"within {PLANNER_TOL:.0%} ({good / total if total else 0:.0%}).")
    parts += ["", "### Why, from the recorded bytes and times", ""]
    parts += [f"- {line}" for line in analysis(rows, fr)]
    parts += [f"- Planner ({variants[0]['name']}). {line}" for line in planner_analysis(
        rows, prows, planner.get("estimates", {}), planner.get("reserve_bytes", 0),
        planner.get("predicted_step_s"))]
    parts += ["", "### The planner's pick at each cap, per time model", "",
              planner_table(fr, variants, vrows), ""]
    parts += ["", "### Each system's best tokens/s under each cap", "",
              family_table(fr), "",
              "### Every configuration", "",
              config_table(rows, planner.get("estimates", {})), "",
              f"Loss per step of {loss['reference']} (every configuration's losses differ "
              f"from these by at most {loss['max_diff']:.1e}): "
              + ", ".join(f"{x:.5f}" for x in loss["losses"]) + ".", "", end]
    return "\n".join(parts)


def analysis(rows: list[dict], fr: list[dict]) -> list[str]:
    """Data-derived explanations: the memory floor of each family, and per cap where AMSP
    misses a target, the bytes and times of the two configurations compared."""
    lines = []
    floors = {}
    for fam in FAMILIES:
        mine = [r for r in rows if r["family"] == fam]
        if mine:
            floors[fam] = min(mine, key=lambda r: r["peak"])
    if "amsp" in floors and "zero3" in floors:
        a, z = floors["amsp"], floors["zero3"]
        lines.append(
            f"Memory floor: AMSP's smallest plan {a['label']} peaks at {a['peak'] / MB:.1f} MB "
            f"with {_mb(a['state'])} MB of model states; {z['label']} at {z['peak'] / MB:.1f} MB "
            f"with {_mb(z['state'])} MB. In fp32 both hold 16 B/param/shard of states at "
            "equal factors (the parameter shard is the master: param, grad, two Adam "
            "moments); the rest of the gap is buffers and activations.")
    for f in fr:
        if f["baseline"] is None or (f["ratio"] is not None and f["ratio"] >= TARGET_FLOOR):
            continue
        b, am = f["baseline"], f["amsp"]
        line = (f"{f['cap'] / MB:.1f} MB: {b['label']} {_cfg_facts(b)}; ")
        line += (f"{am['label']} {_cfg_facts(am)}." if am else "no AMSP plan fits.")
        if am:
            line += " " + _why(b, am, rows)
        lines.append(line)
    finite = [f for f in fr if f["ratio"] is not None and not math.isinf(f["ratio"])
              and f["baseline"] is not None]
    if finite:
        best = max(finite, key=lambda f: f["ratio"])
        lines.append(f"Largest gain, {best['cap'] / MB:.1f} MB: {best['amsp']['label']} "
                     f"{_cfg_facts(best['amsp'])}; {best['baseline']['label']} "
                     f"{_cfg_facts(best['baseline'])}.")
    return lines


def planner_analysis(rows: list[dict], prows: list[dict], estimates: dict,
                     reserve: float, predicted: dict | None = None) -> list[str]:
    """Where the planner's pick misses: plans whose measured peak exceeds its estimate (+
    reserve) by more than 2 MB, and each (pick, measured best) pair it got wrong, with the
    bytes that separate them and, given the model's predicted step times (`predicted`,
    plan -> s), how far apart it put them against how far apart they measured."""
    predicted = predicted or {}
    amsp = {r["key"].split(":", 1)[1]: r for r in rows if r["family"] == "amsp"}
    lines = []
    under = [(n, r["peak"], estimates[n] + reserve) for n, r in amsp.items()
             if n in estimates and r["peak"] > estimates[n] + reserve + 2 * MB]
    if under:
        lines.append("Memory model: measured peak above the planner's estimate + reserve by "
                     "more than 2 MB for " + ", ".join(
                         f"{n} ({p / MB:.1f} vs {e / MB:.1f} MB)" for n, p, e in under)
                     + "; at caps between the two the planner picks a plan that does not fit.")
    pairs: dict[tuple, list[float]] = {}
    refused: dict[str, list[float]] = {}
    for p in prows:
        if not p["counted"] or p["within"]:
            continue
        best = max((r for r in amsp.values() if r["peak"] <= p["cap"]), key=lambda r: r["tps"])
        name = best["key"].split(":", 1)[1]
        if name in estimates and estimates[name] + reserve > p["cap"]:
            refused.setdefault(name, []).append(p["cap"])
        elif p["rank"] is not None:
            pairs.setdefault((p["pick"], name), []).append(p["cap"])
    for name, caps in refused.items():
        lines.append(
            f"Memory model: at {', '.join(f'{c / MB:.1f}' for c in caps)} MB the fastest "
            f"fitting plan, {name} (measured {amsp[name]['peak'] / MB:.1f} MB), is estimated at "
            f"{(estimates[name] + reserve) / MB:.1f} MB, over the cap, so the planner does not "
            "consider it.")
    for (pick, best), caps in pairs.items():
        a, b = amsp[pick], amsp[best]
        lines.append(
            f"Time model: at {', '.join(f'{c / MB:.1f}' for c in caps)} MB it ranks {pick} "
            f"({a['tps']:.0f} tokens/s measured; {_mb(a['inter'])} MB inter-node, "
            f"{_mb(a['intra'])} MB intra-node buffers per step) above {best} ({b['tps']:.0f} "
            f"tokens/s; {_mb(b['inter'])} / {_mb(b['intra'])} MB)" + _margins(
                a, b, predicted.get(pick), predicted.get(best)) + ".")
    return lines


def _margins(pick: dict, best: dict, pick_s: float | None, best_s: float | None) -> str:
    """How far apart the model put two plans, and whether the measurement separates them."""
    if pick_s is None or best_s is None:
        return ""
    p_name, b_name = pick["key"].split(":", 1)[1], best["key"].split(":", 1)[1]
    return (f"; the model predicts {pick_s:.3f} s per step for {p_name} and {best_s:.3f} s "
            f"for {b_name} ({abs(best_s / pick_s - 1):.0%} apart); measured, {b_name} is "
            f"{best['tps'] / pick['tps'] - 1:.0%} faster, with min-max ranges that "
            + ("overlap" if _ranges_overlap(pick, best) else "do not overlap")
            + f" ({_ranges(pick, best)})")


def _ranges_overlap(a: dict, b: dict) -> bool:
    """Whether two rows' measured min-max tokens/s ranges overlap (no measured difference)."""
    return a["tps_min"] <= b["tps_max"] and b["tps_min"] <= a["tps_max"]


def _ranges(a: dict, b: dict) -> str:
    """'min-max vs min-max tokens/s' of two rows."""
    return (f"{a['tps_min']:.0f}-{a['tps_max']:.0f} vs "
            f"{b['tps_min']:.0f}-{b['tps_max']:.0f} tokens/s")


def _why(b: dict, am: dict, rows: list[dict]) -> str:
    """One sentence on what separates a baseline from AMSP's best plan under the same cap."""
    notes = []
    if _ranges_overlap(b, am):
        notes.append(f"The min-max ranges overlap ({_ranges(b, am)}): not a measured "
                     "difference")
    if b["wire"] is not None and am["wire"] is not None and b["wire"] < am["wire"] - 1e5:
        what = {"zero3_keep": "it keeps the gathered blocks from forward to backward "
                              "(reshard_after_forward=False: no backward all-gather; the "
                              "sweep varies only the plan for AMSP, whose blocks reshard)",
                "hpz": "its backward all-gathers run inside the node from a secondary "
                       "parameter copy (ZeRO++ hpZ), which AMSP's plans do not have"}.get(
                           b["key"], "")
        notes.append(f"{b['label']} sends {(am['wire'] - b['wire']) / MB:.1f} MB less per "
                     "rank across nodes per step" + (f": {what}" if what else ""))
    elif b["wire"] is not None and am["wire"] is not None:
        same = abs(b["wire"] - am["wire"]) <= 1e5
        notes.append(
            (f"both send {am['wire'] / MB:.1f} MB per rank across nodes per step" if same else
             f"{am['label']} sends {(b['wire'] - am['wire']) / MB:.1f} MB less per rank across "
             "nodes per step")
            + f", so the gap is not in the inter-node bytes; {am['label']} moves "
              f"{_mb(am['intra'])} MB of intra-node buffers per step ({b['label']}: "
              f"{_mb(b['intra'])} MB), over loopback on the same 2 cores that compute")
    text = "; ".join(notes)
    return (text[:1].upper() + text[1:] + ".") if notes else ""


def _cfg_facts(r: dict) -> str:
    waited = f", waited {r['waited']:.2f} s in collectives" if r["waited"] is not None else ""
    return (f"({r['tps']:.0f} tokens/s, step {r['step_s']:.2f} s{waited}; "
            f"{_mb(r['inter'])} MB inter-node and {_mb(r['intra'])} MB intra-node buffers "
            f"per step, {_mb(r['wire'])} MB sent per rank across nodes; peak "
            f"{r['peak'] / MB:.1f} MB, states {_mb(r['state'])} MB)")


def sections_of(text: str) -> dict[tuple[int, int], str]:
    """Every frontier section in a document, keyed by (nodes, ranks per node)."""
    return {(int(m.group(1)), int(m.group(2))): m.group(0) for m in _SECTION.finditer(text)}


def overlap_section(text: str) -> str | None:
    i = text.find(OVERLAP[0])
    j = text.find(OVERLAP[1], i + len(OVERLAP[0])) if i >= 0 else -1
    return text[i:j + len(OVERLAP[1])] if i >= 0 and j >= 0 else None


def assemble(old_text: str, new_section: str, header: str) -> str:
    """The whole document: header, the frontier sections (the new one replacing its scale,
    the others as they were; fewest ranks first), the overlap section verbatim."""
    sections = sections_of(old_text)
    sections.update(sections_of(new_section))
    ordered = [sections[k] for k in sorted(sections, key=lambda k: (k[0] * k[1], k))]
    parts = [header.rstrip("\n"), *ordered]
    kept = overlap_section(old_text)
    if kept is not None:
        parts.append(kept)
    return "\n\n".join(parts) + "\n"
