"""Bisect switches for tools/stress.py, imported by each rank through
``--experimental.custom_import stress_switches`` (tools/ on PYTHONPATH; torchtitan imports
one module, so this one imports amsp_dtensor.titan itself, the recipe's custom_import).

``AMSP_STRESS_SWITCHES`` (comma-separated names) says which to apply. Only the switches
that need code live here; those an [amsp] flag already gives (no_prefetch,
no_grad_overlap, ...) are flags, listed in tools/stress.py's SWITCHES. To add one: a
function below, registered in PATCHES under its name, and the name in tools/stress.py's
SWITCHES with no flags.
"""

from __future__ import annotations

import os
import sys

import amsp_dtensor.titan  # noqa: F401  (the recipe's custom_import: registers llama3_amsp)
from amsp_dtensor import compat


def no_async_unshard() -> None:
    """FSDP2 all-gathers stay synchronous on CPU: amsp's apply_prefetch asks for async
    ones (the only way a prefetched all-gather overlaps compute without streams)."""
    original = compat.fsdp_set_unshard_async_op

    def sync_only(module, async_op):
        original(module, False)

    compat.fsdp_set_unshard_async_op = sync_only


PATCHES = {
    "no_async_unshard": no_async_unshard,
}


def _apply() -> list[str]:
    names = [n for n in os.environ.get("AMSP_STRESS_SWITCHES", "").split(",") if n]
    applied = []
    for name in names:
        if name in PATCHES:
            PATCHES[name]()
            applied.append(name)
    if applied and os.environ.get("RANK", "0") == "0":
        print(f"[stress_switches] applied: {', '.join(applied)}", file=sys.stderr, flush=True)
    return applied


APPLIED = _apply()
