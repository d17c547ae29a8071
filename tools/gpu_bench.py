"""The compute side of a training step on one GPU: floor, FSDP2, HSDP and AMSP plans.

    python tools/gpu_bench.py                          # one GPU, llama3-8B dims, W=64 (8 per node)
    python tools/gpu_bench.py --preset 0.54b           # dim 2048, 8 layers, seq 2048, 4 sequences, W=16
    python tools/gpu_bench.py --preset tiny --device cpu   # seconds, on CPU (what the test runs)

One process is rank 0 of a W-rank job on torch's fake process group: collectives return at
once and move no data, so a step is the compute side of a real one (kernels, copies,
casts, the optimizer on real shard sizes) without NCCL time, which FSDP2 and AMSP would both
pay. Model: the testing TinyLlama at the preset's sizes, bf16 compute, AdamW (foreach).
``floor``: the bf16 model's forward and backward, no sharding and no optimizer. FSDP2:
``fully_shard`` per embedding / block / [norm, output] / root with
``MixedPrecisionPolicy(bf16, fp32)`` over fp32 params (``hsdp``: shard groups of a node).
AMSP (``amsp:<plan>``): a bf16 model with fp32 masters, the same units; ``+int8``: int8
gradients and bf16 weights across nodes; ``+opu``: ``overlap_param_update=True``.
``compiled``: per-block ``torch.compile`` before sharding.

Per row: the median step time of ``--steps`` after ``--warmup``, the ratio to FSDP2 in the
same mode, MFU (6 x params + attention flops per token, against ``--peak-tflops``; the
default is the H200's dense bf16 peak, and none on CPU) and the peak memory allocated
(CUDA only). Prints a markdown table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

PRESETS = {
    # llama3-8B dims (no grouped-query attention: the testing model has none)
    "8b": dict(dim=4096, blocks=32, heads=32, ffn=14336, vocab=128256, seq=4096, batch=1,
               world=64, per_node=8),
    "0.54b": dict(dim=2048, blocks=8, heads=16, ffn=8192, vocab=128256, seq=2048, batch=4,
                  world=16, per_node=8),
    "tiny": dict(dim=64, blocks=4, heads=4, ffn=128, vocab=100, seq=16, batch=1,
                 world=4, per_node=2),
}
CONFIGS = "floor,fsdp2,hsdp,amsp:pW-gW-osW,amsp:pS-gS-osW,amsp:pS-gS-osW+opu,amsp:pS-gS-osW+int8"
H200_BF16_TFLOPS = 989.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--configs", default=CONFIGS,
                    help="W = world, S = ranks per node (pS-gS-osW = p8-g8-os64 at W=64)")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help=f"for MFU (default {H200_BF16_TFLOPS} on CUDA, none on CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        setattr(args, k, v)
    return args


def flops_per_step(cfg, batch: int) -> float:
    """Training flops of one step: 6 per parameter per token, plus attention's scores and
    weighted sum (12 x layers x dim x seq per token, halved by the causal mask)."""
    params = (2 * cfg.vocab_size * cfg.dim + cfg.n_layers * (4 * cfg.dim * cfg.dim
              + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim) + cfg.dim)
    tokens = batch * cfg.max_seq_len
    return tokens * (6 * params + 6 * cfg.n_layers * cfg.dim * cfg.max_seq_len)


def run(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    from amsp_dtensor import compat
    from tools.host_bench import Bench, resolve

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.precision = "bf16"
    cuda = args.device.startswith("cuda")
    peak = args.peak_tflops or (H200_BF16_TFLOPS if cuda else None)
    compat.init_fake_process_group(0, args.world)
    meshes: dict = {}
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        for key in [resolve(k, args.world, args.per_node) for k in args.configs.split(",") if k]:
            gc.collect()  # the previous system's model and optimizer
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            b = Bench(key, mode, args, meshes)
            times = []
            for i in range(args.warmup + args.steps):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                b.step()
                b.finish()
                if cuda:
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - start)
            step = statistics.median(times)
            flops = flops_per_step(b.cfg, args.batch)
            rows.append({
                "mode": mode, "config": key, "step_s": step,
                "mfu": flops / step / (peak * 1e12) if peak else None,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            })
            print(f"{mode} {key}: {step * 1e3:.1f} ms", file=sys.stderr, flush=True)
            del b
    for row in rows:
        base = next((r for r in rows if r["mode"] == row["mode"] and r["config"] == "fsdp2"), None)
        row["vs_fsdp2"] = row["step_s"] / base["step_s"] if base else None
    dist.destroy_process_group()
    return rows


def markdown(rows: list[dict], args) -> str:
    lines = [f"preset {args.preset} (dim {args.dim}, {args.blocks} layers, seq {args.seq}, "
             f"{args.batch} sequence(s)), W={args.world} ({args.per_node} per node), "
             f"{args.device}, median of {args.steps} steps after {args.warmup}",
             "", "| mode | configuration | step ms | vs FSDP2 | MFU | peak GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        vs = "" if r["vs_fsdp2"] is None else f"{r['vs_fsdp2']:.2f}x"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mem = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        lines.append(f"| {r['mode']} | {r['config']} | {r['step_s'] * 1e3:.1f} | {vs} | {mfu} | {mem} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(markdown(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
