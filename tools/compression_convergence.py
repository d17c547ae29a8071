"""The debug recipe (4 CPU ranks, 2 simulated nodes x 2, plan p2-g2-os4) trained N steps
exact and under each compression setting, from identical weights; renders the loss curves
to docs/compression_convergence_<N>.png and the table between the convergence-<N> markers
in docs/compression.md (one set per length: the LR schedule depends on the step count).

    python -m tools.compression_convergence --steps 100          # runs what is missing, renders
    python -m tools.compression_convergence --steps 300 --only exact "grads=int8" \
        "grads=int8, no error feedback"                           # a subset
    python -m tools.compression_convergence --steps 100 --render # renders the saved dumps only

Runs go to runs/compression/<N>steps/<setting>, one at a time under flock /tmp/amsp_cpu.lock."""
import argparse, re, statistics, subprocess
from pathlib import Path

SETTINGS = {  # name: extra CLI arguments of amsp_dtensor.train
    "exact": [],
    "grads=bf16": ["--amsp.compress_grads", "bf16"],
    "grads=int8": ["--amsp.compress_grads", "int8"],
    "grads=int8,weights=bf16": ["--amsp.compress_grads", "int8", "--amsp.compress_weights", "bf16"],
    "grads=int8, no error feedback": ["--amsp.compress_grads", "int8", "--amsp.no-compress-error-feedback"],
}
ROOT, DOC = Path("runs/compression"), Path("docs/compression.md")


def folder(name, steps):
    return ROOT / f"{steps}steps" / re.sub(r"[^a-z0-9]+", "_", name).strip("_")


def scalars(dump):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = {}
    for run in sorted((dump / "tb").glob("*")):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def series(tb, tag):
    return [tb[tag][s] for s in sorted(tb[tag])]


def run(name, steps):
    dump = folder(name, steps)
    if (dump / "tb").exists() and len(scalars(dump).get("loss_metrics/global_avg_loss", {})) >= steps:
        return
    subprocess.run(["rm", "-rf", str(dump)], check=True)
    cmd = ["flock", "/tmp/amsp_cpu.lock", "torchrun", "--nproc_per_node", "4", "-m", "amsp_dtensor.train",
           "--job.config_file", "recipes/debug_cpu.toml", "--training.steps", str(steps),
           "--job.dump_folder", str(dump), *SETTINGS[name]]
    print("+", " ".join(cmd), flush=True)
    dump.mkdir(parents=True)
    with open(dump.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)


def render(steps):
    import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
    tbs = {n: scalars(folder(n, steps)) for n in SETTINGS if (folder(n, steps) / "tb").exists()}
    loss = {n: series(tb, "loss_metrics/global_avg_loss")[:steps] for n, tb in tbs.items()}
    inter = {n: statistics.mean(series(tb, "comm/inter_node_bytes")) for n, tb in tbs.items()}
    ref = loss["exact"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for n, l in loss.items():
        a.plot(range(1, len(l) + 1), l, label=n, lw=1)
        b.plot(range(1, len(l) + 1), [x - r for x, r in zip(l, ref)], label=n, lw=1)
    a.set(xlabel="step", ylabel="loss", yscale="log", title="debug recipe, p2-g2-os4, 2 nodes x 2")
    b.set(xlabel="step", ylabel="loss - exact loss", title="gap to exact")
    a.legend(fontsize=8); fig.tight_layout(); fig.savefig(f"docs/compression_convergence_{steps}.png", dpi=110)
    rows = ["| setting | final loss | final gap vs exact | within 1% | mean \\|loss - exact\\| | max \\|loss - exact\\| "
            "| mean \\|loss - exact\\|, second half | mean loss, last 50 steps | cross-node bytes / step "
            "| vs exact |", "|---" * 10 + "|"]
    for n, l in loss.items():
        d = [abs(x - r) for x, r in zip(l, ref)]
        gap = (l[-1] - ref[-1]) / ref[-1]
        rows.append(f"| {n} | {l[-1]:.4f} | {gap:+.3%} | {'yes' if abs(gap) <= 0.01 else 'no'} | {statistics.mean(d):.1e} "
                    f"| {max(d):.1e} | {statistics.mean(d[len(d) // 2:]):.1e} | {statistics.mean(l[-50:]):.4f} | {inter[n] / 1e6:.2f} MB | {inter[n] / inter['exact']:.3f} |")
    same = len({l[0] for l in loss.values()}) == 1
    text = (f"{len(ref)} steps; step-1 loss {'equal in every run' if same else 'NOT equal across runs'} "
            f"({ref[0]:.5f}). Cross-node bytes: comm/inter_node_bytes per rank per step (mean over the run)."
            + "".join(f" Not run: {n}." for n in SETTINGS if n not in tbs) + "\n\n"
            + "\n".join(rows))
    doc, begin, end = DOC.read_text(), f"<!-- convergence-{steps}:begin -->", f"<!-- convergence-{steps}:end -->"
    DOC.write_text(doc[:doc.index(begin) + len(begin)] + "\n" + text + "\n" + doc[doc.index(end):])
    print(text)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--render", action="store_true", help="only render the saved dumps")
    p.add_argument("--only", nargs="*", default=list(SETTINGS), help="settings to run")
    args = p.parse_args()
    if not args.render:
        for n in args.only:
            run(n, args.steps)
    render(args.steps)
