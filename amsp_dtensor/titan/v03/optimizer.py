"""torchtitan 0.3's OptimizersContainer around amsp.AMSPOptimizer (see titan/amsp_optimizers).

A Configurable component as 0.3 declares them: ``AmspOptimizersContainer.Config`` is 0.3's
``OptimizersContainer.Config`` (param groups, implementation), and ``config.build(
model_parts=...)``, which 0.3's Trainer calls, builds this container: one AMSPOptimizer per
model part, holding 0.3's parameter groups (Adam and AdamW, each group with its own
kwargs; v03.job.optimizer_of refuses anything else in one line).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn as nn

from torchtitan.components.optimizer import OptimizersContainer

from ... import compat
from ..amsp_optimizers import OPTIMIZER_CLASSES, AmspOptimizers
from .job import optimizer_of


class AmspOptimizersContainer(AmspOptimizers, OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        name, kwargs, implementation, groups = optimizer_of(config)
        kwargs = dict(kwargs, fused=implementation == "fused",
                      foreach=implementation == "foreach")
        all_params = self._build_amsp_optimizers(model_parts, OPTIMIZER_CLASSES[name], kwargs,
                                                 groups)
        compat.titan03_optimizers_container_post_init(self, all_params)


def amsp_optimizer_config(config: OptimizersContainer.Config) -> AmspOptimizersContainer.Config:
    """The same settings, built as the AMSP container."""
    return _settings_as(config, AmspOptimizersContainer.Config)


def titan_optimizer_config(config: AmspOptimizersContainer.Config) -> OptimizersContainer.Config:
    """The inverse of ``amsp_optimizer_config``: the same settings, built as torchtitan's
    own container (for a job that builds no AMSP units, such as a seed checkpoint)."""
    return _settings_as(config, OptimizersContainer.Config)


def _settings_as(config, cls):
    """Every setting of 0.3's OptimizersContainer.Config in ``config``, as ``cls`` (its
    lists and dicts copied, so neither config changes the other's)."""
    def copied(value):
        return type(value)(value) if isinstance(value, (list, dict)) else value

    return cls(**{f.name: copied(getattr(config, f.name))
                  for f in dataclasses.fields(OptimizersContainer.Config) if f.init})
