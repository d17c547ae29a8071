"""A checkpoint that does not fit the AMSP job is refused before DCP's collective load,
for either torchtitan (both call ``CheckpointManager.dcp_load(state_dict, checkpoint_id,
from_hf, ...)``): every rank reads the metadata, compares it with the model's and the AMSP
optimizer's entries, and raises the same one-line CheckpointMismatch, so none waits in
DCP's load. The RNG state and the compression residuals are fitted to the file here.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import FileSystemReader

from torchtitan.components.checkpoint import OPTIMIZER

from ..checkpoint import OTHER_SETTINGS, check_complete, check_entries_fit
from .amsp_optimizers import RESIDUALS, AmspOptimizers, refuse_part_keyed
from .rng import STATE_KEY as RNG_KEY


# torchtitan's CheckpointManager state keys that are not tensors of the model
_TITAN_SECTIONS = ("optimizer", "lr_scheduler", "dataloader", "train_state", RNG_KEY)


def refuse_misfits(dcp_load, pipelined: bool = False):
    """Wrap CheckpointManager.dcp_load: compare the checkpoint's metadata with the model's
    and the AMSP optimizer's tensors first (a local read on every rank, so all of them
    raise the same one-line CheckpointMismatch and none waits in DCP's load). Under
    pipeline parallelism a rank holds its stages' entries only: the others' are expected
    in the file, its own must be there."""

    def load(state_dict, checkpoint_id, *args, **kwargs):
        from_hf = kwargs.get("from_hf", args[0] if args else False)
        if from_hf:
            return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        check_complete(checkpoint_id)
        metadata = FileSystemReader(checkpoint_id).read_metadata()
        optimizers = state_dict.get(OPTIMIZER)
        amsp_optimizers = isinstance(optimizers, AmspOptimizers)
        if optimizers is not None:
            refuse_part_keyed(checkpoint_id, metadata)
        try:
            if amsp_optimizers:  # its residual entries fit this file (or are left out) from now
                optimizers.expect_checkpoint(checkpoint_id, metadata)
            wanted = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
            if optimizers is not None:
                wanted[OPTIMIZER] = optimizers.state_dict()
            # every non-tensor state (torchtitan's and any other) is its own section; the
            # residuals are per rank, fitted above, not compared
            others = tuple(_TITAN_SECTIONS) + tuple(
                k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
            check_entries_fit(checkpoint_id, wanted,
                              [("", "model", ""), (OPTIMIZER, "optimizer state", OTHER_SETTINGS)],
                              others=(*others, f"{OPTIMIZER}.{RESIDUALS}"), metadata=metadata,
                              partial=pipelined)
            rng = state_dict.get(RNG_KEY)
            if rng is None:
                return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
            rng.expect_checkpoint(set(metadata.state_dict_metadata))
            try:
                return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
            finally:
                rng.expect_checkpoint(None)
        finally:
            if amsp_optimizers:
                optimizers.expect_checkpoint(None)

    return load
