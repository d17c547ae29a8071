"""The planner under pipeline parallelism (plan/cost/pipeline.py, plan = "auto" with
[parallelism] pipeline_parallel_degree > 1).

References: torchtitan's own stage split (``generate_llm_fqn_per_model_part``) and model
(the parameters of each stage's modules), torch's schedules (their warm-up arithmetic, as
torch's ScheduleInterleaved1F1B states it), and the collectives every rank records in a
real 4-rank run (pp 2 x dp 2, plan = "auto", TensorBoard scalars of every rank): equal,
op by op and byte for byte, to the planner's events for that rank's stage, and its state
bytes to the planner's."""

from __future__ import annotations

import collections
import glob

import pytest

import amsp_dtensor.titan  # noqa: F401  (its CPU shims before anything imports torchtitan)
from amsp_dtensor.plan.cost.models import get_model
from amsp_dtensor.plan.cost.pipeline import Pipeline, Stage, stage_model, stages_of_fqns
from amsp_dtensor.plan.cost.planner import choose_plan
from test_titan import _main as run_main, torchrun


def _debug_stages(n_stages: int, first: int = 1, last: int = 1) -> list[list[str]]:
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    return generate_llm_fqn_per_model_part(n_stages, 6, first, last)


@pytest.mark.parametrize("n_stages", [2, 4])
def test_stage_parameters_are_those_of_torchtitans_split(n_stages):
    """Each stage's parameter count (the cost model's shapes) equals the parameters of the
    modules torchtitan puts on that stage, counted on its own debug model."""
    import torch
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel"])
    shape = get_model("debugmodel")
    names = _debug_stages(n_stages)
    stages = stages_of_fqns(names)
    assert [st.embeddings for st in stages] == [True] + [False] * (n_stages - 1)
    assert [st.head for st in stages] == [False] * (n_stages - 1) + [True]
    for modules, stage in zip(names, stages):
        want = sum(p.numel() for m in modules for p in model.get_submodule(m).parameters())
        assert stage_model(shape, stage).num_params == want, modules
    assert sum(stage_model(shape, st).num_params for st in stages) == shape.num_params


@pytest.mark.parametrize("pp, v, M", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 12)])
def test_interleaved_in_flight_is_torchs_warm_up(pp, v, M):
    """Interleaved 1F1B: rank r runs (v - 1) * pp + 2 * (pp - 1 - r) warm-up forwards,
    then one more before its first backward (torch's ScheduleInterleaved1F1B), so that
    many micro-batch chunks are in flight at its peak; every count is back to 0 at the end."""
    pipe = Pipeline(pp, "Interleaved1F1B", M, [Stage(1)] * (pp * v))
    for rank in range(pp):
        states = pipe.in_flight(rank)
        peak = max(sum(s.values()) for s in states)
        assert peak == min(M * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1), (rank, peak)
        assert all(n == 0 for n in states[-1].values())
        assert all(n >= 0 for s in states for n in s.values())


@pytest.mark.parametrize("schedule, want", [
    ("GPipe", lambda pp, M, r: M),              # every forward before any backward
    ("1F1B", lambda pp, M, r: min(M, pp - r)),  # pp - r warm-up forwards, then 1F1B
    ("LoopedBFS", lambda pp, M, r: 2 * M),      # both local stages' forwards first
])
def test_in_flight_of_the_other_schedules(schedule, want):
    pp, M = 4, 8
    v = 2 if schedule == "LoopedBFS" else 1
    pipe = Pipeline(pp, schedule, M, [Stage(1)] * (pp * v))
    for rank in range(pp):
        assert max(sum(s.values()) for s in pipe.in_flight(rank)) == want(pp, M, rank)


def test_gpipe_holds_more_activations_than_1f1b_and_zero_bubble_keeps_param_1():
    """The same plan under GPipe and 1F1B differs only in what is in flight: rank 0 holds
    M micro-batches of its stage's activations under GPipe and pp under 1F1B; a schedule
    that splits backwards is costed on plans with param = 1 only (the engine's rule)."""
    shape = get_model("llama3_8b")
    stages = [Stage(16, embeddings=True), Stage(16, head=True)]
    common = dict(seq_len=4096, micro_batch=1, world_size=16, ranks_per_node=8,
                  memory_budget_bytes=float("inf"), include_baselines=False)
    reports = {s: choose_plan(shape, pipeline=Pipeline(2, s, 8, stages), **common)
               for s in ("GPipe", "1F1B")}
    for est in reports["1F1B"].candidates:
        gpipe = next(c for c in reports["GPipe"].candidates if c.plan == est.plan)
        rank0 = {s: next(r for r in e.pipeline_ranks if r.rank == 0).memory
                 for s, e in (("GPipe", gpipe), ("1F1B", est))}
        assert rank0["GPipe"].activations == 4 * rank0["1F1B"].activations  # 8 vs 2
        assert rank0["GPipe"].states == rank0["1F1B"].states
    zb = choose_plan(shape, pipeline=Pipeline(2, "ZBVZeroBubble", 8,
                                              [Stage(8, embeddings=True), Stage(8), Stage(8),
                                               Stage(8, head=True)]), **common)
    assert zb.candidates and all(c.plan.s_p == 1 for c in zb.candidates)
    assert any(c.plan.s_p > 1 for c in reports["1F1B"].candidates)


# --------------------------------------------------------------------------------------
# plan = "auto" in a real pipeline job: what the planner predicted per rank is what each
# rank recorded.
# --------------------------------------------------------------------------------------
PP_AUTO = ["--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.pipeline_parallel_schedule", "1F1B",
           "--training.local_batch_size", "4", "--training.global_batch_size", "-1",
           "--amsp.plan", "auto", "--amsp.gpu_memory_gib", "0.075"]


def _report(argv):
    """The planner's report for the job these flags make (4 ranks, 2 per node, pp 2)."""
    from amsp_dtensor.plan.cost.planner import plan
    from amsp_dtensor.titan.planner_bridge import planner_inputs
    from amsp_dtensor.titan.validate import pipeline_of
    from amsp_dtensor.train import parse_job_config

    job_config = parse_job_config(["--job.config_file", "recipes/debug_cpu.toml", *argv])
    return plan(**planner_inputs(job_config, world=2, ranks_per_node=2,
                                 pipeline=pipeline_of(job_config, 2)))


EXPLICIT = ["--amsp.param_shard", "2", "--amsp.grad_shard", "2", "--amsp.optim_shard", "2"]


@pytest.mark.parametrize("flags", [
    [], EXPLICIT, [*EXPLICIT, "--parallelism.fsdp_reshard_after_forward", "always"],
], ids=["auto", "p2-g2-os2", "p2-g2-os2-reshard-always"])
def test_pipeline_records_what_the_planner_predicted(flags, tmp_path):
    """4 ranks = 2 simulated nodes of 2, pp 2 x dp 2, 1F1B over 4 micro-batches. With
    plan = "auto" and a 75 MiB budget (which rules out the replicated plans) the job runs
    the planner's plan; with explicit factors, the planner's estimate of that plan. Each
    rank's recorded collectives per step (count and bytes per op and mesh dim, inter-node
    bytes) are the planner's events for its pipeline rank: with FSDP2's all-gathers
    (param 2), one per unit per step under torchtitan's default policy for PP, more
    under "always" (cost/pipeline.py, all_gathers); its P, G and OS bytes
    (amsp.memory_by_state) are the planner's states for that rank."""
    argv = [*PP_AUTO, *flags]
    if flags:  # explicit factors: drop plan = "auto" and its budget
        argv = [a for a in argv if a not in ("--amsp.plan", "auto", "--amsp.gpu_memory_gib",
                                             "0.075")]
    report = _report([*argv, "--amsp.plan", "auto"] if flags else argv)
    if flags:
        chosen = next(c for c in report.candidates if c.plan.name == "p2-g2-os2")
    else:
        chosen = report.best
        assert chosen.fits and chosen.plan.s_os > 1  # the budget leaves sharded states only
    proc = torchrun([*argv, "--training.steps", "3", "--metrics.save_for_all_ranks"], tmp_path)
    log = proc.stdout + proc.stderr
    if not flags:
        assert f'plan = "auto": the planner chose {chosen.plan.name}' in log
    assert f"Applied AMSP plan {chosen.plan.name}" in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted(glob.glob(str(tmp_path / "tb" / "*" / "rank_*")))
    assert len(runs) == 4, runs
    for run in runs:
        rank = int(run.rsplit("_", 1)[1])
        mine = next(r for r in chosen.pipeline_ranks if r.rank == rank // 2)
        predicted = mine.events
        want = collections.Counter()
        for ev in predicted:
            want[f"comm/{ev.op}/{ev.dim}/count"] += ev.count
            want[f"comm/{ev.op}/{ev.dim}/bytes"] += ev.count * ev.nbytes
        inter = sum(ev.count * ev.nbytes for ev in predicted if ev.inter_node)
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        for step in (2, 3):  # step 1's post-step all-gathers land in step 2 (trainer.py)
            got = {tag: next(e.value for e in acc.Scalars(tag) if e.step == step)
                   for tag in acc.Tags()["scalars"]
                   if tag.startswith("comm/") and tag.endswith(("/count", "/bytes"))}
            assert got == dict(want), (rank, step, got, dict(want))
            inter_got = next(e.value for e in acc.Scalars("comm/inter_node_bytes")
                             if e.step == step)
            assert inter_got == inter == 4  # the norm's all-reduce over pp crosses nodes
            # the states this rank holds: its stage's P, G and OS, byte for byte
            for state in ("param", "grad", "optim"):
                mib = next(e.value for e in acc.Scalars(f"memory_by_state/{state}(MiB)")
                           if e.step == step)
                assert mib * 2**20 == getattr(mine.memory.states, state), (rank, state)
    if flags:  # FSDP2's all-gathers: one per unit per step by default, more under "always"
        gathers = {ev.phase: ev.count for ev in mine.events
                   if ev.op == "all_gather" and ev.dim == "p" and ev.unit == 0}
        always = "always" in flags  # the last stage's 1F1B: F B F B ..., so 1 + 4
        assert gathers == ({"forward": 1, "backward": 4} if always else {"forward": 1}), gathers


@pytest.mark.parametrize("argv, starts_with", [
    (["--parallelism.pipeline_parallel_schedule_csv", "tests/assets/none.csv"],
     "amsp.plan='auto' with parallelism.pipeline_parallel_degree=2: the planner costs "
     "torch's named schedules, not a CSV schedule"),
    (["--training.global_batch_size", "16"],
     "amsp.plan='auto' with parallelism.pipeline_parallel_degree=2: the planner costs one "
     "pipeline schedule per optimizer step, but training.global_batch_size asks for 2"),
], ids=["csv-schedule", "gradient-accumulation"])
def test_auto_plan_pipeline_refusals_are_one_line(argv, starts_with, monkeypatch, capsys):
    base = [a for a in PP_AUTO if a not in ("--amsp.gpu_memory_gib", "0.075")]
    if "--training.global_batch_size" in argv:
        i = base.index("--training.global_batch_size")
        base = base[:i] + base[i + 2:]
    code, err = run_main([*base, *argv], monkeypatch, capsys, world=4, local=4)
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith("amsp_dtensor.train: error: " + starts_with), err[0]
