"""The step lifecycle of one AMSP unit: named states and the transitions allowed between them.

[Note: unit step lifecycle]
A unit's gradient and its update pass through these states in every training step::

    IDLE --backward under no_sync--> ACCUMULATING --last backward--> REDUCING
    IDLE ----------------last backward (no accumulation)-----------> REDUCING
    REDUCING --every stage of the gradient sync completed--> SYNCED
    SYNCED --optimizer step, P shard needs an all-gather--> SENDING --landed--> UPDATED
    SYNCED --optimizer step, P shard is the OS shard (s_os = s_p)-----------> UPDATED
    any state but SENDING --zero_grad()--> IDLE (SENDING keeps its update in flight)
    any state --reset after an exception (the update is landed first)--> IDLE

- ACCUMULATING holds the step's partial G sums (G layout); no cross-replica traffic yet.
- REDUCING: the last backward has issued the sync stages (reduce-scatter over "g" and/or
  "os", all-reduce over "rep"); they complete in later hooks, at the end of backward, or,
  for the last stage, in ``step()`` (unit by unit) or whatever next needs the gradients.
- SYNCED: the step's G is reduced over all ranks, in the OS layout; the step may run.
- SENDING: the new weights are in the fp32 masters, their all-gather into the P shards
  is in flight (``overlap_param_update=True``); the next forward, a ``state_dict()`` or
  ``load_state_dict()`` or ``wait_param_update()`` lands it (param_update.py, which also
  refuses a parameter written in place meanwhile).
- UPDATED: the P shards hold the new weights; G is kept until ``zero_grad()``, as torch
  keeps ``.grad``. A backward without ``zero_grad()`` adds to it, as torch's would.

Every transition is checked: a step that finds a unit anywhere but SYNCED is misuse
(``step()`` twice, ``no_sync`` around the last micro-batch, no backward at all), and the
error says which and how to fix it, before any collective is issued.
"""

from __future__ import annotations

import enum


class StepState(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"
    SYNCED = "synced"
    SENDING = "sending"
    UPDATED = "updated"


_ALLOWED: dict[StepState, frozenset[StepState]] = {
    StepState.IDLE: frozenset({StepState.ACCUMULATING, StepState.REDUCING}),
    StepState.ACCUMULATING: frozenset({StepState.ACCUMULATING, StepState.REDUCING}),
    StepState.REDUCING: frozenset({StepState.SYNCED}),
    # another backward before the step adds to the synced G, as DDP's would
    StepState.SYNCED: frozenset({StepState.ACCUMULATING, StepState.REDUCING, StepState.SENDING,
                                 StepState.UPDATED}),
    StepState.SENDING: frozenset({StepState.UPDATED}),
    StepState.UPDATED: frozenset({StepState.ACCUMULATING, StepState.REDUCING}),
}


class LifecycleError(RuntimeError):
    """A transition the step lifecycle does not allow (an engine bug, not misuse: misuse
    is caught earlier with a message that names the fix)."""


class StepLifecycle:
    """The current StepState of one unit, changed only through ``to()``."""

    __slots__ = ("state", "owner")

    def __init__(self, owner: str = ""):
        self.state = StepState.IDLE
        self.owner = owner

    def to(self, new: StepState) -> None:
        if new is not StepState.IDLE and new not in _ALLOWED[self.state]:
            raise LifecycleError(
                f"AMSP unit {self.owner or '<root>'}: {self.state.value} -> {new.value} is not a "
                "valid step transition"
            )
        self.state = new

    def __repr__(self) -> str:
        return f"StepLifecycle({self.owner!r}, {self.state.value})"
