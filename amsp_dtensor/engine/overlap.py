"""``amsp.set_overlap``: which of the engine's communication runs behind compute.

Four overlaps, each with its own switch so that its effect can be measured alone:

- ``grad_sync`` (model): every stage of a unit's gradient sync is issued as soon as its
  input is ready, and the last stages stay in flight after backward returns (root.py).
  Off: each gradient collective is waited for right after it is issued.
- ``prefetch`` (model): explicit FSDP2 prefetch, set from the order in which the units'
  forwards first ran: each unit all-gathers the next one in forward and the previous one
  in backward. On CPU, where FSDP2 has no streams, the all-gathers are also made async
  (only then does a prefetched all-gather run while the current unit computes), except
  where the model runs collectives of its own (the Note on async all-gathers on CPU); on
  CUDA FSDP2's own streams overlap them. Off: FSDP2's defaults (implicit backward prefetch).
- ``step`` (model): per-unit optimizer step for elementwise optimizers (optim.py's
  [Note: per-unit step]): the units are updated in a few batches, in issue order, each
  as soon as its own gradients have landed, and their post-step all-gathers are issued
  right after. Off: the whole step, then every all-gather.
- ``param_update`` (``AMSPOptimizer(overlap_param_update=...)``, off by default): the
  post-step all-gathers are left in flight and land in the next forward.

The first three are on by default: they change when collectives are waited for, never
what they compute, so losses and weights are bit-identical either way. All four live on
the root's state (``Overlap`` below).
"""

from __future__ import annotations

from dataclasses import dataclass
import torch.nn as nn

from .. import compat
from .handle import root_state

__all__ = ["Overlap", "set_overlap"]


@dataclass(frozen=True)
class Overlap:
    """Which of the engine's overlaps are on."""

    grad_sync: bool = True  # each gradient stage issued as soon as its input is ready
    prefetch: bool = True  # explicit FSDP2 prefetch of the next unit's all-gather
    step: bool = True  # step batches of units as their gradients land, all-gathers after each
    # AMSPOptimizer(overlap_param_update=...): post-step all-gathers land in the next forward
    param_update: bool = False


def set_overlap(
    model: nn.Module,
    *,
    grad_sync: bool | None = None,
    prefetch: bool | None = None,
    step: bool | None = None,
) -> Overlap:
    """Switch overlaps of the root ``model`` on or off (None: leave as is); returns the
    settings now in force. Call between steps (not inside forward or backward). The
    fourth switch is the optimizer's ``overlap_param_update``."""
    given = {"grad_sync": grad_sync, "prefetch": prefetch, "step": step}
    for name, value in given.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"set_overlap({name}=...) takes a bool or None, got {value!r}")
    return root_state(model).set_overlap(**{k: v for k, v in given.items() if v is not None})


# [Note: async all-gathers on CPU]
# Without streams, a prefetched all-gather overlaps the current unit's compute only if it
# is issued async (FSDP2's private ``_set_unshard_async_op``): gloo then runs it on its own
# thread while the training thread computes. The engine does so only where nothing else
# communicates on the training thread during forward and backward, i.e. data parallelism
# alone. With tensor parallelism (TP's functional collectives), expert parallelism (EP's
# all-to-alls), context parallelism (the K/V exchange) or a pipeline (its stages' sends
# and receives), the training thread waits on collectives of other groups while FSDP2's
# all-gathers are in flight on gloo's threads; two multi-dimensional runs once died in native code in such a wait under load
# (docs/reliability.md), and no cause was found, so those layouts keep FSDP2's synchronous
# all-gathers on CPU: prefetch there only orders the all-gathers, as on FSDP2's defaults.
# CUDA is unaffected (FSDP2's streams overlap, never this switch).


def async_all_gathers(info, prefetch: bool) -> bool:
    """Whether the FSDP units of a root over ``info`` (its MeshInfo) issue their
    all-gathers async: [Note: async all-gathers on CPU]."""
    infos = [info, *((info.expert,) if info.expert else ())]
    model_collectives = (info.pp_mesh is not None or info.cp > 1
                         or any(i.tp > 1 for i in infos))
    return prefetch and info.mesh.device_type == "cpu" and not model_collectives


def apply_prefetch(root) -> None:
    """Set (or clear) FSDP2's explicit prefetch lists of every FSDP unit of ``root`` (a
    root.RootState, which calls this)."""
    if not root.forward_order_known:
        return
    fsdp_units = [unit for unit in root.forward_order if unit.uses_fsdp]
    on = root.overlap.prefetch
    async_all_gather = async_all_gathers(root.info, on)
    for index, unit in enumerate(fsdp_units):
        after = fsdp_units[index + 1:index + 2] if on else []
        before = fsdp_units[max(index - 1, 0):index] if on else []
        unit.module.set_modules_to_forward_prefetch([u.module for u in after])
        unit.module.set_modules_to_backward_prefetch([u.module for u in before])
    for unit in fsdp_units:
        compat.fsdp_set_unshard_async_op(unit.module, async_all_gather)
