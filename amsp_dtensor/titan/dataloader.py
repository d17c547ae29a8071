"""torchtitan's text data loader, resumable on another data-parallel world size.

torchtitan 0.2.2's ``ParallelAwareDataloader`` saves one state per data-parallel rank
(``dp_rank_<r>``: where rank r is in its own shard of the dataset, plus its token buffer)
and refuses a checkpoint saved under another dp world ("dp_degree is inconsistent before
and after checkpoint, dataloader resharding is not supported yet"). AMSP jobs change their
world size on resume (another plan, fewer or more nodes), so the AMSP TrainSpecs build
``ReshardableDataloader`` instead:

- it also saves ``amsp_global_sequences``, the number of sequences (training samples)
  all dp ranks together have handed to the trainer;
- resumed on the same dp world it loads torchtitan's per-rank state: exact, as before;
- resumed on another dp world of k ranks, rank j takes its share of that global count
  (``n // k``, one more on the first ``n % k`` ranks) and skips that many sequences of its
  own shard of the dataset, i.e. it stands where rank j of a k-rank run started from
  scratch would stand after n sequences. Rank 0 logs one warning saying what is not exact.

[Note: what a resharded resume loses] A k'-rank run and a k-rank run split the dataset
into different shards, so the documents the saved run read before the checkpoint are not
the ones the resumed ranks skip: some are read a second time, some never, and the saved
ranks' token buffers (tokens of their unfinished documents) are dropped. The global count
of sequences trained on is kept, and every step after the resume sees the data a k-rank run
would see at that step. Skipping tokenizes the skipped documents again (torchdata's
fast-forward): its cost grows with the data consumed before the checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset, build_text_dataloader

from .reshard_data import (GLOBAL_SEQUENCES, KEY_PREFIX, WORLD_SIZE,  # noqa: F401
                           Reshardable, checkpoint_keys, dataloader_keys_before_load)

class ReshardableDataloader(Reshardable, ParallelAwareDataloader):
    """ParallelAwareDataloader whose checkpoint loads on any dp world size (module doc)."""

    def __init__(self, dataset, dp_rank: int, dp_world_size: int, **kwargs):
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
        self._reshardable_init()


def build_reshardable_text_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True
) -> ReshardableDataloader:
    """torchtitan's ``build_text_dataloader`` (same dataset, same loader settings),
    returning a ReshardableDataloader."""
    training = job_config.training
    dataset = HuggingFaceTextDataset(
        dataset_name=training.dataset,
        dataset_path=training.dataset_path,
        tokenizer=tokenizer,
        seq_len=training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
    kwargs = {**asdict(training.dataloader), "batch_size": training.local_batch_size}
    return ReshardableDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def reshardable_dataloader_fn(build_dataloader_fn):
    """The AMSP variant's data loader builder: ours in place of torchtitan's text loader;
    any other builder (a spec with its own dataset) is kept as it is."""
    if build_dataloader_fn is build_text_dataloader:
        return build_reshardable_text_dataloader
    return build_dataloader_fn
