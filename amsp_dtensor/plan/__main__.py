"""`python -m amsp_dtensor.plan`: rank AMSP plans for a model and cluster, print the choice.

Example (the paper's setting):
  python -m amsp_dtensor.plan --model llama_7b --gpus 1024 --gpus-per-node 8 --gpu-mem 80 \
      --seq-len 4096 --micro-batch 1 --global-batch-tokens 4194304 [--bandwidth t.json] [--json]
Errors (unknown model, bad sizes, nothing fits, bad bandwidth table) print one line on stderr
and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from amsp_dtensor.cost.bandwidth import BandwidthTableError
from amsp_dtensor.cost.models import MODELS, ModelShape, get_model
from amsp_dtensor.cost.planner import NoPlanFits, PlanEstimate, PlanReport, choose_plan

PROG = "python -m amsp_dtensor.plan"
GiB = 2**30


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + 2 lines)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Rank AMSP sharding plans by predicted step "
                "communication time among those that fit in memory (PAPER.md, Planner).")
    p.add_argument("--model", help=f"one of: {', '.join(sorted(MODELS))}; or give "
                   "--layers/--dim/--heads/--ffn/--vocab")
    for flag, what in (("--layers", "transformer blocks"), ("--dim", "hidden size"),
                       ("--heads", "attention heads"), ("--kv-heads", "KV heads (GQA)"),
                       ("--ffn", "FFN hidden size"), ("--vocab", "vocabulary size")):
        p.add_argument(flag, type=int, help=f"explicit model: {what}")
    p.add_argument("--gpus", type=int, required=True, help="world size (ranks)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per rank, GiB")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--global-batch-tokens", type=int,
                   help="tokens per optimizer step; micro-batches = this / "
                   "(seq-len * micro-batch * gpus)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per step (default 1)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--activation-checkpointing", choices=("none", "full"), default="none")
    p.add_argument("--attention", choices=("flash", "math"), default="flash")
    p.add_argument("--bandwidth", help="bandwidth table JSON from python -m amsp_dtensor.profile")
    p.add_argument("--top", type=int, default=8, help="plans to list (default 8)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _positive(name, value):
    if value is not None and value <= 0:
        raise UsageError(f"--{name} must be positive, got {value:g}")


def _model(args) -> ModelShape:
    explicit = [args.layers, args.dim, args.heads, args.ffn, args.vocab]
    if args.model and any(v is not None for v in explicit):
        raise UsageError("give --model or the explicit --layers/--dim/--heads/--ffn/--vocab, not both")
    if args.model:
        return get_model(args.model)
    if any(v is None for v in explicit):
        raise UsageError("give --model NAME or all of --layers --dim --heads --ffn --vocab")
    return ModelShape(f"custom_{args.layers}L_{args.dim}d", args.dim, args.layers, args.heads,
                      args.vocab, args.ffn, args.kv_heads)


def _micro_batches(args) -> int:
    if args.global_batch_tokens is None:
        return args.micro_batches or 1
    per_step = args.seq_len * args.micro_batch * args.gpus
    if args.global_batch_tokens % per_step:
        raise UsageError(
            f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of seq-len x "
            f"micro-batch x gpus = {per_step}; change the batch or the micro-batch"
        )
    return args.global_batch_tokens // per_step


def _row(e: PlanEstimate, mark: str = " ", unit: int = GiB) -> str:
    m = e.memory
    return (f"{mark}{e.label[:18]:<18}{m.states.param / unit:7.2f}{m.states.grad / unit:7.2f}"
            f"{m.states.optim / unit:7.2f}{m.total / unit:8.2f}{'' if e.fits else '!':1}"
            f"{e.bytes_intra / 1e9:9.2f}{e.bytes_inter / 1e9:9.2f}{e.comm_seconds * 1e3:10.1f}")


def _header(u: str) -> str:
    return (f" {'plan / system':<18}{'P':>7}{'G':>7}{'OS':>7}{'total':>8} {'intra':>9}"
            f"{'inter':>9}{'comm':>10}\n {'':<18}{u:>7}{u:>7}{u:>7}{u:>8} {'GB':>9}{'GB':>9}"
            f"{'ms':>10}")


def render(report: PlanReport, top: int) -> str:
    s = report.settings
    mdl = report.model
    biggest = max(c.memory.total for c in report.candidates)
    unit, unit_name = (GiB, "GiB") if biggest >= GiB else (2**20, "MiB")
    lines = [
        f"{mdl.name}: {mdl.num_params / 1e6:,.1f}M params, {mdl.n_layers} layers, dim {mdl.dim}",
        f"{s['world_size']} ranks ({s['ranks_per_node']}/node), seq {s['seq_len']} x "
        f"micro-batch {s['micro_batch']} x {s['micro_batches']} per step, {s['mixed_precision']}"
        f", AC {s['activation_checkpointing']}",
        f"budget {s['memory_budget_bytes'] / GiB:.2f} GiB/rank; time model: "
        f"{report.time_model}"[:79],
        "",
        _header(unit_name),
    ]
    fitting = [c for c in report.candidates if c.fits]
    for i, c in enumerate(report.candidates[:top]):
        lines.append(_row(c, "*" if i == 0 and c.fits else " ", unit))
    if len(report.candidates) > top:
        lines.append(f" ... {len(report.candidates) - top} more plans "
                     f"({len(fitting)} of {len(report.candidates)} fit)")
    lines.append(" baselines:")
    for b in report.baselines.values():
        lines.append(_row(b, " ", unit))
    best = report.best
    lines += [
        "",
        "* chosen, ! over the memory budget. intra/inter: collective buffer bytes per",
        "rank per step (AG output, RS input, AR tensor); comm: sum of collective times",
        "(no overlap).",
        f"chosen: {best.plan.name}, {best.memory.total / unit:.2f} {unit_name}/rank, "
        f"{best.comm_seconds * 1e3:.1f} ms comm/step. For the job TOML:",
        "",
        report.to_toml().rstrip(),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        for name in ("gpus", "gpus_per_node", "gpu_mem", "seq_len", "micro_batch",
                     "global_batch_tokens", "micro_batches", "layers", "dim", "heads",
                     "kv_heads", "ffn", "vocab", "top"):
            _positive(name.replace("_", "-"), getattr(args, name))
        if args.gpus % args.gpus_per_node:
            raise UsageError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node "
                             f"{args.gpus_per_node}")
        model = _model(args)
        report = choose_plan(
            model, seq_len=args.seq_len, micro_batch=args.micro_batch,
            micro_batches=_micro_batches(args), world_size=args.gpus,
            ranks_per_node=args.gpus_per_node, memory_budget_bytes=args.gpu_mem * GiB,
            bandwidth=args.bandwidth, mixed_precision=args.precision,
            activation_checkpointing=args.activation_checkpointing, attention=args.attention,
        )
    except NoPlanFits as exc:
        sm = exc.smallest
        print(f"{PROG}: error: {exc}; smallest: param={sm.plan.s_p} grad={sm.plan.s_g} "
              f"optim={sm.plan.s_os}", file=sys.stderr)
        return 2
    except (UsageError, ValueError, TypeError, BandwidthTableError) as exc:
        msg = " ".join(str(exc).split())
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(render(report, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
