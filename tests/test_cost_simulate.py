"""`python -m amsp_dtensor.plan.simulate` at 64 ranks (8 per node) on torch's fake backend:
the real engine's recorded collectives and state bytes equal the cost model's, exactly."""

import dataclasses
import json
import subprocess
import sys

import pytest

from amsp_dtensor.plan.cost.comm import predicted_events
from amsp_dtensor.plan.cost.memory import state_bytes_of_rank, step_bytes
from amsp_dtensor.plan.cost.models import MODELS
from amsp_dtensor.plan import ShardingPlan
from amsp_dtensor.harness.simulate import main

PLANS = ["p8-g64-os64", "p1-g1-os8", "p2-g2-os16", "p1-g16-os16", "p64-g64-os64"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "sim.json"
    args = [sys.executable, "-m", "amsp_dtensor.plan.simulate", "--model", "llama3_debugmodel",
            "--gpus", "64", "--gpus-per-node", "8", "--rank", "63", "--layers", "2",
            "--json", str(out)]
    for p in PLANS:
        args += ["--plan", p]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["plan"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("plan", PLANS)
def test_collectives_and_state_bytes_equal_the_model(reports, plan):
    rep = reports[plan]
    assert rep["collectives_equal"] and not rep["unexpected"]
    for row in rep["kinds"]:
        assert row["recorded_count"] == row["predicted_count"], row
    # the model's numbers, recomputed here from the flavor's shapes with 2 layers
    shape = MODELS["llama3_debugmodel"]
    units = [u for u in shape.unit_param_shapes()[:2]] + [shape.unit_param_shapes()[-1]]
    rp = ShardingPlan.from_name(plan).resolve(64, 8)
    events = predicted_events(rp, units, 2, 2, 2, clip=True)
    assert rep["collectives_recorded"] == sum(e.count for e in events)
    synced = state_bytes_of_rank(units, rp, 63, 2, grads_synced=True)
    accum = state_bytes_of_rank(units, rp, 63, 2, grads_synced=False)
    assert rep["state_bytes"]["measured"] == {
        "param": synced.param, "optim": synced.optim, "grad_synced": synced.grad,
        "grad_accumulating": accum.grad}
    assert rep["states_equal"]
    # the buffers the step leaves alive beside P and OS: synced G and post-step all-gathers
    two_layers = dataclasses.replace(shape, n_layers=2)
    step = step_bytes(two_layers, rp, "bf16", clip=True)
    assert rep["step_buffer_bytes"]["measured"] == {
        "synced_grad": step.synced_grad, "gather": step.gather}
    assert rep["step_buffers_equal"]


MOE_PAIRS = [("p8-g64-os64", "p2-g2-os4"), ("p1-g1-os1", "p1-g1-os8")]


@pytest.fixture(scope="module")
def moe_reports(tmp_path_factory):
    """deepseek_v3_16b's widths (one dense and one MoE block) at 1024 ranks, 8 per node,
    ep 8 (the expert world: 128 ranks, one per node), as rank 77."""
    out = tmp_path_factory.mktemp("sim_moe") / "sim.json"
    args = [sys.executable, "-m", "amsp_dtensor.plan.simulate", "--model", "deepseek_v3_16b",
            "--gpus", "1024", "--gpus-per-node", "8", "--ep", "8", "--rank", "77",
            "--json", str(out)]
    for dense, expert in MOE_PAIRS:
        args += ["--plan", dense, "--expert-plan", expert]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("pair", range(len(MOE_PAIRS)))
def test_moe_collectives_and_state_bytes_of_both_groups_equal_the_model(moe_reports, pair):
    """Every collective of the step (dense, expert, EP's token all-to-alls) and the P, G
    and OS bytes of each group, recorded on rank 77 of 1024, equal the cost model's."""
    rep = moe_reports[pair]
    assert rep["collectives_equal"] and not rep["unexpected"] and rep["states_equal"]
    for row in rep["kinds"]:
        assert row["recorded_count"] == row["predicted_count"], row
    dims = {row["dim"] for row in rep["kinds"]}
    assert "ep" in dims and any(d.startswith("expert_") for d in dims), dims
    tokens = [row for row in rep["kinds"] if row["dim"] == "ep" and row["op"] == "all_to_all"]
    routed = 32 * 6 * 2048 * 2  # seq 32 x top 6 x dim x bf16
    assert {row["nbytes"] for row in tokens} == {routed, 64 * 8}  # and the counts, int64
    assert all(not row["inter_node"] for row in tokens)  # ep 8 inside the node
    expert = [row for row in rep["kinds"] if row["dim"].startswith("expert_")
              and row["group_size"] > 1 and row["dim"] != "expert_shard"]
    assert all(row["inter_node"] for row in expert)  # one expert-world rank per node
    measured, predicted = rep["state_bytes"]["measured"], rep["state_bytes"]["predicted"]
    assert measured == predicted
    assert measured["expert_param"] > 0 and measured["dense_param"] > 0


@pytest.mark.parametrize("args, message", [
    (["--gpus", "64", "--gpus-per-node", "8", "--plan", "p8-g8-os8"], "--model"),
    (["--model", "llama3_8b", "--gpus", "60", "--gpus-per-node", "8", "--plan", "p8-g8-os8"],
     "--gpus 60 is not a multiple of --gpus-per-node 8"),
    (["--model", "llama3_8b", "--gpus", "4", "--gpus-per-node", "8", "--plan", "p8-g8-os8"],
     "--gpus-per-node 8 is more than --gpus 4"),
    (["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--plan", "p3-g3-os3"],
     "--plan p3-g3-os3:"),
    (["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--plan", "p8"],
     "--plan p8:"),
    (["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--plan", "p8-g8-os8",
      "--rank", "64"], "--rank 64 is not in [0, 64)"),
    (["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--plan", "p8-g8-os8",
      "--layers", "0"], "--layers must be positive"),
    (["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--plan", "p8-g8-os8",
      "--seq-len", "x"], "invalid int value"),
    (["--model", "deepseek_v3_16b", "--gpus", "64", "--gpus-per-node", "8", "--ep", "8",
      "--plan", "p8-g8-os8"], "give one --expert-plan per --plan"),
    (["--model", "deepseek_v3_16b", "--gpus", "64", "--gpus-per-node", "8", "--ep", "3",
      "--plan", "p8-g8-os8", "--expert-plan", "p1-g1-os1"], "--ep 3 does not divide"),
    (["--model", "deepseek_v3_16b", "--gpus", "64", "--gpus-per-node", "8", "--ep", "8",
      "--plan", "p8-g8-os8", "--expert-plan", "p16-g16-os16"], "--expert-plan / --ep:"),
    (["--model", "deepseek_v3_16b", "--gpus", "64", "--gpus-per-node", "8", "--ep", "8",
      "--plan", "p8-g8-os8", "--expert-plan", "p1-g1-os1", "--seq-len", "30"],
     "is not a multiple of the 64 experts"),
    (["--model", "llama3_8b", "--gpus", "64", "--gpus-per-node", "8", "--ep", "8",
      "--plan", "p8-g8-os8"], "--ep and --expert-plan apply to a mixture-of-experts"),
])
def test_bad_input_one_line_exit_2(args, message, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and message in lines[0], captured.err
