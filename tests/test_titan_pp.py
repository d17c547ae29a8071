"""torchtitan's pipeline parallelism with AMSP on every stage.

Refusals: one line, exit 2, before any process group (train.main as under torchrun, in
this process). Equivalence: torchtitan's own FSDP2 + PP (``--model.name llama3``) and
AMSP + PP (``llama3_amsp``), both loading one seed checkpoint
(``--checkpoint.initial_load_path``, model only), fp32, 4 micro-batches, STEPS steps: the
loss of every step within 1e-4 relative, on pp 2 x dp 2 (1F1B under plans p2-g2-os2 and
p1-g1-os2; Interleaved1F1B, 2 stages per rank, under p2-g2-os2) and on 8 ranks, pp 2 x dp 2
x tp 2 (1F1B, p2-g2-os2). torchtitan runs each configuration once, for all the plans
compared with it. Checkpoints moving between pipeline degrees: test_titan_pp_checkpoint.py."""

from __future__ import annotations

import pytest

from test_titan import _main as run_main, losses, save_seed_checkpoint, torchrun

STEPS = 5
REL_TOL = 1e-4
PP_ARGS = ["--parallelism.pipeline_parallel_degree", "2",
           "--training.local_batch_size", "4", "--training.global_batch_size", "-1",
           "--training.steps", str(STEPS)]


def _main(argv, monkeypatch, capsys, rank=0):  # 4 ranks on one node
    return run_main(argv, monkeypatch, capsys, world=4, local=4, rank=rank)


@pytest.mark.parametrize("argv, starts_with", [
    (["--parallelism.pipeline_parallel_degree", "3"],
     "parallelism.pipeline_parallel_degree=3: does not divide the world size 4"),
    (["--parallelism.pipeline_parallel_degree", "2"],  # the recipe's optim_shard = 4 > dp 2
     "amsp.optim_shard=4: does not divide the world size 2"),
    (["--parallelism.pipeline_parallel_degree", "2", "--amsp.optim_shard", "2",
      "--parallelism.pipeline_parallel_layers_per_stage", "1"],  # 8 stages for 2 ranks
     "parallelism.pipeline_parallel_layers_per_stage=1: llama3_amsp debugmodel has 6 layers, "
     "cut into 8 stages"),
    (["--parallelism.pipeline_parallel_degree", "4", "--amsp.param_shard", "1",
      "--amsp.grad_shard", "1", "--amsp.optim_shard", "1",
      "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
      "--parallelism.pipeline_parallel_last_stage_less_layers", "0"],  # 8 stages, 6 layers
     "parallelism.pipeline_parallel_degree=4: llama3_amsp debugmodel has 6 layers, too few "
     "for 8 pipeline stages"),
    (["--parallelism.pipeline_parallel_degree", "2", "--amsp.optim_shard", "2",
      "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "parallelism.pipeline_parallel_schedule='ZBVZeroBubble': splits each backward into "
     "input and weight halves (zero bubble), which AMSP runs with amsp.param_shard = 1 only "
     "(the plan has 2)"),
], ids=["pp-not-dividing-world", "factor-outside-the-stage-dp-world",
        "layers-per-stage-not-fitting", "too-few-layers", "zero-bubble"])
def test_pipeline_refusals_are_one_line_before_start_up(argv, starts_with, monkeypatch, capsys):
    code, err = _main(argv, monkeypatch, capsys)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]
    if "world size 2" in starts_with:
        assert ("under parallelism.pipeline_parallel_degree=2 the factors are those of one "
                "stage's data-parallel world: 4 / 2 ranks") in err[0]


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory):
    return save_seed_checkpoint(tmp_path_factory.mktemp("seed"))


# name -> (ranks, flags): the pipeline configurations, each run once by torchtitan's own
# FSDP2 + PP (titan_reference) and by AMSP + PP under one or more plans
CONFIGS = {
    "1F1B": (4, ["--parallelism.pipeline_parallel_schedule", "1F1B"]),
    # 2 stages per rank: (6 layers + the first and last stage's one layer less) / 2 = 4 stages
    "Interleaved1F1B": (4, ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                            "--parallelism.pipeline_parallel_layers_per_stage", "2"]),
    # 8 ranks = pp 2 x dp 2 x tp 2 (the recipe's nodes of 2 ranks: one TP group each)
    "1F1B-tp2": (8, ["--parallelism.pipeline_parallel_schedule", "1F1B",
                     "--parallelism.tensor_parallel_degree", "2"]),
}
TIMEOUT = {4: 600, 8: 1200}  # 8 gloo ranks on 2 cores are slow


def _load(seed_checkpoint) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_checkpoint),
            "--checkpoint.interval", "100"]


@pytest.fixture(scope="module")
def titan_reference(tmp_path_factory, seed_checkpoint):
    """config name -> the losses of torchtitan's own FSDP2 + PP (``--model.name llama3``)
    on it; each configuration runs once, whichever AMSP plans it is compared with."""
    runs: dict[str, list[float]] = {}

    def reference(config: str) -> list[float]:
        if config not in runs:
            nproc, flags = CONFIGS[config]
            dump = tmp_path_factory.mktemp(f"fsdp-{config}")
            torchrun(["--model.name", "llama3", *PP_ARGS, *flags, *_load(seed_checkpoint)],
                     dump, nproc=nproc, timeout=TIMEOUT[nproc])
            runs[config] = losses(dump)
        return runs[config]

    return reference


@pytest.mark.parametrize("config, plan", [
    ("1F1B", (2, 2, 2)), ("1F1B", (1, 1, 2)), ("Interleaved1F1B", (2, 2, 2)),
    ("1F1B-tp2", (2, 2, 2)),
], ids=["1F1B-p2-g2-os2", "1F1B-p1-g1-os2", "Interleaved1F1B-p2-g2-os2", "1F1B-tp2-p2-g2-os2"])
def test_amsp_pipeline_matches_torchtitan_fsdp_pipeline(config, plan, titan_reference,
                                                        seed_checkpoint, tmp_path):
    nproc, flags = CONFIGS[config]
    s_p, s_g, s_os = plan
    proc = torchrun([*PP_ARGS, *flags, *_load(seed_checkpoint), "--amsp.param_shard", str(s_p),
                     "--amsp.grad_shard", str(s_g), "--amsp.optim_shard", str(s_os)],
                    tmp_path / "amsp", nproc=nproc, timeout=TIMEOUT[nproc])
    log = proc.stdout + proc.stderr
    assert f"Applied AMSP plan p{s_p}-g{s_g}-os{s_os}" in log and "one pipeline stage of 2" in log
    want, got = titan_reference(config), losses(tmp_path / "amsp")
    print(f"{config} p{s_p}-g{s_g}-os{s_os}: " + ", ".join(
        f"step {step} AMSP {g:.6f} torchtitan {w:.6f} rel {abs(g - w) / abs(w):.1e}"
        for step, (g, w) in enumerate(zip(got, want), start=1)))
    assert len(got) == len(want) == STEPS
    assert want[-1] < want[0] - 0.5  # it trains
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert abs(g - w) <= REL_TOL * abs(w), (step, got, want)
    assert (tmp_path / "amsp" / "checkpoint" / f"step-{STEPS}").is_dir()
