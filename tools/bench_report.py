"""The benchmark's numbers, charts and markdown, from the worker's results (no processes).

Frontier (one section per scale): tokens/s per configuration (median, min-max over the
repetitions), peak memory per rank (max over ranks and repetitions), and for every memory
cap (every distinct peak) each system's fastest configuration under it, AMSP's best against
the best of all others, and the planner's pick. Overlap ablation: exposed = T_real - T_noop,
efficiency = (T_serial - T_real) / (T_serial - T_noop), paired per repetition. Compression:
each setting against its plan's exact run. ``assemble`` rebuilds docs/benchmarks.md.
"""

from __future__ import annotations

import math
import re
import statistics

from tools.bench_systems import FAMILIES, amsp_key, family, fsdp_sizes, label

MB = 1e6
OTHERS = tuple(f for f in FAMILIES if f != "amsp")
PEERS = ("ds_z1", "ds_z2", "ds_z3", "ds_hpz", "ds_mics", "mfsdp")
COLORS = {"ddp": "tab:brown", "fsdp2": "tab:blue", "ds_z1": "tab:olive", "ds_z2": "tab:cyan",
          "ds_z3": "tab:green", "ds_hpz": "tab:purple", "ds_mics": "tab:pink",
          "mfsdp": "tab:orange", "amsp": "tab:red", "amsp_c": "tab:red"}
COMPRESSED_LABEL = "AMSP compressed"  # amsp:<plan>+g-<codec>/+w-<codec> rows
TARGET_FLOOR, TARGET_WIN, PLANNER_TOL, PLANNER_SHARE = 0.95, 1.5, 0.10, 0.8
# the MoE flavour's targets: AMSP >= 1.3x the best baseline at most caps, never behind (a
# tie: within the run-to-run tenth, LOAD_NOTE) where its plan space holds the baseline's
# schedule, and the planner within PLANNER_TOL at 90% of the caps
MOE_WIN, MOE_TIE, MOE_PLANNER_SHARE = 1.3, 0.9, 0.9
LOSS_TOL = 1e-5
OVERLAP = ("<!-- overlap:begin -->", "<!-- overlap:end -->")
COMPRESSION = ("<!-- compression:begin -->", "<!-- compression:end -->")
# a generated section: one per scale and link rate ("frontier-2x2" at 1gbit or unshaped,
# "frontier-2x2-200mbit"), the overlap ablation and the compression runs
_SECTION = re.compile(r"<!-- (frontier-(\d+)x(\d+)((?:-\w+)*)|overlap|compression):begin -->.*?"
                      r"<!-- \1:end -->", re.S)
DEFAULT_HEADER = "# Benchmarks"  # a new document's; an existing one keeps its own

# how far a cap's ratio moves between runs, said beside each sweep's load average
LOAD_NOTE = (" At such loads a cap's ratio (AMSP's best over the best other system) moves "
             "between runs of the same command by about a tenth (dropping one of the 4x2 "
             "sweep's three repetitions moved it by a median 12% per cap; the host-time "
             "ratios of docs/performance.md move by 0.03-0.06x between runs of unchanged "
             "code), so ratios within about 10% of 1.00x are ties.")


def scale_tag(meta: dict) -> str:
    """"2x2" for 2 nodes x 2 ranks at 1gbit (or unshaped), "2x2-200mbit" at another rate;
    "-moe" after either for the MoE flavour."""
    tag, bw = f"{meta['nodes']}x{meta['ranks_per_node']}", meta.get("bw", "")
    rate = bw.split(" ")[0] if bw.endswith(" between nodes") else "1gbit"
    tag = tag if rate == "1gbit" else f"{tag}-{rate}"
    return tag + ("-moe" if is_moe(meta) else "")


def is_moe(meta: dict) -> bool:
    return bool(meta.get("model", {}).get("ep"))


def same_schedule(key: str, meta: dict) -> str | None:
    """The AMSP configuration that runs baseline `key`'s schedule (the MoE flavour): FSDP2
    + EP with dense shard groups of s and expert ones of se is the plan pair ps-gs-oss /
    pse-gse-ose; None where AMSP's plan space lacks it (DDP without EP, FSDP2 keeping the
    parameters after forward)."""
    if key != "zero3" and not key.startswith("hsdp:"):
        return None
    s, se = fsdp_sizes(key, meta["world"], meta["model"]["ep"])
    return f"amsp:p{s}-g{s}-os{s}+e-p{se}-g{se}-os{se}"


def _mb(x) -> str:
    return "n/a" if x is None else f"{x / MB:.1f}"


def _maxed(per_rank, part):
    vals = [w[part] for w in per_rank or [] if w]
    return max(vals) if vals else None


def _exposed(per_rank) -> dict[str, tuple[float, bool]] | None:
    """{mesh dim: (the slowest rank's seconds blocked in that dim's collectives in the
    timed step, whether they cross nodes)} from the worker's ``by_dim``; None before it
    was recorded."""
    dims = [w["by_dim"] for w in per_rank or [] if w and "by_dim" in w]
    if not dims:
        return None
    out: dict[str, tuple[float, bool]] = {}
    for by in dims:
        for dim, (seconds, inter) in by.items():
            was = out.get(dim, (0.0, False))
            out[dim] = (max(was[0], seconds), was[1] or inter)
    return out


def _table(head: str, rows: list[str]) -> str:
    """A markdown table: its header line, the rule under it, then ``rows``."""
    return "\n".join([head, "|" + "---|" * (head.count("|") - 1), *rows])


def summarize(data: dict) -> list[dict]:
    """One row per configuration measured in real mode, in run order."""
    meta = data["meta"]
    rpn, tokens = meta["ranks_per_node"], meta["tokens_per_step"]
    by: dict[str, list[dict]] = {}
    for r in data["results"]:
        if r.get("mode", "real") == "real":
            by.setdefault(r["config"], []).append(r)
    rows = []
    for key, reps in by.items():
        reps = sorted(reps, key=lambda r: r["rep"])
        first = reps[0]
        tps = [tokens / statistics.mean(r["step_times"]) for r in reps if r["step_times"]]
        comm = first.get("comm") or {}
        amsp = key.startswith("amsp")
        measured = (comm.get("recorder") if amsp else None) or comm.get("counted") or {}
        states = [s for s in first.get("state_bytes_per_rank") or [] if s]
        rows.append({
            "key": key, "family": family(key), "label": label(key, rpn),
            "compressed": amsp and bool(amsp_key(key.split(":", 1)[1])[2]),
            "tps": statistics.median(tps), "tps_min": min(tps), "tps_max": max(tps),
            "reps": len(tps), "steps": len(first["step_times"]),
            "step_s": tokens / statistics.median(tps),
            "peak": max(max(r["peak_bytes_per_rank"]) for r in reps),
            "state": max(sum(s.values()) for s in states) if states else None,
            "state_parts": states[0] if states else None,
            "reported": next((x for x in first.get("reported_bytes_per_rank") or [] if x), None),
            "inter": measured.get("inter"), "intra": measured.get("intra"),
            "losses": first["losses"],
            "waited": _maxed(first.get("waited_s_per_rank"), "in_step"),
            "waited_after": _maxed(first.get("waited_s_per_rank"), "after_step"),
            "exposed": _exposed(first.get("waited_s_per_rank")),
        })
    return rows


def loss_check(rows: list[dict]) -> dict:
    """Largest |loss - DDP's loss| over configurations and their common steps."""
    ref = next((r for r in rows if r["key"] == "ddp"), rows[0])
    worst, worst_key = 0.0, ref["key"]
    for r in rows:
        r["loss_diff"] = max((abs(a - b) for a, b in zip(r["losses"], ref["losses"])),
                             default=0.0)
        if r["loss_diff"] > worst:
            worst, worst_key = r["loss_diff"], r["key"]
    peers = [r["loss_diff"] for r in rows if r["family"] in PEERS]
    return {"reference": ref["key"], "losses": ref["losses"], "max_diff": worst,
            "worst": worst_key, "ok": worst <= LOSS_TOL, "peers_max": max(peers, default=None),
            "over": [(r["label"], r["loss_diff"]) for r in rows if r["loss_diff"] > LOSS_TOL]}


def select_caps(rows: list[dict]) -> list[float]:
    """Memory caps, ascending: every distinct measured peak (peaks within 1 kB of the
    previous one are one cap, the largest of them, so that all of them fit it)."""
    caps: list[float] = []
    for p in sorted(r["peak"] for r in rows):
        if caps and p - caps[-1] <= 1e3:
            caps[-1] = p
        else:
            caps.append(p)
    return caps


def best_under(rows: list[dict], cap: float, families=tuple(FAMILIES)) -> dict | None:
    fits = [r for r in rows if r["family"] in families and r["peak"] <= cap]
    return max(fits, key=lambda r: r["tps"]) if fits else None


def _ratio(amsp: dict | None, base: dict | None) -> float | None:
    """AMSP's tokens/s over the base's (None: no AMSP plan fits; inf: nothing else fits)."""
    return None if amsp is None else math.inf if base is None else amsp["tps"] / base["tps"]


def frontier(rows: list[dict], caps: list[float]) -> list[dict]:
    """Per cap: each family's fastest fitting configuration, the best of all others, AMSP's
    best and their ratio."""
    out = []
    for cap in caps:
        per = {f: best_under(rows, cap, (f,)) for f in FAMILIES}
        base = best_under(rows, cap, OTHERS)
        out.append({"cap": cap, "per_family": per, "baseline": base, "amsp": per["amsp"],
                    "ratio": _ratio(per["amsp"], base)})
    return out


def planner_rows(rows: list[dict], fr: list[dict], picks: dict) -> list[dict]:
    """Per cap: the planner's pick (``picks``: cap -> plan name, None = refuses), its
    measured rank among AMSP's plans that fit (1 = fastest), its slowdown vs the fastest
    and whether it is within PLANNER_TOL; ``counted`` is False where no AMSP plan fits."""
    amsp = {r["key"].split(":", 1)[1]: r for r in rows if r["family"] == "amsp"}
    out = []
    for f in fr:
        cap = f["cap"]
        pick = next((v for k, v in picks.items() if abs(float(k) - cap) < 0.5), None)
        fitting = sorted((r for r in amsp.values() if r["peak"] <= cap), key=lambda r: -r["tps"])
        row = {"cap": cap, "pick": pick, "counted": bool(fitting), "rank": None,
               "of": len(fitting), "slowdown": None, "within": False, "note": ""}
        if not fitting:
            row["note"] = "refuses: nothing fits, as measured" if pick is None else \
                f"picks {pick}, but no AMSP plan fits as measured"
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


def planner_share(prows: list[dict]) -> tuple[int, int]:
    counted = [p for p in prows if p["counted"]]
    return sum(p["within"] for p in counted), len(counted)


def chart_series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    """Each family's frontier as a step line (x = every distinct peak from the family's
    smallest on, MB; y = its best tokens/s under x; drawn with where='post')."""
    xs_all = select_caps(rows)
    out = {}
    for fam in (*FAMILIES, "amsp_c"):
        mine = [r for r in rows if (r["family"] == fam and not r["compressed"])
                or (fam == "amsp_c" and r["compressed"])]
        if mine:
            xs = [x for x in xs_all if x >= min(r["peak"] for r in mine)]
            ys = [best_under(mine, x)["tps"] for x in xs]
            out[fam] = ([x / MB for x in xs + [xs_all[-1] * 1.04]], ys + [ys[-1]])
    return out


def chart(rows: list[dict], meta: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 6.5))
    for fam, (xs, ys) in chart_series(rows).items():
        ax.step(xs, ys, where="post", color=COLORS[fam], alpha=0.85,
                lw=2.4 if fam == "amsp" else 1.3, ls="-" if fam in ("amsp", "fsdp2", "ddp")
                else "--", label=f"{FAMILIES.get(fam, COMPRESSED_LABEL)} frontier")
    for r in rows:
        c = COLORS[r["family"]]
        marker = ("^" if r["compressed"] else "o") if r["family"] == "amsp" else "s"
        ax.errorbar([r["peak"] / MB], [r["tps"]], yerr=[[r["tps"] - r["tps_min"]],
                    [r["tps_max"] - r["tps"]]], fmt=marker, color=c, ms=4, capsize=2)
        ax.annotate(r["label"].replace("AMSP ", ""), (r["peak"] / MB, r["tps"]),
                    textcoords="offset points", xytext=(3, 3), fontsize=6, color=c)
    ax.set_xlabel("peak memory per rank, MB (malloc in use, max over ranks and repetitions)")
    ax.set_ylabel("tokens/s (median, min-max over repetitions)")
    ax.set_title(f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, "
                 f"{meta.get('link_short', '')}: the fastest configuration under each cap",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _ratio_s(x) -> str:
    if x is None:
        return "no AMSP plan fits"
    return "only AMSP fits" if math.isinf(x) else f"{x:.2f}x"


def _best(r: dict | None) -> str:
    """Two cells: a configuration's label and tokens/s, or '- | -' where none fits."""
    return f"{r['label']} | {r['tps']:.0f}" if r else "- | -"


def frontier_table(fr: list[dict], prows: list[dict]) -> str:
    lines = []
    for f, p in zip(fr, prows):
        rank, slow = ((f"{p['rank']} of {p['of']}", f"{p['slowdown'] * 100:.0f}%")
                      if p["rank"] is not None else (p["note"], "n/a"))
        lines.append(f"| {f['cap'] / MB:.1f} | {_best(f['baseline'])} | {_best(f['amsp'])} | "
                     f"{_ratio_s(f['ratio'])} | {p['pick'] or 'none fits'} | {rank} | {slow} |")
    return _table("| cap MB/rank | best other system under the cap | tokens/s | AMSP's best | "
                  "tokens/s | AMSP / best of all others | planner's pick | its rank among AMSP "
                  "plans that fit | slowdown vs best AMSP |", lines)


def compressed_table(fr: list[dict], compressed: list[dict], loss: dict) -> str:
    """Per cap: the best other system, AMSP's best exact plan (before) and AMSP's best with
    the compressed configurations too (after), each over the best other."""
    lines = []
    for f in fr:
        a, c = f["amsp"], best_under(compressed, f["cap"])
        after = a if c is None or (a is not None and a["tps"] >= c["tps"]) else c
        lines.append(f"| {f['cap'] / MB:.1f} | {_best(f['baseline'])} | {_best(a)} | "
                     f"{_ratio_s(f['ratio'])} | {_best(after)} | "
                     f"{_ratio_s(_ratio(after, f['baseline']))} |")
    gaps = ", ".join(f"{r['label']} {r['loss_diff']:.1e}" for r in compressed)
    return _table("| cap MB/rank | best other system | tokens/s | AMSP exact: best | tokens/s | "
                  "/ best other (before) | AMSP with compressed: best | tokens/s | / best other "
                  "(after) |", lines) + (
        "\n\nThe caps are the exact configurations' peaks; a compressed configuration counts "
        "at every cap it fits. Compression is lossy, so its rows are kept out of the loss "
        f"agreement above; their largest |loss - {loss['reference']}'s| over the common "
        f"steps: {gaps}.")


def family_table(fr: list[dict], only_ran: bool = False) -> str:
    """Each system's best per cap; with ``only_ran`` the columns of the systems the sweep
    ran, else of every system."""
    lines = []
    ran = [fam for fam in FAMILIES if not only_ran or any(f["per_family"][fam] for f in fr)]
    for f in fr:
        cells = []
        for fam in ran:
            r = f["per_family"][fam]
            cells.append("-" if r is None else f"{r['tps']:.0f} ({r['label']})".replace(
                "AMSP ", "").replace("FSDP2 ", "").replace("MFSDP ", "").replace("DS ", ""))
        lines.append(f"| {f['cap'] / MB:.1f} | " + " | ".join(cells) + " |")
    return _table("| cap MB/rank | " + " | ".join(FAMILIES[f] for f in ran) + " |", lines)


def config_table(rows: list[dict], estimates: dict) -> str:
    lines = []
    for r in sorted(rows, key=lambda r: r["peak"]):
        parts = r["state_parts"] or {}
        est = estimates.get(r["key"].split(":", 1)[1]) if r["family"] == "amsp" else None
        waited = "n/a" if r["waited"] is None else f"{r['waited']:.3f}" + (
            f" (+{r['waited_after']:.3f})" if r["waited_after"] else "")
        lines.append(
            f"| {r['label']} | {r['tps']:.0f} ({r['tps_min']:.0f}-{r['tps_max']:.0f}) | "
            f"{r['reps']} x {r['steps']} | {r['step_s']:.3f} | {r['peak'] / MB:.1f} | "
            f"{_mb(est)} | {_mb(r['state'])} ({_mb(parts.get('param'))}/"
            f"{_mb(parts.get('grad'))}/{_mb(parts.get('optim'))}) | {_mb(r['inter'])} | "
            f"{_mb(r['intra'])} | {waited} | "
            f"{r['losses'][-1]:.5f} | {r.get('loss_diff', 0.0):.1e} |")
    return _table("| configuration | tokens/s median (min-max) | reps x timed steps | step s | "
                  "peak MB/rank | planner estimate MB | states MB/rank (P/G/OS) | inter-node "
                  "MB/step | intra-node MB/step | AMSP waited s/step | loss, last step | max "
                  "abs loss diff |", lines)


def memory_table(rows: list[dict]) -> str:
    """One configuration per peer: its own memory report beside the sampler's peak."""
    lines = []
    for fam in PEERS:
        r = next((r for r in rows if r["family"] == fam), None)
        if r is None:
            continue
        p = r["state_parts"] or {}
        rep = r["reported"]
        said = (f"see_memory_usage MA (process RSS on DS_ACCELERATOR=cpu) {_mb(rep['rss_delta'])}"
                " MB above its value before the build" if rep else "no memory report of its own "
                "(its only one, check_gpu_memory, reads torch.cuda)")
        lines.append(f"| {r['label']} | {r['peak'] / MB:.1f} | {_mb(r['state'])} ("
                     f"{_mb(p.get('param'))}/{_mb(p.get('grad'))}/{_mb(p.get('optim'))}) | "
                     f"{said} |")
    return _table("| configuration | sampler's peak MB/rank | states MB/rank (P/G/OS), from its "
                  "own tensors | what it reports itself |", lines)


def moe_targets(rows: list[dict], fr: list[dict], prows: list[dict], meta: dict) -> list[str]:
    """The MoE flavour's targets (MOE_WIN, MOE_TIE, MOE_PLANNER_SHARE), measured."""
    both = [f for f in fr if f["ratio"] is not None and f["baseline"] is not None]
    wins = [f for f in both if f["ratio"] >= MOE_WIN]
    lines = [f"AMSP >= {MOE_WIN}x the best baseline at most caps where both fit: "
             + ("met" if len(wins) * 2 > len(both) else "MISSED")
             + f" (at {len(wins)} of {len(both)} caps"
             + (f"; ratios {min(f['ratio'] for f in both):.2f}x-"
                f"{max(f['ratio'] for f in both):.2f}x" if both else "") + ")."]
    keys = {r["key"]: r for r in rows}
    held, behind = [], []
    for f in both:
        twin = keys.get(same_schedule(f["baseline"]["key"], meta) or "")
        if twin is not None and twin["peak"] <= f["cap"]:
            held.append(f)
            if f["ratio"] < MOE_TIE:
                behind.append(f)
    lines.append(f"Never behind (below {MOE_TIE}x, the run-to-run tenth) where AMSP's plan space "
                 "holds the best baseline's schedule (FSDP2 + EP with shard groups s / se is "
                 f"the pair ps-gs-oss / pse-gse-ose) and that pair fits the cap: "
                 + ("met" if not behind else "MISSED") + f" ({len(held)} such caps"
                 + ("" if not behind else "; behind at " + "; ".join(
                     f"{f['cap'] / MB:.1f} MB ({f['ratio']:.2f}x against "
                     f"{f['baseline']['label']})" for f in behind)) + ").")
    good, total = planner_share(prows)
    share = good / total if total else float("nan")
    lines.append(f"Planner's pick within {PLANNER_TOL:.0%} of the measured best AMSP pair at "
                 f"{MOE_PLANNER_SHARE:.0%} of the caps: {good} of {total} ({share:.0%}): "
                 + ("met" if total and share >= MOE_PLANNER_SHARE else "MISSED") + ".")
    return lines


def short_table(fr: list[dict]) -> str | None:
    """Where AMSP's best stays under MOE_WIN against the best baseline: per AMSP
    configuration (the caps it is best at), its step and the seconds the slowest rank was
    blocked in each mesh dim's collectives (the recorder's, bench_worker.exposed_by_dim;
    x: across nodes), the rest being compute, EP's all-to-alls and host time. None where
    nothing falls short or no row has the breakdown."""
    short: dict[str, list[dict]] = {}
    for f in fr:
        if f["ratio"] is not None and f["baseline"] is not None and f["ratio"] < MOE_WIN:
            short.setdefault(f["amsp"]["key"], []).append(f)
    lines = []
    for caps in short.values():
        r = caps[0]["amsp"]
        if not r.get("exposed"):
            continue
        dims = sorted(r["exposed"].items(), key=lambda kv: -kv[1][0])
        exposed = sum(sec for sec, _ in r["exposed"].values())
        ratios = [f["ratio"] for f in caps]
        at = ", ".join(f"{f['cap'] / MB:.1f}" for f in caps)
        lines.append(
            f"| {r['label']} | {at} | "
            f"{min(ratios):.2f}-{max(ratios):.2f}x | {r['step_s']:.3f} | "
            + ", ".join(f"{d}{' (x)' if inter else ''} {sec:.3f}" for d, (sec, inter) in dims)
            + f" | {r['step_s'] - exposed:.3f} |")
    if not lines:
        return None
    return _table("| AMSP's best | at caps MB | / best baseline | step s | exposed s by mesh "
                  "dim, (x) across nodes | rest s (compute, EP all-to-alls, host) |", lines)


def targets(rows: list[dict], fr: list[dict], prows: list[dict], loss: dict) -> list[str]:
    lines = []
    with_base = [f for f in fr if f["baseline"] is not None]
    finite = [f for f in with_base if f["ratio"] is not None]
    below = [f for f in with_base if f["ratio"] is None or f["ratio"] < TARGET_FLOOR]
    if not with_base:
        lines.append("AMSP against the others: this run measured no other configuration, "
                     "so neither target can be judged.")
    elif not below:
        worst = min(finite, key=lambda f: f["ratio"])
        lines.append(f"AMSP >= {TARGET_FLOOR}x the best of all others at every cap where one "
                     f"fits ({len(with_base)} caps): met; lowest {worst['ratio']:.2f}x at "
                     f"{worst['cap'] / MB:.1f} MB.")
    else:
        lines.append(f"AMSP >= {TARGET_FLOOR}x the best of all others at every cap where one "
                     f"fits: MISSED at {len(below)} of {len(with_base)} caps: " + "; ".join(
                         f"{f['cap'] / MB:.1f} MB (" + ("no AMSP plan fits" if f["ratio"] is None
                         else f"{f['ratio']:.2f}x against {f['baseline']['label']}") + ")"
                         for f in below) + ".")
    both_fit = [f for f in finite if not math.isinf(f["ratio"])]
    best = max(both_fit, key=lambda f: f["ratio"], default=None)
    if best is not None:
        wins = [f for f in both_fit if f["ratio"] >= TARGET_WIN]
        lines.append(f"AMSP >= {TARGET_WIN}x the best of all others at one cap or more: "
                     + (f"met at {len(wins)} cap(s)" if wins else
                        f"MISSED by {TARGET_WIN - best['ratio']:.2f}x")
                     + f"; highest {best['ratio']:.2f}x at {best['cap'] / MB:.1f} MB "
                     f"({best['amsp']['label']} {best['amsp']['tps']:.0f} vs "
                     f"{best['baseline']['label']} {best['baseline']['tps']:.0f} tokens/s).")
    good, total = planner_share(prows)
    share = good / total if total else float("nan")
    lines.append(f"Planner's pick within {PLANNER_TOL:.0%} of the measured best AMSP plan: "
                 f"{good} of {total} caps where an AMSP plan fits ({share:.0%}; target >= "
                 f"{PLANNER_SHARE:.0%}: {'met' if total and share >= PLANNER_SHARE else 'MISSED'}).")
    lines.append(f"Loss agreement over all {len(rows)} configurations and their common steps: "
                 f"largest |loss - {loss['reference']}'s| = {loss['max_diff']:.1e} "
                 f"({loss['worst']}; {'agree' if loss['ok'] else 'DISAGREE'} within "
                 f"{LOSS_TOL:.0e})" + (f"; the peers' largest: {loss['peers_max']:.1e}"
                                       if loss["peers_max"] is not None else "")
                 + ("; over the tolerance, so not the same training: " + ", ".join(
                     f"{k} ({d:.1e})" for k, d in loss["over"]) if loss["over"] else "") + ".")
    return lines


def workload(meta: dict) -> str:
    m, a = meta["model"], meta["args"]
    if not m.get("ep"):
        return f"llama3 `{a['flavor']}` ({m['params']:,} params)"
    return (f"torchtitan deepseek_v3 at the MoE flavour's size (`--flavor {a['flavor']}`, "
            f"tools/bench_systems.moe_args: {m['params']:,} params, {m['expert_params']:,} of "
            f"them routed experts ({m['expert_params'] / m['params']:.0%}); 3 MoE blocks of 16 "
            f"experts, top 2, and 1 shared expert, after 1 dense block), expert parallel "
            f"{m['ep']} (torchtitan's ExpertParallel over consecutive ranks; DDP runs without "
            "it, every expert on every rank)")


def section(data: dict, command: str, png_name: str) -> str:
    """One scale's markdown between its markers."""
    meta, a = data["meta"], data["meta"]["args"]
    every = summarize(data)
    rows = [r for r in every if not r["compressed"]]
    compressed = [r for r in every if r["compressed"]]
    loss = loss_check(rows)
    for r in compressed:  # lossy: measured against the same reference, not in the check
        r["loss_diff"] = max(abs(x - y) for x, y in zip(r["losses"], loss["losses"]))
    caps = select_caps(rows)
    fr = frontier(rows, caps)
    planner = data.get("planner") or {}
    variants = planner.get("variants") or [{"name": "none", "desc": "not run", "picks": {}}]
    vrows = [planner_rows(rows, fr, v["picks"]) for v in variants]
    n, rpn = meta["nodes"], meta["ranks_per_node"]
    later = a.get("warmup_later")
    tag, moe = scale_tag(meta), is_moe(meta)
    parts = [f"<!-- frontier-{tag}:begin -->", "",
             f"## {'MoE: ' if moe else ''}{n} nodes x {rpn} ranks ({meta['world']} ranks), "
             f"{meta.get('bw', '')}", "",
             "```", command, "```", "",
             f"- Machine: {meta['machine']}; {n} emulated nodes x {rpn} ranks, gloo. Link: "
             f"{meta['link']}.",
             f"- Workload: {workload(meta)}, fp32, "
             f"seq {a['seq']}, {a['micro_batch']} sequence per rank per micro-batch, M = "
             f"{a['micro_batches']}: {meta['tokens_per_step']} tokens per step; AdamW.",
             f"- {len(rows) + len(compressed)} configurations, interleaved in each of "
             f"{a['reps']} repetitions"
             + (" (DeepSpeed MiCS in a process set of its own after the others: it needs "
                "DeepSpeed 0.19.6)" if any(r["family"] == "ds_mics" for r in rows) else "")
             + f"; each rebuilt from the same seed, {a['warmup']} warm-up steps"
             + (f" ({later} in repetitions after the first)" if later not in (None, a["warmup"])
                else "")
             + (f", the first of them of {a['warmup_micro_batches']} micro-batches"
                if a.get("warmup_micro_batches") else "") + f", then {a['steps']} timed step(s)"
             + (f"; cut after repetition 0 (off their system's frontier by >= "
                f"{a['prune']:.0%} in tokens/s at no less memory"
                + (f", or off every system's by >= {a['prune_all']:.0%}"
                   if a.get("prune_all") else "")
                + f"; never a plan the planner can pick): "
                f"{', '.join(label(k, rpn) for k in meta['pruned'])}"
                if meta.get("pruned") else "")
             + f". Sweep wall time {meta['wall_s']:.0f} s.",
             ]
    if meta.get("loadavg"):
        parts.append(f"- 1-minute load average at the start and end of each process set: "
                     f"{', '.join(f'{x:.1f}' for x in meta['loadavg'])} (the sweep's own ranks "
                     "and gloo's per-group polling threads count in it, so compare it with an "
                     "idle run of the same command rather than with the 2 cores)." + LOAD_NOTE)
    if meta.get("incomplete"):
        parts.append("- Stopped by the timeout, results so far: " + "; ".join(meta["incomplete"])
                     + ".")
    if meta.get("skipped"):
        parts.append(("- Not run on this model: " if moe else "- Not installed here, skipped: ")
                     + "; ".join(meta["skipped"]) + ".")
    if meta.get("profile_command"):
        parts.append(f"- Bandwidth profile for the planner, on the same emulated cluster "
                     f"before the sweep ({meta.get('profile_s', 0):.0f} s): "
                     f"`{meta['profile_command']}`.")
    parts += [f"- Planner: `choose_plan` with the cap as its memory budget, fp32; time model "
              f"of the frontier table: {variants[0]['desc']}; reserve "
              f"{planner.get('reserve_bytes', 0) / MB:.1f} MB ({planner.get('reserve_note', '')}).",
              "", "### The frontier", "", frontier_table(fr, vrows[0]), "",
              f"![frontier {n}x{rpn}]({png_name})", "", "### Targets (measured)", ""]
    parts += [f"- {line}" for line in targets(rows, fr, vrows[0], loss)]
    if moe:
        parts += [f"- {line}" for line in moe_targets(rows, fr, vrows[0], meta)]
        short = short_table(fr)
        if short:
            parts += ["", f"Where AMSP's best stays under {MOE_WIN}x, which part of its "
                      "step takes the time (the recorded step of repetition 0):", "", short]
    for v, vr in list(zip(variants, vrows))[1:]:
        good, total = planner_share(vr)
        parts.append(f"- The planner with {v['name']} ({v['desc']}): {good} of {total} caps "
                     f"within {PLANNER_TOL:.0%} ({good / total if total else 0:.0%}).")
    check = planner.get("measured_memory")
    if check:  # tools/bench.py's [Note: the planner with measured memory]
        good, total = planner_share(planner_rows(rows, fr, check["exact"]))
        noisy = sorted(planner_share(planner_rows(rows, fr, p))[0] for p in check["noisy"])
        lo, hi = check["gap_mb"]
        parts.append(
            f"- The planner with {check['time_model']} and the measured peaks in place of its "
            f"memory estimates: {good} of {total} caps within {PLANNER_TOL:.0%}; with those "
            f"peaks off by a normal error of {check['sd_mb']} MB (sd, {len(noisy)} draws): "
            f"{noisy[0]}-{noisy[-1]} of {total}. The caps are the measured peaks, so the pick "
            f"needs each estimate on the right side of its own plan's peak; measured peak - "
            f"the planner's estimate runs from {lo:+.1f} to {hi:+.1f} MB here.")
    if compressed:
        parts += ["", "### AMSP with compressed cross-node stages: before and after", "",
                  f"{len(compressed)} compressed AMSP configurations (`amsp.set_compression`, "
                  "error feedback on) ran interleaved with the others: "
                  + ", ".join(r["label"] for r in compressed) + ".", "",
                  compressed_table(fr, compressed, loss)]
    parts += ["", "### Each system's best tokens/s under each cap", "", family_table(fr, only_ran=moe), "",
              "### Memory as each peer reports it, beside the sampler", "", memory_table(rows),
              "", "### Every configuration", "",
              config_table(rows + compressed, planner.get("estimates", {})), "",
              f"Loss per step of {loss['reference']} (every configuration's losses differ from "
              f"these by at most {loss['max_diff']:.1e}): "
              + ", ".join(f"{x:.5f}" for x in loss["losses"]) + ".", "",
              f"<!-- frontier-{tag}:end -->"]
    return "\n".join(parts)


def _stats(values) -> dict:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"med": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"med": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _fmt(s, digits: int = 3) -> str:
    if not s or s["n"] == 0:
        return "n/a"
    if s["n"] == 1:
        return f"{s['med']:.{digits}f}"
    sep = " to " if s["min"] < 0 else "-"  # "-0.50-0.61" would read as a minus
    return f"{s['med']:.{digits}f} ({s['min']:.{digits}f}{sep}{s['max']:.{digits}f})"


def overlap_rows(data: dict) -> list[dict]:
    """One row per configuration run in real mode. noop / serial come from the row's own
    runs when measured, else from its plan's all-on configuration (shared, flagged)."""
    res = data["results"]

    def per_rep(key, mode):
        return {r["rep"]: statistics.mean(r["step_times"]) for r in res
                if r["config"] == key and r["mode"] == mode and r["step_times"]}

    rows = []
    for key in dict.fromkeys(r["config"] for r in res if r["mode"] == "real"):
        base = key.split("/")[0]
        real, noop, serial = per_rep(key, "real"), per_rep(key, "noop"), per_rep(key, "serial")
        shared = not noop or not serial
        if shared:
            noop, serial = per_rep(base, "noop"), per_rep(base, "serial")
        none = per_rep(base + "/none", "real") if base.startswith("amsp") else {}
        k = sorted(real)
        blocked = [_maxed(r["waited_s_per_rank"], "in_step") for r in res
                   if r["config"] == key and r["mode"] == "real"]
        rows.append({
            "key": key, "label": label(key, data["meta"]["ranks_per_node"]),
            "real": _stats(real.values()), "noop": _stats(noop.values()),
            "serial": _stats(serial.values()), "shared": shared and key != base,
            "exposed": _stats(real[i] - noop[i] for i in k if i in noop),
            "efficiency": _stats((serial[i] - real[i]) / (serial[i] - noop[i]) for i in k
                                 if i in noop and i in serial and serial[i] > noop[i]),
            "speedup": _stats(none[i] / real[i] for i in k if i in none) if none else None,
            "recorded": _stats(blocked) if any(b is not None for b in blocked) else None})
    return rows


def overlap_table(data: dict) -> str:
    lines = []
    for r in overlap_rows(data):
        mark = " *" if r["shared"] else ""
        lines.append(f"| {r['label']} | {_fmt(r['real'])} | {_fmt(r['noop'])}{mark} | "
                     f"{_fmt(r['serial'])}{mark} | {_fmt(r['exposed'])} | "
                     f"{_fmt(r['efficiency'], 2)} | {_fmt(r['speedup'], 2)} | "
                     f"{_fmt(r['recorded'])} |")
    return _table("| plan / system: configuration | T_real s | T_noop s | T_serial s | exposed "
                  "s (T_real - T_noop) | overlap efficiency | speed-up vs none | recorded "
                  "exposed s |", lines)


def overlap_section(runs: list[dict], command: str) -> str:
    first = runs[0]["meta"]
    a = first["args"]
    parts = [OVERLAP[0], "", "## Overlap ablation: how much communication is hidden", "",
             "```", command, "```", "",
             f"- Machine: {first['machine']}; {first['nodes']} emulated nodes x "
             f"{first['ranks_per_node']} ranks (gloo, CPU). Workload as above "
             f"({first['tokens_per_step']} tokens per step).",
             f"- Each measurement rebuilds the system and runs {a['warmup']} warm-up + "
             f"{a['steps']} timed step(s) in one comm mode (tools/bench_comm.py); "
             f"{a['reps']} repetitions, interleaved; median (min-max). T_real: real "
             "collectives; T_noop: local copies only (compute); T_serial: each collective "
             "waited when issued. Rows marked * share their plan's all-on T_noop / T_serial.",
             ""]
    for data in runs:
        meta = data["meta"]
        parts += [f"### {meta.get('bw', '')}: {meta.get('link_short', '')}", "",
                  f"Run wall time {meta['wall_s']:.0f} s.", "", overlap_table(data), ""]
    parts.append(OVERLAP[1])
    return "\n".join(parts)


def compression_rows(data: dict) -> list[dict]:
    """Per AMSP configuration, paired per repetition with its plan's exact run (the key
    before '+'): step-time ratio, cross-node wire bytes of one recorded step (rep 0, rank
    0) and the relative gap of the last loss (rep 0), each against exact. A (config, rep)
    measured twice keeps the later one (the launcher runs the first one twice, to warm)."""
    res = [r for r in data["results"] if r["mode"] == "real" and r["step_times"]]
    by = {}
    for r in res:
        by.setdefault(r["config"], {})[r["rep"]] = r
    t = lambda r: statistics.mean(r["step_times"])  # noqa: E731
    inter = lambda r: ((r.get("comm") or {}).get("recorder_wire") or {}).get("inter")  # noqa: E731
    rows = []
    for key, mine in by.items():
        exact = by.get(key.split("+")[0], {})
        k = sorted(set(mine) & set(exact))
        m0, e0 = mine[min(mine)], exact.get(min(exact)) if exact else None
        rows.append({"key": key, "setting": "+".join(key.split("+")[1:]) or "exact",
                     "step": _stats(t(r) for r in mine.values()),
                     "ratio": _stats(t(mine[i]) / t(exact[i]) for i in k),
                     "inter": inter(m0), "bytes_ratio": inter(m0) / inter(e0)
                     if e0 and inter(m0) is not None and inter(e0) else None,
                     "loss_gap": (m0["losses"][-1] - e0["losses"][-1]) / e0["losses"][-1]
                     if e0 else None})
    return rows


def compression_section(runs: dict, commands: list[str]) -> str:
    """``runs``: {"<nodes>x<rpn> <bw>": worker result with meta["planned"]}."""
    any_meta = next(iter(runs.values()))["meta"]
    parts = [COMPRESSION[0], "", "## Compressed cross-node stages", "",
             "```", *commands, "```", "",
             f"- Machine: {any_meta['machine']}; emulated nodes (tools/cluster, inter-node link "
             "shaped with tbf, intra-node loopback), gloo, CPU. Workload as above "
             f"({any_meta['tokens_per_step']} tokens per step), AMSP with torchtitan's units.",
             "- Per plan: exact, then `amsp.set_compression` settings (`+g-CODEC`: grads=, "
             "`+w-CODEC`: weights=; error feedback on), all configurations interleaved in each "
             "repetition; each rebuilt from the same seed, then warm-up and timed steps (below); "
             "the first configuration runs twice in each repetition and the first result is "
             "dropped (it warms the process). Step-time ratio = setting / exact of the same "
             "repetition, median (min-max) over repetitions. Cross-node MB: wire bytes rank 0 "
             "sends across nodes in one step (the recorder's events, ring factor x buffer, as "
             "the cost model counts). Loss gap: (loss - exact loss) / exact loss after the last "
             "timed step (repetition 0).",
             "- The planned plan is the planner's pick at the memory it estimates for HSDP "
             "(shard = a node), told the shaped link rate, as in the overlap ablation.", ""]
    for name, data in sorted(runs.items(), key=lambda kv: (kv[1]["meta"]["world"], kv[0])):
        meta, a = data["meta"], data["meta"]["args"]
        parts += [f"### {meta['nodes']} nodes x {meta['ranks_per_node']}, {meta['bw']} between "
                  "nodes", "",
                  f"Planned plan {meta['planned']}. {a['reps']} repetitions of "
                  f"{a['warmup']} warm-up + {a['steps']} timed step(s) (M = {a['micro_batches']} "
                  f"micro-batches of seq {a['seq']}). Run wall time {meta['wall_s']:.0f} s; "
                  f"1-minute load average {meta['loadavg'][0]:.1f} at its start, "
                  f"{meta['loadavg'][1]:.1f} at its end.", ""]
        lines = []
        for r in compression_rows(data):
            plan = r["key"].split("+")[0][5:]
            br = "n/a" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}"
            gap = "n/a" if r["loss_gap"] is None else f"{r['loss_gap']:+.1e}"
            lines.append(f"| {plan}{' (planned)' if plan == meta['planned'] else ''} | "
                         f"{r['setting']} | {_fmt(r['step'])} | {_fmt(r['ratio'], 2)} | "
                         f"{_mb(r['inter'])} | {br} | {gap} |")
        parts += [_table("| plan | setting | step s | step time / exact | cross-node wire MB / "
                         "step | wire bytes / exact | loss gap vs exact |", lines), ""]
    parts.append(COMPRESSION[1])
    return "\n".join(parts)


def sections_of(text: str) -> dict[str, re.Match]:
    return {m.group(1): m for m in _SECTION.finditer(text or "")}


def _place(m: re.Match) -> tuple:
    """Frontier sections first (dense, then MoE), fewest ranks first, 1gbit before other
    rates; then the overlap, then compression."""
    if m.group(2) is None:
        return (2 if m.group(1) == "overlap" else 3,)
    nodes, rpn = int(m.group(2)), int(m.group(3))
    rate, moe = m.group(4).removesuffix("-moe"), m.group(4).endswith("-moe")
    return (int(moe), nodes * rpn, nodes, rpn, rate)


def header_of(text: str) -> str:
    """The document's text before its first generated section (DEFAULT_HEADER if none)."""
    m = _SECTION.search(text)
    return (text[:m.start()] if m else text).rstrip("\n") or DEFAULT_HEADER


def assemble(old_text: str, header: str | None = None, frontier_section: str | None = None,
             overlap: str | None = None, compression: str | None = None) -> str:
    """The whole document: the header (by default the old document's own), then every
    generated section of the old document, each replaced by the new one of its name."""
    sections = sections_of(old_text)
    for new in (frontier_section, overlap, compression):
        sections.update(sections_of(new))
    ordered = [m.group(0) for m in sorted(sections.values(), key=_place)]
    return "\n\n".join([(header or header_of(old_text)).rstrip("\n"), *ordered]) + "\n"
