"""Mixture-of-experts models through torchtitan 0.2.2 with AMSP: the [amsp] expert factors
and expert parallelism refused in one line before start-up where they cannot work."""

from __future__ import annotations

import pytest

from test_titan import _main

MOE = ["--model.name", "qwen3_amsp", "--model.flavor", "debugmodel_moe"]


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
     "parallelism.expert_parallel_degree=2 with tensor_parallel_degree=2: expert parallelism "
     "beside tensor parallelism is not supported"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2",
      "--parallelism.expert_tensor_parallel_degree", "2"], 4, 2,
     "parallelism.expert_tensor_parallel_degree=2: AMSP runs the routed experts without "
     "tensor parallelism"),
    (["--amsp.expert_param_shard", "2"], 4, 2,
     "amsp.expert_param_shard=2: llama3_amsp debugmodel has no MoE layers; remove the [amsp] "
     "expert_* factors"),
    (["--parallelism.expert_parallel_degree", "2"], 4, 2,
     "parallelism.expert_parallel_degree=2: llama3_amsp debugmodel has no MoE layers"),
    ([*MOE, "--parallelism.expert_parallel_degree", "2", "--amsp.plan", "auto"], 4, 2,
     "amsp.plan='auto' with expert parallelism or [amsp] expert factors: the planner does "
     "not choose expert plans yet"),
], ids=["expert-factor-outside-the-expert-world", "expert-chain-rule", "ep-not-dividing-ranks",
        "ep-not-dividing-experts", "ep-with-tp", "etp", "expert-keys-on-a-dense-model",
        "ep-on-a-dense-model", "auto-with-experts"])
def test_expert_refusals_are_one_line_before_start_up(argv, world, local, starts_with,
                                                      monkeypatch, capsys):
    if local == 3:
        argv = [*argv, "--amsp.ranks_per_node", "3", "--amsp.optim_shard", "6",
                "--amsp.param_shard", "3", "--amsp.grad_shard", "3"]
    code, err = _main(argv, monkeypatch, capsys, world=world, local=local)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]
