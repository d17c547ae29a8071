"""Same seed, same data, fp32: torchtitan's own FSDP run and AMSP runs give one loss curve.

Baseline: ``--model.name llama3`` is torchtitan's parallelize_llama (FSDP2 over all 4
ranks, i.e. plan (W, W, W) done by torchtitan), with ``--amsp.init_like_single_process``
so its sharded weights start from the same full seeded initialisation AMSP uses (on CPU,
DTensor random init depends on the layout; see amsp_dtensor/titan/weights.py).
AMSP runs: (4, 4, 4) = ZeRO-3 by the engine, the recipe's (2, 2, 4), and (1, 1, 4) =
ZeRO-1 (the engine's s_p = 1 path, without FSDP).
The recipe is fp32 (training.dtype and mixed_precision_param), 2 micro-batches per step.
"""

from __future__ import annotations

import pytest

from test_titan import losses, torchrun

STEPS = 4
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    dump = tmp_path_factory.mktemp("fsdp")
    torchrun(["--model.name", "llama3", "--amsp.init_like_single_process",
              "--training.steps", str(STEPS)], dump)
    return losses(dump)


@pytest.mark.parametrize("plan", [(4, 4, 4), (2, 2, 4), (1, 1, 4)], ids=lambda p: "p{}-g{}-os{}".format(*p))
def test_amsp_loss_curve_matches_torchtitan_fsdp(plan, baseline, tmp_path):
    s_p, s_g, s_os = plan
    torchrun(["--amsp.param_shard", str(s_p), "--amsp.grad_shard", str(s_g),
              "--amsp.optim_shard", str(s_os), "--training.steps", str(STEPS)], tmp_path)
    curve = losses(tmp_path)
    assert len(curve) == len(baseline) == STEPS
    assert baseline[-1] < baseline[0] - 0.3  # it trains: the comparison is not of flat lines
    for step, (got, want) in enumerate(zip(curve, baseline), start=1):
        assert abs(got - want) <= REL_TOL * abs(want), (step, got, want, curve, baseline)
