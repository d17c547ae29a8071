"""Each rank's RNG state in torchtitan's checkpoint, so a resumed run draws what an
uninterrupted one would (dropout, sampling, anything random after the start).

torchtitan 0.2.2 seeds once at start (``[debug] seed``) and saves no RNG state, so after a
resume the generators restart from the seed. AmspTrainer adds this Stateful to the
checkpointer's states under ``amsp_rng``; each rank saves its own key (``rank<r>``), since
one key all ranks share would be saved once.

[Note: RNG state comes back on the same world size only] On another world size the ranks'
streams cannot continue one for one, and restoring some ranks (those the checkpoint
knows) but not others would mix restored and seeded streams. Before the load,
``expect_checkpoint`` is told the checkpoint's keys; unless they are exactly this world's
ranks, every rank offers nothing (asking DCP for a key the checkpoint lacks would fail the
load) and keeps its seeded state. Every rank reads the same metadata, so all decide alike.
"""

from __future__ import annotations

import torch.distributed as dist

from ..checkpoint import rng_state, set_rng_state

STATE_KEY = "amsp_rng"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class RngState:
    """torch's CPU generator and, when there is one, the current CUDA device's."""

    def __init__(self) -> None:
        self._restore: bool | None = None  # None: saving; else whether this load restores

    def expect_checkpoint(self, stored_keys: set[str] | None) -> None:
        """The checkpoint's keys (full DCP keys) for the next load; None when done."""
        if stored_keys is None:
            self._restore = None
            return
        prefix = STATE_KEY + "."
        ranks = {k[len(prefix):].split(".")[0] for k in stored_keys if k.startswith(prefix)}
        self._restore = ranks == {f"rank{r}" for r in range(_world_size())}

    def state_dict(self) -> dict:
        if self._restore is False:
            return {}
        return {f"rank{_rank()}": rng_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get(f"rank{_rank()}")
        if state:
            set_rng_state(state)
