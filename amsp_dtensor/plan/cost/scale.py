"""`python -m amsp_dtensor.plan.cost.scale`: the planner's choice for llama3 8B/70B/405B at 64,
1024 and 8192 GPUs (80 GB, 8 per node, seq 8192), beside FSDP2 (ZeRO-3), HSDP and ZeRO-1
in the same model (the table in docs/planner.md).

Data parallelism only: every GPU needs at least one whole sequence per micro-batch, so the
global batch is at least GPUs x 8192 tokens; it is 4M tokens at 64 GPUs, 16M at 1024 and
64M (the smallest possible) at 8192. Each row takes the first setting under which some
plan fits: no activation checkpointing, then full checkpointing, then full checkpointing
with fused RMSNorm (what torch.compile makes of torchtitan's norm).
"""

from __future__ import annotations

import sys

from .planner import choose_plan

GiB = 2**30
CASES = ((64, 4 * 2**20), (1024, 16 * 2**20), (8192, 64 * 2**20))
MODELS = ("llama3_8b", "llama3_70b", "llama3_405b")
SEQ = 8192


def rows(models=MODELS, cases=CASES, reserve_gib: float = 5.0):
    for name in models:
        for gpus, tokens in cases:
            M = tokens // (SEQ * gpus)
            for ac, norm in (("none", "composite"), ("full", "composite"), ("full", "fused")):
                r = choose_plan(name, seq_len=SEQ, micro_batch=1, micro_batches=M,
                                world_size=gpus, ranks_per_node=8,
                                memory_budget_bytes=80 * GiB,
                                reserve_bytes=int(reserve_gib * GiB),
                                activation_checkpointing=ac, norm=norm, require_fit=False)
                if r.best.fits:
                    break
            yield name, gpus, tokens, M, f"{ac}, {norm}", r


def _cell(e) -> str:
    mark = "" if e.fits else " (does not fit)"
    return (f"{e.step_seconds:.2f} s, {e.step.mfu * 100:.1f}%, "
            f"{e.memory.total / GiB:.1f} GiB{mark}")


def table() -> str:
    out = ["| model | GPUs | batch (M) | AC, norm | chosen plan: step, MFU, memory | FSDP2 (ZeRO-3) "
           "| HSDP | ZeRO-1 |", "|---|---|---|---|---|---|---|---|"]
    for name, gpus, tokens, M, ac, r in rows():
        b = r.best
        chosen = f"{b.plan.name}: {_cell(b)}" if b.fits else "no plan fits"
        out.append(f"| {name} | {gpus} | {tokens // 2**20}M ({M}) | {ac} | {chosen} | "
                   f"{_cell(r.baselines['zero3'])} | {_cell(r.baselines['hsdp'])} | "
                   f"{_cell(r.baselines['zero1'])} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table())
    sys.exit(0)
