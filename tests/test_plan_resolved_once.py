"""One plan object from the config to the mesh: the torchtitan path resolves the [amsp] plan
once per job. amsp_dtensor.train's check before start-up resolves it; the parallelize_fn
builds the mesh from that same object, and every unit reads it from the mesh.

One process as rank 0 of a 4-rank job on torch's fake process group (no other processes):
the debug recipe's config is read and checked as ``amsp_dtensor.train`` does, then the
AMSP parallelize_fn shards the debug model. ``ShardingPlan.resolve``, the one function
that turns a requested plan into a ResolvedPlan, is counted throughout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "debug_cpu.toml"


@pytest.fixture
def resolutions(monkeypatch):
    """Every ShardingPlan.resolve call from here on (a list of the plans resolved)."""
    from amsp_dtensor.plan import ShardingPlan

    calls, real = [], ShardingPlan.resolve

    def counted(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ShardingPlan, "resolve", counted)
    return calls


def _parallelize(job_config, world=4):
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, llama3_args

    from amsp_dtensor.titan import parallelize_llama_amsp

    with torch.device("meta"):
        model = Transformer(llama3_args[job_config.model.flavor])
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1,
                        world_size=world)
    return parallelize_llama_amsp(model, dims, job_config)


def test_the_titan_path_resolves_the_plan_once(monkeypatch, fake_four_ranks, resolutions):
    from amsp_dtensor import train
    from amsp_dtensor.engine import handle
    from amsp_dtensor.titan import amsp_plan_of

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    job_config, _ = train.read_job_config(["--job.config_file", str(RECIPE),
                                           "--amsp.no-init-full-model"])
    plan = train.check_amsp(job_config)
    assert len(resolutions) == 1 and plan.name == "p2-g2-os4"

    model = _parallelize(job_config)
    units = {id(u): u for m in model.modules() if (u := handle.unit_of(m)) is not None}
    assert len(units) == len(model.layers) + 2  # embeddings, blocks, [norm, output]
    assert len(resolutions) == 1, f"the plan was resolved {len(resolutions)} times"
    assert amsp_plan_of(model) is plan
    assert all(unit.info.plan is plan for unit in units.values())


def test_fully_shard_reads_the_plan_from_the_mesh(fake_four_ranks, resolutions):
    """The engine alone: init_mesh resolves a ShardingPlan once; fully_shard, with or
    without the same plan, resolves nothing and every unit holds the mesh's plan; a plan
    that asks for other factors is refused in one line naming both."""
    import amsp_dtensor as amsp
    from amsp_dtensor.engine import handle
    from amsp_dtensor.engine.mesh import mesh_info

    sharding = amsp.ShardingPlan("node", "node", "full")
    mesh = amsp.init_mesh(sharding, ranks_per_node=2, device_type="cpu")
    resolved = mesh_info(mesh).plan
    assert len(resolutions) == 1 and resolved.name == "p2-g2-os4"
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    amsp.fully_shard(first, mesh=mesh)
    amsp.fully_shard(second, mesh=mesh, plan=sharding)
    assert len(resolutions) == 1
    assert handle.unit_of(first).info.plan is resolved is handle.unit_of(second).info.plan
    with pytest.raises(ValueError) as refused:
        amsp.fully_shard(torch.nn.Linear(4, 4), mesh=mesh, plan=amsp.ShardingPlan(1, 1, 4))
    assert str(refused.value).startswith(
        "plan p1-g1-os4 does not match the mesh, which was built for p2-g2-os4")
    assert "\n" not in str(refused.value)


def test_the_expert_plan_is_resolved_once_too(monkeypatch, fake_four_ranks, resolutions):
    """With experts (deepseek_v3, ep 2): the check before start-up resolves the dense and
    the expert plan, once each; job_expert_plan then hands out that same expert plan."""
    from amsp_dtensor import train
    from amsp_dtensor.titan.validate import job_expert_plan, job_plan

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    job_config, _ = train.read_job_config([
        "--job.config_file", str(RECIPE), "--model.name", "deepseek_v3_amsp",
        "--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree", "2",
        "--amsp.expert_optim_shard", "2"])
    plan = train.check_amsp(job_config)
    assert len(resolutions) == 2, resolutions  # the dense plan, the expert plan
    expert = job_expert_plan(job_config)
    assert job_plan(job_config) is plan and expert.name == "p2-g2-os2"  # "dp": 4 / ep 2
    assert job_expert_plan(job_config) is expert and len(resolutions) == 2, resolutions
