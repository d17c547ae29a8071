"""torchtitan's data-parallel flags under AMSP, resolved without any process group.

``[parallelism] data_parallel_replicate_degree`` R x ``data_parallel_shard_degree`` S
(over the data-parallel world, world / tp; S = -1 is "the rest") decide the plan when
``[amsp]`` leaves its factors at "dp" (their default): pS-gS-osS, R replicas. The
reference for R and S is torchtitan's own ``ParallelDims``, which resolves the same flags
for its FSDP/HSDP/DDP (a dataclass: its checks run without a process group).
``fsdp_reshard_after_forward`` maps as torchtitan's ``apply_fsdp`` maps it. Explicit
[amsp] factors beside explicit data-parallel degrees must agree (param_shard = S), and
every refusal is one line, exit 2, before start-up, as are the settings AMSP cannot honour.
The one multi-rank run of a layout asked for by these flags (its recorded collectives) is
in test_titan_equivalence.py.
"""

from __future__ import annotations

import pytest

from test_titan import RECIPE, _main as run_main

FACTOR_LINES = ("param_shard = 2\n", "grad_shard = 2\n", "optim_shard = 4\n")


@pytest.fixture(scope="module")
def no_factors(tmp_path_factory):
    """The debug recipe with [amsp] setting no factors (ranks_per_node = 2 stays)."""
    text = RECIPE.read_text()
    for line in FACTOR_LINES:
        assert line in text
        text = text.replace(line, "")
    path = tmp_path_factory.mktemp("recipe") / "no_factors.toml"
    path.write_text(text)
    return path


def _config(toml, *argv):
    from amsp_dtensor.train import parse_job_config

    return parse_job_config(["--job.config_file", str(toml), *argv])


def _titan_dims(world, replicate, shard, tp=1):
    """torchtitan's own resolution of the data-parallel degrees."""
    from torchtitan.distributed import ParallelDims

    return ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=1, tp=tp, pp=1, ep=1, etp=1,
                        world_size=world)


# (id, world, ranks per node, tp, replicate, shard, the plan's factor)
MAPPINGS = [
    ("ddp", 4, 2, 1, 4, 1, 1),                    # replicate = W: p1-g1-os1
    ("ddp-rest", 4, 2, 1, 4, -1, 1),
    ("ddp-8", 8, 4, 1, 8, -1, 1),
    ("hsdp", 4, 2, 1, 2, 2, 2),                   # R x S: pS-gS-osS
    ("hsdp-rest", 4, 2, 1, 2, -1, 2),
    ("hsdp-2-nodes-of-4", 8, 4, 1, 2, -1, 4),
    ("fsdp", 4, 2, 1, 1, -1, 4),                  # torchtitan's defaults: pW-gW-osW
    ("fsdp-explicit", 4, 2, 1, 1, 4, 4),
    ("hsdp+tp2", 8, 4, 2, 2, -1, 2),              # dp world 8 / 2 = 4 = 2 x 2
    ("fsdp+tp2", 4, 2, 2, 1, -1, 2),
    ("ddp+tp2", 4, 2, 2, 2, -1, 1),
]


@pytest.mark.parametrize("world, per_node, tp, replicate, shard, factor",
                         [m[1:] for m in MAPPINGS], ids=[m[0] for m in MAPPINGS])
def test_dp_flags_decide_the_plan_when_amsp_sets_no_factors(
        no_factors, world, per_node, tp, replicate, shard, factor):
    from amsp_dtensor.titan import resolve_plan

    cfg = _config(no_factors, "--parallelism.data_parallel_replicate_degree", str(replicate),
                  "--parallelism.data_parallel_shard_degree", str(shard),
                  "--parallelism.tensor_parallel_degree", str(tp), "--training.seq_len", "64")
    assert (cfg.amsp.param_shard, cfg.amsp.grad_shard, cfg.amsp.optim_shard) == ("dp",) * 3
    plan = resolve_plan(cfg, world=world, ranks_per_node=per_node)
    titan = _titan_dims(world, replicate, shard, tp)
    assert (plan.s_p, plan.s_g, plan.s_os) == (titan.dp_shard,) * 3 == (factor,) * 3
    assert plan.mesh_shape["rep"] == titan.dp_replicate  # R replicas of every state
    assert plan.world_size == world // tp and plan.ranks_per_node == per_node // tp


def test_the_recipe_keeps_its_factors_under_torchtitans_default_degrees():
    """recipes/debug_cpu.toml sets p2-g2-os4 and data_parallel_replicate_degree = 1,
    data_parallel_shard_degree = -1 (torchtitan's defaults, which leave the layout open):
    the [amsp] factors decide, as before these flags were read."""
    from amsp_dtensor.titan import resolve_plan

    text = RECIPE.read_text()
    assert "data_parallel_replicate_degree = 1\ndata_parallel_shard_degree = -1\n" in text
    plan = resolve_plan(_config(RECIPE), world=4, ranks_per_node=2)
    assert plan.name == "p2-g2-os4"


@pytest.mark.parametrize("argv, name", [
    # explicit factors that agree with the degrees: param_shard = S, G and OS further
    (["--parallelism.data_parallel_replicate_degree", "2"], "p2-g2-os4"),
    (["--parallelism.data_parallel_replicate_degree", "2",
      "--parallelism.data_parallel_shard_degree", "2"], "p2-g2-os4"),
    (["--parallelism.data_parallel_replicate_degree", "2", "--amsp.optim_shard", "2"],
     "p2-g2-os2"),
    (["--parallelism.data_parallel_replicate_degree", "4", "--amsp.param_shard", "replica",
      "--amsp.grad_shard", "1"], "p1-g1-os4"),  # DDP's parameters, optimizer states sharded
    # a factor left at "dp" next to explicit ones takes S
    (["--parallelism.data_parallel_replicate_degree", "2", "--amsp.param_shard", "dp",
      "--amsp.grad_shard", "dp"], "p2-g2-os4"),
    (["--amsp.param_shard", "dp", "--amsp.grad_shard", "dp"], "p4-g4-os4"),
], ids=["hsdp-replicate", "hsdp-shard", "hsdp-os2", "ddp-zero1", "dp-beside-explicit",
        "dp-under-defaults"])
def test_explicit_factors_that_agree_with_the_degrees(argv, name):
    from amsp_dtensor.titan import resolve_plan

    assert resolve_plan(_config(RECIPE, *argv), world=4, ranks_per_node=2).name == name


def test_plan_auto_under_torchtitans_default_degrees(no_factors):
    from amsp_dtensor.titan import resolve_plan

    plan = resolve_plan(_config(no_factors, "--amsp.plan", "auto"), world=4, ranks_per_node=2)
    assert plan.world_size == 4


# --------------------------------------------------------------------------------------
# fsdp_reshard_after_forward: torchtitan's apply_fsdp (no PP) reshards the embeddings and
# blocks on "default" and "always", the final [norm, output] unit on "always" only.
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, amsp_value, want", [
    ("default", None, (True, False)),
    ("always", None, (True, True)),
    ("never", None, (False, False)),
    ("default", "false", (False, False)),
    ("default", "2", (2, False)),  # hpZ: reshard to 2 of the 4 P ranks
    ("always", "true", (True, True)),
    ("never", "False", (False, False)),
])
def test_fsdp_reshard_after_forward_maps_to_fsdp2(no_factors, policy, amsp_value, want):
    from amsp_dtensor.titan import resolve_plan
    from amsp_dtensor.titan.validate import reshard_after_forward_of

    argv = ["--parallelism.fsdp_reshard_after_forward", policy]
    if amsp_value is not None:
        argv += ["--amsp.reshard_after_forward", amsp_value]
    cfg = _config(no_factors, *argv)
    plan = resolve_plan(cfg, world=4, ranks_per_node=2)  # p4-g4-os4
    got = reshard_after_forward_of(cfg, plan)
    assert got == want and type(got[0]) is type(want[0])


def test_parallelize_passes_the_reshard_setting_to_fully_shard(no_factors, monkeypatch):
    """The AMSP parallelize_fn hands reshard_after_forward_of's pair to the units as
    torchtitan's apply_fsdp does: the first to the embeddings and every block, the second
    to [final norm, output head]. amsp.fully_shard is replaced by a recorder here (no
    process group), so this checks the wiring only; the run in test_titan_equivalence.py
    checks what FSDP2 then does (the all-gathers it issues)."""
    import amsp_dtensor as amsp
    from amsp_dtensor.titan import amsp_train_spec

    calls = []
    monkeypatch.setattr(amsp, "fully_shard",
                        lambda module, **kw: calls.append((module, kw.get("reshard_after_forward"))))
    monkeypatch.setattr(amsp, "init_mesh", lambda *a, **kw: None)
    monkeypatch.setattr(amsp, "set_gradient_divide_factor", lambda *a, **kw: None)
    monkeypatch.setattr(amsp, "set_compression", lambda *a, **kw: type(
        "Off", (), {"enabled": False})())
    import torch
    from torchtitan.distributed import ParallelDims

    spec = amsp_train_spec("llama3")
    for policy, want in (("never", (False, False)), ("always", (True, True)),
                         ("default", (True, False))):
        cfg = _config(no_factors, "--parallelism.fsdp_reshard_after_forward", policy,
                      "--amsp.no-init-full-model")
        args = spec.model_args["debugmodel"]
        with torch.device("meta"):
            model = spec.model_cls(args)
        calls.clear()
        spec.parallelize_fn(model, ParallelDims(1, -1, 1, 1, 1, 1, 1, 4), cfg)
        by_module = {id(m) if not isinstance(m, list) else tuple(map(id, m)): r for m, r in calls}
        assert by_module[id(model.tok_embeddings)] == want[0]
        assert all(by_module[id(block)] == want[0] for block in model.layers.values())
        assert by_module[(id(model.norm), id(model.output))] == want[1]


# --------------------------------------------------------------------------------------
# Refusals: one line naming the keys and the fix, exit 2, before any process group.
# --------------------------------------------------------------------------------------
def _main(toml, argv, monkeypatch, capsys, world=4, local=2, rank=0):
    return run_main(argv, monkeypatch, capsys, world=world, local=local, rank=rank, toml=toml)


REFUSALS = [
    ("param-shard-vs-replicate", "recipe", 4,
     ["--parallelism.data_parallel_replicate_degree", "2", "--amsp.param_shard", "4",
      "--amsp.grad_shard", "4"],
     "amsp.param_shard=4 contradicts parallelism.data_parallel_replicate_degree=2, "
     "data_parallel_shard_degree=-1 (2 copies of the parameters, each sharded over 2 of the 4 "
     "data-parallel ranks): set amsp.param_shard = 2 (or \"dp\", to follow "
     "[parallelism]), or leave data_parallel_replicate_degree and data_parallel_shard_degree "
     "at torchtitan's defaults (1, -1) for the [amsp] factors to decide alone"),
    ("recipe-under-ddp", "recipe", 4, ["--parallelism.data_parallel_replicate_degree", "4"],
     "amsp.param_shard=2 contradicts parallelism.data_parallel_replicate_degree=4, "
     "data_parallel_shard_degree=-1 (4 copies of the parameters, each sharded over 1 of the 4 "
     "data-parallel ranks): set amsp.param_shard = 1"),
    ("recipe-under-fsdp-4", "recipe", 4, ["--parallelism.data_parallel_shard_degree", "4"],
     "amsp.param_shard=2 contradicts parallelism.data_parallel_replicate_degree=1, "
     "data_parallel_shard_degree=4"),
    ("auto-with-degrees", "no_factors", 4,
     ["--amsp.plan", "auto", "--parallelism.data_parallel_replicate_degree", "2"],
     "amsp.plan='auto' with parallelism.data_parallel_replicate_degree=2, "
     "data_parallel_shard_degree=-1: the planner chooses the data-parallel layout itself"),
    ("replicate-not-dividing", "no_factors", 4,
     ["--parallelism.data_parallel_replicate_degree", "3"],
     "parallelism.data_parallel_replicate_degree=3: does not divide the 4 data-parallel "
     "ranks (the world); use a divisor of 4"),
    ("product-not-the-world", "no_factors", 4,
     ["--parallelism.data_parallel_replicate_degree", "2",
      "--parallelism.data_parallel_shard_degree", "4"],
     "parallelism.data_parallel_replicate_degree=2, data_parallel_shard_degree=4: 2 x 4 is "
     "not the 4 data-parallel ranks (the world)"),
    ("product-under-tp", "no_factors", 4,
     ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree",
      "2"],
     "parallelism.data_parallel_replicate_degree=1, data_parallel_shard_degree=4: 1 x 4 is "
     "not the 2 data-parallel ranks (world 4 / tensor_parallel_degree 2)"),
    ("shard-zero", "no_factors", 4, ["--parallelism.data_parallel_shard_degree", "0"],
     "parallelism.data_parallel_shard_degree=0: must be -1 (the rest) or a positive int"),
    ("replicate-rest", "no_factors", 4, ["--parallelism.data_parallel_replicate_degree", "-1"],
     "parallelism.data_parallel_replicate_degree=-1: must be a positive int"),
    # 6 ranks, 2 per node: shard 3 spans a node and a half (AMSP's rules 1-2)
    ("shard-spans-nodes-partly", "no_factors", 6,
     ["--parallelism.data_parallel_replicate_degree", "2"],
     "parallelism.data_parallel_replicate_degree=2, data_parallel_shard_degree=-1: AMSP "
     "shards over 3 ranks, which spans nodes without filling them (2 data-parallel ranks per "
     "node); a shard group must divide a node or fill whole nodes: use a "
     "data_parallel_shard_degree in 1, 2, 6 (data_parallel_replicate_degree = 6 / it)"),
    ("reshard-false-vs-always", "recipe", 4,
     ["--parallelism.fsdp_reshard_after_forward", "always",
      "--amsp.reshard_after_forward", "False"],
     "amsp.reshard_after_forward=False contradicts parallelism.fsdp_reshard_after_forward="
     "'always' (reshard_after_forward=True): set one of them to agree, or "
     "amsp.reshard_after_forward = \"dp\" (the default) to follow [parallelism]"),
    ("reshard-true-vs-never", "recipe", 4,
     ["--parallelism.fsdp_reshard_after_forward", "never", "--amsp.reshard_after_forward", "true"],
     "amsp.reshard_after_forward=True contradicts parallelism.fsdp_reshard_after_forward='never'"),
    ("reshard-hpz-vs-always", "no_factors", 4,
     ["--parallelism.fsdp_reshard_after_forward", "always", "--amsp.reshard_after_forward", "2"],
     "amsp.reshard_after_forward=2 contradicts parallelism.fsdp_reshard_after_forward='always'"),
    ("reshard-word", "recipe", 4, ["--amsp.reshard_after_forward", "sometimes"],
     "amsp.reshard_after_forward='sometimes': use true, false, an int"),
    # settings that failed on every rank after start-up, or were ignored
    ("early-step-in-backward", "recipe", 4, ["--optimizer.early_step_in_backward"],
     "optimizer.early_step_in_backward=True: not supported with AMSP (the optimizer steps on "
     "OS shards after the gradient sync); set it to false"),
    ("optimizer-name", "recipe", 4, ["--optimizer.name", "Adafactor"],
     "optimizer.name='Adafactor': AMSP supports Adam, AdamW"),
    ("cpu-offload", "recipe", 4, ["--training.enable_cpu_offload"],
     "training.enable_cpu_offload=True: AMSP does not offload parameters, gradients or "
     "optimizer states to the CPU; set it to false"),
    ("tp-without-apply-tp", "recipe", 4,
     ["--model.name", "qwen3_amsp", "--parallelism.tensor_parallel_degree", "2",
      "--amsp.optim_shard", "2"],
     "parallelism.tensor_parallel_degree=2: torchtitan.models.qwen3.infra.parallelize has no "
     "apply_tp to split this model with; set it to 1"),
]


@pytest.mark.parametrize("toml, world, argv, starts_with", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])
def test_refusal_is_one_line_before_start_up(toml, world, argv, starts_with, no_factors,
                                             monkeypatch, capsys):
    path = RECIPE if toml == "recipe" else no_factors
    code, err = _main(path, argv, monkeypatch, capsys, world=world)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]
    code, err = _main(path, argv, monkeypatch, capsys, world=world, rank=1)
    assert code == 2 and err == []  # once per job: the other ranks stop quietly


@pytest.mark.filterwarnings("ignore:The field `parallelism.fsdp-reshard-after-forward`")
def test_policy_word_from_toml_is_refused(no_factors, tmp_path, monkeypatch, capsys):
    """tyro checks the policy's choices on the command line only; from TOML any string
    reaches the config."""
    bad = tmp_path / "bad.toml"
    bad.write_text(no_factors.read_text().replace(
        "data_parallel_shard_degree = -1\n",
        "data_parallel_shard_degree = -1\nfsdp_reshard_after_forward = \"sometimes\"\n"))
    code, err = _main(bad, [], monkeypatch, capsys)
    assert code == 2 and err == [
        "amsp_dtensor.train: error: parallelism.fsdp_reshard_after_forward='sometimes': use one "
        "of default, always, never"]


def test_no_process_group_before_a_refusal(monkeypatch, capsys):
    """The refusals above come from the checks amsp_dtensor.train runs before torchtitan's
    Trainer: none of them reaches init_process_group."""
    import torch.distributed as dist

    from amsp_dtensor import train

    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: started.append(a))
    monkeypatch.setattr(train, "run", lambda job_config: started.append("run") or 0)
    code, _ = _main(RECIPE, ["--optimizer.early_step_in_backward"], monkeypatch, capsys)
    assert code == 2 and started == []
    code, _ = _main(RECIPE, [], monkeypatch, capsys)  # the same job, accepted, would start
    assert code == 0 and started == ["run"]
