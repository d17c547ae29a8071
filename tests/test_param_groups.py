"""AMSPOptimizer with torch param groups (each its own lr and weight decay), on 4 CPU ranks
(2 nodes x 2): every plan trains as single-process torch.optim with the same groups
(losses, norms, every weight within 1e-5); Adafactor's sharded step with groups; a
checkpoint moves between plans with its groups and their hyperparameters; bad groups are
refused before anything is built. One process group for the module (run_cases)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import (
    MAX_NORM,
    OPTIMIZERS,
    amsp_training,
    make_model,
    param_groups,
    plan_mesh,
    reference_training,
)
from extra_cases import _train as extra_train

WORLD, PER_NODE, STEPS, MICRO_BATCHES = 4, 2, 4, 2
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]
ADAFACTOR_PLANS = [(1, 1, 4), (2, 2, 2)]
TOL = 1e-5


def _model(plan):
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(*plan)
    mesh = plan_mesh(sharding, PER_NODE)
    model = make_model(torch.float32)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    return model


def _build(plan, optimizer="adamw_groups", groups=True, **overrides):
    import amsp_dtensor as amsp

    model = _model(plan)
    cls, kwargs = OPTIMIZERS[optimizer]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return model, amsp.AMSPOptimizer(model, cls, **{**kwargs, **overrides},
                                     param_groups=param_groups(named, optimizer) if groups else None)


def _train(model, optim, rank, steps):
    """Steps ``steps`` (a range), clipped as reference_training clips; the mean losses."""
    return extra_train(model, optim, rank, WORLD, len(steps), steps.start, max_norm=MAX_NORM)


def checkpoint_case(rank, world):
    """2 steps under p2-g2-os4 with the groups, then model and optimizer state moved to a
    p1-g4-os4 optimizer built with lr 0 (its default group must get 1e-3 back from the
    checkpoint), 2 more steps; and a load into an optimizer grouped otherwise."""
    source, source_optim = _build((2, 2, 4))
    losses = _train(source, source_optim, rank, range(2))
    full = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(source, options=full)
    optim_state = source_optim.state_dict()
    target, target_optim = _build((1, 4, 4), lr=0.0)
    set_model_state_dict(target, model_state, options=full)
    target_optim.load_state_dict(optim_state)
    out = {"saved_groups": [{k: v for k, v in g.items() if k != "params"}
                            for g in optim_state["param_groups"]],
           "loaded_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in target_optim.param_groups],
           "losses": losses + _train(target, target_optim, rank, range(2, 4))}
    _, ungrouped = _build((1, 4, 4), groups=False)
    try:
        ungrouped.load_state_dict(optim_state)
        out["regrouped_error"] = None
    except ValueError as e:
        out["regrouped_error"] = str(e)
    return out


def _bad_groups(model):
    """name -> (param_groups, the error type, a piece of its message)."""
    named = dict(model.named_parameters())
    head = [named["tok_embeddings.weight"], named["output.weight"]]
    rest = [p for n, p in named.items() if n not in ("tok_embeddings.weight", "output.weight")]
    return {
        "not a list": ({"params": rest}, TypeError, "non-empty list of dicts"),
        "twice": ([{"params": head}, {"params": rest + head[:1]}], ValueError,
                  "'tok_embeddings.weight' is in param_groups[0] and param_groups[1]"),
        "in no group": ([{"params": rest}], ValueError,
                        "2 trainable parameters are in no group (tok_embeddings.weight, "
                        "output.weight)"),
        "unknown key": ([{"params": head, "betas2": 0.9}, {"params": rest}], ValueError,
                        "param_groups[0] has 'betas2', which AdamW does not take"),
        "unknown name": ([{"params": ["layers.9.w"]}, {"params": head + rest}], ValueError,
                         "param_groups[0]: 'layers.9.w' is not a parameter of this model"),
        "not a parameter": ([{"params": [torch.zeros(2)]}, {"params": head + rest}],
                            ValueError, "a tensor that is not a parameter of this model"),
        "empty": ([{"params": []}, {"params": head + rest}], ValueError,
                  "param_groups[0] holds no parameters: drop it"),
    }


def bad_groups_case(rank, world):
    """Each bad param_groups raises; afterwards the same model still takes an optimizer,
    here with groups of FQN strings (adamw_norms), and trains."""
    import amsp_dtensor as amsp

    model = _model((2, 2, 4))
    errors = {}
    for name, (groups, kind, _) in _bad_groups(model).items():
        try:
            amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3, param_groups=groups)
            errors[name] = None
        except kind as e:
            errors[name] = str(e)
    cls, kwargs = OPTIMIZERS["adamw_norms"]
    by_name = param_groups([(n, n) for n, _ in model.named_parameters()], "adamw_norms")
    optim = amsp.AMSPOptimizer(model, cls, param_groups=by_name, **kwargs)
    try:
        optim.add_param_group({"params": [], "lr": 1.0})
        errors["add_param_group"] = None
    except ValueError as e:
        errors["add_param_group"] = str(e)
    return {"errors": errors, "losses": _train(model, optim, rank, range(2)),
            "group_sizes": [len(g["params"]) for g in optim.param_groups]}


def _cases():
    cases = {("adamw_groups", plan): partial(amsp_training, plan=plan, dtype=torch.float32,
                                             micro_batches=MICRO_BATCHES, steps=STEPS,
                                             optimizer="adamw_groups")
             for plan in PLANS}
    cases.update({("adafactor_groups", plan): partial(
        amsp_training, plan=plan, dtype=torch.float32, micro_batches=MICRO_BATCHES,
        steps=STEPS, optimizer="adafactor_groups") for plan in ADAFACTOR_PLANS})
    cases["checkpoint"] = checkpoint_case
    cases["bad groups"] = bad_groups_case
    return cases


@pytest.fixture(scope="module")
def results():
    if os.environ.get("AMSP_SKIP_MULTIPROC") == "1":
        pytest.skip("multi-process")
    return run_cases(_cases(), WORLD, PER_NODE)


@pytest.fixture(scope="module")
def references():
    return {name: reference_training(WORLD, MICRO_BATCHES, STEPS, torch.float32,
                                     optimizer=name)
            for name in ("adamw_groups", "adafactor_groups", "adamw", "adafactor")}


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_groups_change_training(references):
    """The reference with groups is not the one without: a path that dropped the groups'
    options would fail the tests below by far more than their tolerance."""
    for grouped, plain in (("adamw_groups", "adamw"), ("adafactor_groups", "adafactor")):
        w, p = references[grouped]["weights"], references[plain]["weights"]
        assert max(_rel(w[n], p[n]) for n in w) > 100 * TOL
        assert _rel(references[grouped]["losses"], references[plain]["losses"]) > 10 * TOL


@pytest.mark.parametrize("optimizer,plan", [*(("adamw_groups", p) for p in PLANS),
                                            *(("adafactor_groups", p) for p in ADAFACTOR_PLANS)],
                         ids=lambda v: v if isinstance(v, str) else "p{}-g{}-os{}".format(*v))
def test_groups_match_single_process_torch_optim(results, references, optimizer, plan):
    ref = references[optimizer]
    for r in results.get((optimizer, plan)):
        assert _rel(r["losses"], ref["losses"]) <= TOL, (r["losses"], ref["losses"])
        assert _rel(r["norms"], ref["norms"]) <= TOL, (r["norms"], ref["norms"])
        if r["weights"] is not None:
            worst = max(_rel(r["weights"][n], ref["weights"][n]) for n in ref["weights"])
            assert worst <= TOL, worst


def test_a_checkpoint_moves_between_plans_with_its_groups(results):
    # the reference: 4 steps of one micro-batch each, the same groups
    ref = reference_training(WORLD, 1, 4, torch.float32, optimizer="adamw_groups")
    for r in results.get("checkpoint"):
        assert [g["lr"] for g in r["saved_groups"]] == [3e-3, 5e-4, 1e-3]
        assert [g["weight_decay"] for g in r["saved_groups"]] == [0.0, 0.0, 0.3]
        assert r["loaded_groups"] == r["saved_groups"]  # lr 1e-3 back, not the target's 0
        assert _rel(r["losses"], ref["losses"]) <= TOL, (r["losses"], ref["losses"])
        assert r["regrouped_error"] == (
            "the checkpoint's optimizer groups the parameters differently from this one: its "
            "group of 'tok_embeddings.weight' holds 2 parameters, this one's 21; build "
            "AMSPOptimizer with the param_groups it was saved with")


@pytest.mark.parametrize("name", list(_bad_groups(make_model(torch.float32))))
def test_bad_param_groups_are_refused_naming_the_fix(results, name):
    _, _, message = _bad_groups(make_model(torch.float32))[name]
    for r in results.get("bad groups"):
        assert r["errors"][name] is not None and message in r["errors"][name], r["errors"][name]


def test_groups_by_fqn_after_refusals(results):
    """After every refusal the model still takes an optimizer; groups named by FQN train
    as single-process torch.optim with the same groups."""
    ref = reference_training(WORLD, 1, 2, torch.float32, optimizer="adamw_norms")
    for r in results.get("bad groups"):
        assert r["errors"]["add_param_group"] == (
            "AMSPOptimizer.add_param_group: the groups are fixed when the optimizer is built; "
            "pass every group in param_groups=[...]")
        assert r["group_sizes"] == [5, 16]
        assert _rel(r["losses"], ref["losses"]) <= TOL, (r["losses"], ref["losses"])


def test_regex_groups_first_match_wins_and_torchtitans_errors():
    """torchtitan's param_groups patterns (0.3's ParamGroupConfig) as AMSPOptimizer groups:
    the first regex found in a parameter's name wins, frozen parameters are left out, and a
    parameter no pattern finds or a pattern that finds none stop with one line."""
    from amsp_dtensor.titan.amsp_optimizers import _groups_by_pattern

    model = make_model(torch.float32)
    model.tok_embeddings.weight.requires_grad_(False)
    groups = _groups_by_pattern(model, [(r"norm\.", {"lr": 1.0}), (r"attention", {}),
                                        (r".*", {"weight_decay": 0.0})])
    names = {id(p): n for n, p in model.named_parameters()}
    got = [sorted(names[id(p)] for p in g["params"]) for g in groups]
    want = [[], [], []]
    for n, p in model.named_parameters():
        if p.requires_grad:
            want[0 if "norm." in n else 1 if "attention" in n else 2].append(n)
    assert got == [sorted(w) for w in want] and all(want)
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == [
        {"lr": 1.0}, {}, {"weight_decay": 0.0}]
    with pytest.raises(ValueError, match=r"^no optimizer param_groups pattern matches "
                       r"layers\.0\.attention\.\w+\.weight, .*: end the list with a "
                       r"catch-all pattern '\.\*'$"):
        _groups_by_pattern(model, [(r"^output", {}),
                                   (r"layers\.\d+\.(feed_forward|\w*norm)", {})])
    with pytest.raises(ValueError, match=r"^Optimizer param_groups pattern 'tok_emb' "
                       "matched no parameters$"):  # tok_embeddings is frozen
        _groups_by_pattern(model, [("tok_emb", {}), (".*", {})])
