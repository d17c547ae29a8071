"""AMSPOptimizer.state_dict() before the first step (what DCP asks for when a job
resumes): it offers zero moments at step 0, leaves training exactly as it was when
nothing is loaded into it (also between clip_grad_norm_ and step), a checkpoint saved
that early loads as a placeholder again, and a fresh optimizer that goes the DCP way
(state_dict(), fill it in place, load_state_dict()) continues a run exactly. 2 gloo
ranks, plan p1-g1-os2; Adam with L2 weight decay, SGD with dampened momentum and NAdam,
whose placeholder state differs from a fresh one, so a placeholder that leaked into
training would show. Each optimizer is one case of the process group (run_cases)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import global_batches, local_micro_batch, make_model
from amsp_dtensor.testing.tiny_llama import loss_fn

pytestmark = pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1",
                                reason="multi-process")

OPTIMIZERS = {
    "adam_l2": (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1}),
    "sgd_dampened": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-3}),
}
HUGE_NORM = 1e6  # clip_grad_norm_ runs (and prepares the step's grads) but never scales


def _build(rank, world, name):
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(1, 1, 2)
    mesh = amsp.init_mesh(sharding, ranks_per_node=1, device_type="cpu")
    model = make_model(torch.float32)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    cls, kwargs = OPTIMIZERS[name]
    return model, amsp.AMSPOptimizer(model, cls, **kwargs)


def _train(model, optim, rank, world, steps, before_step=None):
    losses = []
    for step in steps:
        batch = local_micro_batch(global_batches(step, world, 1, model.cfg), rank, world, 0)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        optim.clip_grad_norm_(HUGE_NORM)
        if before_step is not None:
            before_step(step)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    optim.wait_param_update()
    return losses


def _local_copy(state_dict):
    """The tensors of a state_dict as plain local copies (what a checkpoint holds)."""
    out = {}
    for fqn, entry in state_dict["state"].items():
        out[fqn] = {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                    if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    return out


def _fill_and_load(optim, saved, saved_is_placeholder):
    """What DCP does on load: ask for a state_dict, fill its tensors in place and replace
    its other values from the checkpoint, hand it to load_state_dict."""
    target = optim.state_dict()
    for fqn, entry in target["state"].items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                (v.to_local() if hasattr(v, "to_local") else v).copy_(saved[fqn][k])
    target["state_is_placeholder"] = saved_is_placeholder
    optim.load_state_dict(target)


def _case(rank, world, name):
    """The losses of a plain run and of the runs that met an early state_dict(), the early
    state_dict()'s values (local copies) and the masters before and after it was taken."""
    plain_model, plain = _build(rank, world, name)
    plain_losses = _train(plain_model, plain, rank, world, range(2))
    saved_dict = plain.state_dict()  # after step 2, as a checkpoint would
    saved, saved_flag = _local_copy(saved_dict), saved_dict["state_is_placeholder"]
    weights = {k: v.clone() for k, v in plain_model.state_dict().items()}
    plain_losses += _train(plain_model, plain, rank, world, range(2, 4))

    # state_dict() before the first step: placeholder, then training as if untouched
    model, optim = _build(rank, world, name)
    masters_before = [m.to_local().clone() for m in optim._masters]
    early = optim.state_dict()
    early_copy = _local_copy(early)  # state_dict values share storage with the live state
    masters_after = [m.to_local().clone() for m in optim._masters]
    touched_losses = _train(model, optim, rank, world, range(4))

    # state_dict() between clip_grad_norm_ and the first step: the prepared grads stay
    model, optim = _build(rank, world, name)
    between_losses = _train(model, optim, rank, world, range(4),
                            before_step=lambda step: step == 0 and optim.state_dict())

    # a checkpoint saved before the first step, loaded into a fresh optimizer
    model, optim = _build(rank, world, name)
    _fill_and_load(optim, early_copy, early["state_is_placeholder"])
    early_ckpt_losses = _train(model, optim, rank, world, range(4))

    # resume the DCP way: a fresh optimizer's state_dict() filled in place, then loaded
    model, optim = _build(rank, world, name)
    model.load_state_dict(weights)
    _fill_and_load(optim, saved, saved_flag)
    resumed_losses = _train(model, optim, rank, world, range(2, 4))
    return {
        "plain": plain_losses, "touched": touched_losses, "resumed": resumed_losses,
        "between": between_losses, "early_ckpt": early_ckpt_losses,
        "early_flag": early["state_is_placeholder"], "early_state": early_copy,
        "masters_before": masters_before, "masters_after_state_dict": masters_after,
    }


@pytest.fixture(scope="module")
def results():
    return run_cases({name: partial(_case, name=name) for name in OPTIMIZERS}, 2, 1)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_dict_before_first_step_is_zero_and_changes_nothing(results, name):
    for r in results.get(name):
        early = r["early_state"]
        assert all(len(entry) > 1 for entry in early.values())  # moments, not just a master
        moments = [v for entry in early.values() for k, v in entry.items()
                   if k != "master" and isinstance(v, torch.Tensor) and v.dim() > 0]
        assert all(float(v.abs().max()) == 0.0 for v in moments)
        assert all(float(entry["step"]) == 0.0 for entry in early.values() if "step" in entry)
        assert len(r["masters_before"]) == len(r["masters_after_state_dict"])
        assert all(torch.equal(a, b)
                   for a, b in zip(r["masters_before"], r["masters_after_state_dict"]))
        assert r["touched"] == r["plain"]  # exactly: the placeholder was dropped
        assert r["between"] == r["plain"]  # the grads clip had prepared were stepped
        assert r["early_flag"] is True and r["early_ckpt"] == r["plain"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fresh_optimizer_loaded_the_dcp_way_continues_the_run(results, name):
    for r in results.get(name):
        assert r["resumed"] == r["plain"][2:]
        assert r["plain"][3] != r["plain"][2]
