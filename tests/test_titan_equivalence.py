"""Same seed, same data, fp32: torchtitan's own FSDP run and AMSP runs give one loss curve.

Baseline: ``--model.name llama3`` is torchtitan's parallelize_llama (FSDP2 over all 4
ranks, i.e. plan (W, W, W) done by torchtitan), with ``--amsp.init_like_single_process``
so its sharded weights start from the same full seeded initialisation AMSP uses (on CPU,
DTensor random init depends on the layout; see amsp_dtensor/titan/weights.py).
AMSP runs: (4, 4, 4) = ZeRO-3 by the engine and the recipe's (2, 2, 4) (the engine's s_p = 1
path, without FSDP, is compared with torchtitan in test_titan_tp and test_titan_pp, at
p1-g1-os2). The recipe plan's run is the first run
of the feature tests below (full activation checkpointing and a checkpoint saved at step
2, both exact: the same losses as without them), so it is launched once for both.
The recipe is fp32 (training.dtype and mixed_precision_param), 2 micro-batches per step.
"""

from __future__ import annotations

import pytest

from test_titan import losses, scalars, torchrun

STEPS = 4
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    dump = tmp_path_factory.mktemp("fsdp")
    torchrun(["--model.name", "llama3", "--amsp.init_like_single_process",
              "--training.steps", str(STEPS)], dump)
    return losses(dump)


RECIPE_PLAN = (2, 2, 4)
# the feature tests' first run: the recipe's plan with full activation checkpointing and a
# checkpoint saved at step 2 (see below)
FEATURES_FIRST = ["--training.steps", str(STEPS), "--checkpoint.enable",
                  "--checkpoint.interval", "2", "--activation_checkpoint.mode", "full"]


def _plan_args(plan) -> list[str]:
    s_p, s_g, s_os = plan
    return ["--amsp.param_shard", str(s_p), "--amsp.grad_shard", str(s_g),
            "--amsp.optim_shard", str(s_os), "--training.steps", str(STEPS)]


@pytest.mark.parametrize("plan", [(4, 4, 4), RECIPE_PLAN], ids=lambda p: "p{}-g{}-os{}".format(*p))
def test_amsp_loss_curve_matches_torchtitan_fsdp(plan, baseline, tmp_path, request):
    if plan == RECIPE_PLAN:
        curve = request.getfixturevalue("features")["first_curve"]
    else:
        torchrun(_plan_args(plan), tmp_path)
        curve = losses(tmp_path)
    assert len(curve) == len(baseline) == STEPS
    assert baseline[-1] < baseline[0] - 0.3  # it trains: the comparison is not of flat lines
    for step, (got, want) in enumerate(zip(curve, baseline), start=1):
        assert abs(got - want) <= REL_TOL * abs(want), (step, got, want, curve, baseline)


# --------------------------------------------------------------------------------------
# torchtitan features under AMSP, against the same FSDP baseline: two launches in all.
#   first:   plan p2-g2-os4, activation checkpointing "full", 2 micro-batches per step
#            (gradient accumulation under no_sync), checkpoint saved at step 2; 4 steps.
#   resumed: a fresh job that loads the step-2 checkpoint and runs steps 3-4 under another
#            plan (p1-g4-os4) with selective (per-op) activation checkpointing, per-block
#            torch.compile and ONE micro-batch of 4 (no accumulation): the same samples
#            per rank and step as the first run's 2 x 2.
# Every feature is exact math, so each row compares losses with a tolerance for fp32
# round-off only. torch.compile uses the aot_eager backend: dynamo (fullgraph per block)
# and AOTAutograd run as with inductor, but no C++ code is generated (inductor's codegen
# costs minutes of CPU per rank on this machine; it is exercised on GPU machines).
# --------------------------------------------------------------------------------------
FEATURE_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    import shutil

    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2"]
    first = tmp_path_factory.mktemp("features_first")
    first_proc = torchrun(FEATURES_FIRST, first)
    resumed = tmp_path_factory.mktemp("features_resumed")
    shutil.copytree(first / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    resumed_proc = torchrun([
        "--training.steps", str(STEPS), *ckpt,
        "--amsp.param_shard", "1", "--amsp.grad_shard", "4",
        "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "op",
        "--compile.enable", "--compile.backend", "aot_eager",
        "--training.local_batch_size", "4",
    ], resumed)
    return {
        "first": scalars(first)["loss_metrics/global_avg_loss"],
        "first_curve": losses(first),
        "first_log": first_proc.stdout + first_proc.stderr,
        "resumed": scalars(resumed)["loss_metrics/global_avg_loss"],
        "resumed_log": resumed_proc.stdout + resumed_proc.stderr,
    }


def _close(got: list[float], want: list[float], rel: float) -> bool:
    return all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want, strict=True))


def test_feature_activation_checkpointing_full(features, baseline):
    assert "Applied full activation checkpointing" in features["first_log"]
    got = [features["first"][s] for s in range(1, STEPS + 1)]
    assert _close(got, baseline, FEATURE_REL_TOL), (got, baseline)


def test_feature_gradient_accumulation(features, baseline):
    """2 micro-batches of 2 (first run, no_sync on the first) and 1 micro-batch of 4
    (resumed run) give one curve, and both give torchtitan FSDP's."""
    assert "gradient accumulation steps 2" in features["first_log"]
    assert "gradient accumulation steps 1" in features["resumed_log"]
    first = [features["first"][s] for s in (3, 4)]
    resumed = [features["resumed"][s] for s in (3, 4)]
    assert _close(resumed, first, FEATURE_REL_TOL), (resumed, first)
    got = [features["first"][s] for s in range(1, STEPS + 1)]
    assert _close(got, baseline, FEATURE_REL_TOL), (got, baseline)


def test_feature_checkpoint_save_and_resume_under_another_plan(features):
    """Step 3 needs the saved weights, step 4 also the optimizer's moments and steps."""
    log = features["resumed_log"]
    assert "Loading the checkpoint from" in log and "p1-g4-os4" in log
    assert sorted(features["resumed"]) == [3, 4]
    first = [features["first"][s] for s in (3, 4)]
    resumed = [features["resumed"][s] for s in (3, 4)]
    assert _close(resumed, first, FEATURE_REL_TOL), (resumed, first)
    assert first[1] != pytest.approx(first[0], rel=1e-3)  # the step moved the loss


def test_feature_activation_checkpointing_selective_op(features, baseline):
    assert "Applied selective activation checkpointing" in features["resumed_log"]
    resumed = [features["resumed"][s] for s in (3, 4)]
    assert _close(resumed, baseline[2:], FEATURE_REL_TOL), (resumed, baseline)


def test_feature_compile(features, baseline):
    assert "Compiling each TransformerBlock with torch.compile" in features["resumed_log"]
    resumed = [features["resumed"][s] for s in (3, 4)]
    assert _close(resumed, baseline[2:], FEATURE_REL_TOL), (resumed, baseline)


# --------------------------------------------------------------------------------------
# A layout asked for by torchtitan's own flags (test_titan_dp_flags.py resolves every
# mapping without a process group; this run checks what trains): HSDP, 2 replicas x
# shard 2, with fsdp_reshard_after_forward = "never", and [amsp] leaving its factors to
# them ("dp", the recipe's explicit factors overridden on the command line). The same run
# switches every overlap off in [amsp]: the flags reach the engine (its log line), and
# the collectives and losses are those of the overlapped schedule (bit-for-bit identity
# with overlaps on is the engine's test_overlap.py, at every plan).
# --------------------------------------------------------------------------------------
HSDP_BY_FLAGS = ["--amsp.param_shard", "dp", "--amsp.grad_shard", "dp", "--amsp.optim_shard", "dp",
                 "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.fsdp_reshard_after_forward", "never",
                 "--amsp.no-overlap-grad-sync", "--amsp.no-overlap-prefetch",
                 "--amsp.no-overlap-step", "--amsp.no-overlap-param-update",
                 "--training.steps", str(STEPS)]


def test_hsdp_asked_by_torchtitan_flags_trains_that_layout(baseline, tmp_path):
    """The recorded collectives of each step are those of plan p2-g2-os2 on 2 nodes of 2
    under "never" (docs/layouts.md's schedule): per micro-batch each of the 8 units
    all-gathers its P shards in forward only (no re-gather in backward) and
    reduce-scatters its grads over its node's 2 ranks; once per step the replicas
    all-reduce the grad shards across the nodes, the only bytes that leave a node besides
    the 4-byte norm; no OS-group collective (s_os = s_g = s_p). Losses: torchtitan's FSDP."""
    proc = torchrun(HSDP_BY_FLAGS, tmp_path)
    log = proc.stdout + proc.stderr
    assert "[amsp] plan p2-g2-os2 on 4 ranks (2 per node)" in log
    assert ("AMSP Overlap(grad_sync=False, prefetch=False, step=False, "
            "param_update=False)") in log
    tb = scalars(tmp_path)
    n, fp32, units, micro_batches = 6_163_712, 4, 1 + 6 + 1, 2  # debugmodel, see test_titan
    for step in range(1, STEPS + 1):
        assert [tb[f"amsp/{k}"][step] for k in ("s_p", "s_g", "s_os")] == [2, 2, 2]
        assert tb["comm/all_gather/p/count"][step] == units * micro_batches  # default: 30
        assert tb["comm/all_gather/p/bytes"][step] == micro_batches * fp32 * n
        assert tb["comm/reduce_scatter/p/count"][step] == units * micro_batches
        assert tb["comm/reduce_scatter/p/bytes"][step] == micro_batches * fp32 * n
        assert tb["comm/all_reduce/rep/count"][step] == units
        assert tb["comm/all_reduce/rep/bytes"][step] == fp32 * n / 2
        assert tb["comm/inter_node_bytes"][step] == tb["comm/all_reduce/rep/bytes"][step]
    assert not [tag for tag in tb if tag.startswith(("comm/reduce_scatter/os", "comm/all_gather/os",
                                                     "comm/reduce_scatter/g", "comm/all_gather/g"))]
    curve = losses(tmp_path)
    assert len(curve) == len(baseline) == STEPS
    for step, (got, want) in enumerate(zip(curve, baseline), start=1):
        assert abs(got - want) <= REL_TOL * abs(want), (step, got, want, curve, baseline)
