"""Host overhead of a training step: FSDP2 and AMSP with compute made negligible.

    python tools/host_bench.py                       # W=16, 8 per node, 16 blocks, eager + compiled
    python tools/host_bench.py --modes eager --reps 5 --json out.json

One process is rank 0 of a W-rank job on torch's fake process group: collectives return at
once and move no data. The model is the testing TinyLlama at tiny dims (dim 64) with many
blocks, so a step's time is what the host does around the kernels: hooks, copies, casts,
Python. Units as torchtitan makes them: the embedding, each block, [norm, output], the root.
Per configuration it reports the step's CPU time (``time.process_time``; torch runs on one
thread) and wall time, each the min over ``--reps`` interleaved repetitions of the mean of
``--steps`` steps, and the kernel-launching ops of one eager step
(amsp_dtensor/testing/op_count.py; a dispatch mode does not see inside compiled code).

Configurations (``--configs``, comma separated; W = world, S = ranks per node):
``fsdp2`` (``fully_shard`` over W ranks), ``hsdp`` (FSDP2 HSDP, shard groups of S), and
``amsp:<plan>[+int8][+opu]``: AMSP at a plan name (``pW-gW-osW`` is FSDP2's schedule,
``pS-gS-osS`` HSDP's), ``+int8`` int8 gradients and bf16 weights across nodes
(``amsp.set_compression``), ``+opu`` ``overlap_param_update=True``, ``+nostep`` ``amsp.set_overlap(step=False)`` (one
optimizer step once every gradient has landed, instead of in batches as they land), ``+muon``
torch.optim.Muon on the blocks' matrices with an AdamW group for the rest (the fake process
group's all-to-alls move nothing, so this is Muon's host cost and Newton-Schulz compute at
these dims, against the same plan's AdamW). Every system gets the
same explicit prefetch (the next unit in forward, the previous in backward) and torch
AdamW (foreach); AMSP's masters are views of the fp32 params. ``--modes eager,compiled``:
compiled is per-block ``torch.compile`` (before sharding, as torchtitan does).

``--ep N``: the model is the testing TinyMoE at the same dims (a dense first block, then MoE
blocks of ``--experts`` grouped experts, top 2, and a shared expert), its experts split over N
consecutive ranks by its all-to-all EP (each rank routes to its own tokens' counts: the fake
group moves no data, and the routing is the balanced one, which does not read the weights);
``fsdp2`` is then torchtitan's FSDP2 + EP (each MoE block's experts sharded over the W / N
ranks of "efsdp" before their block, their gradients divided by W, prefetch naming them),
and AMSP keys name an expert plan, ``amsp:<plan>+e-<expert plan>`` (``E`` = W / N):
``amsp:pW-gW-osW+e-pE-gE-osE`` is torchtitan's layout.

Rows of the markdown table: one per (mode, configuration), with CPU ms, wall ms, ops and
the ratio of CPU time to the baseline at the same schedule (FSDP2 for pW-gW-osW and AMSP's
own plans, HSDP for pS-gS-osS).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_CONFIGS = ("fsdp2,hsdp,amsp:pW-gW-osW,amsp:pS-gS-osS,amsp:p8-g8-os16,"
                   "amsp:p8-g8-os16+int8,amsp:p8-g8-os16+opu")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=16)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (min taken)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--ep", type=int, default=0, help="expert parallel: the TinyMoE model")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE block")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="instead of timing: cProfile (all functions, then the engine's "
                         "alone) and torch.profiler of each configuration")
    ap.add_argument("--op-diff", action="store_true",
                    help="also list the ops each AMSP row launches beyond its baseline's")
    return ap.parse_args(argv)


def resolve(key: str, world: int, per_node: int, ep: int = 0) -> str:
    key = key.replace("W", str(world)).replace("S", str(per_node))
    return key.replace("E", str(world // ep)) if ep else key


def baseline_of(key: str, world: int, per_node: int) -> str:
    """The FSDP2 configuration at the same schedule (AMSP's own plans: fully_shard)."""
    if key.startswith("amsp:"):
        plan = key[5:].split("+")[0]
        return "hsdp" if plan == f"p{per_node}-g{per_node}-os{per_node}" else "fsdp2"
    return key


class Bench:
    """One built system: model, optimizer and a ``step()``. ``args`` gives the sizes
    (dim, blocks, seq; heads, ffn, vocab, batch when present), the world, and optionally
    ``device`` and ``precision``: "fp32" (all fp32), or "bf16" (FSDP2:
    MixedPrecisionPolicy(bf16, fp32) over fp32 params; AMSP: a bf16 model with fp32
    masters). Keys as in the module docstring, and ``floor``: no sharding and no
    optimizer, the model's forward and backward alone."""

    def __init__(self, key: str, mode: str, args, meshes: dict):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        import amsp_dtensor as amsp
        from amsp_dtensor import compat
        from amsp_dtensor.testing.tiny_llama import TinyLlama, TinyLlamaConfig, loss_fn

        self.key, self.mode = key, mode
        device = torch.device(getattr(args, "device", "cpu"))
        bf16 = getattr(args, "precision", "fp32") == "bf16"
        torch.manual_seed(0)
        sizes = dict(vocab_size=getattr(args, "vocab", 100), dim=args.dim,
                     n_layers=args.blocks, n_heads=getattr(args, "heads", 4),
                     ffn_dim=getattr(args, "ffn", None) or 2 * args.dim, max_seq_len=args.seq)
        ep = getattr(args, "ep", 0)
        if ep:
            from amsp_dtensor.testing.tiny_moe import TinyMoE, TinyMoEConfig, expert_parallelize

            cfg = TinyMoEConfig(**sizes, n_experts=args.experts, top_k=2,
                                expert_dim=2 * args.dim, shared_dim=args.dim, balanced=True)
            with device:
                model = TinyMoE(cfg)
        else:
            cfg = TinyLlamaConfig(**sizes)
            with device:
                model = TinyLlama(cfg)
        routed = [getattr(b, "moe", None) and b.moe.experts for b in model.layers]
        if bf16 and (key == "floor" or key.startswith("amsp:")):
            model = model.to(torch.bfloat16)
        if mode == "compiled":
            for i, block in enumerate(model.layers):
                model.layers[i] = torch.compile(block)
        units = [model.tok_embeddings, *model.layers, [model.norm, model.output]]
        world, per_node = args.world, args.per_node
        self.finish = lambda: None
        if key == "floor":
            optim = None
        elif key in ("fsdp2", "hsdp"):
            if key not in meshes:
                shape = (world,) if key == "fsdp2" else (world // per_node, per_node)
                names = ("dp",) if key == "fsdp2" else ("replicate", "shard")
                meshes[key] = init_device_mesh(device.type, shape, mesh_dim_names=names)
            kw = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if bf16 else {}
            if ep:  # torchtitan's FSDP2 + EP: experts over "efsdp" (W / ep), ep fastest
                if "efsdp" not in meshes:
                    meshes["efsdp"] = init_device_mesh(device.type, (world // ep, ep),
                                                       mesh_dim_names=("efsdp", "ep"))
                expert_parallelize(model, meshes["efsdp"]["ep"])
                for ex in filter(None, routed):
                    ex.counts_from_self = True
                    fully_shard(ex, mesh=meshes["efsdp"]["efsdp"], **kw)
                    ex.set_gradient_divide_factor(float(world))
            for unit in units:
                fully_shard(unit, mesh=meshes[key], **kw,
                            **({"reshard_after_forward": False} if isinstance(unit, list) else {}))
            fully_shard(model, mesh=meshes[key], **kw)
            fsdp = [u if not isinstance(u, list) else u[0] for u in units]
            # each block's experts with it (torchtitan's prefetch under EP)
            ex_of = [[], *[[e] if e else [] for e in routed], []]
            for i, m in enumerate(fsdp):  # the prefetch AMSP sets (engine/overlap.py)
                m.set_modules_to_forward_prefetch(
                    fsdp[i + 1:i + 2] + (ex_of[i + 1] if i + 1 < len(fsdp) else []))
                m.set_modules_to_backward_prefetch(
                    fsdp[max(i - 1, 0):i] + (ex_of[i - 1] if i > 0 else []))
            for m in [*fsdp, *filter(None, routed)]:
                if device.type == "cpu":  # as AMSP does on CPU, where FSDP2 has no streams
                    compat.fsdp_set_unshard_async_op(m, True)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        else:
            plan_name, *extra = key[5:].split("+")
            experts = next((e[2:] for e in extra if e.startswith("e-")), None)
            if bool(ep) != bool(experts):
                raise SystemExit(f"{key}: with --ep an AMSP key names an expert plan "
                                 "(+e-<plan>), without it none")
            plan = amsp.ShardingPlan.from_name(plan_name)
            tag = (plan_name, experts)
            if tag not in meshes:
                meshes[tag] = amsp.init_mesh(plan, ranks_per_node=per_node,
                                             device_type=device.type, **(dict(
                                                 ep=ep, expert_plan=amsp.ShardingPlan.from_name(
                                                     experts)) if ep else {}))
            mesh = meshes[tag]
            if ep:  # each MoE block's experts a unit on the expert mesh, before the block
                expert_parallelize(model, amsp.expert_mesh(mesh)["ep"])
                for ex in filter(None, routed):
                    ex.counts_from_self = True
                    amsp.fully_shard(ex, mesh=amsp.expert_mesh(mesh))
            for unit in units:
                amsp.fully_shard(unit, mesh=mesh,
                                 **({"reshard_after_forward": False} if isinstance(unit, list)
                                    else {}))
            amsp.fully_shard(model, mesh=mesh)
            if "int8" in extra:
                amsp.set_compression(model, grads="int8", weights="bf16")
            if "nostep" in extra:  # one optimizer step after every gradient has landed
                amsp.set_overlap(model, step=False)
            if "muon" in extra:  # Muon on the blocks' matrices, AdamW (a group) on the rest
                matrices = [p for n, p in model.named_parameters()
                            if p.dim() == 2 and n.startswith("layers.")]
                rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
                optim = amsp.AMSPOptimizer(
                    model, torch.optim.Muon, lr=2e-2, weight_decay=0.1,
                    overlap_param_update="opu" in extra, param_groups=[
                        {"params": matrices},
                        {"params": rest, "optimizer": torch.optim.AdamW, "lr": 1e-3,
                         "weight_decay": 0.1, "foreach": True}])
            else:
                optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                                           foreach=True, overlap_param_update="opu" in extra)
            self.finish = optim.wait_param_update
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (getattr(args, "batch", 1), args.seq + 1),
                               generator=g).to(device)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.model, self.optim, self.loss_fn, self.cfg = model, optim, loss_fn, cfg

    def step(self) -> None:
        loss = self.loss_fn(self.model(self.inputs), self.targets)
        loss.backward()
        if self.optim is None:  # the floor: forward and backward only
            for p in self.model.parameters():
                p.grad = None
            return
        self.optim.step()
        self.optim.zero_grad()

    def timed(self, steps: int) -> tuple[float, float]:
        """(CPU s, wall s) per step, the mean of ``steps`` steps."""
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            self.step()
        self.finish()
        return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps

    def count_ops(self) -> int:
        from amsp_dtensor.testing.op_count import counting_mode

        mode = counting_mode()
        with mode:
            self.step()
            self.finish()
        self.op_counts = dict(mode.counts)
        return sum(mode.counts.values())


def run(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    from amsp_dtensor import compat

    torch.set_num_threads(1)
    compat.init_fake_process_group(0, args.world)
    keys = [resolve(k, args.world, args.per_node, args.ep) for k in args.configs.split(",") if k]
    modes = [m for m in args.modes.split(",") if m]
    meshes: dict = {}
    benches = [Bench(key, mode, args, meshes) for mode in modes for key in keys]
    rows = {}
    for b in benches:
        for _ in range(args.warmup):  # lazy init, optimizer states, compilation
            b.step()
        b.finish()
        # a dispatch mode does not see inside compiled code: ops are counted eager only
        ops = b.count_ops() if b.mode == "eager" else None
        counts = b.op_counts if ops is not None else {}
        rows[(b.mode, b.key)] = {"mode": b.mode, "config": b.key, "ops": ops,
                                 "matmuls": counts.get("aten.mm", 0), "op_counts": counts,
                                 "cpu_ms": float("inf"), "wall_ms": float("inf")}
    for _ in range(args.reps):  # interleaved: every system once per repetition
        for b in benches:
            cpu, wall = b.timed(args.steps)
            row = rows[(b.mode, b.key)]
            row["cpu_ms"] = min(row["cpu_ms"], cpu * 1e3)
            row["wall_ms"] = min(row["wall_ms"], wall * 1e3)
    for (mode, key), row in rows.items():
        base = rows.get((mode, baseline_of(key, args.world, args.per_node)))
        row["baseline"] = baseline_of(key, args.world, args.per_node)
        row["cpu_vs_baseline"] = row["cpu_ms"] / base["cpu_ms"] if base else None
        row["ops_vs_baseline"] = row["ops"] / base["ops"] if base and row["ops"] else None
    dist.destroy_process_group()
    return list(rows.values())


def profile(args) -> None:
    """cProfile (Python-side host time, by function) and torch.profiler (the ``AMSP::`` and
    FSDP2 ranges) of ``--steps`` steps of each configuration, written under ``--profile``."""
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist

    from amsp_dtensor import compat

    torch.set_num_threads(1)
    compat.init_fake_process_group(0, args.world)
    os.makedirs(args.profile, exist_ok=True)
    keys = [resolve(k, args.world, args.per_node) for k in args.configs.split(",") if k]
    meshes: dict = {}
    for mode in [m for m in args.modes.split(",") if m]:
        for key in keys:
            b = Bench(key, mode, args, meshes)
            for _ in range(args.warmup):
                b.step()
            b.finish()
            name = f"{mode}-{key.replace(':', '_').replace('+', '_')}"
            prof = cProfile.Profile()
            prof.enable()
            b.timed(args.steps)
            prof.disable()
            with open(os.path.join(args.profile, name + ".cprofile.txt"), "w") as f:
                stats = pstats.Stats(prof, stream=f)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(60)
                # the engine's own functions (AMSP rows): what each step calls, and how often
                stats.sort_stats("cumulative").print_stats("amsp_dtensor/engine", 60)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
                b.timed(args.steps)
            table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
            with open(os.path.join(args.profile, name + ".torch.txt"), "w") as f:
                f.write(table)
            print(f"profiled {name}")
    dist.destroy_process_group()


def markdown(rows: list[dict], args) -> str:
    model = (f"TinyMoE ({args.experts} experts, top 2, ep {args.ep})" if args.ep else "TinyLlama")
    lines = [f"W={args.world} ({args.per_node} per node), {model} dim {args.dim}, "
             f"{args.blocks} blocks ({args.blocks + 3} units), seq {args.seq}; min of "
             f"{args.reps} interleaved reps of {args.steps} steps; load {_load()}",
             "",
             "| mode | configuration | CPU ms/step | wall ms/step | ops/step | CPU vs | ops vs |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r["cpu_vs_baseline"] is None else f"{r['cpu_vs_baseline']:.2f}x {r['baseline']}"
        ops = "" if r["ops_vs_baseline"] is None else f"{r['ops_vs_baseline']:.2f}x"
        lines.append(f"| {r['mode']} | {r['config']} | {r['cpu_ms']:.1f} | {r['wall_ms']:.1f} | "
                     f"{'-' if r['ops'] is None else r['ops']} | {ratio} | {ops} |")
    return "\n".join(lines)


def op_differences(rows: list[dict], top: int = 8) -> str:
    """Per AMSP row, the ops it launches more (or fewer) than its baseline."""
    import collections

    by = {(r["mode"], r["config"]): r for r in rows}
    lines = []
    for r in rows:
        base = by.get((r["mode"], r["baseline"]))
        if base is None or base is r or not r["op_counts"]:
            continue
        diff = collections.Counter(r["op_counts"])
        diff.subtract(base["op_counts"])
        parts = [f"{op.removeprefix('aten.')} {n:+d}" for op, n in
                 sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top] if n]
        lines.append(f"- {r['mode']} {r['config']} vs {r['baseline']}: {', '.join(parts)}")
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.profile:
        profile(args)
        return 0
    rows = run(args)
    print(markdown(rows, args))
    if args.op_diff:
        print("\nops per step beyond the baseline's:\n" + op_differences(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": os.getloadavg(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
