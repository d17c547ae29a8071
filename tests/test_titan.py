"""torchtitan integration: the debug recipe under torchrun, TensorBoard scalars, [amsp] errors.

Multi-process runs get a timeout. The helpers here are reused by test_titan_equivalence.py.
(No lock file here: a test taking a lock that the caller may hold deadlocks the suite.)
"""

from __future__ import annotations

import glob
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug_cpu.toml"


def torchrun(args: list[str], dump: Path, nproc: int = 4, timeout: int = 280,
             launcher: tuple[str, ...] = (), env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun [launcher] -m amsp_dtensor.train`` on the debug recipe, dump folder
    ``dump``, with ``env`` added to the environment; faulthandler on, so a rank killed by
    a signal (a native abort) leaves every thread's Python stack in the failure."""
    cmd = [
        "timeout", str(timeout),
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--standalone",  # a free port: a fixed one collides with any other job
        *launcher, "-m", "amsp_dtensor.train", "--job.config_file", str(RECIPE),
        "--job.dump_folder", str(dump), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONFAULTHANDLER="1",
               **(env or {}))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def scalars(dump: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the TensorBoard event files under dump/tb."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    runs = glob.glob(str(dump / "tb" / "*"))
    assert runs, f"no TensorBoard run folder under {dump / 'tb'}"
    for run in runs:
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def losses(dump: Path) -> list[float]:
    curve = scalars(dump)["loss_metrics/global_avg_loss"]
    return [curve[s] for s in sorted(curve)]


def save_seed_checkpoint(dump: Path, model: tuple[str, ...] = ("--model.name", "llama3")) -> Path:
    """One full model saved by torchtitan on one rank under ``dump``, the folder of its
    step (for ``--checkpoint.initial_load_path``, model only); ``model``: the flags that
    name it."""
    torchrun([*model, "--checkpoint.enable",
              "--checkpoint.create_seed_checkpoint",
              "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "1"],
             dump, nproc=1)
    steps = sorted((dump / "checkpoint").iterdir())
    # the initial weights, as torchtitan's main saves them (step 0, no training step)
    assert [s.name for s in steps] == ["step-0"], (dump, steps)
    return steps[0]


# --------------------------------------------------------------------------------------
# The debug recipe (the README's main job), a few steps, 4 ranks = 2 simulated nodes x 2.
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("debug_cpu")
    # torchtitan's own init flow (meta model sharded, shards initialised afterwards), the
    # one the 8B/70B recipes use; the equivalence tests cover init_full_model = true.
    proc = torchrun(["--training.steps", "3", "--amsp.no-init-full-model"], dump)
    return dump, proc


def test_debug_recipe_trains_and_loss_falls(debug_run):
    dump, proc = debug_run
    curve = losses(dump)
    assert len(curve) == 3
    assert curve[-1] < curve[0] - 0.2, curve  # measured: 8.14 -> 7.44 in 3 steps
    assert "plan p2-g2-os4 on 4 ranks (2 per node)" in proc.stdout + proc.stderr
    # every overlap on by default (test_titan_equivalence switches them off by flags)
    assert ("AMSP Overlap(grad_sync=True, prefetch=True, step=True, "
            "param_update=True)") in proc.stdout + proc.stderr


def test_tensorboard_holds_the_scalars(debug_run):
    dump, _ = debug_run
    tb = scalars(dump)
    for tag in (
        "loss_metrics/global_avg_loss",
        "throughput(tps)",
        "memory_by_state/param(MiB)",
        "memory_by_state/grad(MiB)",
        "memory_by_state/optim(MiB)",
        "comm/all_gather/p/bytes",
        "comm/all_gather/p/seconds",
        "comm/reduce_scatter/p/bytes",
        "comm/reduce_scatter/os/bytes",
        "comm/all_gather/os/bytes",
        "comm/intra_node_bytes",
        "comm/inter_node_bytes",
    ):
        assert tag in tb, f"{tag} missing; have {sorted(tb)}"
        assert set(tb[tag]) == {1, 2, 3}, (tag, tb[tag])
    assert "mfu(%)" not in tb  # no known peak FLOP rate on CPU
    assert tb["amsp/s_p"][1] == 2 and tb["amsp/s_g"][1] == 2 and tb["amsp/s_os"][1] == 4


def test_no_cross_replica_traffic_on_the_first_micro_batch(debug_run):
    """2 micro-batches per step: the OS-group reduce-scatter (the only collective that
    leaves a node besides the clip norm and the post-step all-gather) runs once per unit
    per step, i.e. only in the last micro-batch; the P-group reduce-scatter runs in both."""
    dump, _ = debug_run
    tb = scalars(dump)
    # llama3 debugmodel cut as torchtitan cuts it: the embeddings, 6 transformer blocks,
    # [final norm, output head]; the root holds nothing
    units = 1 + 6 + 1
    micro_batches = 2
    for step in (1, 2, 3):
        assert tb["comm/reduce_scatter/os/count"][step] == units
        assert tb["comm/reduce_scatter/p/count"][step] == units * micro_batches
        assert tb["comm/all_gather/os/count"][step] == units


def test_exposed_communication_is_logged(debug_run):
    """Each step logs how long this rank waited for its collectives and the hidden
    fraction of their time: 0 <= exposed <= the collectives' summed time, 0 <= hidden <= 1."""
    dump, _ = debug_run
    tb = scalars(dump)
    for step in (1, 2, 3):
        total = sum(v[step] for k, v in tb.items()
                    if k.startswith("comm/") and k.endswith("/seconds"))
        exposed = tb["comm/exposed_seconds"][step]
        hidden = tb["comm/hidden_fraction"][step]
        assert 0 < exposed <= total + 1e-9, (step, exposed, total)
        assert 0 <= hidden <= 1
        assert hidden == pytest.approx(1 - exposed / total, abs=1e-6)


@pytest.fixture(scope="module")
def compressed_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("debug_cpu_compressed")
    proc = torchrun(["--training.steps", "3", "--amsp.no-init-full-model",
                     "--amsp.compress_grads", "int8", "--amsp.compress_weights", "bf16"], dump)
    return dump, proc


def test_compression_keys_compress_the_cross_node_stages(compressed_run, debug_run):
    """p2-g2-os4 on 2 nodes of 2: the OS reduce-scatter and the post-step all-gather cross
    nodes and are sent compressed; the P collectives inside a node are as in the exact run,
    and the loss stays within int8's tolerance of it (the first step's is before any
    exchange, so equal)."""
    dump, proc = compressed_run
    exact, tb = scalars(debug_run[0]), scalars(dump)
    assert "cross-node stages compressed: grads=int8,weights=bf16" in proc.stdout + proc.stderr
    for step in (1, 2, 3):
        assert "comm/reduce_scatter/os/bytes" not in tb
        assert tb["comm/all_to_all/os/count"][step] == exact["comm/reduce_scatter/os/count"][step]
        ratio = tb["comm/all_to_all/os/bytes"][step] / exact["comm/reduce_scatter/os/bytes"][step]
        assert 0.25 < ratio < 0.30, ratio  # int8 payload plus scales and block padding
        assert tb["comm/all_gather/os/bytes"][step] == exact["comm/all_gather/os/bytes"][step] / 2
        assert tb["comm/compressed_bytes"][step] == (tb["comm/all_to_all/os/bytes"][step]
                                                     + tb["comm/all_gather/os/bytes"][step])
        for tag in ("comm/all_gather/p/bytes", "comm/reduce_scatter/p/bytes"):
            assert tb[tag][step] == exact[tag][step], tag
        assert 0 < tb["amsp/residual_norm"][step] < 1
        assert tb["memory_by_state/residual(MiB)"][step] > 0
    got, want = losses(dump), losses(debug_run[0])
    assert got[0] == pytest.approx(want[0], abs=1e-6)
    assert max(abs(a - b) for a, b in zip(got, want)) < 5e-3, (got, want)


def test_memory_by_state_matches_the_plan(debug_run):
    """fp32 params, plan (2, 2, 4): P = 4/s_p, OS = 8/s_os bytes per param (padding aside:
    the two AdamW moments; the fp32 P shard is its own master).

    G is measured after the step: the engine then holds the synced grads in the OS layout
    (4/s_os), having held 4/s_g while accumulating; either is accepted.
    """
    dump, _ = debug_run
    tb = scalars(dump)
    n = 6_163_712  # llama3 debugmodel parameters (torchtitan's count)
    mib = 2**20
    for key, per_param in (("param", 4 / 2), ("optim", 8 / 4)):
        got = tb[f"memory_by_state/{key}(MiB)"][1]
        assert got == pytest.approx(n * per_param / mib, rel=0.02), key
    grad = tb["memory_by_state/grad(MiB)"][1]
    assert any(grad == pytest.approx(n * b / mib, rel=0.02) for b in (4 / 2, 4 / 4)), grad


# --------------------------------------------------------------------------------------
# qwen3 (output head tied to the embeddings) through the generic <name>_amsp TrainSpec.
# --------------------------------------------------------------------------------------
# lr 3e-4: at the recipe's 8e-4, step 3 overshoots (8.17378, 7.08203, 8.10536), with
# AMSP and with torchtitan's own FSDP (--model.name qwen3 --amsp.init_like_single_process)
# alike: the same values to all printed digits, grad norms too.
QWEN3 = ["--model.name", "qwen3_amsp", "--model.flavor", "debugmodel", "--training.seq_len", "64",
         "--optimizer.lr", "3e-4"]
QWEN3_PARAMS = 31_987_968  # qwen3 debugmodel, the tied output/embedding weight counted once


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("qwen3")
    proc = torchrun([*QWEN3, "--training.steps", "3"], dump)
    return dump, proc


def test_qwen3_trains_under_amsp(qwen3_run):
    dump, proc = qwen3_run
    curve = losses(dump)
    assert len(curve) == 3  # measured: 8.174, 6.887, 7.452
    assert max(curve[1:]) < curve[0] - 0.4, curve
    assert "Applied AMSP plan p2-g2-os4" in proc.stdout + proc.stderr


def test_qwen3_tied_weight_is_one_parameter_of_the_root_unit(qwen3_run):
    """fp32, plan (2, 2, 4): P = 4 B / s_p and OS = 8 B / s_os per parameter (the fp32 P
    shard is its own master), the tied output/embedding weight (1.05% of the parameters)
    held once: 61.012 MiB of P, not 62.012."""
    dump, _ = qwen3_run
    tb = scalars(dump)
    assert tb["memory_by_state/param(MiB)"][1] == pytest.approx(QWEN3_PARAMS * 4 / 2 / 2**20, rel=1e-3)
    assert tb["memory_by_state/optim(MiB)"][1] == pytest.approx(QWEN3_PARAMS * 8 / 4 / 2**20, rel=1e-3)


def test_amsp_variant_of_any_registered_spec():
    import amsp_dtensor.titan as titan
    from amsp_dtensor.titan.validate import AmspConfigError

    assert titan.uses_amsp("llama3_amsp") and titan.uses_amsp("qwen3_amsp")
    assert not titan.uses_amsp("llama3") and not titan.uses_amsp("qwen3")
    assert titan.ensure_registered("llama4_amsp")  # built on demand from torchtitan's llama4
    with pytest.raises(AmspConfigError, match="model.name='nope_amsp': no TrainSpec 'nope'"):
        titan.ensure_registered("nope_amsp")


# (Checkpoint save + resume under another plan: test_titan_equivalence.py's feature matrix.)


# --------------------------------------------------------------------------------------
# [amsp] validation: one line naming the key, non-zero exit, before any training.
# --------------------------------------------------------------------------------------
def _main(argv, monkeypatch, capsys, world=4, local=2, rank=0, toml=RECIPE):
    """``amsp_dtensor.train.main`` on the debug recipe in this process, as one rank of
    torchrun would run it: (exit code, stderr lines). Reused by the other titan tests."""
    from amsp_dtensor import train

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setenv("RANK", str(rank))
    code = train.main(["--job.config_file", str(toml), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize(
    "argv, world, starts_with",
    [
        (["--amsp.optim_shard", "3"], 4, "amsp.optim_shard=3: does not divide the world size 4"),
        (["--amsp.param_shard", "fulll"], 4, "amsp.param_shard='fulll': not a strategy"),
        (["--amsp.param_shard", "0"], 4, "amsp.param_shard=0:"),
        (["--amsp.param_shard", "4"], 4, "amsp.grad_shard=2: plan param=4, grad=2, optim=4 breaks rule 'param <= grad <= optim'"),
        (["--amsp.grad_shard", "1"], 4, "amsp.grad_shard=1:"),
        (["--amsp.optim_shard", "full", "--amsp.param_shard", "1"], 4,
         "amsp.grad_shard=2: plan param=1, grad=2, optim=4 breaks rule 'grad follows param or optim'"),
        ([], 6, "amsp.optim_shard=4: does not divide the world size 6"),
        (["--amsp.ranks_per_node", "3"], 4, "amsp.ranks_per_node=3: the world size 4"),
        (["--amsp.plan", "best"], 4, "amsp.plan='best':"),
        (["--amsp.param_shards", "2"], 4, "amsp.param_shards: unknown key in [amsp]; known keys: "),
        (["--amsp.no-overlap-grad-syncs"], 4, "amsp.no-overlap-grad-syncs: unknown key in [amsp]"),
        (["--amsp.reshard_after_forward", "3"], 4, "amsp.reshard_after_forward=3:"),
        (["--amsp.compress_grads", "fp8"], 4,
         "amsp.compress_grads='fp8': use one of bf16, int8, or \"\" to send grads exactly"),
    ],
)
def test_bad_amsp_setting_is_one_line_naming_the_key(argv, world, starts_with, monkeypatch, capsys):
    code, err = _main(argv, monkeypatch, capsys, world=world)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]


def test_unknown_key_in_toml(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(RECIPE.read_text().replace("[amsp]\n", "[amsp]\nparam_shards = 2\n"))
    from amsp_dtensor import train

    monkeypatch.setenv("WORLD_SIZE", "4")
    code = train.main(["--job.config_file", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("amsp_dtensor.train: error: amsp.param_shards: unknown key in [amsp]")


def test_cli_flags_reach_the_config():
    from amsp_dtensor.titan import resolve_plan
    from amsp_dtensor.train import parse_job_config

    cfg = parse_job_config([
        "--job.config_file", str(RECIPE), "--amsp.param_shard", "4", "--amsp.grad_shard", "full",
        "--amsp.optim_shard", "4", "--amsp.reshard_after_forward", "2",
    ])
    assert (cfg.amsp.param_shard, cfg.amsp.grad_shard, cfg.amsp.optim_shard) == (4, "full", 4)
    assert cfg.amsp.reshard_after_forward == 2 and cfg.amsp.ranks_per_node == 2
    plan = resolve_plan(cfg, world=4)
    assert (plan.s_p, plan.s_g, plan.s_os, plan.ranks_per_node) == (4, 4, 4, 2)


@pytest.mark.parametrize("argv, line", [
    (["--amsp.optim_shard", "3"],
     "amsp_dtensor.train: error: amsp.optim_shard=3: does not divide the world size 4; "
     "valid factors on 4 ranks (2 per node): 1, 2, 4"),
    ([], "amsp_dtensor.train: error: job.config_file: not valid TOML: Cannot declare "
         "('amsp',) twice"),
], ids=["bad-factor", "bad-toml"])
def test_error_exit_from_a_fresh_process_has_no_traceback(argv, line, tmp_path):
    recipe = RECIPE
    if not argv:  # a TOML file torchtitan cannot parse (its loader logs a traceback)
        recipe = tmp_path / "twice.toml"
        recipe.write_text(RECIPE.read_text() + "\n[amsp]\nplan = \"auto\"\n")
    env = dict(os.environ, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", RANK="0", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "amsp_dtensor.train", "--job.config_file", str(recipe), *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr  # torchtitan logs to stdout
    assert proc.returncode == 2
    assert "Traceback" not in out and "ERROR" not in out, out
    lines = [l for l in proc.stderr.splitlines() if "amsp_dtensor.train: error:" in l]
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr


def test_plan_auto_asks_the_planner():
    from amsp_dtensor.plan.cost.planner import plan as planner_plan
    from amsp_dtensor.titan import resolve_plan
    from amsp_dtensor.titan.planner_bridge import planner_inputs
    from amsp_dtensor.train import parse_job_config

    cfg = parse_job_config(["--job.config_file", str(RECIPE), "--amsp.plan", "auto"])
    chosen = resolve_plan(cfg, world=4)
    # the same call made directly: the bridge passes the job's model, batch and world
    accepted = inspect.signature(planner_plan).parameters  # the bridge passes what it takes
    direct = planner_plan(**{k: v for k, v in planner_inputs(cfg, 4, 2).items()
                             if k in accepted}).plan
    assert (chosen.s_p, chosen.s_g, chosen.s_os) == (direct.s_p, direct.s_g, direct.s_os)
    assert chosen.world_size == 4 and chosen.ranks_per_node == 2


def test_plan_auto_inputs_carry_the_cp_degree():
    """Under context parallelism the bridge hands the planner the cp degree, and the
    gradient-accumulation steps of the batch ranks (world / cp): the recipe's global batch
    of 16 sequences, 2 per micro-batch, over 4 / 2 batch ranks is 4 micro-batches (2
    without cp). (torchtitan 0.2.2 itself refuses cp before this: validate.py.)"""
    from amsp_dtensor.plan.cost.planner import plan as planner_plan
    from amsp_dtensor.titan.planner_bridge import planner_inputs
    from amsp_dtensor.train import parse_job_config

    cfg = parse_job_config(["--job.config_file", str(RECIPE), "--amsp.plan", "auto",
                            "--training.seq_len", "512"])
    assert planner_inputs(cfg, 4, 2)["num_micro_batches"] == 2
    cfg.parallelism.context_parallel_degree = 2
    inputs = planner_inputs(cfg, 4, 2)
    assert inputs["context_parallel_degree"] == 2 and inputs["num_micro_batches"] == 4
    report = planner_plan(**inputs)
    assert report.settings["context_parallel_degree"] == 2
    assert report.best.step.tokens == 512 // 2 * 2 * 4  # seq / cp x micro-batch x 4
    assert report.best.step.cp_comm_seconds > 0


def test_torchtitan_profiler_runs_on_cpu(tmp_path):
    """The CPU shim (9): torchtitan's --profiling.enable_profiling asks for a GPU activity
    that is None on CPU (TypeError in torch.profiler); with the shims its profiler records
    CPU steps and writes their trace."""
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        from amsp_dtensor.titan import cpu_compat
        cpu_compat.apply()
        from torchtitan.config.job_config import Profiling
        from torchtitan.tools.profiling import maybe_enable_profiling
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}",
                                rank=0, world_size=1)
        config = Profiling(enable_profiling=True, profile_freq=2, profiler_warmup=0,
                           profiler_active=1, save_traces_folder="traces")
        with maybe_enable_profiling(config, base_folder="{tmp_path}") as prof:
            for _ in range(2):
                torch.ones(64, 64) @ torch.ones(64, 64)
                prof.step()
        dist.destroy_process_group()
        print(sorted(os.listdir("{tmp_path / 'traces'}")))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration_2" in proc.stdout, proc.stdout
