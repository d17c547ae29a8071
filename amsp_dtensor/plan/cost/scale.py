"""`python -m amsp_dtensor.plan.cost.scale`: the planner's choice for llama3 8B/70B/405B at 64,
1024 and 8192 GPUs (80 GB, 8 per node, seq 8192), beside FSDP2 (ZeRO-3), HSDP and ZeRO-1
in the same model (the table in docs/planner.md).

Data parallelism only: every GPU needs at least one whole sequence per micro-batch, so the
global batch is at least GPUs x 8192 tokens; it is 4M tokens at 64 GPUs, 16M at 1024 and
64M (the smallest possible) at 8192. Each row takes the first setting under which some
plan fits: no activation checkpointing, then full checkpointing, then full checkpointing
with fused RMSNorm (what torch.compile makes of torchtitan's norm).

`python -m amsp_dtensor.plan.cost.scale --tp`: llama3 70B and 405B at 1024 and 8192 GPUs
with tensor parallelism (torchtitan's 2-D layout: TP degree 1, 2, 4, 8 inside the node,
the AMSP factors over the W / tp data-parallel ranks), at the same global batches as
above (so the data-parallel ranks run tp times as many micro-batches), the best AMSP plan
beside FSDP2 + TP (ZeRO-3 over the data-parallel world) and HSDP + TP (sharded over the
node's R / tp data-parallel ranks, replicated across nodes); each row again takes the
first checkpointing setting under which some AMSP plan fits.
"""

from __future__ import annotations

import sys

import argparse

from .planner import STEP_TIME_TIE, choose_plan

GiB = 2**30
CASES = ((64, 4 * 2**20), (1024, 16 * 2**20), (8192, 64 * 2**20))
MODELS = ("llama3_8b", "llama3_70b", "llama3_405b")
SEQ = 8192
SETTINGS = (("none", "composite"), ("full", "composite"), ("full", "fused"))
TP_MODELS = ("llama3_70b", "llama3_405b")
TP_CASES = ((1024, 16 * 2**20), (8192, 64 * 2**20))
TP_DEGREES = (1, 2, 4, 8)


def rows(models=MODELS, cases=CASES, reserve_gib: float = 5.0):
    for name in models:
        for gpus, tokens in cases:
            M = tokens // (SEQ * gpus)
            for ac, norm in SETTINGS:
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


def tp_rows(models=TP_MODELS, cases=TP_CASES, degrees=TP_DEGREES, reserve_gib: float = 5.0):
    """(model, GPUs, tokens, tp, "ac, norm", PlanReport) per TP degree."""
    for name in models:
        for gpus, tokens in cases:
            for tp in degrees:
                for ac, norm in SETTINGS:
                    r = choose_plan(name, seq_len=SEQ, micro_batch=1, global_batch_tokens=tokens,
                                    world_size=gpus, ranks_per_node=8, tp=tp,
                                    memory_budget_bytes=80 * GiB,
                                    reserve_bytes=int(reserve_gib * GiB),
                                    activation_checkpointing=ac, norm=norm, require_fit=False)
                    if r.best.fits:
                        break
                yield name, gpus, tokens, tp, f"{ac}, {norm}", r


def tp_table() -> str:
    out = ["| model | GPUs | tp | DP ranks (M) | AC, norm | AMSP plan: step, MFU, memory "
           "| TP comm | FSDP2 + TP | HSDP + TP |", "|---|---|---|---|---|---|---|---|---|"]
    done = list(tp_rows())
    for name, gpus, tokens, tp, ac, r in done:
        b = r.best
        group = [x[5].best for x in done if x[:2] == (name, gpus) and x[5].best.fits]
        fastest = min((e.step_seconds for e in group), default=None)
        # the row --tp auto would take (fastest that fits; within 1% the smaller degree)
        mark = ""
        if b.fits and fastest is not None and b.step_seconds <= fastest * (1 + STEP_TIME_TIE):
            smaller = [e for e in group if e.tp < tp
                       and e.step_seconds <= fastest * (1 + STEP_TIME_TIE)]
            mark = "" if smaller else " **fastest**"
        chosen = f"{b.plan.name}: {_cell(b)}{mark}" if b.fits else "no plan fits"
        tp_comm = f"{b.tp_comm_seconds:.2f} s" if b.fits and tp > 1 else "-"
        out.append(f"| {name} | {gpus} | {tp} | {r.settings['data_parallel_world_size']} "
                   f"({r.settings['micro_batches']}) | {ac} | {chosen} | {tp_comm} | "
                   f"{_cell(r.baselines['zero3'])} | {_cell(r.baselines['hsdp'])} |")
    return "\n".join(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m amsp_dtensor.plan.cost.scale")
    parser.add_argument("--tp", action="store_true",
                        help="the tensor-parallel table (70B, 405B; tp 1, 2, 4, 8)")
    print(tp_table() if parser.parse_args().tp else table())
    sys.exit(0)
