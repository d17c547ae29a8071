"""tools/bench_peers without the peers' heavy runs: a missing peer is one line naming the
install command, the CUDA stand-ins for Megatron-FSDP are undone, MiCS runs in its own
process set; and, where the peers are installed, DeepSpeed ZeRO-2 and Megatron-FSDP
ZeRO-3 train the same model as DDP on 2 gloo ranks (loss per step within 1e-5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import bench_peers as P

REPO = Path(__file__).resolve().parents[1]


def test_missing_peer_is_one_line_and_mics_has_its_own_process_set(monkeypatch, tmp_path):
    monkeypatch.setattr(P, "ROOT", tmp_path)
    line = P.missing("ds_mics:2")
    assert line == ("ds_mics:2: runs/peers/ds0196 is not installed "
                    "(python -m tools.bench install-peers)")
    assert "runs/peers/common" in P.missing("mfsdp_z3") and "ds0198" in P.missing("ds_z1")
    assert P.missing("zero3") is None and P.missing("amsp:p2-g2-os4") is None
    (tmp_path / "ds0198" / "deepspeed").mkdir(parents=True)
    assert P.missing("ds_hpz:2") is None and P.missing("ds_mics:4") is not None
    assert [P.env_of(k) for k in ("ds_mics:2", "ds_z3", "mfsdp_hfsdp:2", "ddp")] == \
        ["mics", "main", "main", "main"]


def test_cuda_shim_is_undone():
    before = (torch.cuda.current_device, torch.cuda.Stream, torch.Tensor.cuda)
    shim = P._CudaShim()
    assert torch.cuda.current_device() == 0
    t = torch.ones(2)
    assert t.cuda() is t and torch.cuda.current_stream().wait_event(torch.cuda.Event())
    shim.restore()
    assert (torch.cuda.current_device, torch.cuda.Stream, torch.Tensor.cuda) == before


@pytest.mark.skipif(bool(P.missing("mfsdp_z3")),
                    reason="peers not installed (python -m tools.bench install-peers)")
def test_cuda_shim_makes_megatron_fsdp_gathers_wait(monkeypatch):
    """Its coalesced all-gathers are asked for asynchronously; under the shim they are
    waited for (no stream orders a bucket's reuse after its gather on CPU)."""
    monkeypatch.setattr(sys, "path", [str(P.ROOT / "common"), *sys.path])
    from megatron_fsdp import param_and_grad_buffer as buffers

    asked = []
    monkeypatch.setattr(buffers, "_coalescing_manager",
                        lambda group=None, device=None, async_ops=False: asked.append(async_ops))
    shim = P._CudaShim()
    buffers._coalescing_manager("g", async_ops=True)
    shim.restore()
    buffers._coalescing_manager("g", async_ops=True)
    assert asked == [False, True]


@pytest.mark.skipif(bool(P.missing("ds_z2") or P.missing("mfsdp_z3")),
                    reason="peers not installed (python -m tools.bench install-peers)")
def test_peers_train_the_same_model_as_ddp(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tools.bench_worker", "--runs", "ddp,ds_z2,mfsdp_z3", "--reps", "1",
         "--warmup", "1", "--warmup-micro-batches", "2", "--steps", "2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    ref = res["ddp"]["losses"]
    # a first step of 2 micro-batches, then two of 4: DeepSpeed is told the boundary and
    # the scale per step, so its short step is the same as DDP's
    for key in ("ds_z2", "mfsdp_z3"):
        assert len(res[key]["losses"]) == 3
        assert max(abs(a - b) for a, b in zip(res[key]["losses"], ref)) < 1e-5, key
        state = res[key]["state_bytes_per_rank"][0]
        assert state["optim"] >= 8 * 6_163_712 // 2  # AdamW's two moments, sharded over 2
