"""torchtitan 0.3's MetricsProcessor with the AMSP scalars (titan/metrics.py's list).

A Configurable component: ``AmspMetricsProcessor.Config`` is 0.3's
``MetricsProcessor.Config`` (log_freq, TensorBoard, W&B), built by 0.3's Trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torchtitan.components.metrics import MetricsProcessor

from ..metrics import AmspMetrics


class AmspMetricsProcessor(AmspMetrics, MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self._drop_unknown_peak()


def amsp_metrics_config(config: MetricsProcessor.Config) -> AmspMetricsProcessor.Config:
    return AmspMetricsProcessor.Config(**{f.name: getattr(config, f.name) for f in fields(config)
                                          if f.init})
