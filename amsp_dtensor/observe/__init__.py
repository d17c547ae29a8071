"""Accounting of what the engine does: collectives issued (recorder.py), bytes held per
state kind (memory.py), gradient bytes during backward (backward_memory.py).

This package's import runs whenever collectives.py imports the recorder, so it imports
only the recorder: backward_memory.py and memory.py read the engine's state (state.py,
which imports collectives.py) and are imported from their own modules.
"""

from .recorder import CommEvent, CommRecorder, active_recorders, record_comms

__all__ = [
    "CommEvent",
    "CommRecorder",
    "record_comms",
    "active_recorders",
]
