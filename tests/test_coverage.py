"""Models beyond the plain llama block, under every valid plan on 4 CPU ranks (2 nodes x 2),
one process group for the module: frozen parameters (LoRA-style: frozen embeddings and the
attention half of every block) train exactly like single-process training and hold no G
or OS; tied weights split over two units are refused with one line naming both modules,
and train exactly when they share one unit; Adafactor (factored second moments over whole
rows and columns) trains exactly like torch.optim.Adafactor in one process; other
optimizers outside the elementwise list are refused at construction. Each plan and model
is one case of the process group (run_cases)."""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import amsp_training, make_model, plan_mesh, reference_training
from engine_cases import rel_diff

pytestmark = pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1",
                                reason="multi-process")

WORLD, PER_NODE, STEPS, MICRO_BATCHES = 4, 2, 3, 2
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]
TIED_EXACT_PLANS = [(1, 1, 4), (2, 2, 4), (4, 4, 4)]
PLAN_IDS = [f"p{a}-g{b}-os{c}" for a, b, c in PLANS]


def _tied_split(rank, world, plan, separate):
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(*plan)
    mesh = plan_mesh(sharding, PER_NODE)
    model = make_model(torch.float32, variant="tied")
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(getattr(model, separate), mesh=mesh, plan=sharding)
    try:
        amsp.fully_shard(model, mesh=mesh, plan=sharding)
    except ValueError as exc:
        return str(exc)
    return None


def _refused_optimizer(rank, world):
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(2, 2, 4)
    mesh = plan_mesh(sharding, PER_NODE)
    model = make_model(torch.float32)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    out = {}
    class MyAdamW(torch.optim.AdamW):  # a subclass may change the update: refused too
        pass

    for cls in (torch.optim.LBFGS, MyAdamW):
        try:
            amsp.AMSPOptimizer(model, cls, lr=1e-2)
            out[cls.__name__] = None
        except (TypeError, ValueError) as exc:
            out[cls.__name__] = str(exc)
    return out


def _adafactor_moves_between_plans(rank, world):
    """Adafactor's state (row factors sharded with the rows, column factors whole) saved
    under one plan continues under another like the run that never moved."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    import amsp_dtensor as amsp
    from extra_cases import _build, _train

    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    source = _build((2, 2, 4))
    source_optim = amsp.AMSPOptimizer(source, torch.optim.Adafactor, **kwargs)
    _train(source, source_optim, rank, world, 2)
    full = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(source, options=full)
    optim_state = source_optim.state_dict()
    target = _build((1, 4, 4))
    set_model_state_dict(target, model_state, options=full)
    target_optim = amsp.AMSPOptimizer(target, torch.optim.Adafactor, **kwargs)
    target_optim.load_state_dict(optim_state)
    return {"source": _train(source, source_optim, rank, world, 2, first_step=2),
            "target": _train(target, target_optim, rank, world, 2, first_step=2)}


def _all_cases() -> dict:
    cases = {}
    for plan in PLANS:
        train = partial(amsp_training, plan=plan, dtype=torch.float32,
                        micro_batches=MICRO_BATCHES, steps=STEPS)
        cases[("adafactor", plan)] = partial(train, optimizer="adafactor")
        cases[("frozen", plan)] = partial(train, variant="frozen")
        for separate in ("output", "tok_embeddings"):
            cases[("tied_split", plan, separate)] = partial(_tied_split, plan=plan,
                                                            separate=separate)
    for plan in TIED_EXACT_PLANS:
        cases[("tied", plan)] = partial(amsp_training, plan=plan, dtype=torch.float32,
                                        micro_batches=MICRO_BATCHES, steps=STEPS,
                                        variant="tied")
    cases["optimizers"] = _refused_optimizer
    cases["adafactor_moved"] = _adafactor_moves_between_plans
    return cases


@pytest.fixture(scope="module")
def runs():
    results = run_cases(_all_cases(), WORLD, PER_NODE, timeout=600)
    refs = {v: reference_training(WORLD, MICRO_BATCHES, STEPS, torch.float32, variant=v)
            for v in ("frozen", "tied")}
    refs["adafactor"] = reference_training(WORLD, MICRO_BATCHES, STEPS, torch.float32,
                                           optimizer="adafactor")
    return results, refs


def _check_exact(case, ref):
    assert rel_diff(case["losses"], ref["losses"]) <= 1e-5, (case["losses"], ref["losses"])
    for name, want in ref["weights"].items():
        assert rel_diff(case["weights"][name], want) <= 1e-5, name


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_frozen_parameters_train_exactly(runs, plan):
    results, refs = runs
    frozen = results.get(("frozen", plan))
    _check_exact(frozen[0], refs["frozen"])
    # frozen weights did not move
    start = make_model(torch.float32, variant="frozen")
    for name, param in start.named_parameters():
        if not param.requires_grad:
            assert torch.equal(frozen[0]["weights"][name], param.detach()), name


def _elements(params, s):
    """Elements of ``params`` with each dim 0 padded to a multiple of s, per rank."""
    return sum(math.ceil(p.shape[0] / s) * (p.numel() // p.shape[0]) for p in params)


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_frozen_parameters_hold_p_but_no_g_or_os(runs, plan):
    results, _ = runs
    s_p, s_g, s_os = plan
    model = make_model(torch.float32, variant="frozen")
    units = [list(b.parameters()) for b in model.layers]
    in_blocks = {id(p) for u in units for p in u}
    units.append([p for p in model.parameters() if id(p) not in in_blocks])
    trainable = [[p for p in u if p.requires_grad] for u in units]
    every = [p for u in units for p in u]
    frozen = results.get(("frozen", plan))
    for rank, result in enumerate(frozen):
        mem = result["memory"]
        # P: every parameter, frozen ones included (FSDP's padded shard; whole if s_p = 1)
        assert mem["param"] == 4 * _elements(every, s_p), (rank, mem)
        # G (read after the first, no_sync micro-batch): trainable parameters only
        assert mem["grad"] == 4 * sum(_elements(u, s_g) for u in trainable), (rank, mem)
    # OS: one shard group holds exactly the 2 AdamW states of the trainable parameters (fp32
    # params: the P shard is the master)
    phi_trainable = sum(p.numel() for u in trainable for p in u)
    assert sum(frozen[r]["memory"]["optim"] for r in range(s_os)) == 8 * phi_trainable


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_tied_weights_in_two_units_are_refused(runs, plan):
    results, _ = runs
    for separate, other in (("output", "tok_embeddings"), ("tok_embeddings", "output")):
        for message in results.get(("tied_split", plan, separate)):
            assert message is not None and message.startswith("tied parameters:"), message
            assert f"'{other}.weight'" in message and f"'{separate}'" in message, message
            assert "\n" not in message


@pytest.mark.parametrize("plan", TIED_EXACT_PLANS, ids=[f"p{a}-g{b}-os{c}" for a, b, c in TIED_EXACT_PLANS])
def test_tied_weights_in_one_unit_train_exactly(runs, plan):
    results, refs = runs
    case = results.get(("tied", plan))[0]
    _check_exact(case, refs["tied"])


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_adafactor_trains_exactly(runs, plan):
    results, refs = runs
    by_rank = results.get(("adafactor", plan))
    case = by_rank[0]
    _check_exact(case, refs["adafactor"])
    start = make_model(torch.float32)
    moved = max((case["weights"][n] - p.detach()).abs().max().item() for n, p in start.named_parameters())
    assert moved > 1e-3, moved  # it trained (so agreement is not two idle runs)
    for other in by_rank[1:]:
        assert other["losses"] == case["losses"]


def test_adafactor_state_moves_between_plans(runs):
    results, _ = runs
    for moved in results.get("adafactor_moved"):
        # the two plans sum grads in different orders: fp32 drift only
        for a, b in zip(moved["target"], moved["source"]):
            assert abs(a - b) / abs(b) <= 1e-5, moved


def test_optimizers_outside_the_elementwise_list_are_refused(runs):
    results, _ = runs
    for messages in results.get("optimizers"):
        for name, message in messages.items():
            assert message is not None, name
            assert name in message and "elementwise" in message and "\n" not in message, message
