"""`python -m amsp_dtensor.plan`: rank AMSP plans for a model and cluster, print the choice.

Example (the paper's setting):
  python -m amsp_dtensor.plan --model llama_7b --gpus 1024 --gpus-per-node 8 --gpu-mem 80 \
      --seq-len 4096 --micro-batch 1 --global-batch-tokens 4194304 [--bandwidth t.json] [--json]
With tensor parallelism, torchtitan's 2-D layout (TP inside a node, AMSP over the rest):
  ... --tp 8        plans of the data-parallel world (gpus / 8 ranks) beside TP degree 8
  ... --tp auto     every TP degree dividing the node (up to 8) at one global batch: a
                    (tp, plan) table, then the fastest pair that fits
With experts (a mixture-of-experts model), the dense and the expert plan together:
  ... --model deepseek_v3_16b --ep 8   a dense plan over the gpus and an expert plan over
                    the gpus / 8 ranks that hold the same experts, with EP's all-to-alls
With compression of the cross-node stages (the engine's amsp.set_compression):
  ... --compress grads=int8,weights=bf16   plans ranked with the compressed stages, then
                    the chosen plan(s)' cross-node bytes and step time, exact vs compressed
Errors (unknown model, conflicting model flags, non-finite or non-positive numbers, impossible
topologies, nothing fits, bad bandwidth table) print one line naming the flag on stderr and
exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from amsp_dtensor.plan import expert_parallel_world, tp_outside_node
from amsp_dtensor.plan.cost.bandwidth import BandwidthTableError
from amsp_dtensor.plan.compression import CODECS, Compression
from amsp_dtensor.plan.cost.models import MODELS, ModelShape, get_model
from amsp_dtensor.plan.cost.nccl import NcclModel
from amsp_dtensor.plan.cost.planner import (
    PAIR_GRID_LIMIT,
    MAX_AUTO_TP,
    NoPlanFits,
    OPTIMIZERS,
    PlanEstimate,
    PlanReport,
    choose_plan,
)
from amsp_dtensor.plan.cost.step import ComputeModel
from amsp_dtensor.plan.cost.tensor_parallel import check_sequence_parallel

PROG = "python -m amsp_dtensor.plan"
GiB = 2**30


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + 2 lines)
        raise UsageError(message)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None


def _tp(text: str):
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r} (a TP degree or 'auto')") from None


def _compress(text: str) -> Compression:
    try:
        return Compression.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Rank AMSP sharding plans by predicted step time "
                "among those that fit in memory (the AMSP paper's planner, with NCCL's "
                "tuning model per collective and the engine's overlap).")
    p.add_argument("--model", help=f"one of: {', '.join(sorted(MODELS))}; or give "
                   "--layers/--dim/--heads/--ffn/--vocab [--kv-heads]")
    for flag, what in (("--layers", "transformer blocks"), ("--dim", "hidden size"),
                       ("--heads", "attention heads"), ("--kv-heads", "KV heads (GQA)"),
                       ("--ffn", "FFN hidden size"), ("--vocab", "vocabulary size")):
        p.add_argument(flag, type=int, help=f"explicit model: {what}")
    p.add_argument("--gpus", type=int, required=True, help="world size (ranks)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node")
    p.add_argument("--gpu-mem", type=_number, required=True, help="memory per GPU, GiB")
    p.add_argument("--reserve-gib", type=_number, default=DEFAULT_RESERVE_GIB,
                   help="memory per GPU outside tensors: CUDA context, NCCL buffers, "
                   f"allocator slack (GiB, default {DEFAULT_RESERVE_GIB:g}; 0 on CPU)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--global-batch-tokens", type=int,
                   help="tokens per optimizer step; micro-batches = this / "
                   "(seq-len * micro-batch * gpus)")
    g.add_argument("--micro-batches", type=int, help="micro-batches per step (default 1)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--reduce-dtype", choices=("bf16", "fp32"),
                   help="dtype of gradients and their collectives (default: --precision)")
    p.add_argument("--norm", choices=("composite", "fused"), default="composite",
                   help="RMSNorm activations: eager composite (fp32 copies) or fused kernel")
    p.add_argument("--activation-checkpointing", choices=("none", "full"), default="none")
    p.add_argument("--attention", choices=("flash", "math"), default="flash")
    p.add_argument("--tflops", type=_number, default=200.0,
                   help="sustained bf16 TFLOP/s of one GPU on the model (default 200)")
    p.add_argument("--peak-tflops", type=_number, default=312.0,
                   help="peak TFLOP/s of one GPU, for MFU (default 312, A100/A800 bf16)")
    p.add_argument("--nvlink-gbps", type=_number, default=150.0,
                   help="NVLink bus bandwidth per GPU inside a node, GB/s (default 150)")
    p.add_argument("--nics-per-node", type=int,
                   help="NICs per node (default: one per two GPUs, 4 for 8 GPUs)")
    p.add_argument("--nic-gbps", type=_number, default=25.0,
                   help="bandwidth of one NIC, GB/s (default 25: 200 Gb/s HDR)")
    p.add_argument("--tp", type=_tp, default=1, metavar="N|auto",
                   help="tensor-parallel degree (torchtitan's tensor_parallel_degree): a "
                   "divisor of --gpus-per-node; the plans then shard the gpus / N data-"
                   f"parallel ranks. auto: every such degree up to {MAX_AUTO_TP} at one global "
                   "batch (--global-batch-tokens, else the batch of --micro-batches at tp 1)")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="expert-parallel degree (torchtitan's expert_parallel_degree) for a "
                   "model with experts (deepseek_v3_*, qwen3_*_a*b): the planner then picks "
                   "a dense plan and an expert plan (over gpus / N ranks); default 1")
    p.add_argument("--cp", type=int, default=1, metavar="N",
                   help="context-parallel degree (torchtitan's context_parallel_degree): N "
                   "consecutive data-parallel ranks split each sequence; the plans' factors "
                   "range over them too, each rank holds seq-len / N tokens and the K/V "
                   "exchange joins the step; default 1")
    p.add_argument("--disable-loss-parallel", action="store_true",
                   help="with --tp: gather the logits instead of torchtitan's default "
                   "loss_parallel (its parallelism.disable_loss_parallel)")
    p.add_argument("--overlap-param-update", action="store_true",
                   help="the post-step all-gather overlaps the next forward "
                   "(AMSPOptimizer(overlap_param_update=True))")
    p.add_argument("--compress", type=_compress, default=Compression(),
                   metavar="grads=CODEC,weights=CODEC|none",
                   help="compress the stages whose group spans nodes, as the engine's "
                   f"amsp.set_compression does (CODEC: {', '.join(CODECS)}); plans are ranked "
                   "with it and the chosen plan's cross-node bytes are shown exact vs "
                   "compressed (default none)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw; or muon: torch.optim.Muon on every block matrix, AdamW on "
                   "the rest (AMSPOptimizer's Muon: each matrix orthogonalized by one owner "
                   "of the shard group); dense models, no --tp")
    p.add_argument("--bandwidth", help="bandwidth table JSON from python -m amsp_dtensor.plan.profile "
                   "(used where it has data; NCCL's model elsewhere)")
    p.add_argument("--top", type=int, default=8, help="plans to list (default 8)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


DEFAULT_RESERVE_GIB = 5.0


def _positive(name, value):
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"--{name} must be a finite number, got {value}")
    if value <= 0:
        raise UsageError(f"--{name} must be positive, got {value:g}")


def _model(args) -> ModelShape:
    explicit = {"--layers": args.layers, "--dim": args.dim, "--heads": args.heads,
                "--ffn": args.ffn, "--vocab": args.vocab, "--kv-heads": args.kv_heads}
    given = [k for k, v in explicit.items() if v is not None]
    if args.model and given:
        raise UsageError(f"{given[0]} conflicts with --model {args.model} (give --model or "
                         "the explicit --layers/--dim/--heads/--ffn/--vocab, not both)")
    if args.model:
        return get_model(args.model)
    missing = [k for k in ("--layers", "--dim", "--heads", "--ffn", "--vocab")
               if explicit[k] is None]
    if missing:
        raise UsageError(f"give --model NAME or all of --layers --dim --heads --ffn --vocab "
                         f"(missing {missing[0]})")
    try:
        return ModelShape(f"custom_{args.layers}L_{args.dim}d", args.dim, args.layers,
                          args.heads, args.vocab, args.ffn, args.kv_heads)
    except ValueError as exc:
        flag = "--kv-heads" if "n_kv_heads" in str(exc) else "--heads"
        raise UsageError(f"{flag}: {exc}") from None


def _micro_batches(args, tp: int = 1) -> int:
    if args.global_batch_tokens is None:
        return args.micro_batches or 1
    cp = args.cp
    per_step = args.seq_len * args.micro_batch * args.gpus // tp // cp
    if args.global_batch_tokens % per_step:
        ranks = "gpus" if tp == 1 else f"data-parallel ranks (gpus / tp {tp})"
        ranks += f" / cp {cp}" if cp > 1 else ""
        raise UsageError(
            f"--global-batch-tokens {args.global_batch_tokens} is not a multiple of seq-len x "
            f"micro-batch x {ranks} = {per_step}; change the batch or the micro-batch"
        )
    return args.global_batch_tokens // per_step


def _check_tp(args, model: ModelShape) -> None:
    """--tp against the node, the model and the sequence, naming the flags."""
    if args.tp == "auto":
        return
    if args.tp < 1:
        raise UsageError(f"--tp must be positive or auto, got {args.tp}")
    problem = tp_outside_node(args.tp, args.gpus_per_node, f"--tp {args.tp}",
                              f"--gpus-per-node {args.gpus_per_node}")
    if problem is not None:
        raise UsageError(problem)
    try:
        model.check_tensor_parallel(args.tp)
        check_sequence_parallel(args.seq_len, args.tp)
    except ValueError as exc:
        raise UsageError(f"--tp {args.tp}: {exc}") from None


def _row(e: PlanEstimate, mark: str = " ") -> str:
    m = e.memory
    st = e.step
    return (f"{mark}{e.label[:16]:<16}{m.states.param / GiB:6.2f}{m.states.grad / GiB:6.2f}"
            f"{m.states.optim / GiB:6.2f}{m.total / GiB:7.2f}{'' if e.fits else '!':1}"
            f"{e.bytes_intra / 1e9:7.2f}{e.bytes_inter / 1e9:7.2f}"
            f"{e.wire_bytes_intra / 1e9:7.2f}{e.wire_bytes_inter / 1e9:7.2f}"
            f"{e.node_nic_bytes / 1e9:8.1f}{e.comm_seconds * 1e3:8.1f}"
            f"{e.step_seconds * 1e3:8.1f}{st.mfu * 100:5.1f}")


def _header() -> str:
    return (f" {'':<16}{'memory per GPU (GiB)':^25} {'buffer (GB)':^14}{'wire (GB)':^14}"
            f"{'node':>8}{'comm':>8}{'step':>8}{'MFU':>5}\n"
            f" {'plan / system':<16}{'P':>6}{'G':>6}{'OS':>6}{'total':>7} {'intra':>7}"
            f"{'inter':>7}{'intra':>7}{'inter':>7}{'NICs GB':>8}{'sum ms':>8}{'ms':>8}"
            f"{'%':>5}")


def render(report: PlanReport, top: int) -> str:
    s = report.settings
    mdl = report.model
    lines = [
        f"{mdl.name}: {mdl.num_params / 1e6:,.1f}M params, {mdl.n_layers} layers, dim {mdl.dim}",
        f"{s['world_size']} GPUs ({s['ranks_per_node']}/node), seq {s['seq_len']} x "
        f"micro-batch {s['micro_batch']} x {s['micro_batches']} per step"
        + (f", context parallel {s['context_parallel_degree']} (each GPU holds seq / "
           f"{s['context_parallel_degree']} tokens)" if s.get("context_parallel_degree")
           else ""),
        f"{s['mixed_precision']} (grads {s['reduce_dtype']}), activation checkpointing "
        f"{s['activation_checkpointing']}, norm {s['norm']}",
        f"budget {s['memory_budget_bytes'] / GiB:.2f} GiB/GPU incl. {s['reserve_bytes'] / GiB:g}"
        f" GiB reserve; compute {s['compute_flops'] / 1e12:g} TFLOP/s of "
        f"{s['peak_flops'] / 1e12:g} peak",
        f"time model: {report.time_model}",
    ]
    if report.tp > 1:
        lines += [
            f"tensor parallel: tp {report.tp} inside each node (torchtitan's llama3 TP plan, "
            f"loss_parallel {'on' if s['loss_parallel'] else 'off'});",
            f"plans and baselines shard the {s['data_parallel_world_size']} data-parallel "
            f"ranks ({s['ranks_per_node'] // report.tp} per node): ZeRO-3/FSDP = FSDP2 + TP,",
            "HSDP/MiCS = HSDP + TP; memory is per GPU, of the TP-local shapes",
        ]
    lines += [
        "",
        _header(),
    ]
    fitting = [c for c in report.candidates if c.fits]
    for i, c in enumerate(report.candidates[:top]):
        lines.append(_row(c, "*" if i == 0 and c.fits else " "))
    if len(report.candidates) > top:
        lines.append(f" ... {len(report.candidates) - top} more plans "
                     f"({len(fitting)} of {len(report.candidates)} fit)")
    lines.append(" baselines:")
    for b in report.baselines.values():
        lines.append(_row(b, " "))
    best = report.best
    lines += [
        "",
        "* chosen, ! over the memory budget. Memory in GiB (2^30 B), traffic in GB (1e9 B),",
        "per step. buffer: collective buffer bytes per GPU (AG output, RS input, AR tensor);",
        "wire: bytes one GPU sends (ring factor x buffer); node NICs: bytes leaving one node.",
        "comm sum: collective times added up (no overlap); step: predicted step time with the",
        "engine's overlap; plans within 1% of the fastest step rank by comm sum.",
        *([f"TP's own collectives (activations, per layer) take "
           f"{best.tp_comm_seconds * 1e3:.1f} ms of the chosen step,",
           "on the critical path (in step, not in comm sum)."] if report.tp > 1 else []),
        *(_muon_lines(best) if best.muon is not None else []),
        f"chosen: {best.pair_name}, {best.memory.total / GiB:.2f} GiB/GPU, "
        f"{best.step_seconds * 1e3:.1f} ms/step, MFU {best.step.mfu * 100:.1f}%. For the job TOML:",
        "",
        report.to_toml().rstrip(),
    ]
    return "\n".join(lines)


def _muon_lines(best: PlanEstimate) -> list[str]:
    """Muon's part of the chosen plan's step: the owners' Newton-Schulz balance and the
    exchange (cost/muon.py)."""
    m = best.muon
    flops, n = m.member_flops, len(m.member_flops)
    up, down = m.balance()
    sent = sum(e.nbytes for e in m.events)
    return [f"Muon: Newton-Schulz per rank of {best.plan.name}'s shard groups ({n} OS ranks "
            "own the matrices),",
            f"TFLOP per step: max {max(flops) / 1e12:.2f}, mean {sum(flops) / n / 1e12:.2f}, "
            f"min {min(flops) / 1e12:.2f} ({up:+.1%} / {down:+.1%} of the mean); the owner "
            f"exchange: 2 all-to-alls,",
            f"{sent / 1e9:.3f} GB buffer per GPU (in the plan's traffic and step)."]


def _expert_row(e: PlanEstimate, mark: str = " ") -> str:
    x, m = e.memory.expert_states, e.memory
    groups = e.group_bytes()
    return (f"{mark}{e.expert_plan.name[:16]:<16}{x.param / GiB:6.2f}{x.grad / GiB:6.2f}"
            f"{x.optim / GiB:6.2f}{m.total / GiB:7.2f}{'' if e.fits else '!':1}"
            f"{groups['expert']['intra'] / 1e9:7.2f}{groups['expert']['inter'] / 1e9:7.2f}"
            f"{e.comm_seconds * 1e3:8.1f}{e.step_seconds * 1e3:8.1f}{e.step.mfu * 100:5.1f}")


def render_experts(report: PlanReport, top: int) -> str:
    """A model with experts: its experts, the expert plans beside the chosen dense one,
    and why the pair: the search's rounds, bytes per group, EP's all-to-alls."""
    mdl, s, best = report.model, report.settings, report.best
    x = mdl.experts
    ep, e_world = s["expert_parallel_degree"], s["expert_world_size"]
    inside = s["ranks_per_node"] % ep == 0
    lines = [
        f"experts: {mdl.moe_layers} MoE blocks of {mdl.n_layers}, {x.n_experts} routed "
        f"(top {x.top_k}) + {x.n_shared} shared each; {mdl.expert_numel / 1e9:,.2f}B of "
        f"{mdl.num_params / 1e9:,.2f}B params routed experts, {mdl.active_params / 1e9:,.2f}B "
        "active per token",
        f"expert parallel: ep {ep} ({'inside a node' if inside else 'across nodes'}); "
        f"expert world {e_world} ranks "
        f"({max(1, s['ranks_per_node'] // ep) if inside else 1} per node): the expert plans "
        "shard over it",
        "",
        f"expert plans with the dense plan {best.plan.name} (P, G, OS: the experts' own; total "
        "and step: both groups)",
        f" {'':<16}{'experts per GPU (GiB)':^25} {'experts (GB)':^14}{'comm':>8}{'step':>8}"
        f"{'MFU':>5}",
        f" {'expert plan':<16}{'P':>6}{'G':>6}{'OS':>6}{'total':>7} {'intra':>7}{'inter':>7}"
        f"{'sum ms':>8}{'ms':>8}{'%':>5}",
    ]
    for i, c in enumerate(report.expert_candidates[:top]):
        lines.append(_expert_row(c, "*" if i == 0 and c.fits else " "))
    if len(report.expert_candidates) > top:
        fit = sum(c.fits for c in report.expert_candidates)
        lines.append(f" ... {len(report.expert_candidates) - top} more expert plans "
                     f"({fit} of {len(report.expert_candidates)} fit)")
    groups = best.group_bytes()
    rounds = ", then ".join(f"{d} + experts {e}" for d, e in report.rounds)
    n = len(report.candidates) * len(report.expert_candidates)
    lines += [
        "",
        (f"why: the fastest fitting of all {n} pairs: {rounds}." if n <= PAIR_GRID_LIMIT else
         f"why: alternating search over {n} pairs (dense plans with the expert plan fixed, then "
         f"expert plans with the dense one fixed): {rounds}."),
        "bytes per GPU per step by group (GB, intra / inter node): " + "; ".join(
            f"{g} {b['intra'] / 1e9:.2f} / {b['inter'] / 1e9:.2f}"
            for g, b in sorted(groups.items())) + " (ep: EP's token all-to-alls)",
        f"EP's all-to-alls take {best.step.ep_comm_seconds * 1e3:.1f} ms of the chosen step, on "
        "the critical path of each MoE block.",
        f"torchtitan's own layout (FSDP2 + EP, experts on dim 1 where torchtitan shards them "
        f"so): {report.baselines['zero3'].pair_name}, "
        f"{report.baselines['zero3'].step_seconds * 1e3:.1f} ms/step, "
        f"{report.baselines['zero3'].memory.total / GiB:.2f} GiB/GPU"
        if "zero3" in report.baselines else "",
    ]
    return "\n".join(line.rstrip() for line in lines)


def render_tp_table(report: PlanReport) -> str:
    """tp="auto": one row per TP degree, its best plan (or the smallest if none fits)."""
    lines = [
        "tensor-parallel degrees at one global batch (* = chosen: the fastest that fits;",
        "within 1% the smaller degree); memory per GPU in GiB, times per step:",
        f" {'tp':>3}{'DP ranks':>9}{'M':>4}  {'best plan':<18}{'P':>6}{'G':>6}{'OS':>6}"
        f"{'total':>7} {'DP comm':>8}{'TP comm':>8}{'step':>9}{'MFU':>6}",
        f" {'':>3}{'':>9}{'':>4}  {'':<18}{'':>6}{'':>6}{'':>6}{'':>7} {'sum s':>8}"
        f"{'s':>8}{'s':>9}{'%':>6}",
    ]
    for t, r in sorted(report.by_tp.items()):
        b = r.best
        m = b.memory
        mark = "*" if r is report else " "
        lines.append(
            f"{mark}{t:>3}{r.settings['data_parallel_world_size']:>9}"
            f"{r.settings['micro_batches']:>4}  {b.plan.name[:18]:<18}"
            f"{m.states.param / GiB:6.2f}{m.states.grad / GiB:6.2f}{m.states.optim / GiB:6.2f}"
            f"{m.total / GiB:7.2f}{'' if b.fits else '!':1}{b.comm_seconds:8.2f}"
            f"{b.tp_comm_seconds:8.2f}{b.step_seconds:9.2f}{b.step.mfu * 100:6.1f}")
    return "\n".join(lines)


def _same_plan(report: PlanReport, tp: int, name: str) -> PlanEstimate | None:
    """The estimate of plan `name` at TP degree `tp` in a report (None if absent)."""
    r = report.by_tp.get(tp, report) if report.by_tp else report
    if r.tp != tp:
        return None
    return next((c for c in r.candidates if c.plan.name == name), None)


def compression_rows(report: PlanReport, exact: PlanReport) -> list[dict]:
    """The chosen plan with compression and, if another, the chosen plan without it:
    cross-node buffer bytes per step and step time, exact vs compressed."""
    rows = []
    picks = [("chosen", report.best.tp, report.best.plan.name)]
    if (exact.best.tp, exact.best.plan.name) != picks[0][1:]:
        picks.append(("chosen exact", exact.best.tp, exact.best.plan.name))
    for role, tp, name in picks:
        comp, ex = _same_plan(report, tp, name), _same_plan(exact, tp, name)
        if comp is None or ex is None:
            continue
        rows.append({"role": role, "plan": name, "tensor_parallel_degree": tp,
                     "bytes_inter_exact": comp.bytes_inter_exact,
                     "bytes_inter_compressed": comp.bytes_inter,
                     "wire_bytes_inter_exact": comp.wire_bytes_inter_exact,
                     "wire_bytes_inter_compressed": comp.wire_bytes_inter,
                     "step_seconds_exact": ex.step_seconds,
                     "step_seconds_compressed": comp.step_seconds,
                     "codec_seconds": comp.step.codec_seconds if comp.step else 0.0,
                     "memory_exact": ex.memory.total, "memory_compressed": comp.memory.total,
                     "fits_exact": ex.fits, "fits_compressed": comp.fits})
    return rows


def render_compression(compression: Compression, rows: list[dict]) -> str:
    lines = [
        f"compression {compression}: only stages whose group spans nodes; per GPU, per step",
        f" {'':<16}{'cross-node wire GB':^22}{'buffer GB':^16}{'step ms':^18}{'codec':>7}"
        f"{'mem GiB':^16}",
        f" {'plan':<16}{'exact':>8}{'compr.':>8}{'ratio':>6}{'exact':>8}{'compr.':>8}"
        f"{'exact':>9}{'compr.':>9}{'ms':>7}{'exact':>8}{'compr.':>8}",
    ]
    for r in rows:
        ratio = (r["wire_bytes_inter_compressed"] / r["wire_bytes_inter_exact"]
                 if r["wire_bytes_inter_exact"] else 1.0)
        tp = f" tp{r['tensor_parallel_degree']}" if r["tensor_parallel_degree"] > 1 else ""
        mark = "*" if r["role"] == "chosen" else "^"
        lines.append(
            f"{mark}{(r['plan'] + tp)[:16]:<16}"
            f"{r['wire_bytes_inter_exact'] / 1e9:8.2f}"
            f"{r['wire_bytes_inter_compressed'] / 1e9:8.2f}{ratio:6.3f}"
            f"{r['bytes_inter_exact'] / 1e9:8.2f}{r['bytes_inter_compressed'] / 1e9:8.2f}"
            f"{r['step_seconds_exact'] * 1e3:9.1f}{r['step_seconds_compressed'] * 1e3:9.1f}"
            f"{r['codec_seconds'] * 1e3:7.1f}"
            f"{r['memory_exact'] / GiB:7.2f}{'' if r['fits_exact'] else '!':1}"
            f"{r['memory_compressed'] / GiB:7.2f}{'' if r['fits_compressed'] else '!':1}")
    lines += [
        "* chosen with compression (the plan table above is ranked with it); ^: the plan",
        "chosen without it. wire: bytes one GPU sends in groups that span nodes (ratio:",
        "compressed / exact); buffer: recorder convention, where a compressed all-reduce is",
        "an all-to-all plus an all-gather (two buffers). codec: encode/decode time in the",
        "step. Memory adds the error-feedback residuals (and, for fp32 params with weights",
        "compressed, a separate fp32 master).",
    ]
    chosen = next((r for r in rows if r["role"] == "chosen"), None)
    exact = next((r for r in rows if r["role"] == "chosen exact"), None)
    if chosen and exact and exact["fits_exact"] and (
            exact["step_seconds_exact"] < chosen["step_seconds_compressed"]):
        lines += [
            f"Compression does not pay here: {exact['plan']} without it "
            f"({exact['step_seconds_exact'] * 1e3:.1f} ms) beats the best plan",
            f"that fits with it ({chosen['step_seconds_compressed'] * 1e3:.1f} ms): its "
            "residuals cost memory; run without --compress."]
    return "\n".join(line.rstrip() for line in lines)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        for name in ("gpus", "gpus_per_node", "gpu_mem", "seq_len", "micro_batch",
                     "global_batch_tokens", "micro_batches", "layers", "dim", "heads",
                     "kv_heads", "ffn", "vocab", "top", "tflops", "peak_tflops",
                     "nvlink_gbps", "nics_per_node", "nic_gbps"):
            _positive(name.replace("_", "-"), getattr(args, name))
        if not math.isfinite(args.reserve_gib) or args.reserve_gib < 0:
            raise UsageError(f"--reserve-gib must be a finite number >= 0, got {args.reserve_gib}")
        if args.reserve_gib >= args.gpu_mem:
            raise UsageError(f"--reserve-gib {args.reserve_gib:g} leaves nothing of --gpu-mem "
                             f"{args.gpu_mem:g}")
        if args.tflops > args.peak_tflops:
            raise UsageError(f"--tflops {args.tflops:g} is above --peak-tflops "
                             f"{args.peak_tflops:g}")
        if args.gpus_per_node > args.gpus:
            raise UsageError(f"--gpus-per-node {args.gpus_per_node} is more than --gpus "
                             f"{args.gpus}")
        if args.gpus % args.gpus_per_node:
            raise UsageError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node "
                             f"{args.gpus_per_node}")
        if args.nics_per_node is None:
            args.nics_per_node = max(1, args.gpus_per_node // 2)
        if args.nics_per_node > args.gpus_per_node:
            raise UsageError(f"--nics-per-node {args.nics_per_node} is more than "
                             f"--gpus-per-node {args.gpus_per_node} (one NIC per GPU at most)")
        model = _model(args)
        _check_tp(args, model)
        if args.ep is not None and args.ep < 1:
            raise UsageError(f"--ep must be positive, got {args.ep}")
        if args.ep not in (None, 1) and model.experts is None:
            raise UsageError(f"--ep {args.ep}: model {model.name} has no experts; give a "
                             "mixture-of-experts --model (e.g. deepseek_v3_16b) or drop --ep")
        if model.experts is not None:
            if args.tp != 1:
                raise UsageError(f"--tp {args.tp} with {model.name}: the planner has no "
                                 "tensor parallelism with experts; use --tp 1")
            try:
                model.expert_units(args.ep or 1)
                expert_parallel_world(args.gpus, args.gpus_per_node, args.ep or 1)
            except ValueError as exc:
                raise UsageError(f"--ep {args.ep or 1}: {exc}") from None
        if args.optimizer == "muon" and (args.tp != 1 or model.experts is not None):
            raise UsageError(f"--optimizer muon with " + (f"--tp {args.tp}" if args.tp != 1
                             else f"{model.name}'s experts") + ": AMSP runs Muon on a dense "
                             "model without TP; use --optimizer adamw there")
        if args.cp < 1:
            raise UsageError(f"--cp must be positive, got {args.cp}")
        if args.cp > 1 and (model.experts is not None or args.tp == "auto"):
            raise UsageError(f"--cp {args.cp}: the planner has no context parallelism beside "
                             "experts or --tp auto yet; give --tp N with a dense --model")
        if args.tp == "auto":  # one global batch for every degree
            batch = {"global_batch_tokens": args.global_batch_tokens or (
                (args.micro_batches or 1) * args.seq_len * args.micro_batch * args.gpus)}
        else:
            batch = {"micro_batches": _micro_batches(args, args.tp)}
        cluster = NcclModel(nvlink_bw=args.nvlink_gbps * 1e9, nic_bw=args.nic_gbps * 1e9,
                            nics_per_node=args.nics_per_node, gpus_per_node=args.gpus_per_node)
        plan_args = dict(
            model=model, seq_len=args.seq_len, micro_batch=args.micro_batch,
            **batch, tp=args.tp, loss_parallel=not args.disable_loss_parallel,
            world_size=args.gpus,
            ranks_per_node=args.gpus_per_node, memory_budget_bytes=args.gpu_mem * GiB,
            bandwidth=args.bandwidth, mixed_precision=args.precision,
            activation_checkpointing=args.activation_checkpointing, attention=args.attention,
            norm=args.norm, reduce_dtype=args.reduce_dtype,
            reserve_bytes=int(args.reserve_gib * GiB),
            compute=ComputeModel(compute_flops=args.tflops * 1e12,
                                 peak_flops=args.peak_tflops * 1e12),
            overlap_param_update=args.overlap_param_update, cluster=cluster,
            ep=args.ep or 1, cp=args.cp, optimizer=args.optimizer,
        )
        report = choose_plan(**plan_args, compression=args.compress)
        rows = []
        if args.compress.enabled:  # the same job without compression, for the comparison
            rows = compression_rows(report, choose_plan(**plan_args, require_fit=False))
    except NoPlanFits as exc:
        sm = exc.smallest
        tp = f" tp={sm.tp}" if sm.tp > 1 else ""
        print(f"{PROG}: error: {exc}; smallest: param={sm.plan.s_p} grad={sm.plan.s_g} "
              f"optim={sm.plan.s_os}{tp}", file=sys.stderr)
        return 2
    except (UsageError, ValueError, TypeError, BandwidthTableError) as exc:
        msg = " ".join(str(exc).split())
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2
    if args.json:
        out = report.as_dict()
        out["units"] = {"memory": "bytes", "traffic": "bytes", "time": "seconds"}
        if args.compress.enabled:
            out["compression"] = {"codecs": {"grads": args.compress.grads,
                                             "weights": args.compress.weights},
                                  "comparison": rows}
        print(json.dumps(out, indent=1))
    else:
        if report.by_tp:
            print(render_tp_table(report))
            print()
        print(render(report, args.top))
        if report.expert_candidates:
            print()
            print(render_experts(report, args.top))
        if args.compress.enabled:
            print()
            print(render_compression(args.compress, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
