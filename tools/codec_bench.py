"""Throughput of the gradient and weight codecs (amsp_dtensor/engine/compression.py).

    python tools/codec_bench.py                  # CPU, one thread, 16M fp32 elements
    python tools/codec_bench.py --device cuda    # the same on a GPU

GB/s of input (the fp32 values a stage hands the codec) for each piece of local work a
compressed stage does, min of ``--reps`` runs:

- ``encode``: values -> bytes sent (bf16: a cast; int8: per-256 block scale, quantize);
- ``encode+feedback``: what a gradient stage does before sending: values + residual
  encoded, the residual replaced by what the encoding dropped;
- ``decode+sum``: what a reduce-scatter does after its all-to-all: k chunks received,
  dequantized and summed (input bytes: the k chunks' fp32 values).

Compare with the link the codec is meant for: a 1 Gbit/s link moves 0.125 GB/s, a 100
Gbit/s one 12.5 GB/s; a codec much slower than its link costs more than it saves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def bench(fn, reps: int, sync) -> float:
    best = float("inf")
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--k", type=int, default=2, help="ranks of the stage's group")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    import torch

    from amsp_dtensor.engine import compression as C

    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    k, m = args.k, args.numel // args.k
    rows = torch.randn(k, m, generator=g).to(device)
    gbytes = rows.numel() * 4 / 1e9
    print(f"codec throughput, GB/s of fp32 input ({rows.numel()} elements as {k} x {m}, "
          f"{device}, {torch.get_num_threads()} thread(s), min of {args.reps}; "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())})\n")
    print("| codec | encode | encode+feedback | decode+sum |\n|---|---|---|---|")
    for codec in ("bf16", "int8"):
        residual = torch.zeros_like(rows)
        chunks = C.encode(rows, codec)
        t_enc = bench(lambda: C.encode(rows, codec), args.reps, sync)
        t_fb = bench(lambda: C._with_feedback(rows, residual, codec), args.reps, sync)
        t_dec = bench(lambda: C.decode(chunks, codec, m).sum(0), args.reps, sync)
        print(f"| {codec} | {gbytes / t_enc:.2f} | {gbytes / t_fb:.2f} | {gbytes / t_dec:.2f} |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
