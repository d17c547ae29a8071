"""torchtitan with tensor parallelism under AMSP (4 ranks: dp 2 x tp 2, the debug recipe).

Same seed, same data, fp32: torchtitan's own FSDP2 + TP run (``--model.name llama3``,
``--amsp.init_like_single_process`` so its 2-D sharded weights start from one full seeded
initialisation, as AMSP's do) and AMSP runs of the plans (2, 2, 2) and (1, 1, 2) over the
data-parallel world give one loss curve, and the same global grad norm.

The global grad norm of step 1 equals the float64 norm of torchtitan's own FSDP2 + TP
gradients (recorded beside its clip by amsp_dtensor.testing.exact_grad_norm) within 1e-6
relative. torchtitan's printed norm is fp32 (torch.nn.utils.get_total_norm) and on CPU
is 8e-6 below that exact norm (debug recipe: float64 1.12638384, AMSP 1.12638378,
torchtitan FSDP2 1.12637460; the fp32 CPU norm of the 2048 x 256 output-projection grad
alone is 1.9e-5 off, single process), so the printed norms are compared at every step
within 2e-5 relative (over 20 steps the largest gap is 1.005e-5, step 6).

Steps per run: 3 in CI (``AMSP_TITAN_TP_STEPS`` sets it; 20 is the full comparison), on
half the recipe's sequence length to keep the three launches short.
The [parallelism] refusals run in-process: one line, exit 2, before any process group.
"""

from __future__ import annotations

import os

import pytest

from test_titan import _main as run_main, RECIPE, scalars, torchrun

STEPS = int(os.environ.get("AMSP_TITAN_TP_STEPS", "3"))
SHORT = ["--training.seq_len", "128", "--training.steps", str(STEPS),
         "--parallelism.tensor_parallel_degree", "2"]
REL_TOL = 1e-4
NORM_REL_TOL = 2e-5  # fp32 printed norms, see above
EXACT_NORM_REL_TOL = 1e-6  # against the float64 norm of torchtitan's gradients


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory):
    dump = tmp_path_factory.mktemp("fsdp_tp")
    exact = dump / "exact_grad_norm.txt"
    torchrun(["--model.name", "llama3", "--amsp.init_like_single_process", *SHORT,
              "--experimental.custom_import", "amsp_dtensor.testing.exact_grad_norm"], dump,
             env={"AMSP_EXACT_GRAD_NORM_FILE": str(exact)})
    got = scalars(dump)
    got["exact_grad_norm"] = {i + 1: float(line) for i, line in enumerate(exact.read_text().split())}
    return got


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
    # step 1, same weights and data: the same gradients, so the same norm when both are exact
    mine, exact, printed = got["grad_norm"][1], want["exact_grad_norm"][1], want["grad_norm"][1]
    assert abs(mine - exact) <= EXACT_NORM_REL_TOL * exact, (mine, exact, printed)
    # the clip's scalar all-reduce over "tp" is recorded under its own mesh dim
    assert got["comm/all_reduce/tp/count"][1] == 1


def test_amsp_with_tp_and_compiled_blocks_matches_torchtitan_fsdp2_with_tp(fsdp_tp, tmp_path):
    """torchtitan's 2d_compile feature (TP + per-block torch.compile) under AMSP, plan
    (1, 1, 2): no FSDP2 unit between the embeddings and the first compiled block, the case
    that needed compat.settle_async_collective (the copy of the mesh fixed for every plan
    is pinned in tests/test_compile_tp.py). aot_eager, as the feature tests compile."""
    proc = torchrun([*SHORT, "--amsp.param_shard", "1", "--amsp.grad_shard", "1",
                     "--amsp.optim_shard", "2", "--compile.enable", "--compile.backend",
                     "aot_eager"], tmp_path)
    assert "Compiling each TransformerBlock with torch.compile" in proc.stdout + proc.stderr
    got, curve = scalars(tmp_path)["loss_metrics/global_avg_loss"], fsdp_tp["loss_metrics/global_avg_loss"]
    assert sorted(got) == sorted(curve) == list(range(1, STEPS + 1))
    for step, value in curve.items():
        assert abs(got[step] - value) <= REL_TOL * abs(value), (step, got[step], value)


def _main(argv, monkeypatch, capsys, rank=0):  # 4 ranks on one node
    return run_main(argv, monkeypatch, capsys, world=4, local=4, rank=rank)


@pytest.mark.parametrize("argv, starts_with", [
    (["--parallelism.context_parallel_degree", "2"],  # on 0.2.2; 0.3: tests/test_titan03.py
     "parallelism.context_parallel_degree=2: AMSP runs context parallelism with torchtitan "
     "0.3 (its K/V all-gather around FlexAttention); torchtitan 0.2.2's runs SDPA through "
     "DTensor, untested with AMSP (on CPU it stops: \"Operator "
     "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
     "strategy\"); use torchtitan 0.3 or set it to 1"),
    (["--parallelism.expert_parallel_degree", "2"],  # the recipe's llama3 has no experts
     "parallelism.expert_parallel_degree=2: llama3_amsp debugmodel has no MoE layers"),
    (["--parallelism.tensor_parallel_degree", "4"],  # the recipe's [amsp] ranks_per_node = 2
     "parallelism.tensor_parallel_degree=4: does not divide the 2 ranks per node"),
    (["--parallelism.tensor_parallel_degree", "2"],  # the recipe's optim_shard = 4 > dp 2
     "amsp.optim_shard=4: does not divide the world size 2"),
], ids=["cp", "ep", "tp-not-dividing-ranks-per-node", "factor-outside-the-dp-world"])
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


def test_loss_parallel_with_a_loss_other_than_cross_entropy(monkeypatch, capsys):
    """torch's loss_parallel() implements cross-entropy only: a train spec with another
    loss is refused in one line naming the key, and passes once loss parallel is off."""
    import dataclasses

    from torchtitan.components.loss import build_mse_loss

    from amsp_dtensor import train
    from amsp_dtensor.titan import specs

    registry = specs._train_spec.get_train_spec
    monkeypatch.setattr(specs._train_spec, "get_train_spec",
                        lambda name: dataclasses.replace(registry(name), build_loss_fn=build_mse_loss))
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--amsp.optim_shard", "2"]
    code, err = _main(tp2, monkeypatch, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        "amsp_dtensor.train: error: parallelism.disable_loss_parallel=false with "
        "tensor_parallel_degree=2: loss parallel computes cross-entropy only, and "
        "llama3_amsp's loss is built by build_mse_loss; set parallelism.disable_loss_parallel "
        "= true (the output projection then returns full logits to that loss)")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    job_config, _ = train.read_job_config(
        ["--job.config_file", str(RECIPE), *tp2, "--parallelism.disable_loss_parallel"])
    assert train.check_amsp(job_config) is not None  # the same job, loss parallel off: accepted
