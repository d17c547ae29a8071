"""AMSP stages under ``torch.distributed.pipelining``.

torch's ``PipelineStage`` runs each micro-batch's backward itself and, for FSDP2 modules,
turns FSDP2's gradient reduction and its reshard after backward off for all of them and
runs both afterwards, outside autograd (``perform_reduce_grad``); for any other module it runs plain backwards and
scales ``.grad`` in place (``scale_grads``). Neither fits an AMSP root: its gradients leave
``.grad`` for the engine's buffers as they arrive, and its once-per-step sync across
replicas is issued by the hooks of the last backward outside ``amsp.no_sync``.

``pipeline_stage(stage)`` makes a stage whose module is an AMSP root behave as the DDP
convention says, on every schedule that runs full backwards (GPipe, 1F1B, interleaved
1F1B, looped BFS): every micro-batch's backward but the stage's last of the step runs
under ``amsp.no_sync`` (P and G collectives only, each unit's gradients accumulated at
their G size), the last one outside it (the sync, overlapped with that backward), and the
schedule's gradient scale (its micro-batch count when ``scale_grads=True``) divides the
gradients along with the divide factor. As torch does for FSDP2, the all-gathered
parameters stay until the stage's last backward ([Note: unsharded through the step]). The stage's class is swapped for a subclass that
does this, as FSDP2 swaps a module's class; nothing else of the stage changes.

[Note: split backward]
Zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, CSV schedules
with I and W actions) split a micro-batch's backward into an input half (autograd over
the stage's inputs only: no weight gradient, no hook) and a later weight half, which
torch computes outside autograd's engine and adds to each weight's ``.grad`` by hand. An
AMSP stage with s_p = 1 (plain parameters) runs both halves as torch does and, after each
weight half, hands the ``.grad`` of every unit to the gradient path as an end of backward
would (``RootState.end_backward_outside_autograd``): under no_sync for all but the
stage's last weight half of the step, which syncs. With s_p > 1 the weights the halves
see are FSDP2's sharded parameters, whose all-gathered copies autograd used: refused.
"""

from __future__ import annotations

import contextlib

from .. import compat
from .handle import root_of

__all__ = ["pipeline_stage"]

_CLASSES: dict[type, type] = {}


def pipeline_stage(stage):
    """Let ``stage`` (a ``torch.distributed.pipelining`` stage whose ``submod`` is an AMSP
    root, ``amsp.fully_shard`` having been called on it last) drive AMSP's gradient path;
    returns ``stage``. Call it before the schedule's first step."""
    if not isinstance(stage, compat.pipeline_stage_base()):
        raise TypeError(f"pipeline_stage expects a torch.distributed.pipelining stage, got "
                        f"{type(stage).__name__}")
    if root_of(stage.submod) is None:
        raise ValueError(
            f"pipeline stage {stage.stage_index}: its module {type(stage.submod).__name__} is "
            "not an AMSP root: call amsp.fully_shard on its blocks and then on the stage's "
            "module itself before amsp.pipeline_stage")
    cls = type(stage)
    if cls not in _CLASSES.values():
        if cls not in _CLASSES:
            # one base, so the layout is the stage's own and its __class__ can be swapped
            methods = {k: v for k, v in vars(_AMSPStage).items() if not k.startswith("__")}
            _CLASSES[cls] = type(f"AMSP{cls.__name__}", (cls,), methods)
        stage.__class__ = _CLASSES[cls]
    return stage


class _AMSPStage:
    """The methods of a pipeline stage whose module is an AMSP root (the Note above),
    copied into a subclass of the stage's class."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False):
        root = root_of(self.submod)
        if backward_type == "input":  # [Note: split backward]
            _check_split_backward(self, root)
            return compat.pipeline_stage_backward_input(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"], self.submod.parameters())
        if backward_type not in ("full", "weight"):
            raise RuntimeError(f"pipeline stage {self.stage_index}: unknown backward type "
                               f"{backward_type!r}")
        sync = contextlib.nullcontext() if last_backward else root.grad_sync_suspended()
        _reshard_after_backward(root, last_backward)  # [Note: unsharded through the step]
        with sync:
            if backward_type == "weight":
                _check_split_backward(self, root)
                compat.pipeline_stage_backward_weight(self.submod.parameters(),
                                                      bwd_kwargs["param_groups"])
                root.end_backward_outside_autograd()
                return (), None
            grads = compat.pipeline_stage_backward(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"])
        return grads, None

    def scale_grads(self, grad_scale_factor: int) -> None:
        """The schedule's scale for this step: kept with the divide factor (the engine
        divides the synced gradients once, in fp32, when the optimizer reads them)."""
        if isinstance(grad_scale_factor, bool) or not grad_scale_factor > 0:
            raise ValueError(f"grad_scale_factor must be positive, got {grad_scale_factor!r}")
        root_of(self.submod).set_pipeline_grad_scale(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        """After the stage's last backward of the step: its sync was issued by that
        backward's hooks (outside no_sync), so only the scale is left."""
        self.scale_grads(grad_scale_factor)


def _reshard_after_backward(root, last_backward: bool) -> None:
    """[Note: unsharded through the step] As torch's stage does for an FSDP2 module: the
    FSDP2 units of the stage keep their all-gathered parameters after every backward but
    the stage's last of the step, so micro-batches whose forward ran before an earlier
    micro-batch's backward (1F1B, interleaved) do not all-gather them again; the last
    backward reshards them."""
    for unit in root.units:
        if unit.uses_fsdp:
            unit.module.set_reshard_after_backward(last_backward, recurse=False)


def _check_split_backward(stage, root) -> None:
    """[Note: split backward]: plain parameters only (s_p = 1 on every unit)."""
    sharded = [unit.name for unit in root.units if unit.uses_fsdp]
    if sharded:
        raise NotImplementedError(
            f"pipeline stage {stage.stage_index}: a split backward (zero-bubble schedules: "
            f"input and weight halves) needs param_shard = 1 on the stage, but unit "
            f"{sharded[0]} shards its parameters with FSDP2: use a plan with param=1 or a "
            "schedule with full backwards (GPipe, 1F1B, Interleaved1F1B, LoopedBFS)")
