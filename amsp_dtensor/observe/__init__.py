"""Reports of what the engine did, read from its state: bytes held per state kind
(memory.py), gradient bytes during backward (backward_memory.py), the torch.distributed
calls a function makes (dist_calls.py). The recorder of collectives is the engine's own
(engine/recorder.py): the engine emits into it, and observe/ only reads the engine.
"""
