"""A training job that resumes itself: for the fault tests, under ``torchrun --max-restarts``.

    torchrun --nproc_per_node 2 -m amsp_dtensor.testing.checkpoint_job --dir CKPT \\
        --out OUT --plan 1,1,2 --steps 6 --save-every 1 --faults 0:plan:2:1,1:train:4:1

At start it resumes from the newest complete checkpoint in ``--dir`` (if any), then trains
the tiny Llama to ``--steps`` (steps count from 1) and saves every ``--save-every`` steps.
Rank 0 appends one JSON line per event to ``--out``/events.jsonl: ``{"attempt", "resumed_from"}``
once per attempt and ``{"attempt", "step", "loss"}`` per step; at the end every rank's
full weights go to ``--out``/weights.pt (rank 0 writes).

``--faults attempt:point:step:rank,...``: in attempt ``attempt`` (torchrun's restart count)
rank ``rank`` kills itself with SIGKILL at ``point`` of step ``step``:
  - ``train``: inside the backward of the step (a hook on the first block);
  - ``plan``: in the step's save, when DCP asks this rank for its write plan (nothing written);
  - ``written``: in the step's save, right after this rank's data files are written;
  - ``finish``: in the step's save, on the coordinator (rank 0), before ``.metadata`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

SAVE_POINTS = ("plan", "written", "finish")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultyWriter(FileSystemWriter):
    """FileSystemWriter that kills this process at one point of the save."""

    def __init__(self, path, point: str):
        super().__init__(path)
        self.point = point

    def prepare_local_plan(self, plan):
        if self.point == "plan":
            _die()
        return super().prepare_local_plan(plan)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if self.point == "written":
            future.wait()
            _die()
        return future

    def finish(self, metadata, results):
        if self.point == "finish":
            _die()
        return super().finish(metadata, results)


def _parse_faults(text: str) -> dict[tuple[int, int], tuple[str, int]]:
    faults = {}
    for item in filter(None, text.split(",")):
        attempt, point, step, rank = item.split(":")
        if point not in (*SAVE_POINTS, "train"):
            raise SystemExit(f"--faults: unknown point {point!r}")
        faults[(int(attempt), int(step))] = (point, int(rank))
    return faults


def build(plan: tuple[int, int, int], ranks_per_node: int):
    import amsp_dtensor as amsp

    from .scenarios import OPTIMIZERS, make_model

    sharding = amsp.ShardingPlan(*plan)
    mesh = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node, device_type="cpu")
    model = make_model(torch.float32)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding)
    amsp.fully_shard(model, mesh=mesh, plan=sharding)
    cls, kwargs = OPTIMIZERS["adamw"]
    return model, amsp.AMSPOptimizer(model, cls, **kwargs)


def train_step(model, optim, step: int, rank: int, world: int) -> float:
    """One step on the global batch of ``step`` (counted from 1); the mean loss over ranks."""
    from .scenarios import MAX_NORM, global_batches, micro_batch_backwards

    batch = global_batches(step - 1, world, 1, model.cfg)
    loss = torch.zeros(1)
    for _, _, micro_loss in micro_batch_backwards(model, batch, rank, world, 1):
        loss += micro_loss.detach()
    optim.clip_grad_norm_(MAX_NORM)
    optim.step()
    optim.zero_grad()
    dist.all_reduce(loss)
    return loss.item() / world


def main(argv=None) -> None:
    from amsp_dtensor import checkpoint
    from amsp_dtensor.compat import destroy_process_group_at_exit, init_process_group

    from .scenarios import full_weights

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", default="1,1,2")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--faults", default="")
    args = parser.parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = _parse_faults(args.faults)
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)

    def event(**fields) -> None:
        if rank == 0:
            with open(out / "events.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, **fields}) + "\n")

    model, optim = build(tuple(int(x) for x in args.plan.split(",")), args.ranks_per_node)
    start = checkpoint.latest_step(args.dir)
    if start is not None:
        checkpoint.load(checkpoint.step_path(args.dir, start), model, optim)
    event(resumed_from=start)
    for step in range((start or 0) + 1, args.steps + 1):
        point, fault_rank = faults.get((attempt, step), (None, -1))
        hook = None
        if point == "train" and rank == fault_rank:
            hook = model.layers[0].register_full_backward_hook(lambda *_: _die())
        loss = train_step(model, optim, step, rank, world)
        if hook is not None:
            hook.remove()
        event(step=step, loss=loss)
        if step % args.save_every == 0:
            writer = None
            if point in SAVE_POINTS and rank == fault_rank:
                writer = FaultyWriter(checkpoint.step_path(args.dir, step), point)
            checkpoint.save(args.dir, step, model, optim, storage_writer=writer)
    weights = full_weights(model)
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    del model, optim
    destroy_process_group_at_exit()


if __name__ == "__main__":
    main()
