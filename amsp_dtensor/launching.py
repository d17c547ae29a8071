"""What the launchers of both torchtitans share (``amsp_dtensor.train``, and
``titan.v03.launch`` on torchtitan 0.3): which rank shows the console, how a refused config
ends the job, the plan's log line, the offline data, and the training run itself. Imports
nothing of torchtitan at module level."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# seconds a rank other than 0 waits before exiting on a refused config (see main)
REFUSAL_GRACE_S = 5.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _shown_rank() -> bool:
    """True on the ranks listed in LOG_RANK (default "0")."""
    return str(_rank()) in {r.strip() for r in os.environ.get("LOG_RANK", "0").split(",")}


def quiet_other_ranks() -> None:
    """torchtitan's logger: the ranks in LOG_RANK (default "0") log at INFO, as torchtitan's
    run_train.sh arranges with torchrun's --local-ranks-filter; the others log errors only
    (their warnings repeat rank 0's, see quiet_warnings)."""
    import logging

    from torchtitan.tools.logging import logger

    if not _shown_rank():
        logger.setLevel(logging.ERROR)


def prepare_data_at(paths) -> None:
    """Build the offline tokenizer/corpus if any path points into the project's data folder."""
    from amsp_dtensor.data import DEFAULT_ROOT, ensure_assets, set_hf_home

    set_hf_home(DEFAULT_ROOT)
    root = DEFAULT_ROOT.resolve()
    if any(p and Path(p).resolve().is_relative_to(root) for p in paths):
        ensure_assets(DEFAULT_ROOT)


def refuse(error: Exception, prog: str = "amsp_dtensor.train") -> int:
    """A refused config: rank 0 prints the one line (``<prog>: error: <error>``), every rank
    exits 2 (before any process group exists)."""
    if _rank() == 0:
        print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun stops every rank once one has exited: the others wait, so rank 0
        # (which checked the same config) has printed the line before it is stopped
        import time

        time.sleep(REFUSAL_GRACE_S)
    return 2


def log_plan(plan, tp: int, version_note: str = "", cp: int = 1) -> None:
    """``[amsp] plan p2-g2-os4 on 4 ranks (2 per node) x tensor parallel 2``, on the shown
    rank; under context parallelism ``..., context parallel 2 among them``."""
    from torchtitan.tools.logging import logger

    among = f", context parallel {cp} among them" if cp > 1 else ""
    under_tp = f" x tensor parallel {tp}" if tp > 1 else ""
    logger.info(f"[amsp] plan {plan.name} on {plan.world_size} ranks "
                f"({plan.ranks_per_node} per node{among}){under_tp}{version_note}")


def run_trainer(build, seed_checkpoint: bool = False) -> int:
    """The body of torchtitan.train.main with the trainer ``build()`` returns: train, close
    the trainer, destroy the process group; with ``seed_checkpoint`` (the job's
    checkpoint.create_seed_checkpoint) save the initial weights as step 0 instead of
    training, as torchtitan's main does (one rank, checkpointing on: its asserts). Exit
    code 2 when a checkpoint does not match the job (every rank raises it before any
    collective of the load), else 0."""
    import torch

    from torchtitan.tools.logging import logger

    from amsp_dtensor.checkpoint import CheckpointMismatch

    trainer, code = None, 0
    try:
        try:
            trainer = build()
            if seed_checkpoint:
                assert int(os.environ["WORLD_SIZE"]) == 1, (
                    "Must create seed checkpoint using a single device, to disable sharding.")
                assert trainer.checkpointer.enable, (
                    "Must enable checkpointing when creating a seed checkpoint.")
                trainer.checkpointer.save(curr_step=0, last_step=True)
                logger.info("Created seed checkpoint")
            else:
                trainer.train()
        finally:
            if trainer is not None:
                trainer.close()
    except CheckpointMismatch as e:
        print(f"[rank{_rank()}] amsp_dtensor.train: error: {e}", file=sys.stderr, flush=True)
        code = 2
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if code == 0:
        logger.info("Process group destroyed")
    return code
