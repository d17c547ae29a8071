"""tools/gpu_check.py runs its CPU part here (one process, torch's fake process group as
rank 5 of 16); on a GPU machine the same command checks the CUDA stream order."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*extra):
    return subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--device", "cpu",
                           *extra], capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_gpu_check_cpu_part_passes():
    proc = _run()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert ("gpu_check: OK (cpu, rank 5 of 16, plan 2,2,8, 6 units); checked per unit: "
            "all-gather input 6, landed P rows 6") in proc.stdout


def test_gpu_check_plan_without_fsdp_units():
    """s_p = 1: every unit holds whole parameters (no FSDP, no all-gather to check); the
    landing of the post-step all-gather into them is still checked, on every unit."""
    proc = _run("--plan", "1,1,16", "--world", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert ("gpu_check: OK (cpu, rank 5 of 16, plan 1,1,16, 6 units); checked per unit: "
            "all-gather input 0, landed P rows 6") in proc.stdout
