"""Accounting of what the engine does: collectives issued, bytes held per state kind."""

from .recorder import CommEvent, CommRecorder, record_comms, active_recorders

__all__ = ["CommEvent", "CommRecorder", "record_comms", "active_recorders"]
