"""Mixture-of-experts models through torchtitan 0.2.2 with AMSP.

Parity: torchtitan's own FSDP2 + expert parallelism (``--model.name deepseek_v3``) and AMSP
(``deepseek_v3_amsp``) under several (dense plan, expert plan) pairs, from the same weights
(torchtitan's seed checkpoint, ``--checkpoint.initial_load_path``), fp32, 4 ranks as 2
simulated nodes x 2, ep 2: the loss of every step within 1e-5 relative.
``AMSP_TITAN_MOE_STEPS`` steps (3 in CI; 10 by hand), ``AMSP_TITAN_MOE_PAIRS`` ("all") and
``AMSP_TITAN_MOE_MODELS`` (deepseek_v3 in CI; qwen3,deepseek_v3 by hand):
tools/titan_moe_parity.sh runs the whole comparison. Then the one-line refusals of the
[amsp] expert factors and of expert parallelism where they cannot work.
"""

from __future__ import annotations

import os

import pytest

from test_titan import _main, losses, save_seed_checkpoint, scalars, torchrun

STEPS = int(os.environ.get("AMSP_TITAN_MOE_STEPS", "3"))
REL_TOL = 1e-5
RUN_S = 600 + 120 * STEPS  # a run's time limit: qwen3 takes about 50 s a step here
# torchtitan's MoE debug flavors at sequence length 64 (the same routing and collectives as
# at 256, a quarter of the tokens: CPU time). qwen3 debugmodel_moe: 8 layers, 64 experts,
# 8 per token; deepseek_v3 debugmodel: a dense first layer, then MoE layers with a shared
# expert and the load-balancing expert bias. Both with fp32 experts: deepseek_v3 takes
# torchtitan's for-loop experts off Hopper GPUs by itself; qwen3's grouped experts compute
# in bf16 (on CPU too), so its fp32 flavor (amsp_dtensor.testing.fp32_experts) sets the
# same for-loop path, for torchtitan's run and AMSP's alike.
MODELS = {
    "qwen3": ("--model.flavor", "debugmodel_moe_fp32", "--training.seq_len", "64",
              "--experimental.custom_import", "amsp_dtensor.testing.fp32_experts"),
    "deepseek_v3": ("--model.flavor", "debugmodel", "--training.seq_len", "64"),
}
# the models CI compares (AMSP_TITAN_MOE_MODELS=qwen3,deepseek_v3 for both): deepseek_v3
# (about 40 s a run of 3 steps here); qwen3 takes about 50 s a step
RUN_MODELS = os.environ.get("AMSP_TITAN_MOE_MODELS", "deepseek_v3").split(",")
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.steps", str(STEPS)]
# (dense plan, expert plan) on 4 ranks, 2 per node; under ep 2 the expert world is 2 ranks,
# 1 per node
PAIRS = {
    # torchtitan's own layout: FSDP over the 4 ranks, experts over efsdp = 4 / 2
    "titan-layout": ((4, 4, 4), (2, 2, 2)),
    "dense-p2-g2-os4-experts-p1-g1-os2": ((2, 2, 4), (1, 1, 2)),
    # the experts sharded more than the dense layers (p1 beside p2)
    "dense-p1-g1-os2-experts-p2-g2-os2": ((1, 1, 2), (2, 2, 2)),
}
_pairs = os.environ.get("AMSP_TITAN_MOE_PAIRS", "all")  # or a comma-separated list
RUN_PAIRS = list(PAIRS) if _pairs == "all" else _pairs.split(",")


def _plan(dense, expert) -> list[str]:
    keys = ("param_shard", "grad_shard", "optim_shard")
    return [*(f for k, v in zip(keys, dense) for f in (f"--amsp.{k}", str(v))),
            *(f for k, v in zip(keys, expert) for f in (f"--amsp.expert_{k}", str(v)))]


def _load(seed) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
            "--checkpoint.interval", "100"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """model -> (its seed checkpoint, torchtitan's own FSDP2 + EP 2 losses from it); each
    model runs once."""
    runs = {}

    def get(model: str):
        if model not in runs:
            flags = MODELS[model]
            seed = save_seed_checkpoint(tmp_path_factory.mktemp(f"{model}_seed"),
                                        ("--model.name", model, *flags))
            dump = tmp_path_factory.mktemp(f"{model}_titan")
            torchrun(["--model.name", model, *flags, *EP2, *_load(seed)], dump, timeout=RUN_S)
            runs[model] = seed, losses(dump)
        return runs[model]

    return get


@pytest.mark.parametrize("pair", RUN_PAIRS)
@pytest.mark.parametrize("model", RUN_MODELS)
def test_moe_loss_matches_torchtitan_fsdp2_ep(model, pair, reference, tmp_path):
    dense, expert = PAIRS[pair]
    seed, want = reference(model)
    torchrun(["--model.name", f"{model}_amsp", *MODELS[model], *EP2, *_plan(dense, expert),
              *_load(seed)], tmp_path, timeout=RUN_S)
    got = losses(tmp_path)
    assert len(got) == len(want) == STEPS
    # it trains (not a comparison of flat lines): deepseek_v3's debug flavor at this
    # learning rate drops at step 2 and rises at 3 (6.228, 5.915, 6.352)
    assert min(want[1:]) < want[0] - 0.05
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= REL_TOL * abs(b), (model, pair, step, got, want)
    tb = scalars(tmp_path)  # the experts' plan and bytes are reported on their own
    assert tb["amsp/expert_s_os"][1] == expert[2] and tb["amsp/s_os"][1] == dense[2]
    assert tb["memory_by_state/expert/param(MiB)"][1] > 0


def test_plan_auto_chooses_both_plans_and_matches_torchtitan(reference, tmp_path):
    """plan = "auto" with ep 2 on deepseek_v3: the planner picks the dense and the expert
    plan (logged), the job runs under that pair (TensorBoard's amsp/s_* and
    amsp/expert_s_*), and its losses equal torchtitan's own FSDP2 + EP from the same
    seed."""
    seed, want = reference("deepseek_v3")
    proc = torchrun(["--model.name", "deepseek_v3_amsp", *MODELS["deepseek_v3"], *EP2,
                     "--amsp.plan", "auto", *_load(seed)], tmp_path, timeout=RUN_S)
    line = next(ln for ln in (proc.stdout + proc.stderr).splitlines()
                if '[amsp] plan = "auto": the planner chose ' in ln)
    chosen = line.split("the planner chose ", 1)[1]
    dense, rest = chosen.split(" + experts ")
    expert = rest.split(" (ep 2)")[0]
    tb = scalars(tmp_path)
    for prefix, name in (("amsp/s_", dense), ("amsp/expert_s_", expert)):
        factors = [int(f.lstrip("pgos")) for f in name.split("-")]
        assert [tb[f"{prefix}{k}"][1] for k in ("p", "g", "os")] == factors, (prefix, name)
    got = losses(tmp_path)
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= REL_TOL * abs(b), (chosen, step, got, want)


MOE = ["--model.name", "qwen3_amsp", "--model.flavor", "debugmodel_moe"]


PP_EP = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
         "--training.global_batch_size", "-1"]


@pytest.mark.skipif(os.environ.get("AMSP_TITAN_MOE_8") != "1",
                    reason="8 ranks (about 4 minutes here): AMSP_TITAN_MOE_8=1, as "
                           "tools/titan_moe_parity.sh sets")
def test_deepseek_v3_pipeline_and_expert_parallel_on_8_ranks(reference, tmp_path_factory):
    """8 ranks = pp 2 x 4 data-parallel ranks, ep 2 inside each stage (the recipe's nodes
    of 2 ranks): torchtitan's own FSDP2 + PP + EP against AMSP with the recipe's dense
    plan p2-g2-os4 and torchtitan's expert layout (p2-g2-os2 over each stage's expert world
    of 2), from the same seed. Under PP the losses are read from TensorBoard (rank 0's
    console line is a sentinel)."""
    seed, _ = reference("deepseek_v3")
    curves = {}
    for name in ("deepseek_v3", "deepseek_v3_amsp"):
        dump = tmp_path_factory.mktemp(f"pp_ep_{name}")
        torchrun(["--model.name", name, *MODELS["deepseek_v3"], *EP2, *PP_EP, *_load(seed)],
                 dump, nproc=8, timeout=1200)
        curves[name] = losses(dump)
    want, got = curves["deepseek_v3"], curves["deepseek_v3_amsp"]
    assert len(got) == len(want) == STEPS and min(want[1:]) < want[0] - 0.05
    for step, (a, b) in enumerate(zip(got, want), start=1):
        assert abs(a - b) <= REL_TOL * abs(b), (step, got, want)


@pytest.mark.parametrize("argv, world, local, starts_with", [
    ([*MOE, "--parallelism.expert_parallel_degree", "2", "--amsp.expert_optim_shard", "4"],
     4, 2, "amsp.expert_optim_shard=4: does not divide the expert world size 2; valid factors "
     "on 2 ranks (1 per node): 1, 2 (expert factors are those of the expert world: 4 "
     "data-parallel ranks / expert_parallel_degree 2 = 2 ranks, 1 per node)"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2", "--amsp.expert_param_shard", "2",
      "--amsp.expert_grad_shard", "1"], 4, 2,
     "amsp.expert_grad_shard=1: expert plan param=2, grad=1, optim=2 breaks"),
    ([*MOE, "--parallelism.expert_parallel_degree", "3"], 4, 2,
     "parallelism.expert_parallel_degree=3: ep=3 does not divide the data-parallel world of "
     "4 ranks"),
    ([*MOE, "--parallelism.expert_parallel_degree", "3"], 6, 3,
     "parallelism.expert_parallel_degree=3: qwen3_amsp debugmodel_moe has 64 experts per MoE "
     "layer, which 3 ranks cannot split evenly"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
      "2", "--amsp.optim_shard", "2"], 4, 2,
     "parallelism.expert_parallel_degree=2 with tensor_parallel_degree=2: AMSP runs expert "
     "parallelism beside tensor parallelism with torchtitan 0.3"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2",
      "--parallelism.expert_tensor_parallel_degree", "2"], 4, 2,
     "parallelism.expert_tensor_parallel_degree=2: AMSP runs the routed experts without "
     "tensor parallelism"),
    (["--amsp.expert_param_shard", "2"], 4, 2,
     "amsp.expert_param_shard=2: llama3_amsp debugmodel has no MoE layers; remove the [amsp] "
     "expert_* factors"),
    (["--parallelism.expert_parallel_degree", "2"], 4, 2,
     "parallelism.expert_parallel_degree=2: llama3_amsp debugmodel has no MoE layers"),
    ([*MOE, "--parallelism.pipeline_parallel_degree", "2", "--amsp.optim_shard", "2"], 4, 2,
     "parallelism.pipeline_parallel_degree=2: qwen3_amsp has no pipelining_fn in torchtitan"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2", "--amsp.plan", "auto",
      "--amsp.expert_optim_shard", "2"], 4, 2,
     "amsp.expert_optim_shard=2 with amsp.plan='auto': the planner chooses the expert plan "
     "too; remove the [amsp] expert_* factors"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2", "--compile.enable"], 4, 2,
     "compile.enable=True with parallelism.expert_parallel_degree=2: per-block torch.compile "
     "stops at the routed experts' own AMSP unit"),
], ids=["expert-factor-outside-the-expert-world", "expert-chain-rule", "ep-not-dividing-ranks",
        "ep-not-dividing-experts", "ep-with-tp", "etp", "expert-keys-on-a-dense-model",
        "ep-on-a-dense-model", "pp-on-a-model-without-pipelining", "auto-with-expert-factors",
        "compile-with-ep"])
def test_expert_refusals_are_one_line_before_start_up(argv, world, local, starts_with,
                                                      monkeypatch, capsys):
    if local == 3:
        argv = [*argv, "--amsp.ranks_per_node", "3", "--amsp.optim_shard", "6",
                "--amsp.param_shard", "3", "--amsp.grad_shard", "3"]
    code, err = _main(argv, monkeypatch, capsys, world=world, local=local)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]


def test_the_fp32_flavor_is_qwen3s_own_with_for_loop_experts():
    """The qwen3 flavor the parity runs use (amsp_dtensor.testing.fp32_experts): torchtitan's
    debugmodel_moe with the routed experts on torchtitan's own for-loop path, nothing else
    changed, and the fp32 output of torchtitan's GroupedExperts on that path."""
    import dataclasses

    import torch

    import amsp_dtensor.testing.fp32_experts  # noqa: F401  (first: the CPU shims; the flavors)
    from torchtitan.models.moe.moe import GroupedExperts
    from torchtitan.models.qwen3 import qwen3_args

    base, fp32 = qwen3_args["debugmodel_moe"], qwen3_args["debugmodel_moe_fp32"]
    assert base.moe_args.use_grouped_mm and not fp32.moe_args.use_grouped_mm
    assert dataclasses.replace(fp32, moe_args=base.moe_args) == base
    assert "debugmodel_fp32" not in qwen3_args  # dense flavors have no experts to change
    torch.manual_seed(0)
    experts = GroupedExperts(dim=8, hidden_dim=16, num_experts=3,
                             use_grouped_mm=fp32.moe_args.use_grouped_mm)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w)
    x, counts = torch.randn(10, 8, dtype=torch.float64), torch.tensor([4, 0, 6])
    out = experts.double()(x, counts)
    want = torch.cat([(torch.nn.functional.silu(xe @ experts.w1[e].T) * (xe @ experts.w3[e].T))
                      @ experts.w2[e].T for e, xe in zip((0, 2), (x[:4], x[4:]))])
    assert out.dtype == torch.float64 and torch.allclose(out, want, rtol=1e-12, atol=0)
