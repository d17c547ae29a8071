"""The planner with Muon (choose_plan(optimizer="muon"), the CLI's --optimizer muon): what
it adds to a plan against the same plan under AdamW, each part against its own formula:
the owner exchange (plan/cost/muon.py, whose events equal the recorder's in
tests/muon_cases.py's check_exchange), one fp32 momentum in place of AdamW's two moments,
the busiest owner's Newton-Schulz on the step's critical path, and the refusals."""

from __future__ import annotations

import pytest

from amsp_dtensor.plan.__main__ import main
from amsp_dtensor.plan.cost.models import MODELS
from amsp_dtensor.plan.cost.muon import muon_matrices, owner_flops, predicted_muon_events
from amsp_dtensor.plan.cost.planner import choose_plan
from amsp_dtensor.plan.cost.step import ComputeModel

M8B = MODELS["llama3_8b"]
JOB = dict(seq_len=4096, micro_batch=1, micro_batches=2, world_size=64, ranks_per_node=8,
           memory_budget_bytes=80 * 2 ** 30)


def _estimate(name: str, optimizer: str):
    report = choose_plan(M8B, **JOB, optimizer=optimizer)
    return next(c for c in report.candidates if c.plan.name == name), report


@pytest.mark.parametrize("name", ["p8-g8-os16", "p8-g8-os64", "p64-g64-os64", "p1-g1-os1"])
def test_muon_adds_its_exchange_state_and_newton_schulz_to_the_plan(name):
    adamw, _ = _estimate(name, "adamw")
    muon, report = _estimate(name, "muon")
    plan = muon.plan
    shapes = muon_matrices(M8B)
    assert len(shapes) == 32 * 7 and all(len(s) == 2 for s in shapes)  # every block matrix
    # the exchange: the plan's events plus Muon's two all-to-alls over the shard group
    extra = predicted_muon_events(plan, shapes)
    assert muon.events == adamw.events + extra
    assert len(extra) == (0 if plan.s_os == 1 else 2)
    # one fp32 momentum (4 bytes an element of this rank's rows) where AdamW keeps two
    rows = sum(-(-m // plan.s_os) * n for m, n in shapes)
    assert adamw.memory.states.optim - muon.memory.states.optim == 4 * rows
    assert muon.memory.states.param == adamw.memory.states.param
    # the step: the exchange, then the busiest owner's Newton-Schulz at the compute rate
    flops = max(owner_flops(shapes, plan.s_os))
    exchange = sum(_time(report, e) for e in extra)
    gap = muon.step_seconds - adamw.step_seconds
    assert gap == pytest.approx(exchange + flops / ComputeModel().compute_flops, rel=1e-9)
    assert report.settings["optimizer"] == "muon"


def _time(report, event):
    """The collective's time under the report's model (choose_plan's default: NCCL's
    tuning model of a node of ranks_per_node GPUs)."""
    from amsp_dtensor.plan.cost.nccl import NcclModel

    assert report.time_model.startswith("NCCL tuning model"), report.time_model
    return NcclModel(gpus_per_node=8).time(event.op, event.nbytes, event.group)


def test_the_cli_prints_the_owners_newton_schulz_balance_at_8b_on_64_ranks(capsys):
    """The chosen plan shards OS over all 64 ranks: each of them owns whole matrices, and
    the largest-first assignment keeps every rank within 10% of the mean."""
    assert main(["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8",
                 "--gpu-mem", "80", "--optimizer", "muon", "--top", "2"]) == 0
    out = capsys.readouterr().out
    load = owner_flops(muon_matrices(M8B), 64)
    mean = sum(load) / 64
    assert max(load) <= 1.10 * mean and min(load) >= 0.90 * mean
    assert (f"TFLOP per step: max {max(load) / 1e12:.2f}, mean {mean / 1e12:.2f}, min "
            f"{min(load) / 1e12:.2f} ({max(load) / mean - 1:+.1%} / {min(load) / mean - 1:+.1%} "
            "of the mean)") in out
    assert "chosen: p64-g64-os64" in out and "(64 OS ranks own the matrices)" in out


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "muon", "--tp", "2"], "--optimizer muon with --tp 2: AMSP runs Muon on a "
     "dense model without TP; use --optimizer adamw there"),
    (["--optimizer", "muon", "--model", "deepseek_v3_16b", "--ep", "8"],
     "--optimizer muon with deepseek_v3_16b's experts"),
])
def test_the_cli_refuses_muon_where_amsp_does_not_run_it(capsys, argv, message):
    base = ["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem", "80"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_choose_plan_refuses_an_unknown_optimizer_and_muon_beside_tp_or_experts():
    with pytest.raises(ValueError, match=r"optimizer='sgd'; use one of \('adamw', 'muon'\)"):
        choose_plan(M8B, **JOB, optimizer="sgd")
    with pytest.raises(ValueError, match="optimizer='muon' with tensor parallelism"):
        choose_plan(M8B, **JOB, optimizer="muon", tp=2)
    with pytest.raises(ValueError, match="optimizer='muon' with experts"):
        choose_plan("deepseek_v3_16b", **JOB, optimizer="muon", ep=8)


# The step's buffers against a measured step: rank 0 of a fake 16-rank job (8 per node,
# torch's fake process group: the all-to-alls allocate their outputs and move nothing),
# TinyLlama dim 256, 4 blocks, fp32, Muon on the blocks' matrices and AdamW on the rest;
# glibc's bytes in use sampled after every op of optimizer.step(), over those before it.
MEASURED_PLANS = ("p8-g8-os16", "p16-g16-os16", "p1-g1-os1")


def _measure_step_peaks() -> dict[str, dict[str, int]]:
    import gc

    import torch

    from amsp_dtensor import compat
    from amsp_dtensor.plan import ShardingPlan
    from amsp_dtensor.plan.cost.memory import step_bytes
    from amsp_dtensor.plan.cost.models import ModelShape
    from amsp_dtensor.plan.cost.muon import muon_step
    from tools import host_bench
    from tools.bench_memory import PeakMemory

    args = host_bench.parse_args(["--world", "16", "--per-node", "8", "--blocks", "4",
                                  "--dim", "256", "--seq", "16"])
    torch.set_num_threads(1)
    compat.init_fake_process_group(0, args.world)
    shape = ModelShape("tiny", args.dim, args.blocks, 4, 100, 2 * args.dim, layout="titan")
    meshes, out = {}, {}
    for plan in MEASURED_PLANS:
        bench = host_bench.Bench(f"amsp:{plan}+muon", "eager", args, meshes)
        for _ in range(2):  # the states and every buffer exist
            bench.step()
        bench.loss_fn(bench.model(bench.inputs), bench.targets).backward()
        gc.collect()
        mem = PeakMemory()
        with mem.every_op():
            bench.optim.step()
        bench.finish()
        resolved = ShardingPlan.from_name(plan).resolve(args.world, args.per_node)
        muon = muon_step(shape, resolved)
        model = step_bytes(shape, resolved, "fp32", optimizer_scratch=muon.scratch_bytes)
        plain = step_bytes(shape, resolved, "fp32")
        out[plan] = {"measured": mem.peak_delta, "model": model.gather + model.scratch,
                     "without_muon": plain.gather + plain.scratch}
        del bench
        gc.collect()
    return out


def test_the_step_buffers_bound_a_measured_muon_step():
    """The model's bytes beyond the states at the step's peak (the post-step all-gathers'
    buffers, or the masters and the optimizers' scratch with Muon's step buffers) are at
    or above the measured step and within 40% of it, and Muon's own buffers are
    needed for that: without them the model falls below the measurement at every plan."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          timeout=600, cwd=repo, env={**__import__("os").environ,
                                                      "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    for plan, p in peaks.items():
        print(f"{plan}: measured {p['measured'] / 1e6:.2f} MB, model {p['model'] / 1e6:.2f} MB "
              f"({p['without_muon'] / 1e6:.2f} MB without Muon's buffers)")
        assert p["measured"] <= p["model"] <= 1.4 * p["measured"], (plan, p)
        assert p["without_muon"] < p["measured"], (plan, p)


if __name__ == "__main__":
    import json

    print(json.dumps(_measure_step_peaks()))
