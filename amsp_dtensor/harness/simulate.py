"""`python -m amsp_dtensor.plan.simulate`: one training step of the real engine as one rank of a
large job, on torch's fake process-group backend, checked against the cost model.

  python -m amsp_dtensor.plan.simulate --model llama3_8b --gpus 1024 --gpus-per-node 8 \\
      --plan p8-g64-os64 [--plan ...] [--rank 9] [--layers 1] [--seq-len 16] \\
      [--micro-batches 2] [--precision bf16|fp32] [--json out.json]
  python -m amsp_dtensor.plan.simulate --model qwen3_30b_a3b --gpus 1024 --gpus-per-node 8 \\
      --ep 8 --plan p8-g8-os64 --expert-plan p1-g1-os8     (a mixture of experts: one
      --expert-plan per --plan; simulate_moe_plan)

The model is torchtitan's llama3 Transformer with the flavor's real widths (dim, heads, KV
heads, FFN, vocabulary); only the number of layers and the sequence length are cut, which
changes neither the per-unit collectives nor the per-parameter state bytes. It is built on
the meta device, sharded with amsp.fully_shard, then materialised (uninitialised: the fake
backend moves no data, so values are meaningless and never read). One optimizer step runs
(M micro-batches under no_sync but the last, clip_grad_norm_, AMSPOptimizer(AdamW).step)
inside amsp.record_comms(), and memory_by_state() is read while G accumulates, after the
last backward and after the step (the post-step all-gathers land after they are counted).

Reported, each beside the cost model's prediction:
- every recorded collective as (op, mesh dim, group size, bytes, inter-node, phase) with
  its count, against predicted_events(); with the NCCL model's time per call;
- P, G (accumulating and synced) and OS bytes of this rank, against state_bytes_of_rank();
- the buffers the step leaves alive beside P and OS (synced G, post-step all-gathers,
  read before they land), against cost.memory.step_bytes().
Exit status 0 when both match exactly, 1 when they differ, 2 on bad input (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time

PROG = "python -m amsp_dtensor.plan.simulate"
FLAVORS = {"llama3_debugmodel": "debugmodel", "llama3_8b": "8B", "llama3_70b": "70B",
           "llama3_405b": "405B"}
# mixture-of-experts models (plan/cost/models.py), run as the project's tiny MoE at their
# widths (simulate_moe_plan)
MOE_MODELS = ("deepseek_v3_16b", "deepseek_v3_671b", "qwen3_30b_a3b")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run one step of the AMSP engine as one rank of a "
                "large job (torch's fake process group) and compare with the cost model.")
    p.add_argument("--model", required=True, choices=sorted(FLAVORS) + list(MOE_MODELS),
                   help="torchtitan llama3 flavor, or a mixture-of-experts model (real "
                   "widths)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel degree (a mixture-of-experts model)")
    p.add_argument("--expert-plan", action="append",
                   help="the experts' p<s_p>-g<s_g>-os<s_os> over the expert world (gpus / "
                   "ep): one per --plan, in order (a mixture-of-experts model)")
    p.add_argument("--gpus", type=int, required=True, help="world size of the simulated job")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--plan", action="append", required=True,
                   help="p<s_p>-g<s_g>-os<s_os>; repeat to run several plans")
    p.add_argument("--rank", type=int, default=9, help="the rank this process plays")
    p.add_argument("--layers", type=int, help="transformer blocks (cut; default 1, with "
                   "experts one MoE block after a dense one where the model has one)")
    p.add_argument("--seq-len", type=int, help="sequence length (cut; default 16, with "
                   "experts 32)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--json", help="write the report here as JSON")
    return p


def _check_args(args) -> None:
    moe = args.model in MOE_MODELS
    if args.layers is None:
        args.layers = 1
        if moe:
            from amsp_dtensor.plan.cost.models import MODELS

            args.layers += bool(MODELS[args.model].experts.n_dense_layers)
    if args.seq_len is None:
        args.seq_len = 32 if moe else 16
    if not moe and (args.ep != 1 or args.expert_plan):
        raise UsageError(f"--ep and --expert-plan apply to a mixture-of-experts --model "
                         f"({', '.join(MOE_MODELS)}), not {args.model}")
    if moe:
        _check_moe_args(args)
    for name in ("gpus", "gpus_per_node", "layers", "seq_len", "micro_batch", "micro_batches"):
        v = getattr(args, name)
        if v <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.gpus_per_node > args.gpus:
        raise UsageError(f"--gpus-per-node {args.gpus_per_node} is more than --gpus {args.gpus}")
    if args.gpus % args.gpus_per_node:
        raise UsageError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node "
                         f"{args.gpus_per_node}")
    if not 0 <= args.rank < args.gpus:
        raise UsageError(f"--rank {args.rank} is not in [0, {args.gpus})")
    from amsp_dtensor.plan import ShardingPlan

    for name in args.plan:
        try:
            ShardingPlan.from_name(name).resolve(args.gpus, args.gpus_per_node)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"--plan {name}: {' '.join(str(exc).split())}") from None


def _check_moe_args(args) -> None:
    from amsp_dtensor.plan import ShardingPlan, expert_parallel_world
    from amsp_dtensor.plan.cost.models import MODELS

    x = MODELS[args.model].experts
    if len(args.expert_plan or []) != len(args.plan):
        raise UsageError(f"give one --expert-plan per --plan ({len(args.plan)}) for "
                         f"{args.model}")
    if args.ep < 1 or x.n_experts % args.ep:
        raise UsageError(f"--ep {args.ep} does not divide {args.model}'s {x.n_experts} "
                         "experts")
    tokens = args.seq_len * args.micro_batch * x.top_k
    if tokens % x.n_experts:
        raise UsageError(
            f"--seq-len x --micro-batch x top_k = {tokens} is not a multiple of the "
            f"{x.n_experts} experts: the simulation routes every expert the same tokens; "
            "change --seq-len")
    try:
        world = expert_parallel_world(args.gpus, args.gpus_per_node, args.ep)
        for name in args.expert_plan:
            ShardingPlan.from_name(name).resolve(*world)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--expert-plan / --ep: {' '.join(str(exc).split())}") from None


def simulate_moe_plan(args, plan_name: str, expert_name: str) -> dict:
    """One step of a (dense plan, expert plan) pair with expert parallelism as rank
    args.rank, on the project's tiny MoE (testing/tiny_moe.py) at the model's widths:
    its attention is llama's (not DeepSeek's latent attention, nor qwen3's q/k norms),
    its dense FFN, router, routed experts (count, top-k, hidden) and shared experts are
    the model's. Routing is balanced (every expert the same tokens, every rank alike:
    torch's fake backend moves no data, so each rank receives what it sends). The cost
    model gets the shapes read off the module: its events (both groups' and EP's
    all-to-alls) and each group's state bytes are compared with the recorder's and
    memory_by_state's."""
    import torch
    import torch.distributed as dist

    import amsp_dtensor as amsp
    from amsp_dtensor import compat
    from amsp_dtensor.plan import expert_parallel_world
    from amsp_dtensor.plan.cost.comm import (event_counter, predicted_ep_events,
                                             predicted_events, predicted_expert_events,
                                             recorded_counter)
    from amsp_dtensor.plan.cost.memory import DTYPE_BYTES, state_bytes_of_rank
    from amsp_dtensor.plan.cost.models import MODELS
    from amsp_dtensor.plan.cost.nccl import NcclModel
    from amsp_dtensor.testing.moe import moe_unit_shapes, shard_moe
    from amsp_dtensor.testing.tiny_llama import loss_fn
    from amsp_dtensor.testing.tiny_moe import TinyMoE, TinyMoEConfig

    t0 = time.perf_counter()
    W, R, rank, ep = args.gpus, args.gpus_per_node, args.rank, args.ep
    shape = MODELS[args.model]
    x = shape.experts
    cfg = TinyMoEConfig(vocab_size=shape.vocab_size, dim=shape.dim, n_layers=args.layers,
                        n_heads=shape.n_heads, ffn_dim=shape.ffn_hidden,
                        max_seq_len=args.seq_len,
                        n_dense_layers=min(x.n_dense_layers, args.layers - 1),
                        n_experts=x.n_experts, top_k=x.top_k, expert_dim=x.hidden,
                        shared_dim=x.n_shared * x.hidden, balanced=True)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    e_world, e_per_node = expert_parallel_world(W, R, ep)
    rp = amsp.ShardingPlan.from_name(plan_name).resolve(W, R)
    erp = amsp.ShardingPlan.from_name(expert_name).resolve(e_world, e_per_node)
    compat.init_fake_process_group(rank, W)
    try:
        mesh = amsp.init_mesh(rp.as_plan(), ranks_per_node=R, device_type="cpu", ep=ep,
                              expert_plan=erp.as_plan())
        with torch.device("meta"):
            model = TinyMoE(cfg).to(dtype)
        dense_units, root, expert_units = moe_unit_shapes(model, ep)
        shard_moe(model, mesh, ep)
        model.to_empty(device="cpu")
        for experts in model.experts():
            experts.counts_from_self = True
        optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-4)
        M, b, s = args.micro_batches, args.micro_batch, args.seq_len
        measured = {}
        with amsp.record_comms(model_collectives=True) as rec:
            for m in range(M):
                tokens = torch.randint(0, cfg.vocab_size, (b, s + 1))
                ctx = amsp.no_sync(model) if m < M - 1 else contextlib.nullcontext()
                with ctx:
                    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                if m == 0 and M > 1:
                    measured.update({f"{g}_grad_accumulating": amsp.memory_by_state(
                        model, group=g)["grad"] for g in ("dense", "expert")})
            measured.update({f"{g}_grad_synced": amsp.memory_by_state(model, group=g)["grad"]
                             for g in ("dense", "expert")})
            optim.clip_grad_norm_(1.0)
            optim.step()
        for group in ("dense", "expert"):
            after = amsp.memory_by_state(model, optim, group=group)
            measured[f"{group}_param"], measured[f"{group}_optim"] = after["param"], after["optim"]
        seconds = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()

    e = DTYPE_BYTES[args.precision]
    events = (predicted_events(rp, dense_units, M, e, root, clip=True)
              + predicted_expert_events(erp, ep, R, expert_units, M, e, clip=True)
              + predicted_ep_events(ep, R, len(expert_units), b * s, x.top_k, shape.dim,
                                    x.n_experts, M, e))
    want, got = event_counter(events), recorded_counter(rec.events)
    nccl = NcclModel(gpus_per_node=R, nics_per_node=max(1, R // 2))
    rows = [{"op": ev.op, "dim": ev.dim, "group_size": ev.group_size,
             "group_nodes": ev.group_nodes, "nbytes": ev.nbytes, "inter_node": ev.inter_node,
             "phase": ev.phase, "unit": ev.unit, "predicted_count": want[ev.key()],
             "recorded_count": got.get(ev.key(), 0),
             "predicted_seconds_per_call": nccl.time(ev.op, ev.nbytes, ev.group)}
            for ev in events]
    unexpected = [{"key": list(k), "recorded_count": n} for k, n in got.items() if k not in want]
    predicted = {}
    # the expert world's rank of this rank: ep is the fastest dim (the engine's mesh Note)
    for group, units, plan, r in (("dense", dense_units, rp, rank),
                                  ("expert", expert_units, erp, rank // ep)):
        synced = state_bytes_of_rank(units, plan, r, e, grads_synced=True)
        predicted.update({f"{group}_param": synced.param, f"{group}_grad_synced": synced.grad,
                          f"{group}_optim": synced.optim})
        if M > 1:
            accum = state_bytes_of_rank(units, plan, r, e, grads_synced=False)
            predicted[f"{group}_grad_accumulating"] = accum.grad
    return {
        "plan": f"{rp.name} + experts {erp.name} (ep {ep})", "model": args.model,
        "world_size": W, "ranks_per_node": R, "rank": rank, "layers": args.layers,
        "seq_len": s, "micro_batch": b, "micro_batches": M, "precision": args.precision,
        "collectives_recorded": len(rec.events),
        "collectives_predicted": sum(ev.count for ev in events),
        "collectives_equal": want == got, "kinds": _merge(rows), "unexpected": unexpected,
        "state_bytes": {"measured": measured, "predicted": predicted},
        "states_equal": all(measured[k] == v for k, v in predicted.items()),
        "step_buffer_bytes": None, "step_buffers_equal": True, "seconds": seconds,
    }


def simulate_plan(args, plan_name: str) -> dict:
    """One step of one plan as rank args.rank; returns the comparison (see module doc)."""
    import torch
    import torch.distributed as dist
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, llama3_args

    import amsp_dtensor as amsp
    from amsp_dtensor import compat
    from amsp_dtensor.plan.cost.comm import event_counter, predicted_events, recorded_counter
    from amsp_dtensor.plan.cost.memory import DTYPE_BYTES, state_bytes_of_rank, step_bytes
    from amsp_dtensor.plan.cost.models import from_torchtitan_args
    from amsp_dtensor.plan.cost.nccl import NcclModel
    from amsp_dtensor.observe.memory import step_buffer_bytes

    t0 = time.perf_counter()
    W, R, rank = args.gpus, args.gpus_per_node, args.rank
    compat.init_fake_process_group(rank, W)
    try:
        plan = amsp.ShardingPlan.from_name(plan_name)
        rp = plan.resolve(W, R)
        mesh = amsp.init_mesh(plan, ranks_per_node=R, device_type="cpu")
        margs = copy.deepcopy(llama3_args[FLAVORS[args.model]])
        margs.n_layers = args.layers
        margs.max_seq_len = args.seq_len
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        with torch.device("meta"):
            model = Transformer(margs)
        model = model.to(dtype)
        for block in model.layers.values():
            amsp.fully_shard(block, mesh=mesh, plan=plan)
        amsp.fully_shard(model, mesh=mesh, plan=plan)
        model.to_empty(device="cpu")
        compat.recompute_rope_table(model)  # the complex RoPE table
        # the post-step all-gathers stay in flight after step(), so the buffers the step
        # leaves alive can be read before they land (the schedule is the same)
        optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-4,
                                   overlap_param_update=True)
        M, b, s = args.micro_batches, args.micro_batch, args.seq_len
        measured = {}
        with amsp.record_comms() as rec:
            for m in range(M):
                tokens = torch.randint(0, margs.vocab_size, (b, s + 1))
                ctx = amsp.no_sync(model) if m < M - 1 else contextlib.nullcontext()
                with ctx:
                    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
                    loss.backward()
                if m == 0 and M > 1:
                    measured["grad_accumulating"] = amsp.memory_by_state(model)["grad"]
            measured["grad_synced"] = amsp.memory_by_state(model)["grad"]
            optim.clip_grad_norm_(1.0)
            optim.step()
            step_buffers = step_buffer_bytes(model)
            optim.wait_param_update()
        after = amsp.memory_by_state(model, optim)
        measured["param"], measured["optim"] = after["param"], after["optim"]
        seconds = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()

    shape = from_torchtitan_args(args.model, margs)
    e = DTYPE_BYTES[args.precision]
    units = shape.unit_param_shapes()
    events = predicted_events(rp, units, M, e, shape.root_unit_index, clip=True)
    want, got = event_counter(events), recorded_counter(rec.events)
    nccl = NcclModel(gpus_per_node=R, nics_per_node=max(1, R // 2))
    rows = []
    for ev in events:
        key = ev.key()
        rows.append({"op": ev.op, "dim": ev.dim, "group_size": ev.group_size,
                     "group_nodes": ev.group_nodes, "nbytes": ev.nbytes,
                     "inter_node": ev.inter_node, "phase": ev.phase, "unit": ev.unit,
                     "predicted_count": want[key], "recorded_count": got.get(key, 0),
                     "predicted_seconds_per_call": nccl.time(ev.op, ev.nbytes, ev.group)})
    unexpected = [{"key": list(k), "recorded_count": n} for k, n in got.items() if k not in want]
    synced = state_bytes_of_rank(units, rp, rank, e, grads_synced=True)
    accum = state_bytes_of_rank(units, rp, rank, e, grads_synced=False)
    predicted_states = {"param": synced.param, "grad_synced": synced.grad,
                        "optim": synced.optim}
    if "grad_accumulating" in measured:
        predicted_states["grad_accumulating"] = accum.grad
    states_equal = all(measured[k] == v for k, v in predicted_states.items())
    step_model = step_bytes(shape, rp, args.precision, clip=True)
    predicted_step = {"synced_grad": step_model.synced_grad, "gather": step_model.gather}
    return {
        "plan": rp.name, "model": args.model, "world_size": W, "ranks_per_node": R,
        "rank": rank, "layers": args.layers, "seq_len": s, "micro_batch": b,
        "micro_batches": M, "precision": args.precision,
        "collectives_recorded": len(rec.events),
        "collectives_predicted": sum(ev.count for ev in events),
        "collectives_equal": want == got,
        "kinds": _merge(rows), "unexpected": unexpected,
        "state_bytes": {"measured": measured, "predicted": predicted_states},
        "states_equal": states_equal,
        "step_buffer_bytes": {"measured": step_buffers, "predicted": predicted_step},
        "step_buffers_equal": step_buffers == predicted_step, "seconds": seconds,
    }


def _merge(rows: list[dict]) -> list[dict]:
    """One row per distinct (op, dim, group, bytes, inter, phase); units folded."""
    out: dict = {}
    for r in rows:
        k = (r["op"], r["dim"], r["group_size"], r["nbytes"], r["inter_node"], r["phase"])
        if k not in out:
            out[k] = dict(r, units=1)
            out[k].pop("unit")
        else:
            out[k]["units"] += 1
    return list(out.values())


def render(rep: dict) -> str:
    GB = 1e9
    lines = [
        f"{rep['model']} widths, {rep['layers']} layer(s), seq {rep['seq_len']} x "
        f"{rep['micro_batch']} x {rep['micro_batches']} micro-batches, {rep['precision']}: "
        f"plan {rep['plan']}, rank {rep['rank']} of {rep['world_size']} "
        f"({rep['ranks_per_node']}/node), {rep['seconds']:.1f} s",
        f" {'op':<15}{'dim':<13}{'group':>6}{'nodes':>6}{'bytes':>15} {'phase':<9}"
        f"{'predicted':>10}{'recorded':>9}{'ms/call':>9}",
    ]
    for r in sorted(rep["kinds"], key=lambda r: (r["phase"], r["op"], r["dim"], r["nbytes"])):
        lines.append(
            f" {r['op']:<15}{r['dim']:<13}{r['group_size']:>6}{r['group_nodes']:>6}"
            f"{r['nbytes']:>15,} {r['phase']:<9}{r['predicted_count']:>10}"
            f"{r['recorded_count']:>9}{r['predicted_seconds_per_call'] * 1e3:>9.3f}")
    for u in rep["unexpected"]:
        lines.append(f" recorded, not predicted: {u['key']} x {u['recorded_count']}")
    lines.append(f" collectives: recorded {rep['collectives_recorded']}, predicted "
                 f"{rep['collectives_predicted']}: "
                 f"{'equal' if rep['collectives_equal'] else 'DIFFERENT'}")
    meas, pred = rep["state_bytes"]["measured"], rep["state_bytes"]["predicted"]
    for k in pred:
        lines.append(f" {k:<24} recorded {meas[k]:>15,} B ({meas[k] / GB:8.3f} GB)  "
                     f"model {pred[k]:>15,} B  {'equal' if meas[k] == pred[k] else 'DIFFERENT'}")
    if rep["step_buffer_bytes"] is None:  # the MoE simulation reads the states only
        return "\n".join(lines)
    meas, pred = rep["step_buffer_bytes"]["measured"], rep["step_buffer_bytes"]["predicted"]
    for k in pred:
        lines.append(f" after step: {k:<11} recorded {meas[k]:>15,} B  model {pred[k]:>15,} B  "
                     f"{'equal' if meas[k] == pred[k] else 'DIFFERENT'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check_args(args)
    except UsageError as exc:
        print(f"{PROG}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from amsp_dtensor.titan.cpu_compat import apply

    apply()  # torchtitan on a machine without an accelerator
    reports = []
    for i, name in enumerate(args.plan):
        rep = (simulate_moe_plan(args, name, args.expert_plan[i]) if args.model in MOE_MODELS
               else simulate_plan(args, name))
        reports.append(rep)
        print(render(rep), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    ok = all(r["collectives_equal"] and r["states_equal"] and r["step_buffers_equal"]
             for r in reports)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
