"""Cases for torch.optim.Muon under AMSPOptimizer, shared by tests/test_muon.py (4 ranks)
and tests/test_muon_world8.py (8 ranks): Muon's step on the OS shards fed the same
gradients as single-process torch.optim.Muon + AdamW, bit for bit."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from amsp_dtensor.testing.scenarios import (
    OPTIMIZERS,
    make_model,
    param_groups,
    plan_mesh,
    reference_optimizer,
    shard_model,
)

STEP_STEPS = 3


def shard(plan, ranks_per_node: int = 2):
    import amsp_dtensor as amsp

    sharding = amsp.ShardingPlan(*plan)
    model = make_model(torch.float32)
    shard_model(model, plan_mesh(sharding, ranks_per_node), sharding)
    return model


def build(plan, optimizer: str = "muon", ranks_per_node: int = 2, **overrides):
    import amsp_dtensor as amsp

    model = shard(plan, ranks_per_node)
    cls, kwargs = OPTIMIZERS[optimizer]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return model, amsp.AMSPOptimizer(model, cls, param_groups=param_groups(named, optimizer),
                                     **{**kwargs, **overrides})


def step_grads(step: int, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient for ``step`` (seeded, the same on every rank)."""
    g = torch.Generator().manual_seed(500 + step)
    return {name: torch.randn(shape, generator=g) * 0.05 for name, shape in sorted(shapes.items())}


def full_state(optim) -> dict[str, dict[str, torch.Tensor]]:
    """{fqn: {"master": whole tensor, <state>: whole tensor}} from ``optim.state_dict()``."""
    from amsp_dtensor.engine.layouts import gather_full
    from torch.distributed.tensor import DTensor

    return {fqn: {key: gather_full(v) if isinstance(v, DTensor) else v
                  for key, v in entry.items()}
            for fqn, entry in optim.state_dict()["state"].items()}


def exact_step_case(rank, world, plan, optimizer="muon"):
    """STEP_STEPS steps of AMSP's Muon step alone (``optim.inner.step()``, the wrapped
    sharded optimizer), each rank's master rows given their rows of step_grads; the whole
    weights and states afterwards, and the step's collectives (recorded at step 1, in
    order)."""
    import amsp_dtensor as amsp
    from amsp_dtensor import compat

    model, optim = build(plan, optimizer)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    saved = optim.state_dict()  # the fqns in the wrapped optimizer's order, and the masters
    fqns = [fqn for group in saved["param_groups"] for fqn in group["params"]]
    params = [p for group in optim.param_groups for p in group["params"]]
    offsets = {fqn: compat.global_offset(saved["state"][fqn]["master"])[0] for fqn in fqns}
    recorder = amsp.CommRecorder()
    for step in range(STEP_STEPS):
        grads = step_grads(step, shapes)
        for fqn, param in zip(fqns, params):
            param.grad = grads[fqn][offsets[fqn]:offsets[fqn] + param.shape[0]].clone()
        with amsp.record_comms(recorder) if step == 1 else contextlib.nullcontext():
            optim.inner.step()
        for param in params:
            param.grad = None
    events = [e.key() for e in recorder.events]  # (op, dim, size, bytes, inter, phase)
    state = full_state(optim)  # collective: every rank
    return {"state": state if rank == 0 else None, "events": events}


def reference_steps(optimizer="muon"):
    """The same STEP_STEPS steps by single-process torch optimizers on whole tensors from
    the same initial weights: {fqn: {"master": weight, <state>: ...}}."""
    model = make_model(torch.float32)
    named = [(n, p.detach().clone().requires_grad_(True)) for n, p in model.named_parameters()]
    cls, kwargs = OPTIMIZERS[optimizer]
    optim = reference_optimizer(cls, param_groups(named, optimizer), kwargs)
    shapes = {n: p.shape for n, p in named}
    for step in range(STEP_STEPS):
        grads = step_grads(step, shapes)
        for name, p in named:
            p.grad = grads[name].clone()
        optim.step()
    optimizers = getattr(optim, "optimizers", [optim])
    out = {}
    for name, p in named:
        state = next(o.state[p] for o in optimizers if p in o.state)
        out[name] = {"master": p.detach(), **state}
    return out


def compare_exact(got: dict, want: dict) -> list[str]:
    """The entries (fqn/key) whose tensors are not bit-identical."""
    bad = []
    for fqn, entry in want.items():
        for key, value in entry.items():
            mine = got[fqn].get(key)
            if not (isinstance(mine, torch.Tensor) and torch.equal(torch.as_tensor(mine).float(),
                                                                 torch.as_tensor(value).float())):
                bad.append(f"{fqn}/{key}")
    return bad


def check_exchange(ranks: list[dict], plan, world: int, per_node: int, shapes) -> None:
    """Two all-to-alls over the shard group per step (none at s_os = 1): the first sends
    each rank's rows of every Muon matrix, the second the owners' whole results, which
    add up to every matrix once per shard group; 2 bytes (bfloat16) an element. Rank 0's
    are the planner's (choose_plan(optimizer="muon") on the tiny model: the step's
    all-to-alls of its estimate of this plan), key for key."""
    from amsp_dtensor.plan import ShardingPlan
    from amsp_dtensor.plan.cost.comm import event_counter
    from amsp_dtensor.plan.cost.models import ModelShape
    from amsp_dtensor.plan.cost.planner import choose_plan
    from amsp_dtensor.testing.tiny_llama import TinyLlamaConfig

    s_os = plan[2]
    cfg = TinyLlamaConfig()
    tiny = ModelShape("tiny", cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.ffn_dim)
    report = choose_plan(tiny, seq_len=cfg.max_seq_len, micro_batch=1, micro_batches=1,
                         world_size=world, ranks_per_node=per_node,
                         memory_budget_bytes=float("inf"), optimizer="muon",
                         include_baselines=False)
    name = ShardingPlan(*plan).resolve(world, per_node).name
    estimate = next(c for c in report.candidates if c.plan.name == name)
    predicted = [e for e in estimate.events if e.op == "all_to_all" and e.phase == "step"]
    assert Counter(ranks[0]["events"]) == event_counter(predicted)
    if s_os == 1:
        assert all(rank["events"] == [] for rank in ranks)
        return
    elements = sum(r * c for r, c in shapes)
    for rank in ranks:
        (op1, dim1, n1, sent, _, phase1), (op2, dim2, n2, _, _, phase2) = rank["events"]
        assert (op1, dim1, n1, phase1) == (op2, dim2, n2, phase2) == (
            "all_to_all", "shard", s_os, "step")
        assert sent == 2 * elements // s_os  # every rank holds 1/s_os of each matrix here
    assert sum(rank["events"][1][3] for rank in ranks) == len(ranks) // s_os * 2 * elements


def muon_matrix_shapes() -> list[tuple[int, int]]:
    """The tiny model's Muon matrices (the blocks' 2-D weights), in the optimizer's order."""
    model = make_model(torch.float32)
    return [tuple(p.shape) for n, p in model.named_parameters()
            if p.dim() == 2 and n.startswith("layers.")]
