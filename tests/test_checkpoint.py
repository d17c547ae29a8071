"""Checkpoints through amsp_dtensor.checkpoint (DCP): resume, reshard, faults, mismatches.

- Resume: 6 steps vs 3 steps, save, a fresh model and optimizer loading step 3, steps 4-6;
  3 plans on 4 ranks (2 per node).
- Reshard: checkpoints saved under one (world size, plan) load under another with the
  full weights and every optimizer state identical: 4 -> 4, 4 -> 8, 8 -> 2 and 4 -> 2 ranks,
  each with a plan change; Adafactor's factored moments and Muon's momentum (beside its
  AdamW group's moments) 4 -> 8.
- Faults (torchrun, 2 ranks, ``amsp_dtensor.testing.checkpoint_job``): SIGKILL of one rank
  at three points of a save and in the middle of a step; torchrun restarts the job, which
  resumes from the newest complete checkpoint and ends with the uninterrupted run's losses
  and weights.
- Mismatches: a checkpoint that does not fit stops every rank with the same one-line
  CheckpointMismatch, before any collective.

The 4-, 8- and 2-rank worlds run in turn (8 loads what 4 saved, 2 what both saved), each
one process group whose cases run on their own (run_cases).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial

import pytest
import torch

from amsp_dtensor.testing.multiproc import run_cases

pytestmark = pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1",
                                reason="multi-process")

RESUME_PLANS = [(1, 1, 2), (2, 2, 4), (1, 4, 4)]  # 4 ranks, 2 per node
# (plan, variant): "-overlap" saves with overlap_param_update=True (an update pending) and
# loads into an optimizer that has stepped once already
RESUME_CASES = [(plan, "") for plan in RESUME_PLANS] + [((2, 2, 4), "-overlap")]
ADAFACTOR_SOURCE, ADAFACTOR_TARGET = (4, (2, 2, 4)), (8, (4, 4, 8))
# (source world, source plan) -> (target world, target plan)
RESHARDS = [
    ((4, (1, 1, 2)), (4, (2, 4, 4))),
    ((4, (2, 2, 4)), (8, (1, 8, 8))),
    ((4, (1, 4, 4)), (8, (4, 4, 8))),
    ((8, (1, 8, 8)), (2, (2, 2, 2))),
    ((8, (4, 4, 8)), (2, (1, 1, 2))),
    ((4, (2, 2, 4)), (2, (1, 2, 2))),
]
RANKS_PER_NODE = {2: 1, 4: 2, 8: 4}
JOB_PLAN = (1, 1, 2)  # the torchrun fault jobs: 2 ranks, 1 per node
JOB_STEPS = 6


def _name(world, plan):
    return f"w{world}-p{plan[0]}-g{plan[1]}-os{plan[2]}"


def _build(world, plan, cfg=None, optimizer=torch.optim.AdamW, **kwargs):
    import amsp_dtensor as amsp
    from amsp_dtensor.testing.scenarios import OPTIMIZERS, make_model, plan_mesh

    sharding = amsp.ShardingPlan(*plan)
    mesh = plan_mesh(sharding, RANKS_PER_NODE[world])  # one mesh per plan: its Note
    model = make_model(torch.float32, cfg)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    if optimizer is None:
        return model, None
    options = dict(OPTIMIZERS["adamw"][1]) if optimizer is torch.optim.AdamW else {"lr": 1e-2}
    options.update(kwargs)
    return model, amsp.AMSPOptimizer(model, optimizer, **options)


def _train(model, optim, rank, world, steps):
    from amsp_dtensor.testing.checkpoint_job import train_step

    return [train_step(model, optim, step, rank, world) for step in steps]


def _full_state(model, optim):
    """Full weights and every optimizer state as whole tensors (collective)."""
    from amsp_dtensor.testing.scenarios import full_state

    return full_state(model, optim)


def _saved_at(tmp, world, plan):
    return os.path.join(tmp, _name(world, plan))


def _resume(rank, world, tmp, plan, variant):
    """6 steps straight, and 3 steps + save + a fresh model and optimizer loading step 3 +
    steps 4-6: both runs' losses and full states (rank 0), the step loaded, whether an
    update was pending at the save and the RNG state restored."""
    from amsp_dtensor import checkpoint

    overlap = {"overlap_param_update": True} if variant else {}
    model, optim = _build(world, plan, **overlap)
    whole = _train(model, optim, rank, world, range(1, JOB_STEPS + 1))
    whole_state = _full_state(model, optim)
    model, optim = _build(world, plan, **overlap)
    first = _train(model, optim, rank, world, range(1, 4))
    pending = optim.param_update_pending  # overlap: step 3's all-gather not landed yet
    torch.rand(5)  # randomness used in training: the RNG state moves on
    path = _saved_at(tmp, world, plan) + variant
    checkpoint.save(path, 3, model, optim)
    saved_state = _full_state(model, optim)
    drawn_after_save = torch.rand(3)
    del model, optim
    model, optim = _build(world, plan, **overlap)
    if variant:  # an optimizer that has stepped already (its state is replaced)
        _train(model, optim, rank, world, [5])
    step = checkpoint.load(checkpoint.step_path(path, 3), model, optim)
    drawn_after_load = torch.rand(3)
    rest = _train(model, optim, rank, world, range(step + 1, JOB_STEPS + 1))
    resumed_state = _full_state(model, optim)
    if rank != 0:
        return None
    if not variant:  # the reshard tests compare their loads with this
        torch.save(saved_state, os.path.join(tmp, _name(world, plan) + ".state.pt"))
    return {"whole": whole, "resumed": first + rest, "step": step, "pending": pending,
            "drawn_after_save": drawn_after_save, "drawn_after_load": drawn_after_load,
            "whole_state": whole_state, "resumed_state": resumed_state}


def _save_adafactor(rank, world, tmp):
    """Adafactor: factored moments (a row factor sharded with the rows, a whole column
    factor), saved at step 3 with its full state beside it."""
    from amsp_dtensor import checkpoint

    model, optim = _build(world, ADAFACTOR_SOURCE[1], optimizer=torch.optim.Adafactor)
    _train(model, optim, rank, world, range(1, 4))
    checkpoint.save(_saved_at(tmp, *ADAFACTOR_SOURCE) + "-adafactor", 3, model, optim)
    adafactor_state = _full_state(model, optim)
    if rank == 0:
        torch.save(adafactor_state,
                   os.path.join(tmp, _name(*ADAFACTOR_SOURCE) + "-adafactor.state.pt"))


MUON_SOURCE, MUON_TARGET = (4, (2, 2, 4)), (8, (4, 4, 8))


def _muon(world, plan):
    """Muon on the blocks' matrices, AdamW on the rest (scenarios' "muon" groups)."""
    from muon_cases import build

    return build(plan, ranks_per_node=RANKS_PER_NODE[world])


def _save_muon(rank, world, tmp):
    """Muon + AdamW saved at step 3, its full state beside it."""
    from amsp_dtensor import checkpoint

    model, optim = _muon(world, MUON_SOURCE[1])
    _train(model, optim, rank, world, range(1, 4))
    checkpoint.save(_saved_at(tmp, *MUON_SOURCE) + "-muon", 3, model, optim)
    state = _full_state(model, optim)
    if rank == 0:
        torch.save(state, os.path.join(tmp, _name(*MUON_SOURCE) + "-muon.state.pt"))


def _load_muon(rank, world, tmp):
    from amsp_dtensor import checkpoint

    model, optim = _muon(world, MUON_TARGET[1])
    checkpoint.load(checkpoint.step_path(_saved_at(tmp, *MUON_SOURCE) + "-muon", 3), model, optim)
    state = _full_state(model, optim)
    return state if rank == 0 else None


def _load_reshard(rank, world, tmp, source, target):
    """Load the RESHARDS source checkpoint under this world's plan: (step, full state, the
    loss of one more step) on rank 0; re-saved under this plan for the next world."""
    from amsp_dtensor import checkpoint

    model, optim = _build(world, target[1])
    step = checkpoint.load(checkpoint.step_path(_saved_at(tmp, *source), 3), model, optim)
    state = _full_state(model, optim)
    checkpoint.save(_saved_at(tmp, *target), 3, model, optim)
    # one step more: training goes on from the loaded state
    loss = _train(model, optim, rank, world, [step + 1])[0]
    return (step, state, loss) if rank == 0 else None


def _load_adafactor(rank, world, tmp):
    from amsp_dtensor import checkpoint

    model, optim = _build(world, ADAFACTOR_TARGET[1], optimizer=torch.optim.Adafactor)
    checkpoint.load(checkpoint.step_path(_saved_at(tmp, *ADAFACTOR_SOURCE) + "-adafactor", 3),
                    model, optim)
    adafactor = _full_state(model, optim)
    return adafactor if rank == 0 else None


def _reshard_cases(world):
    """The RESHARDS loaded by ``world``, in order (a source may be the one before's save)."""
    return {("reshard", source, target): partial(_load_reshard, source=source, target=target)
            for source, target in RESHARDS if target[0] == world}


def _world4_cases():
    cases = {("resume", plan, variant): partial(_resume, plan=plan, variant=variant)
             for plan, variant in RESUME_CASES}
    cases["adafactor save"] = _save_adafactor
    cases["muon save"] = _save_muon
    cases.update(_reshard_cases(4))
    return cases


def _world8_cases():
    return {**_reshard_cases(8), "adafactor load": _load_adafactor, "muon load": _load_muon}


# ---- mismatches (2 ranks) ---------------------------------------------------------------
def _mismatch_cases(tmp):
    """name -> (what to build, which checkpoint to load, load with the optimizer?)."""
    from amsp_dtensor.testing.tiny_llama import TinyLlamaConfig

    source = os.path.join(_saved_at(tmp, 2, (1, 2, 2)), "step-3")
    return {
        "interrupted": (dict(), os.path.join(tmp, "interrupted", "step-4"), True),
        "shape": (dict(cfg=TinyLlamaConfig(ffn_dim=48)), source, True),
        "missing": (dict(cfg=TinyLlamaConfig(n_layers=3)), source, True),
        "extra": (dict(cfg=TinyLlamaConfig(n_layers=1)), source, True),
        "optimizer_class": (dict(optimizer=torch.optim.SGD, momentum=0.9), source, True),
        "optimizer_settings": (dict(amsgrad=True), source, True),
        "model_only": (dict(), os.path.join(tmp, "model_only", "step-3"), True),
        "optimizer_left_out": (dict(), source, False),
    }


def _job_reference(rank, world, tmp):
    """The run the torchrun fault jobs must end with: losses and full weights."""
    model, optim = _build(world, JOB_PLAN)
    losses = _train(model, optim, rank, world, range(1, JOB_STEPS + 1))
    return {"losses": losses, "weights": _full_state(model, optim)["weights"]}


def _extras(rank, world, tmp):
    """extra (alike on every rank, with a list) and rank_extra (each rank's own), saved
    with a model at step 6 and loaded into fresh dicts: those dicts after the load."""
    from amsp_dtensor import checkpoint

    model, optim = _build(world, JOB_PLAN)
    _train(model, optim, rank, world, [1])
    extra = {"samples_seen": torch.tensor([96]), "buffers": [torch.ones(2), torch.zeros(3)],
             "epoch": 1}
    rank_extra = {"position": torch.tensor([10 * rank + 7]), "name": f"shard{rank}"}
    checkpoint.save(os.path.join(tmp, "extras"), 6, model, optim, extra=extra,
                    rank_extra=rank_extra)
    got_extra = {"samples_seen": torch.tensor([0]), "buffers": [torch.empty(2), torch.empty(3)],
                 "epoch": 0}
    got_rank_extra = {"position": torch.tensor([0]), "name": ""}
    model2, optim2 = _build(world, JOB_PLAN)
    checkpoint.load(checkpoint.step_path(os.path.join(tmp, "extras"), 6), model2, optim2,
                    extra=got_extra, rank_extra=got_rank_extra)
    return {"extra": got_extra, "rank_extra": got_rank_extra}


def _save_mismatch_sources(rank, world, tmp):
    """The checkpoints of _mismatch_cases that the reshards do not leave: a model-only one,
    and one whose save was interrupted (no .metadata)."""
    from amsp_dtensor import checkpoint

    model, optim = _build(world, JOB_PLAN)
    _train(model, optim, rank, world, [1])
    checkpoint.save(os.path.join(tmp, "model_only"), 3, model)
    checkpoint.save(os.path.join(tmp, "interrupted"), 4, model, optim)
    torch.distributed.barrier()
    if rank == 0:
        os.remove(os.path.join(tmp, "interrupted", "step-4", ".metadata"))
    torch.distributed.barrier()


def _mismatched_load(rank, world, tmp, name):
    """(the CheckpointMismatch message, seconds to raise it), or None if the load worked."""
    from amsp_dtensor import checkpoint

    build, path, with_optim = _mismatch_cases(tmp)[name]
    build = dict(build)
    model, optim = _build(world, (1, 1, 2), build.pop("cfg", None),
                          build.pop("optimizer", torch.optim.AdamW), **build)
    start = time.monotonic()
    try:
        checkpoint.load(path, model, optim if with_optim else None)
        error = None
    except checkpoint.CheckpointMismatch as e:
        error = (str(e), time.monotonic() - start)
    torch.distributed.barrier()  # every rank is past the failed load: none hangs
    return error


def _world2_cases():
    cases = _reshard_cases(2)
    cases["job reference"] = _job_reference
    cases["extras"] = _extras
    cases["mismatch sources"] = _save_mismatch_sources
    for name in _mismatch_cases(tmp=""):
        cases[("mismatch", name)] = partial(_mismatched_load, name=name)
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """world size -> its run_cases results ("tmp": the checkpoints' folder). The worlds
    run in turn: 8 loads what 4 saved, 2 what 4 and 8 saved."""
    tmp = str(tmp_path_factory.mktemp("checkpoints"))
    return {"tmp": tmp, 4: run_cases(_world4_cases(), 4, 2, tmp, timeout=300),
            8: run_cases(_world8_cases(), 8, 4, tmp, timeout=300),
            2: run_cases(_world2_cases(), 2, 1, tmp, timeout=300)}


# ---- resume ------------------------------------------------------------------------------
def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("case", RESUME_CASES, ids=[_name(4, p) + v for p, v in RESUME_CASES])
def test_resume_continues_the_run(results, case):
    r = results[4].get(("resume", *case))[0]
    assert r["step"] == 3
    assert r["pending"] is bool(case[1])  # with overlap, saved while an update was pending
    assert torch.equal(r["drawn_after_save"], r["drawn_after_load"])  # the RNG state came back
    assert r["whole"] == pytest.approx(r["resumed"], abs=1e-6)
    assert r["whole"][3] != r["whole"][2]  # the steps after the resume trained
    assert _max_diff(r["whole_state"]["weights"], r["resumed_state"]["weights"]) <= 1e-6
    assert _max_diff(r["whole_state"]["optim"], r["resumed_state"]["optim"]) <= 1e-6


def test_adafactor_factored_states_reshard_exactly(results):
    results[4].get("adafactor save")  # its traceback, if the save failed
    saved = torch.load(os.path.join(results["tmp"], _name(*ADAFACTOR_SOURCE) + "-adafactor.state.pt"))
    loaded = results[8].get("adafactor load")[0]
    assert any(k.endswith("row_var") for k in saved["optim"])
    assert any(k.endswith("col_var") for k in saved["optim"])
    for kind in ("weights", "optim"):
        assert saved[kind].keys() == loaded[kind].keys()
        for key in saved[kind]:
            assert torch.equal(saved[kind][key], loaded[kind][key]), (kind, key)


def test_muon_momentum_reshards_exactly(results):
    """Muon's momentum buffers (and the AdamW group's moments, the masters) saved on 4
    ranks under p2-g2-os4 load on 8 ranks under p4-g4-os8, tensor for tensor."""
    results[4].get("muon save")
    saved = torch.load(os.path.join(results["tmp"], _name(*MUON_SOURCE) + "-muon.state.pt"))
    loaded = results[8].get("muon load")[0]
    assert any(k.endswith("momentum_buffer") for k in saved["optim"])
    assert any(k.endswith("exp_avg") for k in saved["optim"])
    for kind in ("weights", "optim"):
        assert saved[kind].keys() == loaded[kind].keys()
        for key in saved[kind]:
            assert torch.equal(saved[kind][key], loaded[kind][key]), (kind, key)


# ---- reshard -----------------------------------------------------------------------------
@pytest.mark.parametrize("pair", RESHARDS, ids=[f"{_name(*s)}-to-{_name(*d)}" for s, d in RESHARDS])
def test_reshard_round_trip_is_exact(results, pair):
    (src_world, src_plan), (dst_world, dst_plan) = pair
    step, state, loss = results[dst_world].get(("reshard", *pair))[0]
    # every source was saved at step 3 from the 4-rank run (8-rank ones re-saved unchanged)
    origin = {(8, (1, 8, 8)): (4, (2, 2, 4)), (8, (4, 4, 8)): (4, (1, 4, 4))}.get(
        (src_world, src_plan), (src_world, src_plan))
    saved = torch.load(os.path.join(results["tmp"], _name(*origin) + ".state.pt"))
    assert step == 3
    for kind in ("weights", "optim"):
        assert saved[kind].keys() == state[kind].keys()
        for key in saved[kind]:
            assert torch.equal(saved[kind][key], state[kind][key]), (kind, key)
    assert len(saved["optim"]) == 4 * len(saved["weights"])  # master, exp_avg, exp_avg_sq, step
    assert torch.isfinite(torch.tensor(loss))


def test_extra_and_rank_extra_come_back(results):
    for rank, got in enumerate(results[2].get("extras")):
        assert torch.equal(got["extra"]["samples_seen"], torch.tensor([96]))
        assert torch.equal(got["extra"]["buffers"][0], torch.ones(2))
        assert torch.equal(got["extra"]["buffers"][1], torch.zeros(3))
        assert got["extra"]["epoch"] == 1
        assert torch.equal(got["rank_extra"]["position"], torch.tensor([10 * rank + 7]))
        assert got["rank_extra"]["name"] == f"shard{rank}"


# ---- faults under torchrun ----------------------------------------------------------------
def _torchrun(tmp, name, max_restarts, faults, save_every):
    ckpt, out = os.path.join(tmp, name, "ckpt"), os.path.join(tmp, name, "out")
    os.makedirs(out)
    cmd = ["timeout", "400", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2",
           "--max-restarts", str(max_restarts), "-m", "amsp_dtensor.testing.checkpoint_job",
           "--dir", ckpt, "--out", out, "--plan", ",".join(map(str, JOB_PLAN)),
           "--steps", str(JOB_STEPS), "--save-every", str(save_every), "--faults", faults]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the shared store, as by default
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    resumed = {e["attempt"]: e["resumed_from"] for e in events if "resumed_from" in e}
    losses = {}
    for e in events:
        if "loss" in e:
            losses[e["step"]] = e["loss"]  # a step run again after a restart: the last one
    weights = torch.load(os.path.join(out, "weights.pt"))
    return resumed, [losses[s] for s in sorted(losses)], weights, ckpt


def _check_against_reference(results, losses, weights):
    reference = results[2].get("job reference")[0]
    assert len(losses) == JOB_STEPS
    assert losses == pytest.approx(reference["losses"], abs=1e-6)
    assert _max_diff(weights, reference["weights"]) <= 1e-6


def test_rank_killed_during_saves_resumes_from_last_complete_checkpoint(results):
    # attempt 0: rank 1 dies when asked for its plan in step 2's save (nothing written);
    # attempt 1: rank 1 dies right after writing its data in step 3's save;
    # attempt 2: rank 0 (DCP's coordinator) dies in step 4's save before .metadata exists.
    faults = "0:plan:2:1,1:written:3:1,2:finish:4:0"
    resumed, losses, weights, ckpt = _torchrun(results["tmp"], "save_faults", 3, faults, 1)
    assert resumed == {0: None, 1: 1, 2: 2, 3: 3}
    _check_against_reference(results, losses, weights)
    from amsp_dtensor import checkpoint

    assert checkpoint.latest_step(ckpt) == JOB_STEPS


def test_rank_killed_in_a_step_restarts_under_torchrun(results):
    # rank 1 dies in the backward of step 4; the last complete checkpoint is step 2's
    resumed, losses, weights, _ = _torchrun(results["tmp"], "step_fault", 1, "0:train:4:1", 2)
    assert resumed == {0: None, 1: 2}
    _check_against_reference(results, losses, weights)


# ---- mismatches -----------------------------------------------------------------------------
MISMATCH_MESSAGES = {
    "interrupted": "is not a complete checkpoint (no .metadata: its save was interrupted)",
    "shape": "does not fit: model layers.0.feed_forward",
    "missing": "does not fit: 9 model entries of this job missing from it (first: layers.2.",
    "extra": "does not fit: it has 9 model entries this job lacks (first: layers.1.",
    "optimizer_class": "was saved with AdamW and this optimizer is SGD",
    "optimizer_settings": "21 optimizer state entries of this job missing from it (other "
                          "optimizer settings?) (first: layers.0.attention.wk.weight.max_exp_avg_sq)",
    "model_only": "holds model weights only: load it with optimizer=None",
    "optimizer_left_out": "this model already has an AMSPOptimizer",
}


def test_every_mismatch_case_has_its_message():
    assert _mismatch_cases(tmp="").keys() == MISMATCH_MESSAGES.keys()


@pytest.mark.parametrize("name", sorted(MISMATCH_MESSAGES))
def test_mismatched_checkpoint_stops_every_rank_with_one_line(results, name):
    messages = results[2].get(("mismatch", name))
    assert all(m is not None for m in messages), f"{name}: the load did not fail"
    texts = {text for text, _ in messages}
    assert len(texts) == 1, texts  # every rank, the same verdict
    text = texts.pop()
    assert "\n" not in text
    assert MISMATCH_MESSAGES[name] in text, text
    assert all(seconds < 60 for _, seconds in messages)
