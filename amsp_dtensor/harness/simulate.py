"""`python -m amsp_dtensor.plan.simulate`: one training step of the real engine as one rank of a
large job, on torch's fake process-group backend, checked against the cost model.

  python -m amsp_dtensor.plan.simulate --model llama3_8b --gpus 1024 --gpus-per-node 8 \\
      --plan p8-g64-os64 [--plan ...] [--rank 9] [--layers 1] [--seq-len 16] \\
      [--micro-batches 2] [--precision bf16|fp32] [--json out.json]

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


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Run one step of the AMSP engine as one rank of a "
                "large job (torch's fake process group) and compare with the cost model.")
    p.add_argument("--model", required=True, choices=sorted(FLAVORS),
                   help="torchtitan llama3 flavor (real widths)")
    p.add_argument("--gpus", type=int, required=True, help="world size of the simulated job")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--plan", action="append", required=True,
                   help="p<s_p>-g<s_g>-os<s_os>; repeat to run several plans")
    p.add_argument("--rank", type=int, default=9, help="the rank this process plays")
    p.add_argument("--layers", type=int, default=1, help="transformer blocks (cut)")
    p.add_argument("--seq-len", type=int, default=16, help="sequence length (cut)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--json", help="write the report here as JSON")
    return p


def _check_args(args) -> None:
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
        f" {'op':<15}{'dim':<6}{'group':>6}{'nodes':>6}{'bytes':>15} {'phase':<9}"
        f"{'predicted':>10}{'recorded':>9}{'ms/call':>9}",
    ]
    for r in sorted(rep["kinds"], key=lambda r: (r["phase"], r["op"], r["dim"], r["nbytes"])):
        lines.append(
            f" {r['op']:<15}{r['dim']:<6}{r['group_size']:>6}{r['group_nodes']:>6}"
            f"{r['nbytes']:>15,} {r['phase']:<9}{r['predicted_count']:>10}"
            f"{r['recorded_count']:>9}{r['predicted_seconds_per_call'] * 1e3:>9.3f}")
    for u in rep["unexpected"]:
        lines.append(f" recorded, not predicted: {u['key']} x {u['recorded_count']}")
    lines.append(f" collectives: recorded {rep['collectives_recorded']}, predicted "
                 f"{rep['collectives_predicted']}: "
                 f"{'equal' if rep['collectives_equal'] else 'DIFFERENT'}")
    meas, pred = rep["state_bytes"]["measured"], rep["state_bytes"]["predicted"]
    for k in pred:
        lines.append(f" {k:<18} recorded {meas[k]:>15,} B ({meas[k] / GB:8.3f} GB)  "
                     f"model {pred[k]:>15,} B  {'equal' if meas[k] == pred[k] else 'DIFFERENT'}")
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
    for name in args.plan:
        rep = simulate_plan(args, name)
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
