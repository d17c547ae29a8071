"""Which torchtitan is installed: the one place the integration asks.

torchtitan 0.2.2 (TOML job files, TrainSpecs) and 0.3 (a Python config registry,
``Trainer.Config``) cannot share a venv; the installed one decides which integration
``amsp_dtensor.titan`` and ``amsp_dtensor.train`` load (``titan`` itself for 0.2.2,
``titan.v03`` for 0.3). Read from the package metadata, so nothing of torchtitan is
imported to answer.
"""

from __future__ import annotations

import functools
from importlib import metadata


@functools.lru_cache(maxsize=None)
def titan_version() -> tuple[int, int]:
    """(major, minor) of the installed torchtitan; (0, 0) when none is installed."""
    try:
        text = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return (0, 0)
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def is_titan03() -> bool:
    """True for torchtitan 0.3 or later (the config-registry torchtitan)."""
    return titan_version() >= (0, 3)
