"""An exception inside the backward (or forward) of step 2, caught by the training loop,
then zero_grad() and a retry of step 2: the run must be identical to one that was never
interrupted. Each plan is one case of the world-4 process group; every rank raises at the
same point (as an OOM in the same micro-batch would), so the collectives issued before it
match."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import amsp_dtensor as amsp
from amsp_dtensor.testing.scenarios import (
    LR,
    MAX_NORM,
    full_weights,
    global_batches,
    local_micro_batch,
    make_model,
    plan_mesh,
)
from amsp_dtensor.testing.tiny_llama import loss_fn

PLANS = [(1, 1, 4), (2, 2, 4), (2, 4, 4), (4, 4, 4)]
STEPS = 3
MICRO_BATCHES = 2
FAIL_STEP = 1  # the second step
# where the failure hits: (micro-batch, "forward" | "backward")
FAILURES = {(1, 1, 4): (1, "backward"), (2, 2, 4): (1, "backward"),
            (2, 4, 4): (0, "backward"), (4, 4, 4): (1, "forward")}


class Injected(RuntimeError):
    pass


def _raise_in_backward(grad):
    raise Injected("injected failure in backward")


def _train(rank, world, plan, fail_at=None):
    sharding = amsp.ShardingPlan(*plan)
    mesh = plan_mesh(sharding, 2)
    model = make_model(torch.float32)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    losses, failures = [], 0
    step = 0
    while step < STEPS:
        batch = global_batches(step, world, MICRO_BATCHES, model.cfg)
        total = torch.zeros(1)
        try:
            for micro in range(MICRO_BATCHES):
                mb = local_micro_batch(batch, rank, world, micro)
                last = micro == MICRO_BATCHES - 1
                with amsp.no_sync(model) if not last else contextlib.nullcontext():
                    fail_here = fail_at == (step, micro) and failures == 0
                    hook = _inject(model, FAILURES[plan][1]) if fail_here else None
                    try:
                        out = model(mb[:, :-1])
                    finally:
                        if hook is not None:
                            hook.remove()
                    loss = loss_fn(out, mb[:, 1:]) / MICRO_BATCHES
                    loss.backward()
                total += loss.detach()
            optim.clip_grad_norm_(MAX_NORM)
            optim.step()
            optim.zero_grad()
        except Injected:
            failures += 1
            optim.zero_grad()
            continue  # retry the same step
        dist.all_reduce(total)
        losses.append(total.item() / world)
        step += 1
    return {"losses": losses, "failures": failures, "weights": full_weights(model)}


def _inject(model, where: str):
    """A forward hook that raises after block 1's forward ("forward", block 0 is all-
    gathered and done), or makes the backward raise when it reaches block 0's output
    ("backward": block 1 has fired and its gradient collectives are in flight)."""

    def hook(module, args, output):
        if where == "forward":
            raise Injected("injected failure in forward")
        output.register_hook(_raise_in_backward)

    block = model.layers[1] if where == "forward" else model.layers[0]
    return block.register_forward_hook(hook)


def run_recovery_case(rank, world, plan):
    """The run never interrupted, and the run that failed once in step FAIL_STEP and
    retried it: losses, failures caught and final weights of each."""
    clean = _train(rank, world, plan)
    micro, _ = FAILURES[plan]
    retried = _train(rank, world, plan, fail_at=(FAIL_STEP, micro))
    return {"clean": clean, "retried": retried}
