"""Accounting of what the engine does: collectives issued, bytes held per state kind."""

from .backward_memory import BackwardMemoryTracker, track_backward_memory
from .recorder import CommEvent, CommRecorder, record_comms, active_recorders

__all__ = [
    "BackwardMemoryTracker",
    "CommEvent",
    "CommRecorder",
    "record_comms",
    "active_recorders",
    "track_backward_memory",
]
