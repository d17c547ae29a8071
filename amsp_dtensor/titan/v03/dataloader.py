"""torchtitan 0.3's text data loader, resumable on another data-parallel world size.

0.3's ``HuggingFaceTextDataLoader`` refuses a checkpoint saved under another dp world
("dp_degree is inconsistent before and after checkpoint, dataloader resharding is not
supported yet"), and AMSP jobs change their world on resume (another plan, fewer or more
nodes). ``AmspTextDataLoader`` is that loader with the shared ``Reshardable`` mixin
(titan/reshard_data.py: the global sequence count saved beside torchtitan's per-rank
state, each new rank skipping to its share of it; what that loses: titan/dataloader.py's
module doc). A Configurable component: its ``Config`` is 0.3's loader config.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from ..reshard_data import Reshardable


class AmspTextDataLoader(Reshardable, HuggingFaceTextDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(HuggingFaceTextDataLoader.Config):
        pass

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self._reshardable_init()


def amsp_dataloader_config(config):
    """0.3's text loader config built as the resumable one; any other loader is kept."""
    if type(config) is not HuggingFaceTextDataLoader.Config:
        return config
    return AmspTextDataLoader.Config(**{f.name: getattr(config, f.name) for f in fields(config)
                                        if f.init})
