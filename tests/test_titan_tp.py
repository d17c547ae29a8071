"""torchtitan with tensor parallelism under AMSP (4 ranks: dp 2 x tp 2, the debug recipe).

Same seed, same data, fp32: torchtitan's own FSDP2 + TP run (``--model.name llama3``,
``--amsp.init_like_single_process`` so its 2-D sharded weights start from one full seeded
initialisation, as AMSP's do) and AMSP runs of the plans (2, 2, 2) and (1, 1, 2) over the
data-parallel world give one loss curve, and the same global grad norm.

The global grad norm: the AMSP runs' step-1 norm agrees with the float64 norm of the same
gradients to within 1e-7; torchtitan's own (torch.nn.utils.get_total_norm over FSDP2's
DTensor grads, fp32) is 8e-6 below it, at tp 1 and tp 2 alike (measured on the debug
recipe: float64 1.12638384, AMSP 1.12638378, torchtitan FSDP2 1.12637460). Over 20 steps
the two runs' norms differ by up to 1.005e-5 relative (step 6: AMSP 2.2072773, torchtitan
2.2072551), so the test bounds the difference by 2e-5 relative.

Steps per run: 3 in CI (``AMSP_TITAN_TP_STEPS`` sets it; 20 is the full comparison), on
half the recipe's sequence length to keep the three launches short.
The [parallelism] refusals run in-process: one line, exit 2, before any process group.
"""

from __future__ import annotations

import os

import pytest

from test_titan import RECIPE, scalars, torchrun

STEPS = int(os.environ.get("AMSP_TITAN_TP_STEPS", "3"))
SHORT = ["--training.seq_len", "128", "--training.steps", str(STEPS),
         "--parallelism.tensor_parallel_degree", "2"]
REL_TOL = 1e-4
NORM_REL_TOL = 2e-5


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    dump = tmp_path_factory.mktemp("fsdp_tp")
    torchrun(["--model.name", "llama3", "--amsp.init_like_single_process", *SHORT], dump)
    return scalars(dump)


@pytest.mark.parametrize("plan", [(2, 2, 2), (1, 1, 2)], ids=lambda p: "p{}-g{}-os{}".format(*p))
def test_amsp_with_tp_matches_torchtitan_fsdp2_with_tp(plan, fsdp_tp, tmp_path):
    s_p, s_g, s_os = plan
    proc = torchrun([*SHORT, "--amsp.param_shard", str(s_p), "--amsp.grad_shard", str(s_g),
                     "--amsp.optim_shard", str(s_os)], tmp_path)
    log = proc.stdout + proc.stderr
    assert f"[amsp] plan p{s_p}-g{s_g}-os{s_os} on 2 ranks (1 per node) x tensor parallel 2" in log
    assert "Applied Tensor Parallelism to the model" in log  # torchtitan's own apply_tp
    got, want = scalars(tmp_path), fsdp_tp
    curve = want["loss_metrics/global_avg_loss"]
    assert sorted(got["loss_metrics/global_avg_loss"]) == sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1] - 0.3  # it trains: not a comparison of flat lines
    for step, value in curve.items():
        mine = got["loss_metrics/global_avg_loss"][step]
        assert abs(mine - value) <= REL_TOL * abs(value), (step, mine, value)
    for step, value in want["grad_norm"].items():
        mine = got["grad_norm"][step]
        assert abs(mine - value) <= NORM_REL_TOL * value, (step, mine, value)
    # the clip's scalar all-reduce over "tp" is recorded under its own mesh dim
    assert got["comm/all_reduce/tp/count"][1] == 1


def _main(argv, monkeypatch, capsys, rank=0):
    from amsp_dtensor import train

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", str(rank))
    code = train.main(["--job.config_file", str(RECIPE), *argv])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv, starts_with", [
    (["--parallelism.context_parallel_degree", "2"],
     "parallelism.context_parallel_degree=2: AMSP composes with data and tensor parallelism only"),
    (["--parallelism.pipeline_parallel_degree", "2"],
     "parallelism.pipeline_parallel_degree=2: AMSP composes with data and tensor parallelism only"),
    (["--parallelism.expert_parallel_degree", "2"],
     "parallelism.expert_parallel_degree=2: AMSP composes with data and tensor parallelism only"),
    (["--parallelism.tensor_parallel_degree", "4"],  # the recipe's [amsp] ranks_per_node = 2
     "parallelism.tensor_parallel_degree=4: does not divide the 2 ranks per node"),
    (["--parallelism.tensor_parallel_degree", "2"],  # the recipe's optim_shard = 4 > dp 2
     "amsp.optim_shard=4: does not divide the world size 2"),
], ids=["cp", "pp", "ep", "tp-not-dividing-ranks-per-node", "factor-outside-the-dp-world"])
def test_parallelism_refusals_are_one_line_before_start_up(argv, starts_with, monkeypatch, capsys):
    code, err = _main(argv, monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]
    if "world size 2" in starts_with:
        assert "under parallelism.tensor_parallel_degree=2 the factors are those of the " \
               "data-parallel world: 4 / 2 ranks" in err[0]
    code, err = _main(argv, monkeypatch, capsys, rank=1)  # once per job: other ranks quiet
    assert code == 2 and err == []
