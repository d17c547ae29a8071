"""torchtitan's float8 training (torchao's Float8Linear, emulated on CPU) under AMSP.

torchtitan's float8_emulation feature: ``--model.converters quantize.linear.float8
--quantize.linear.float8.emulate`` with FSDP2's float8 all-gather
(``enable_fsdp_float8_all_gather``) and the scales precomputed after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``), and the same without the all-gather flags.
2 ranks, plan (2, 2, 2) (the linears' weights are FSDP2 params), fp32 master weights built
from the high-precision tensor inside torchao's weight wrapper.

Reference: torchtitan's own FSDP2 float8 run with the all-gather flags (the feature as
torchtitan's list has it), from the same initial weights (``--model.name llama3
--amsp.init_like_single_process``): AMSP's losses in both modes within 1e-4 relative. The
two modes are the same math: each weight is cast with the scale of its whole tensor's
amax (all-reduced over the shards in the all-gather mode, computed in float64 either
way), so the mode changes what is sent, not the numbers. In the all-gather mode the
recorder's P all-gathers carry 1 byte per element of the float8 linears' weights instead
of 4: 3 bytes less per such element gathered, counted from the model below.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from test_titan import RECIPE, scalars, torchrun

STEPS = 3
REL_TOL = 1e-4
FLOAT8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"]
ALL_GATHER = ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
              "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
SHORT = ["--training.steps", str(STEPS), "--training.seq_len", "128",
         "--training.global_batch_size", "4", "--amsp.ranks_per_node", "2",
         "--amsp.param_shard", "2", "--amsp.grad_shard", "2", "--amsp.optim_shard", "2"]
TITAN = ["--model.name", "llama3", "--amsp.init_like_single_process"]

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (pip install -e '.[float8]')")


def test_float8_without_torchao_is_one_line_before_start_up(monkeypatch, capsys):
    from amsp_dtensor import train

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    code = train.main(["--job.config_file", str(RECIPE), *FLOAT8])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        "amsp_dtensor.train: error: model.converters=['quantize.linear.float8']: "
        "quantize.linear.float8 is torchao's training recipe and torchao is not installed; "
        "pip install amsp_dtensor[float8] (or pip install torchao)")
    monkeypatch.delitem(sys.modules, "torchao")
    if importlib.util.find_spec("torchao") is not None:  # installed: the same job is accepted
        job_config, _ = train.read_job_config(["--job.config_file", str(RECIPE), *FLOAT8])
        assert train.check_amsp(job_config) is not None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, args in {"titan_all_gather": [*TITAN, *FLOAT8, *ALL_GATHER],
                       "amsp_all_gather": [*FLOAT8, *ALL_GATHER],
                       "amsp": FLOAT8}.items():
        dump = tmp_path_factory.mktemp(name)
        proc = torchrun([*SHORT, *args], dump, nproc=2)
        out[name] = (scalars(dump), proc.stdout + proc.stderr)
    return out


def _float8_elements_gathered_per_step() -> int:
    """Elements of Float8Linear weights in the P all-gathers of one step: torchtitan
    converts every nn.Linear whose dims are multiples of 16 (its module_filter_fn); the
    forward gathers every unit once, backward the blocks and the embeddings again (their
    units reshard after forward), not [norm, output]."""
    import torch
    import torch.nn as nn
    from torchtitan.models.llama3 import Transformer, llama3_args

    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel"])

    def float8(module):
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear)
                   and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 16 == 0)

    return float8(model) + sum(float8(block) for block in model.layers.values())


@needs_torchao
@pytest.mark.parametrize("mode", ["amsp_all_gather", "amsp"])
def test_float8_trains_through_amsp_like_torchtitan(runs, mode):
    got, log = runs[mode]
    want, _ = runs["titan_all_gather"]
    curve = want["loss_metrics/global_avg_loss"]
    assert sorted(got["loss_metrics/global_avg_loss"]) == sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1] - 0.3  # it trains
    for step, value in curve.items():
        mine = got["loss_metrics/global_avg_loss"][step]
        assert abs(mine - value) <= REL_TOL * abs(value), (step, mine, value)
    assert ("Swapped to Float8Linear layers with enable_fsdp_float8_all_gather="
            f"{mode == 'amsp_all_gather'}") in log
    # the scales are computed right after the step: the update must have landed by then
    overlap_off = "[amsp] overlap_param_update off: the float8 weight scales" in log
    assert overlap_off == (mode == "amsp_all_gather")


@needs_torchao
def test_float8_all_gather_sends_one_byte_per_element(runs):
    fp8, _ = runs["amsp_all_gather"]
    hp, _ = runs["amsp"]
    saved = 3 * _float8_elements_gathered_per_step()
    for step in range(1, STEPS + 1):
        assert fp8["comm/all_gather/p/count"][step] == hp["comm/all_gather/p/count"][step]
        assert hp["comm/all_gather/p/bytes"][step] - fp8["comm/all_gather/p/bytes"][step] == saved
