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

Each state is a value that holds exactly the buffers it needs (unit.py: ``Accumulating``,
``Reducing``, ``Synced``, ``Sending``, ``Updated``), and the unit's methods are the only
code that replaces it, through ``check_transition`` below.

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


_I, _A, _R = StepState.IDLE, StepState.ACCUMULATING, StepState.REDUCING
_ALLOWED: dict[StepState, frozenset[StepState]] = {
    StepState.IDLE: frozenset({_I, _A, _R}),
    StepState.ACCUMULATING: frozenset({_I, _A, _R}),
    StepState.REDUCING: frozenset({_I, StepState.SYNCED}),
    # another backward before the step adds to the synced G, as DDP's would
    StepState.SYNCED: frozenset({_I, _A, _R, StepState.SENDING, StepState.UPDATED}),
    # zero_grad() drops a SENDING unit's G but not its update: only landing leaves SENDING
    StepState.SENDING: frozenset({StepState.UPDATED}),
    StepState.UPDATED: frozenset({_I, _A, _R}),
}


class LifecycleError(RuntimeError):
    """A transition the step lifecycle does not allow (an engine bug, not misuse: misuse
    is caught earlier with a message that names the fix)."""


def check_transition(owner: str, src: StepState, dst: StepState) -> None:
    """Raise LifecycleError unless ``src -> dst`` is in the table. The unit calls it on
    every change of its step state's kind (unit.py)."""
    if dst not in _ALLOWED[src]:
        raise LifecycleError(
            f"AMSP unit {owner or '<root>'}: {src.value} -> {dst.value} is not a valid step "
            "transition"
        )
