"""Parameter and module FQNs as torch's DCP state dicts name them."""

from __future__ import annotations

_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def clean_fqn(name: str) -> str:
    """A parameter or module FQN without wrapper components (activation checkpointing's
    ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``), as torch's DCP state
    dicts name it, so checkpoints load across AC / compile settings."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES)
