"""Planner and `python -m amsp_dtensor.plan`: choice, baselines, output, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from amsp_dtensor.plan.cost.comm import AlphaBeta
from amsp_dtensor.plan.cost.nccl import NcclModel
from amsp_dtensor.plan.cost.planner import STEP_TIME_TIE, NoPlanFits, choose_plan
from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.plan.__main__ import main

GiB = 2**30
PAPER = dict(seq_len=4096, micro_batch=1, micro_batches=1, world_size=1024, ranks_per_node=8)


@pytest.fixture(scope="module")
def paper_7b():
    """LLaMA-7B on 1024 GPUs with 80 GiB each: one planner run (~2 s) for the tests that
    only read it."""
    return choose_plan("llama_7b", memory_budget_bytes=80 * GiB, **PAPER)


def test_best_is_fastest_fitting_plan(paper_7b):
    r = paper_7b
    fitting = [c for c in r.candidates if c.fits]
    assert len(r.candidates) == len(enumerate_plans(1024, 8))
    assert r.best is fitting[0]
    fastest = min(c.step_seconds for c in fitting)
    # plans within 1% of the fastest step are ties; the chosen one moves the fewest bytes
    ties = [c for c in fitting if c.step_seconds <= fastest * (1 + STEP_TIME_TIE)]
    assert r.best in ties
    assert r.best.comm_seconds == min(c.comm_seconds for c in ties)
    assert not r.baselines["ddp"].fits  # 16 B/param of 6.7B does not fit 80 GiB
    assert r.to_toml().startswith("[amsp]\nparam_shard = ")


def test_step_time_columns_are_consistent(paper_7b):
    r = paper_7b
    for c in r.candidates[:5] + list(r.baselines.values()):
        st = c.step
        assert st.comm_sum_seconds == pytest.approx(c.comm_seconds)
        # overlap can hide communication, never add to it
        assert st.compute_seconds <= st.seconds <= st.compute_seconds + c.comm_seconds + 1e-9
        assert st.exposed_comm_seconds == pytest.approx(st.seconds - st.compute_seconds)


def test_fully_sharded_groups_use_the_node_nics(paper_7b):
    # ZeRO-3 at 1024 ranks: every all-gather spans 128 nodes with 8 ranks per node, so
    # the group has the node's 4 NICs (100 GB/s), not one GPU's share (12.5 GB/s).
    r = paper_7b
    z3 = r.baselines["zero3"]
    ag = next(e for e in z3.events if e.op == "all_gather" and e.unit == 0)
    assert (ag.group_size, ag.group_nodes) == (1024, 128)
    t = NcclModel().time(ag.op, ag.nbytes, ag.group)
    assert t < 1.2 * ag.nbytes * 1023 / 1024 / 100e9 + 6e-3
    # and it hides behind compute: exposed communication is a few % of the step
    assert z3.step.exposed_comm_seconds < 0.05 * z3.step.seconds


def test_memory_filter_changes_the_choice():
    small = choose_plan("llama_7b", memory_budget_bytes=29 * GiB, **PAPER)
    assert small.best.memory.total <= 29 * GiB
    with pytest.raises(NoPlanFits) as info:
        choose_plan("llama_7b", memory_budget_bytes=1 * GiB, **PAPER)
    everything = choose_plan("llama_7b", memory_budget_bytes=1 * GiB, require_fit=False, **PAPER)
    smallest = min(everything.candidates, key=lambda c: c.memory.total)
    assert info.value.smallest.plan == smallest.plan
    assert smallest.memory.total > 1 * GiB
    assert f"needs {smallest.memory.total / GiB:.2f} GiB" in str(info.value)


def test_baselines_are_the_systems():
    r = choose_plan("llama3_8b", memory_budget_bytes=80 * GiB, seq_len=8192, micro_batch=1,
                    micro_batches=4, world_size=64, ranks_per_node=8, bandwidth=AlphaBeta())
    names = {k: v.plan.name for k, v in r.baselines.items()}
    assert names == {"ddp": "p1-g1-os1", "zero1": "p1-g1-os64", "zero2": "p1-g64-os64",
                     "zero3": "p64-g64-os64", "hsdp": "p8-g8-os8", "hpz": "p64-g64-os64"}
    assert r.baselines["hpz"].reshard_after_forward == 8
    # hpZ moves backward all-gathers inside the node
    assert r.baselines["hpz"].bytes_inter < r.baselines["zero3"].bytes_inter


def test_torchtitan_args_accepted():
    class Args:  # duck-typed TransformerModelArgs
        dim, n_layers, n_heads, n_kv_heads, vocab_size = 256, 6, 16, None, 2048
        multiple_of, ffn_dim_multiplier = 256, None

    r = choose_plan(Args(), memory_budget_bytes=GiB, seq_len=2048, micro_batch=1,
                    micro_batches=1, world_size=4, ranks_per_node=2)
    assert r.model.num_params == 6_163_712


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "amsp_dtensor.plan", *args],
                          capture_output=True, text=True, timeout=300)


BASE = ["--gpus", "1024", "--gpus-per-node", "8", "--gpu-mem", "80"]


def test_cli_table(capsys):
    assert main(["--model", "llama_7b", *BASE, "--seq-len", "4096", "--micro-batch", "1",
                 "--global-batch-tokens", "4194304"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "baselines:" in out and "HSDP/MiCS" in out and "ZeRO++ hpZ" in out
    assert "Memory in GiB (2^30 B), traffic in GB (1e9 B)" in out
    assert "incl. 5 GiB reserve" in out
    assert out.rstrip().splitlines()[-4] == "[amsp]"


def test_cli_json(capsys):
    assert main(["--model", "llama_7b", *BASE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["name"] == data["candidates"][0]["name"]
    assert data["toml"].startswith("[amsp]")
    assert data["units"] == {"memory": "bytes", "traffic": "bytes", "time": "seconds"}
    assert set(data["baselines"]) == {"ddp", "zero1", "zero2", "zero3", "hsdp", "hpz"}
    chosen = data["chosen"]
    mem = chosen["memory_bytes"]
    assert mem["reserve"] == 5 * GiB
    backward = mem["param"] + mem["grad"] + mem["optim"] + mem["activations"] + mem["temp"]
    step = mem["param"] + mem["optim"] + mem["step"]
    assert mem["total"] == max(backward, step) + mem["reserve"]
    assert mem["peak_phase"] == ("step" if step > backward else "backward")
    for key in ("bytes_intra", "bytes_inter", "wire_bytes_intra", "wire_bytes_inter",
                "node_nic_bytes", "comm_seconds", "step_seconds"):
        assert chosen[key] >= 0, key
    assert chosen["step"]["seconds"] == chosen["step_seconds"]
    assert 0 < chosen["step"]["mfu"] < 1


def test_wire_and_nic_bytes_follow_the_ring():
    # p1-g1-os8 at 1024 x 8: OS subgroup = the node; the sync is an all-reduce over the 128
    # nodes (one rank per node); per rank on the wire 2*(127/128) x buffer, and each node's
    # 8 groups together send 8 x 2*(127/128) x buffer through its NICs.
    r = choose_plan("llama_7b", memory_budget_bytes=float("inf"), **PAPER)
    e = next(c for c in r.candidates if c.plan.name == "p1-g1-os8")
    ars = [ev for ev in e.events if ev.op == "all_reduce" and ev.dim == "rep"]
    buf = sum(ev.nbytes for ev in ars)
    assert e.wire_bytes_inter == pytest.approx(2 * 127 / 128 * buf)
    assert e.node_nic_bytes == pytest.approx(8 * 2 * 127 / 128 * buf)
    assert e.bytes_inter == buf  # the buffer convention: half of what RS + AG would show


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt5", *BASE], "unknown model 'gpt5'"),
    (["--model", "llama_7b", "--gpus", "0", "--gpus-per-node", "8", "--gpu-mem", "80"],
     "--gpus must be positive"),
    (["--model", "llama_7b", "--gpus", "100", "--gpus-per-node", "8", "--gpu-mem", "80"],
     "not a multiple of --gpus-per-node"),
    (["--model", "llama_7b", *BASE, "--global-batch-tokens", "1000"],
     "not a multiple of seq-len x micro-batch x gpus"),
    (["--model", "llama_7b", "--gpus", "1024", "--gpus-per-node", "8", "--gpu-mem", "2",
      "--reserve-gib", "0"],
     "no plan fits in 2.00 GiB per rank; the smallest-memory plan p512-g1024-os1024 needs 28.00 GiB"),
    (["--model", "llama_7b", *BASE, "--bandwidth", "/nonexistent.json"], "cannot read"),
    (["--model", "llama_7b", "--gpus", "8"], "required"),
    (["--gpus", "8", "--gpus-per-node", "8", "--gpu-mem", "8"], "give --model"),
    (["--model", "llama_7b", *BASE, "--seq-len", "abc"], "invalid int value"),
    # non-finite and non-positive numbers
    (["--model", "llama_7b", "--gpus", "8", "--gpus-per-node", "8", "--gpu-mem", "inf"],
     "--gpu-mem must be a finite number, got inf"),
    (["--model", "llama_7b", "--gpus", "8", "--gpus-per-node", "8", "--gpu-mem", "nan"],
     "--gpu-mem must be a finite number, got nan"),
    (["--model", "llama_7b", "--gpus", "8", "--gpus-per-node", "8", "--gpu-mem", "-80"],
     "--gpu-mem must be positive, got -80"),
    (["--model", "llama_7b", "--gpus", "8", "--gpus-per-node", "8", "--gpu-mem", "eighty"],
     "--gpu-mem: invalid number 'eighty'"),
    (["--model", "llama_7b", *BASE, "--reserve-gib", "nan"],
     "--reserve-gib must be a finite number >= 0, got nan"),
    (["--model", "llama_7b", *BASE, "--reserve-gib", "-1"],
     "--reserve-gib must be a finite number >= 0, got -1"),
    (["--model", "llama_7b", *BASE, "--reserve-gib", "80"],
     "--reserve-gib 80 leaves nothing of --gpu-mem 80"),
    (["--model", "llama_7b", *BASE, "--tflops", "inf"], "--tflops must be a finite number"),
    (["--model", "llama_7b", *BASE, "--tflops", "0"], "--tflops must be positive, got 0"),
    (["--model", "llama_7b", *BASE, "--tflops", "400"], "--tflops 400 is above --peak-tflops 312"),
    (["--model", "llama_7b", *BASE, "--nic-gbps", "-25"], "--nic-gbps must be positive"),
    (["--model", "llama_7b", *BASE, "--nvlink-gbps", "inf"], "--nvlink-gbps must be a finite"),
    (["--model", "llama_7b", *BASE, "--micro-batch", "0"], "--micro-batch must be positive"),
    # conflicting model flags
    (["--model", "llama_7b", *BASE, "--kv-heads", "8"], "--kv-heads conflicts with --model llama_7b"),
    (["--model", "llama_7b", *BASE, "--layers", "2"], "--layers conflicts with --model llama_7b"),
    (["--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128", "--vocab", "100",
      "--kv-heads", "3", *BASE], "--kv-heads: model custom_2L_64d"),
    (["--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128", *BASE],
     "(missing --vocab)"),
    # impossible topologies
    (["--model", "llama_7b", "--gpus", "4", "--gpus-per-node", "8", "--gpu-mem", "80"],
     "--gpus-per-node 8 is more than --gpus 4"),
    (["--model", "llama_7b", *BASE, "--nics-per-node", "16"],
     "--nics-per-node 16 is more than --gpus-per-node 8"),
    (["--model", "llama_7b", *BASE, "--nics-per-node", "0"], "--nics-per-node must be positive"),
])
def test_cli_bad_input_one_line_exit_2(args, message, capsys):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert "Traceback" not in captured.err


def test_cli_malformed_table_subprocess(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "amsp_dtensor.bandwidth/1", "entries": [{"op": "x"}]}))
    proc = _cli("--model", "llama3_debugmodel", "--gpus", "4", "--gpus-per-node", "2",
                "--gpu-mem", "1", "--reserve-gib", "0", "--bandwidth", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "malformed bandwidth table" in proc.stderr
    assert proc.stdout == ""


def test_rank_by_comm_sum():
    r = choose_plan("llama_7b", memory_budget_bytes=80 * GiB, rank_by="comm", **PAPER)
    fitting = [c for c in r.candidates if c.fits]
    assert r.best.comm_seconds == min(c.comm_seconds for c in fitting)
    with pytest.raises(ValueError, match="rank_by"):
        choose_plan("llama_7b", memory_budget_bytes=80 * GiB, rank_by="fast", **PAPER)
