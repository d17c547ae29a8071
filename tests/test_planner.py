"""Planner and `python -m amsp_dtensor.plan`: choice, baselines, output, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from amsp_dtensor.cost.comm import AlphaBeta
from amsp_dtensor.cost.planner import NoPlanFits, choose_plan
from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.plan.__main__ import main

GiB = 2**30
PAPER = dict(seq_len=4096, micro_batch=1, micro_batches=1, world_size=1024, ranks_per_node=8)


def test_best_is_fastest_fitting_plan():
    r = choose_plan("llama_7b", memory_budget_bytes=80 * GiB, **PAPER)
    fitting = [c for c in r.candidates if c.fits]
    assert len(r.candidates) == len(enumerate_plans(1024, 8))
    assert r.best is fitting[0]
    assert all(r.best.comm_seconds <= c.comm_seconds for c in fitting)
    # the paper's point: AMSP's choice beats ZeRO-3 and MiCS at 1024 GPUs
    assert r.best.comm_seconds < r.baselines["hsdp"].comm_seconds < r.baselines["zero3"].comm_seconds
    assert r.best.plan.s_p == 8  # P inside a node
    assert not r.baselines["ddp"].fits  # 16 B/param of 6.7B does not fit 80 GiB
    assert r.to_toml().startswith("[amsp]\nparam_shard = 8\n")


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


def test_cli_table_fits_80_columns(capsys):
    assert main(["--model", "llama_7b", *BASE, "--seq-len", "4096", "--micro-batch", "1",
                 "--global-batch-tokens", "4194304"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "baselines:" in out and "HSDP/MiCS" in out and "ZeRO++ hpZ" in out
    assert out.rstrip().endswith("[amsp]\nparam_shard = 8\ngrad_shard = 64\noptim_shard = 64")


def test_cli_json(capsys):
    assert main(["--model", "llama_7b", *BASE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["name"] == data["candidates"][0]["name"]
    assert data["toml"].startswith("[amsp]")
    assert set(data["baselines"]) == {"ddp", "zero1", "zero2", "zero3", "hsdp", "hpz"}
    mem = data["chosen"]["memory_bytes"]
    assert mem["total"] == mem["param"] + mem["grad"] + mem["optim"] + mem["activations"] + mem["temp"]


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt5", *BASE], "unknown model 'gpt5'"),
    (["--model", "llama_7b", "--gpus", "0", "--gpus-per-node", "8", "--gpu-mem", "80"],
     "--gpus must be positive"),
    (["--model", "llama_7b", "--gpus", "100", "--gpus-per-node", "8", "--gpu-mem", "80"],
     "not a multiple of --gpus-per-node"),
    (["--model", "llama_7b", *BASE, "--global-batch-tokens", "1000"],
     "not a multiple of seq-len x micro-batch x gpus"),
    (["--model", "llama_7b", "--gpus", "1024", "--gpus-per-node", "8", "--gpu-mem", "2"],
     "no plan fits in 2.00 GiB per rank; the smallest-memory plan p512-g1024-os1024 needs 28.00 GiB"),
    (["--model", "llama_7b", *BASE, "--bandwidth", "/nonexistent.json"], "cannot read"),
    (["--model", "llama_7b", "--gpus", "8"], "required"),
    (["--gpus", "8", "--gpus-per-node", "8", "--gpu-mem", "8"], "give --model"),
    (["--model", "llama_7b", *BASE, "--seq-len", "abc"], "invalid int value"),
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
                "--gpu-mem", "1", "--bandwidth", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "malformed bandwidth table" in proc.stderr
    assert proc.stdout == ""
