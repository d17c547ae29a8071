"""Checkpoints through torchtitan on another world size, and a console without repeats.

The data loader (in one process; dp ranks are only arguments to the loader): resumed on the
same dp world it continues exactly; on another dp world each rank stands where that rank of
a run started from scratch on the new world would stand; a checkpoint without the global
count is refused in one line naming the way out.

Under torchrun (the debug recipe, seq_len 64, 4 steps, checkpoint every 2): saved on 4 ranks
under p2-g2-os4, resumed from step 2 by fresh jobs on 2 ranks (p1-g1-os2) and on 8 ranks
(p4-g4-os8, 4 per node). The same-world resume under another plan is
test_titan_equivalence.py's checkpoint feature test (equal losses), not repeated here.
"""

from __future__ import annotations

import logging
import math
import os
import shutil

import pytest
import torch

from test_titan import RECIPE, scalars, torchrun

SEQ_LEN = 64
LOCAL_BATCH = 2
STEPS = 4


# --------------------------------------------------------------------------------------
# The data loader alone.
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job_config():
    from amsp_dtensor.train import parse_job_config

    return parse_job_config(["--job.config_file", str(RECIPE), "--training.seq_len", str(SEQ_LEN)])


@pytest.fixture(scope="module")
def tokenizer(job_config):
    from torchtitan.components.tokenizer import build_hf_tokenizer

    return build_hf_tokenizer(job_config)


def _loader(job_config, tokenizer, world: int, rank: int):
    from amsp_dtensor.titan.dataloader import build_reshardable_text_dataloader

    return build_reshardable_text_dataloader(world, rank, tokenizer, job_config)


def _take(loader, batches: int) -> list[torch.Tensor]:
    """The next ``batches`` label tensors, from one iter() as torchtitan's loop takes them."""
    it = iter(loader)
    return [next(it)[1] for _ in range(batches)]


def _saved_checkpoint(job_config, tokenizer, world: int, batches: int) -> dict:
    """What DCP holds for the data loader after every rank of a ``world``-rank run took
    ``batches`` batches: the union of the ranks' keys (the replicated ones once)."""
    saved: dict = {}
    for rank in range(world):
        loader = _loader(job_config, tokenizer, world, rank)
        _take(loader, batches)
        saved.update(loader.state_dict())
    return saved


def _offered(loader, saved: dict) -> dict:
    """DCP's load: the live state_dict's keys that the checkpoint holds, with saved values."""
    loader.expect_checkpoint(set(saved))
    return {k: saved[k] for k in loader.state_dict()}


def test_dataloader_saves_the_global_sequence_count(job_config, tokenizer):
    loader = _loader(job_config, tokenizer, world=4, rank=1)
    _take(loader, 3)
    sd = loader.state_dict()
    assert sd["amsp_global_sequences"] == 3 * LOCAL_BATCH * 4
    assert sd["world_size"] == 4 and "dp_rank_1" in sd  # torchtitan's keys, unchanged


def test_dataloader_resume_on_the_same_world_is_exact(job_config, tokenizer):
    saved = _saved_checkpoint(job_config, tokenizer, world=2, batches=3)
    uninterrupted = _loader(job_config, tokenizer, world=2, rank=1)
    want = _take(uninterrupted, 5)[3:]
    resumed = _loader(job_config, tokenizer, world=2, rank=1)
    resumed.load_state_dict(_offered(resumed, saved))
    got = _take(resumed, 2)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert resumed.state_dict()["amsp_global_sequences"] == (3 + 2) * LOCAL_BATCH * 2


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 4)])
def test_dataloader_resume_on_another_world_continues_from_the_global_count(
        job_config, tokenizer, caplog, old_world, new_world):
    """After 2 steps of 2 micro-batches on the old world (the recipe's global batch of 16),
    each new rank continues where that rank of a new-world run from scratch would be."""
    sequences = 2 * 16
    per_rank = sequences // old_world // LOCAL_BATCH
    saved = _saved_checkpoint(job_config, tokenizer, old_world, batches=per_rank)
    assert saved["amsp_global_sequences"] == sequences
    skip = sequences // new_world // LOCAL_BATCH
    for rank in range(new_world):
        scratch = _loader(job_config, tokenizer, new_world, rank)
        want = _take(scratch, skip + 2)[skip:]
        resumed = _loader(job_config, tokenizer, new_world, rank)
        offered = _offered(resumed, saved)
        assert ("dp_rank_%d" % rank in offered) == (rank < old_world)  # DCP asks for no missing key
        with caplog.at_level(logging.WARNING, logger="torchtitan"):
            resumed.load_state_dict(offered)
        first = _take(resumed, 2)
        assert all(torch.equal(g, w) for g, w in zip(first, want)), rank
        # not silently back at the start of this rank's shard
        assert not torch.equal(first[0], _take(_loader(job_config, tokenizer, new_world, rank), 1)[0])
        assert resumed.state_dict()["amsp_global_sequences"] == sequences + 2 * LOCAL_BATCH * new_world
    warnings = [r.getMessage() for r in caplog.records if "resumed on" in r.getMessage()]
    assert len(warnings) == 1, warnings  # rank 0 only
    assert (f"checkpoint saved on {old_world} data-parallel ranks, resumed on {new_world}: "
            f"each rank skipped {sequences // new_world} sequences") in warnings[0]
    assert "token buffers" in warnings[0] and "read again" in warnings[0]


def test_dataloader_refuses_another_world_without_the_global_count(job_config, tokenizer):
    saved = _saved_checkpoint(job_config, tokenizer, world=4, batches=1)
    del saved["amsp_global_sequences"]  # as torchtitan's own loader saves it
    from amsp_dtensor.checkpoint import CheckpointMismatch

    loader = _loader(job_config, tokenizer, world=2, rank=0)
    # refused when told the checkpoint's keys (before DCP's load), in one line
    with pytest.raises(CheckpointMismatch, match="exclude_from_loading dataloader") as e:
        loader.expect_checkpoint(set(saved))
    assert "\n" not in str(e.value)
    # and by load_state_dict, for a caller that never said which keys there are
    loader.expect_checkpoint(None)
    with pytest.raises(CheckpointMismatch, match="exclude_from_loading dataloader"):
        loader.load_state_dict({k: saved[k] for k in loader.state_dict() if k in saved})


# --------------------------------------------------------------------------------------
# Under torchrun: save on 4 ranks, resume on 2 and on 8.
# --------------------------------------------------------------------------------------
multiproc = pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1", reason="multi-process")

# seq_len 64 keeps each launch to start-up plus a few seconds of steps on 2 cores. The
# recipe's global batch (16 sequences) stays: 2 micro-batches of 2 per rank on 4 ranks,
# 4 of 2 on 2 ranks, 1 of 2 on 8 ranks.
SHORT = ["--training.seq_len", str(SEQ_LEN), "--training.steps", str(STEPS),
         "--checkpoint.enable", "--checkpoint.interval", "2"]

# [Note: why the resumed losses are close, not equal] From step 3 on, the resumed ranks
# read the documents a 2- or 8-rank run would read (another split of the corpus than the
# 4 saved ranks'), so steps 3-4 average the loss over other sequences than the 4-rank run
# does. Measured at seq_len 64: within 3% of the 4-rank losses. A resume that lost the
# weights or the optimizer state would be far off (from scratch: ~8.0 at step 3 and
# ~7.8 at step 4, against the 4-rank run's ~7.5 and ~6.8).
RESUME_REL_TOL = 0.05
FIVE_STEPS = [str(5) if a == str(STEPS) else a for a in SHORT]


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory):
    dump = tmp_path_factory.mktemp("saved_on_4")
    proc = torchrun(SHORT, dump, nproc=4)
    return dump, proc.stdout + proc.stderr


def _resume(tmp_path_factory, saved_on_4, name: str, nproc: int, plan: tuple[int, int, int, int]):
    saved, _ = saved_on_4
    dump = tmp_path_factory.mktemp(name)
    shutil.copytree(saved / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    s_p, s_g, s_os, per_node = plan
    proc = torchrun([*SHORT, "--amsp.param_shard", str(s_p), "--amsp.grad_shard", str(s_g),
                     "--amsp.optim_shard", str(s_os), "--amsp.ranks_per_node", str(per_node)],
                    dump, nproc=nproc, timeout=400)
    return dump, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def resumed_on_2(tmp_path_factory, saved_on_4):
    return _resume(tmp_path_factory, saved_on_4, "resumed_on_2", 2, (1, 1, 2, 1))


@pytest.fixture(scope="module")
def resumed_on_8(tmp_path_factory, saved_on_4):
    return _resume(tmp_path_factory, saved_on_4, "resumed_on_8", 8, (4, 4, 8, 4))


def _losses(dump) -> dict[int, float]:
    return scalars(dump)["loss_metrics/global_avg_loss"]


@multiproc
@pytest.mark.parametrize("resumed,world,plan", [
    ("resumed_on_2", 2, "p1-g1-os2"), ("resumed_on_8", 8, "p4-g4-os8")])
def test_resume_on_another_world_size_continues_at_step_3(request, saved_on_4, resumed, world, plan):
    saved, _ = saved_on_4
    dump, log = request.getfixturevalue(resumed)
    assert f"plan {plan} on {world} ranks" in log
    assert "checkpoint/step-2" in log and "Training starts at step 3" in log, log[-3000:]
    want, got = _losses(saved), _losses(dump)
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [3, 4]  # not from scratch
    for step in (3, 4):
        assert math.isfinite(got[step])
        assert abs(got[step] - want[step]) <= RESUME_REL_TOL * want[step], (step, got, want)
    assert want[4] < want[2] - 0.3  # the 4-rank run trains: close losses are not flat ones
    warnings = [line for line in log.splitlines() if "data-parallel ranks, resumed on" in line]
    assert len(warnings) == 1, warnings
    skipped = 2 * 16 // world  # 2 steps of the recipe's global batch of 16, over the new world
    assert (f"saved on 4 data-parallel ranks, resumed on {world}: "
            f"each rank skipped {skipped} sequences") in warnings[0]


@multiproc
def test_each_warning_shows_once_on_8_ranks(resumed_on_8):
    """Python warnings and torchtitan WARNING lines from rank 0 only; the ones that do not
    apply to a CPU job not at all."""
    _, log = resumed_on_8
    assert log.count("DTensor random operators may not have complete support on cpu device mesh") == 1
    for never in ("'set_vital' is deprecated", "Error running lspci", "fallback to A100",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert never not in log, never
    titan_warnings = [line.split(" - WARNING - ", 1)[1] for line in log.splitlines()
                      if " - WARNING - " in line]
    assert titan_warnings and len(titan_warnings) == len(set(titan_warnings)), titan_warnings


def test_other_ranks_keep_errors_and_drop_warnings(monkeypatch, caplog):
    """Rank 0 shows Python warnings and torchtitan's warnings, rank 1 only errors; the
    torchdata deprecation shows nowhere."""
    import warnings

    import amsp_dtensor.titan  # noqa: F401  (the CPU shims, before torchtitan's logger)
    from torchtitan.tools.logging import logger

    from amsp_dtensor import train

    level = logger.level
    shown = {}
    try:
        for rank in ("0", "1"):
            monkeypatch.setenv("RANK", rank)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train.quiet_warnings()
                warnings.warn("py-warning")
                warnings.warn("'set_vital' is deprecated, please do not call")
            logger.setLevel(logging.INFO)
            train.quiet_other_ranks()
            caplog.clear()
            logger.warning("titan-warning")
            logger.error("titan-error")
            shown[rank] = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    finally:
        logger.setLevel(level)
    assert shown["0"] == ["py-warning", "titan-warning", "titan-error"], shown
    assert shown["1"] == ["titan-error"], shown


@pytest.fixture(scope="module")
def restarted_on_4(tmp_path_factory):
    """The saved_on_4 job again, rank 1 killed (SIGKILL) at the start of step 3 in the
    first attempt, under torchrun --max-restarts 1 with its default shared store."""
    dump = tmp_path_factory.mktemp("restarted_on_4")
    env = {"AMSP_TEST_KILL": "1:3"}
    proc = torchrun([*SHORT, "--experimental.custom_import", "amsp_dtensor.testing.titan_fault"],
                    dump, nproc=4, timeout=400, launcher=("--max-restarts", "1"), env=env)
    return dump, proc.stdout + proc.stderr


@multiproc
def test_rank_killed_in_step_3_restarts_from_step_2_with_the_same_curve(saved_on_4, restarted_on_4):
    saved, _ = saved_on_4
    dump, log = restarted_on_4
    # the kill happened (torchrun may name a peer's failure first, so the marker counts)
    assert "[amsp-test] rank 1 SIGKILLs itself at step 3" in log, log[-3000:]
    assert "checkpoint/step-2" in log and "Training starts at step 3" in log, log[-3000:]
    want, got = _losses(saved), _losses(dump)
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-6), (step, got, want)


@pytest.fixture(scope="module")
def compressed_runs(tmp_path_factory, saved_on_4):
    """Under int8 gradients: a job resumed from the exact run's step-2 checkpoint that
    trains steps 3-5 (saving at step 4), and a fresh job resumed from its step 4."""
    compressed = [*FIVE_STEPS, "--amsp.compress_grads", "int8"]
    first = tmp_path_factory.mktemp("compressed_from_exact")
    shutil.copytree(saved_on_4[0] / "checkpoint" / "step-2", first / "checkpoint" / "step-2")
    first_log = torchrun(compressed, first, nproc=4)
    resumed = tmp_path_factory.mktemp("compressed_resumed")
    shutil.copytree(first / "checkpoint" / "step-4", resumed / "checkpoint" / "step-4")
    resumed_log = torchrun(compressed, resumed, nproc=4)
    return first, first_log.stdout + first_log.stderr, resumed, resumed_log.stdout + resumed_log.stderr


@multiproc
def test_exact_checkpoint_resumed_with_compression_warns_once(compressed_runs):
    """A checkpoint saved without compressed gradients holds no residuals: a compressed
    job resumes from it with one warning, its residuals starting from zero."""
    _, log, _, _ = compressed_runs
    assert "Training starts at step 3" in log, log[-3000:]
    lines = [line for line in log.splitlines() if "error-feedback residuals" in line]
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "holds no error-feedback residuals and this job runs p2-g2-os4 on 4 ranks, 2 per node, "
        "grads=int8: they start from zero")


@multiproc
def test_compressed_resume_restores_the_error_feedback_residuals(compressed_runs):
    """torchtitan's checkpoint carries each rank's residuals: the job resumed at step 5
    has the uninterrupted run's residual norm and loss there. (Residuals restarted from
    zero would hold step 5's leftover alone, not what steps 3-5 left.)"""
    first, _, resumed, log = compressed_runs
    assert "Training starts at step 5" in log and "error-feedback residuals" not in log, log[-3000:]
    want, got = scalars(first), scalars(resumed)
    assert sorted(got["amsp/residual_norm"]) == [5] and 5 in want["amsp/residual_norm"]
    mine, uninterrupted = got["amsp/residual_norm"][5], want["amsp/residual_norm"][5]
    assert mine == pytest.approx(uninterrupted, rel=1e-6), (mine, uninterrupted)
    assert got["loss_metrics/global_avg_loss"][5] == pytest.approx(
        want["loss_metrics/global_avg_loss"][5], abs=1e-6)


def test_titan_checkpoint_that_does_not_fit_is_refused_in_one_line(tmp_path):
    """The check AmspTrainer puts before torchtitan's DCP load: torchtitan's layout (model
    tensors at the top level, the optimizer under "optimizer", other states not compared)."""
    import torch.distributed.checkpoint as dcp

    from amsp_dtensor.checkpoint import CheckpointMismatch
    from amsp_dtensor.titan.trainer import _refuse_misfits

    class Stateful:
        def __init__(self, sd):
            self.sd = sd

        def state_dict(self):
            return self.sd

    def optimizer(n):
        return {"state": {f"w{i}": {"exp_avg": torch.zeros(4, 4)} for i in range(n)}}

    saved = {"w0": torch.ones(4, 4), "w1": torch.ones(4, 4), "optimizer": optimizer(2),
             "train_state": {"step": torch.tensor(2)}}
    dcp.save(saved, checkpoint_id=tmp_path / "step-2", no_dist=True)
    loaded = []
    load = _refuse_misfits(lambda state_dict, checkpoint_id, **kw: loaded.append(checkpoint_id))
    fits = {"w0": torch.ones(4, 4), "w1": torch.ones(4, 4), "optimizer": Stateful(optimizer(2)),
            "train_state": Stateful({"step": torch.tensor(0)})}
    load(fits, checkpoint_id=str(tmp_path / "step-2"), from_hf=False, from_quantized=False)
    assert loaded == [str(tmp_path / "step-2")]
    cases = {
        "has shape [4, 4] in the checkpoint and [4, 5] here": {**fits, "w1": torch.ones(4, 5)},
        "1 model entry of this job missing from it (first: w2)": {**fits, "w2": torch.ones(4, 4)},
        "it has 1 model entry this job lacks (first: w1)": {"w0": fits["w0"], "optimizer": fits["optimizer"]},
        "1 optimizer state entry of this job missing from it (other optimizer settings?) "
        "(first: state.w2.exp_avg)": {**fits, "optimizer": Stateful(optimizer(3))},
    }
    for message, states in cases.items():
        with pytest.raises(CheckpointMismatch) as e:
            load(states, checkpoint_id=str(tmp_path / "step-2"), from_hf=False, from_quantized=False)
        assert message in str(e.value) and "\n" not in str(e.value)
    assert len(loaded) == 1  # DCP was never reached for a misfit


def test_rng_state_comes_back_and_a_rank_the_checkpoint_lacks_keeps_its_own(tmp_path, monkeypatch):
    """AmspTrainer's ``amsp_rng`` state through the same load wrapper torchtitan's load goes
    through: the draws after a resume are the uninterrupted run's; on another world size
    no rank asks DCP for its key (a rank the saving run did not have would fail the load)
    and each keeps its seeded stream."""
    import torch.distributed.checkpoint as dcp

    from amsp_dtensor.titan import rng as rng_module
    from amsp_dtensor.titan.trainer import _refuse_misfits

    def dcp_load(state_dict, checkpoint_id, **kw):
        dcp.load(state_dict, checkpoint_id=checkpoint_id, no_dist=True)

    load = _refuse_misfits(dcp_load)
    torch.manual_seed(7)
    torch.rand(5)  # some training
    dcp.save({"w0": torch.ones(2), "amsp_rng": rng_module.RngState()},
             checkpoint_id=tmp_path / "step-2", no_dist=True)
    uninterrupted = torch.rand(4)
    torch.manual_seed(42)  # a fresh job seeds again
    load({"w0": torch.zeros(2), "amsp_rng": rng_module.RngState()},
         checkpoint_id=str(tmp_path / "step-2"), from_hf=False, from_quantized=False)
    assert torch.equal(torch.rand(4), uninterrupted)

    monkeypatch.setattr(rng_module, "_rank", lambda: 5)  # rank 5 of 8, a 1-rank checkpoint
    monkeypatch.setattr(rng_module, "_world_size", lambda: 8)
    torch.manual_seed(42)
    seeded = torch.rand(4)
    torch.manual_seed(42)
    load({"w0": torch.zeros(2), "amsp_rng": rng_module.RngState()},
         checkpoint_id=str(tmp_path / "step-2"), from_hf=False, from_quantized=False)
    assert torch.equal(torch.rand(4), seeded)


def test_multi_node_restartable_torchrun_with_a_shared_store_gets_one_warning(monkeypatch, caplog):
    """On one node compat.init_process_group keeps restart attempts apart; on several nodes
    it cannot (each agent counts its own restarts), so rank 0 says what to set."""
    import amsp_dtensor.titan  # noqa: F401  (the CPU shims, before torchtitan's logger)
    from amsp_dtensor import train

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "0")
    for restarts, nodes, expected in (("0", "2", 0), ("3", "1", 0), ("3", "2", 1)):
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
        monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            train.warn_multi_node_restarts()
        found = [r for r in caplog.records if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in r.getMessage()]
        assert len(found) == expected, (restarts, nodes, caplog.records)
