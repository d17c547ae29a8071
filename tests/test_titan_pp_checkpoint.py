"""torchtitan checkpoints that move between pipeline degrees under AMSP.

AMSP's optimizer entries are keyed by the full model's parameter names
(``optimizer.state.<fqn>.<state>``), which torchtitan's pipeline split keeps on every
stage, so a checkpoint saved under one pipeline split loads under any other.

Under torchrun, 4 ranks, plan p2-g2-os2, 5 steps, a full checkpoint (model, optimizer,
lr_scheduler, dataloader, train_state) every 2 steps, both configurations from one seed
checkpoint (model only):

- ``PP``:    pp 2 x dp 2, schedule 1F1B, 4 micro-batches of 1 per rank
- ``NO_PP``: pp 1 x dp 2 x tp 2, 1 micro-batch of 4 per rank

[Note: why the run without pipeline stages has tp 2] The reference of a resume is the
uninterrupted run of the saving configuration, which needs the resumed run to read the
same data. torchtitan's data loader shards the corpus by data-parallel rank; pp 1 on 4
ranks with dp 4 would read other sequences from step 3 on (AMSP's loader resumes on another
dp world at the same global count, but from another split of the corpus), and
``--checkpoint.exclude_from_loading dataloader`` would read steps 1-2's data again. With
tp 2 both configurations have dp 2: the same 8 sequences per step, the data loader state
loads as saved, and the resumed losses can be compared with the uninterrupted run's to
1e-4 relative. Resumed after step 2, step 3's loss shows the loaded weights, step 4's the
optimizer state, step 5's the LR schedule too. Both configurations are exact against one process, so their uninterrupted
curves agree too (checked).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from test_titan import losses, save_seed_checkpoint, torchrun

STEPS = 5
SAVED_AT = 2
REL_TOL = 1e-4
COMMON = ["--training.local_batch_size", "4", "--training.global_batch_size", "-1",
          "--training.steps", str(STEPS), "--checkpoint.enable",
          "--checkpoint.interval", str(SAVED_AT),
          "--amsp.param_shard", "2", "--amsp.grad_shard", "2", "--amsp.optim_shard", "2"]
CONFIGS = {
    "PP": ["--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.pipeline_parallel_schedule", "1F1B"],
    "NO_PP": ["--parallelism.tensor_parallel_degree", "2"],
}


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory):
    return save_seed_checkpoint(tmp_path_factory.mktemp("seed"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, seed_checkpoint):
    """config -> (dump, losses) of STEPS steps from the seed, saving every SAVED_AT."""
    runs = {}
    for config, flags in CONFIGS.items():
        dump = tmp_path_factory.mktemp(f"uninterrupted-{config}")
        torchrun([*COMMON, *flags, "--checkpoint.initial_load_path", str(seed_checkpoint)],
                 dump, timeout=600)
        runs[config] = dump, losses(dump)
    return runs


def test_both_configurations_train_alike(uninterrupted):
    """The premise of the resume tests below: pp 2 x dp 2 and pp 1 x dp 2 x tp 2 give one
    curve (each is exact against one process)."""
    (_, pp), (_, no_pp) = uninterrupted["PP"], uninterrupted["NO_PP"]
    print(f"uninterrupted PP {pp}\nuninterrupted NO_PP {no_pp}")
    assert len(pp) == len(no_pp) == STEPS
    assert pp[-1] < pp[0] - 0.5  # it trains
    for step, (a, b) in enumerate(zip(pp, no_pp), start=1):
        assert abs(a - b) <= REL_TOL * abs(b), (step, pp, no_pp)


@pytest.mark.parametrize("saved_by, resumed_by", [("PP", "NO_PP"), ("NO_PP", "PP")])
def test_checkpoint_resumes_under_another_pipeline_degree(uninterrupted, saved_by, resumed_by,
                                                          tmp_path):
    """Step 2's full checkpoint of one configuration, resumed by a fresh job of the other:
    its steps 3-5 are the saving configuration's uninterrupted steps 3-5. (Measured by
    hand, pp 2 -> pp 1: the same resume with ``--checkpoint.exclude_from_loading
    optimizer`` is 5.4% off at step 4, with ``lr_scheduler`` excluded 1.3% off at step 5.)"""
    saved, want = uninterrupted[saved_by]
    dump = tmp_path / "resumed"
    step = f"step-{SAVED_AT}"
    shutil.copytree(saved / "checkpoint" / step, dump / "checkpoint" / step)
    proc = torchrun([*COMMON, *CONFIGS[resumed_by]], dump, timeout=600)
    log = proc.stdout + proc.stderr
    assert f"checkpoint/{step}" in log and f"Training starts at step {SAVED_AT + 1}" in log, log[-3000:]
    got = losses(dump)
    print(f"{saved_by} -> {resumed_by}: " + ", ".join(
        f"step {s} resumed {g:.6f} uninterrupted {w:.6f} rel {abs(g - w) / abs(w):.1e}"
        for s, g, w in zip(range(SAVED_AT + 1, STEPS + 1), got, want[SAVED_AT:])))
    assert len(got) == STEPS - SAVED_AT  # not from scratch
    for s, g, w in zip(range(SAVED_AT + 1, STEPS + 1), got, want[SAVED_AT:]):
        assert abs(g - w) <= REL_TOL * abs(w), (s, got, want)


def test_checkpoint_with_optimizer_entries_keyed_by_model_part_is_refused(tmp_path):
    """A checkpoint of the earlier layout (``optimizer.amsp_optim.<part>`` /
    ``.stage<i>``) would load none of this optimizer's entries: one line, before DCP's load,
    naming the way out."""
    import torch.distributed.checkpoint as dcp

    from amsp_dtensor.checkpoint import CheckpointMismatch
    from amsp_dtensor.titan.trainer import _refuse_misfits

    weights = {"w0": torch.ones(4, 4)}
    state = {"master": torch.zeros(4, 4), "exp_avg": torch.zeros(4, 4)}
    dcp.save({**weights, "optimizer": {"amsp_optim.stage0": {"state": {"w0": state}}}},
             checkpoint_id=tmp_path / "step-2", no_dist=True)
    loaded = []
    load = _refuse_misfits(lambda state_dict, checkpoint_id, **kw: loaded.append(checkpoint_id),
                           pipelined=True)
    with pytest.raises(CheckpointMismatch) as e:
        load({**weights, "optimizer": {"state": {"w0": dict(state)}}},
             checkpoint_id=str(tmp_path / "step-2"), from_hf=False, from_quantized=False)
    message = str(e.value)
    assert "\n" not in message and not loaded
    assert message == (
        f"{tmp_path / 'step-2'} keys its AMSP optimizer state by model part "
        "(optimizer.amsp_optim.stage0.state.w0.exp_avg), a layout this version does not read "
        "(it keys it by parameter name, optimizer.state.<fqn>.<state>): resume it with the "
        "amsp_dtensor version that saved it, or load all but the optimizer state "
        "(--checkpoint.exclude_from_loading optimizer)")
