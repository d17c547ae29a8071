"""tools/host_bench.py at a small size: the table's rows, their op counts against the
model's matmul count, and AMSP at FSDP2's schedule against FSDP2's own count.

Runs the tool as a subprocess (it makes torch's fake process group of its own): rank 0 of
4 ranks, 2 per node, 4 blocks (7 units), eager, one timed step. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from amsp_dtensor.engine.optim import STEP_BATCHES

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = 4
CONFIGS = ("fsdp2", "hsdp", "amsp:pW-gW-osW", "amsp:pS-gS-osS", "amsp:p2-g2-os4",
           "amsp:p2-g2-os4+int8", "amsp:p2-g2-os4+opu")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_bench") / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "host_bench.py"), "--world", "4", "--per-node",
         "2", "--blocks", str(BLOCKS), "--modes", "eager", "--steps", "1", "--reps", "1",
         "--warmup", "1", "--configs", ",".join(CONFIGS), "--json", str(out), "--op-diff"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())["rows"]


def test_every_configuration_has_a_row_with_positive_times_and_counts(result):
    stdout, rows = result
    names = [r["config"] for r in rows]
    assert names == ["fsdp2", "hsdp", "amsp:p4-g4-os4", "amsp:p2-g2-os2", "amsp:p2-g2-os4",
                     "amsp:p2-g2-os4+int8", "amsp:p2-g2-os4+opu"]
    for r in rows:
        assert r["cpu_ms"] > 0 and r["wall_ms"] > 0 and r["ops"] > 0, r
        assert f"| eager | {r['config']} |" in stdout


def test_every_system_runs_the_models_matmuls_once(result):
    """Each of the 7 linears per block and the output head: one matmul forward, two
    backward (the input's and the weight's gradient); the sharding adds none."""
    linears = 7 * BLOCKS + 1
    for r in result[1]:
        assert r["matmuls"] == 3 * linears, r["config"]


def test_amsp_at_fsdp2s_schedules_launches_what_fsdp2_does(result):
    """At p = g = os = W the engine's gradient path is FSDP2's reduce-scatter and the
    masters are the fp32 params: beyond FSDP2's ops it adds one division of each unit's
    synced G (FSDP2 divides inside its reduce-scatter) and nothing per tensor. At HSDP's
    schedule every unit's replica all-reduce is still in flight at step() (the fake group
    never reports one completed), so the units are stepped in batches as they land: at
    most STEP_BATCHES calls of the wrapped optimizer, each with one AdamW step's foreach
    kernels (tests/test_step_batches.py counts which units each call steps)."""
    rows = {r["config"]: r for r in result[1]}
    units = BLOCKS + 2  # embedding, blocks, [norm, output] (the root owns no params)
    extra = rows["amsp:p4-g4-os4"]["ops"] - rows["fsdp2"]["ops"]
    assert extra == units, rows["amsp:p4-g4-os4"]["op_counts"]
    adamw = sum(n for op, n in rows["fsdp2"]["op_counts"].items() if op.startswith("aten._foreach"))
    assert adamw >= 8  # one AdamW step: foreach add, lerp, mul, addcmul, sqrt, div, addcdiv ...
    extra = rows["amsp:p2-g2-os2"]["ops"] - rows["hsdp"]["ops"] - units
    assert extra % adamw == 0 and 1 <= extra // adamw <= STEP_BATCHES - 1, (extra, adamw)
