"""tools/gpu_bench.py at its tiny preset on CPU (eager, two steps): every row of the table,
and its flop count against the parameters of the model it builds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_preset_runs_on_cpu_and_prints_every_row(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bench.py"), "--preset", "tiny", "--device",
         "cpu", "--modes", "eager", "--steps", "1", "--warmup", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["config"] for r in rows] == [
        "floor", "fsdp2", "hsdp", "amsp:p4-g4-os4", "amsp:p2-g2-os4", "amsp:p2-g2-os4+opu",
        "amsp:p2-g2-os4+int8"]
    for r in rows:
        assert r["step_s"] > 0 and r["mfu"] is None and r["peak_mem_gib"] is None, r
        assert f"| eager | {r['config']} | " in proc.stdout
    assert next(r for r in rows if r["config"] == "fsdp2")["vs_fsdp2"] == 1.0


def test_flops_count_six_per_parameter_per_token_plus_attention():
    sys.path.insert(0, str(ROOT))
    from tools.gpu_bench import PRESETS, flops_per_step

    from amsp_dtensor.testing.tiny_llama import TinyLlama, TinyLlamaConfig

    p = PRESETS["tiny"]
    cfg = TinyLlamaConfig(vocab_size=p["vocab"], dim=p["dim"], n_layers=p["blocks"],
                          n_heads=p["heads"], ffn_dim=p["ffn"], max_seq_len=p["seq"])
    params = sum(t.numel() for t in TinyLlama(cfg).parameters())
    tokens = 3 * p["seq"]
    attention = 6 * p["blocks"] * p["dim"] * p["seq"] * tokens
    assert flops_per_step(cfg, 3) == 6 * params * tokens + attention
