"""A data loader whose checkpoint resumes on another data-parallel world size, for either
torchtitan (the mixin ``Reshardable``; ``dataloader.ReshardableDataloader`` for 0.2.2,
``v03.dataloader.AmspTextDataLoader`` for 0.3). What it does and what such a resume
loses: titan/dataloader.py's module doc.
"""

from __future__ import annotations

from typing import Any, Iterator

from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.tools.logging import logger

from ..checkpoint import CheckpointMismatch

GLOBAL_SEQUENCES = "amsp_global_sequences"
WORLD_SIZE = "world_size"  # torchtitan's key for the saving run's dp world size
KEY_PREFIX = "dataloader."  # torchtitan's CheckpointManager key for the data loader


class Reshardable:
    """A ParallelAwareDataloader whose checkpoint loads on any dp world size (a mixin
    placed before either torchtitan's loader class; see the module doc)."""

    def _reshardable_init(self) -> None:
        # Global sequences when this rank's position was last set (0 at start, or from a
        # checkpoint; None: a checkpoint without the count was loaded), and the batches this
        # rank has yielded since.
        self._sequences_at_load: int | None = 0
        self._batches_since_load = 0
        self._checkpoint_keys: set[str] | None = None

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            self._batches_since_load += 1
            yield batch

    def global_sequences(self) -> int | None:
        """Sequences all dp ranks together have handed to the trainer so far.

        [Note: lockstep] Computed on each rank from its own count: torchtitan's training
        loop takes the same number of batches of the same size on every dp rank each step
        (gradient accumulation steps x local batch size), so the value is the same on all
        ranks and DCP saves one copy of it.
        """
        if self._sequences_at_load is None:
            return None
        return self._sequences_at_load + self._batches_since_load * self.batch_size * self.dp_world_size

    def expect_checkpoint(self, keys: set[str] | None) -> None:
        """Before a load: the data loader keys the checkpoint holds (without the
        ``dataloader.`` prefix), so that ``state_dict()`` asks DCP for those only. A rank
        the saving run did not have finds no ``dp_rank_<r>`` there, and DCP fails a load
        that asks for a missing key. None: offer every key again (after the load).

        A checkpoint saved on another dp world without the global count is refused here,
        on every rank alike and before DCP's collective load starts."""
        if keys is not None:
            saved_world = sum(1 for k in keys if k.startswith("dp_rank_"))
            if saved_world and saved_world != self.dp_world_size and GLOBAL_SEQUENCES not in keys:
                raise CheckpointMismatch(self._no_global_count(saved_world))
        self._checkpoint_keys = keys

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sequences = self.global_sequences()
        if sequences is not None:
            sd[GLOBAL_SEQUENCES] = sequences
        if self._checkpoint_keys is not None:
            sd = {k: v for k, v in sd.items() if k in self._checkpoint_keys}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._checkpoint_keys = None
        if not state_dict:
            return
        saved_world = state_dict.get(WORLD_SIZE, self.dp_world_size)
        sequences = state_dict.get(GLOBAL_SEQUENCES)
        if saved_world == self.dp_world_size:
            super().load_state_dict(state_dict)  # torchtitan's own, exact resume
        else:
            self._skip_to_share_of(sequences, saved_world)
        self._sequences_at_load = sequences
        self._batches_since_load = 0

    def _no_global_count(self, saved_world: int) -> str:
        return (f"dataloader: the checkpoint was saved on {saved_world} data-parallel ranks "
                f"without '{GLOBAL_SEQUENCES}' (saved by torchtitan's own data loader, i.e. "
                f"not an <name>_amsp model), so where each of the {self.dp_world_size} ranks "
                f"now stands in the data cannot be derived; resume on {saved_world} "
                f"data-parallel ranks, or pass --checkpoint.exclude_from_loading dataloader to "
                f"start the data again from its beginning")

    def _skip_to_share_of(self, sequences: int | None, saved_world: int) -> None:
        world, rank = self.dp_world_size, self.dp_rank
        if sequences is None:
            raise CheckpointMismatch(self._no_global_count(saved_world))
        share, extra = divmod(sequences, world)
        mine = share + (1 if rank < extra else 0)
        batches, rest = divmod(mine, self.batch_size)
        iterator = StatefulDataLoader.__iter__(self)
        for _ in range(batches):
            next(iterator)
        # The position reached, made the one the training loop's first iter() resumes from.
        StatefulDataLoader.load_state_dict(self, StatefulDataLoader.state_dict(self))
        if rank == 0:
            uneven = (f"; {sequences} is not a multiple of {world} x {self.batch_size}, so "
                      f"ranks skipped {share} or {share + 1} sequences rounded down to whole "
                      f"batches" if extra or rest else "")
            logger.warning(
                f"dataloader: checkpoint saved on {saved_world} data-parallel ranks, resumed on "
                f"{world}: each rank skipped {mine} sequences ({batches} batches of "
                f"{self.batch_size}) of its own shard of the dataset, where a {world}-rank run "
                f"stands after the checkpoint's {sequences} sequences{uneven}. Not exact: the "
                f"{world} ranks' shards differ from the {saved_world} saved ones, so some "
                f"documents read before the checkpoint are read again and some are never "
                f"read, and the {saved_world} saved token buffers (unfinished documents) are "
                f"dropped"
            )


def dataloader_keys_before_load(dcp_load, dataloader):
    """CheckpointManager.dcp_load, telling the data loader first which of its keys the
    checkpoint holds.

    [Note: keys a resharded resume may ask for] DCP loads the keys the live state_dict
    offers and fails on one the checkpoint lacks; a rank the saving run did not have (e.g.
    rank 5 resuming a 4-rank checkpoint) would offer ``dp_rank_5``. dcp_load is the one
    place that knows the checkpoint folder before DCP asks the data loader for its keys.
    """

    def load(state_dict, checkpoint_id, *args, **kwargs):
        if not any(value is dataloader for value in state_dict.values()):
            return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        dataloader.expect_checkpoint(checkpoint_keys(checkpoint_id))
        try:
            return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        finally:
            dataloader.expect_checkpoint(None)

    return load


def checkpoint_keys(checkpoint_id: str) -> set[str]:
    """The data loader keys a DCP checkpoint folder holds (without the prefix)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(checkpoint_id).read_metadata()
    return {k[len(KEY_PREFIX):] for k in metadata.state_dict_metadata if k.startswith(KEY_PREFIX)}
