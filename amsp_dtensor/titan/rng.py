"""Each rank's RNG state in torchtitan's checkpoint, so a resumed run draws what an
uninterrupted one would (dropout, sampling, anything random after the start).

torchtitan 0.2.2 seeds once at start (``[debug] seed``) and saves no RNG state, so after a
resume the generators restart from the seed. AmspTrainer adds this Stateful to the
checkpointer's states under ``amsp_rng``; each rank saves its own key (``rank<r>``), since
one key all ranks share would be saved once.

[Note: a rank the checkpoint does not know] Resumed on a larger world, rank 5 of 8 finds no
``rank5`` in a 4-rank checkpoint, and asking DCP for a key the checkpoint lacks fails the
load. Before the load, ``expect_checkpoint`` is told which keys the checkpoint holds, and
a rank whose key is missing offers nothing and keeps its seeded state; on another world
size the ranks' streams cannot continue one for one anyway.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

STATE_KEY = "amsp_rng"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RngState:
    """torch's CPU generator and, when there is one, the current CUDA device's."""

    def __init__(self) -> None:
        self._available: set[str] | None = None  # keys the checkpoint being loaded holds

    def expect_checkpoint(self, stored_keys: set[str] | None) -> None:
        """The checkpoint's keys (full DCP keys) for the next load; None when done."""
        if stored_keys is None:
            self._available = None
            return
        prefix = STATE_KEY + "."
        self._available = {k[len(prefix):].split(".")[0] for k in stored_keys if k.startswith(prefix)}

    def _key(self) -> str:
        return f"rank{_rank()}"

    def state_dict(self) -> dict:
        key = self._key()
        if self._available is not None and key not in self._available:
            return {}
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return {key: state}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get(self._key())
        if not state:
            return
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
