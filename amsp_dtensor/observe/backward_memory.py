"""Gradient bytes alive on this rank at every unit's gradient hook during backward.

``track_backward_memory(model)`` adds an observer to the engine's per-unit gradient hook
(``AMSPState.unit_grad_observers``: called at the end of each unit's hook, when the engine
has taken that unit's grads). Each call takes a census of the gradient storages this rank
holds at that moment:

- every unit's ``grad_accum`` (G, accumulating) and ``grad_synced`` (the step's G in the
  OS layout);
- every in-flight gradient collective's input kept alive until it completes
  (``pending.input``: the packed send buffer) and its output (``pending.result``);
- the hook's input (this unit's P-shard grads: FSDP2's reduce-scatter output when
  s_p > 1, the engine's flatten of the unit's grads when s_p = 1);
- every unit param's ``.grad`` (the local tensor of a DTensor grad). With s_p = 1 these
  are the grads that have arrived for a unit whose hook has not fired yet; with s_p > 1
  they are FSDP2's views of the hook input, so they add nothing new.

Storages are counted once each (deduplicated by ``untyped_storage().data_ptr()``) at their
full ``untyped_storage().nbytes()``. What the census leaves out: P itself (recorded once as
``param_bytes``), activations, FSDP2's unsharded parameters and their grads (the
reduce-scatter input), and the collectives' internal buffers.

    with amsp.track_backward_memory(model) as tracker:
        ...  # forward/backward of every micro-batch
    tracker.peak_grad_bytes, tracker.samples, tracker.param_bytes
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
import torch
import torch.nn as nn

from ..engine.handle import root_state
from ..engine.root import RootState
from ..engine.unit import AMSPUnit
from .memory import memory_by_state

__all__ = ["BackwardSample", "BackwardMemoryTracker", "track_backward_memory", "grad_census"]


@dataclass(frozen=True)
class BackwardSample:
    """One census: taken at the end of ``unit``'s gradient hook in micro-batch ``micro``
    (0-based, counted by backward passes since the tracker started; ``sync``: the
    backward outside ``no_sync``). ``parts``: bytes per kind of holder, each storage
    counted under the first holder met in the order of ``grad_census``."""

    unit: str
    micro: int
    sync: bool
    bytes: int
    parts: dict = field(default_factory=dict)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_census(state: "RootState", hook_input: torch.Tensor | None = None) -> tuple[int, dict]:
    """(bytes, bytes per holder kind) of the distinct gradient storages alive now."""
    seen: set[int] = set()
    parts = {"grad_accum": 0, "grad_synced": 0, "in_flight_keepalive": 0,
             "in_flight_result": 0, "hook_input": 0, "param_grad": 0}

    def add(kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        storage = _local(tensor).untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            return
        seen.add(ptr)
        parts[kind] += storage.nbytes()

    for unit in state.units:
        add("grad_accum", unit.partial_grad)
        add("grad_synced", unit.synced_grad)
    for entry in state.in_flight:
        add("in_flight_keepalive", entry.pending.input)
        add("in_flight_result", entry.pending.result)
    add("hook_input", hook_input)
    for unit in state.units:
        for param in unit.params:
            add("param_grad", param.grad)
    return sum(parts.values()), parts


class BackwardMemoryTracker:
    """The samples of one ``track_backward_memory`` block (see the module docstring)."""

    def __init__(self, state: "RootState", param_bytes: int):
        self.state = state
        self.param_bytes = param_bytes  # P on this rank, read once at the start
        self.samples: list[BackwardSample] = []
        self._backward = None
        self._micro = -1

    def __call__(self, unit: "AMSPUnit", hook_input: torch.Tensor) -> None:
        backward = self.state.backward
        if backward is not self._backward:  # a new backward pass: the next micro-batch
            self._backward = backward
            self._micro += 1
        total, parts = grad_census(self.state, hook_input)
        sync = bool(backward.sync) if backward is not None else False
        self.samples.append(BackwardSample(unit.name, self._micro, sync, total, parts))

    @property
    def peak_grad_bytes(self) -> int:
        """The largest census (0 before any hook ran)."""
        return max((s.bytes for s in self.samples), default=0)

    @property
    def peak_bytes(self) -> int:
        """P plus the largest gradient census: the model-state bytes at the peak (OS,
        unchanged during backward, not included)."""
        return self.param_bytes + self.peak_grad_bytes


@contextlib.contextmanager
def track_backward_memory(model: nn.Module):
    """Census the gradient bytes of this rank at every unit's gradient hook while the
    block runs; yields a ``BackwardMemoryTracker``. ``model`` is the AMSP root."""
    state = root_state(model)
    tracker = BackwardMemoryTracker(state, memory_by_state(model)["param"])
    state.unit_grad_observers.append(tracker)
    try:
        yield tracker
    finally:
        state.unit_grad_observers.remove(tracker)
