"""AMSP entries of torchtitan 0.3's config registry: ``<torchtitan entry>_amsp``.

Each is torchtitan's own registry function (``llama3_debugmodel``, ``llama3_8b``, ...)
made AMSP's by ``amsp_config``: an ``AmspTrainer.Config`` with the same settings, the
ModelSpec's parallelize_fn AMSP's, the AMSP optimizer, metrics and (resumable) text
data loader components, plain
cross-entropy for the loss (0.3's chunked loss runs the lm_head outside the model's
forward, see v03.trainer.check_job), the partial-DTensor SPMD backend and no CUDA graphs
(AMSP's gradient buffers are allocated and freed each step). The ``amsp``
section starts at ``titan.config.Amsp``'s defaults (factors from the data-parallel
layout). On a GPU machine torchtitan's own launcher finds them:

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module amsp_dtensor.titan.v03 --config llama3_8b_amsp --amsp.optim_shard 8

(on CPU torchtitan's launcher imports triton before this module could shim it: use
``python -m amsp_dtensor.train``, which also reads the TOML recipes).
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common.config_utils import decoder_vocab_size

from ..config import Amsp
from .dataloader import amsp_dataloader_config
from .metrics import amsp_metrics_config
from .optimizer import amsp_optimizer_config
from .parallelize import amsp_model_spec
from .trainer import AmspTrainer


def _as_amsp_trainer_config(base, amsp: Amsp | None) -> AmspTrainer.Config:
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    values["amsp"] = amsp or values.get("amsp") or Amsp()
    return AmspTrainer.Config(**values)


def amsp_config(base, amsp: Amsp | None = None) -> AmspTrainer.Config:
    """torchtitan's ``base`` (a Trainer.Config) trained by AMSP."""
    config = _as_amsp_trainer_config(base, amsp)
    config.model_spec = amsp_model_spec(base.model_spec)
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(base.model_spec))
    config.optimizer = amsp_optimizer_config(config.optimizer)
    config.metrics = amsp_metrics_config(config.metrics)
    config.dataloader = amsp_dataloader_config(config.dataloader)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    return config


def baseline_config(base, amsp: Amsp | None = None) -> AmspTrainer.Config:
    """torchtitan's ``base`` with torchtitan's own parallelism (FSDP2, TP), built as an
    AmspTrainer.Config only to carry ``amsp.init_like_single_process``: the reference the
    equivalence tests compare AMSP with. Same loss and SPMD backend as ``amsp_config``."""
    config = _as_amsp_trainer_config(base, amsp)
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(base.model_spec))
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    return config


def _entry(module: str, name: str):
    def build() -> AmspTrainer.Config:
        import importlib

        return amsp_config(getattr(importlib.import_module(module), name)())

    build.__name__ = build.__qualname__ = f"{name}_amsp"
    build.__doc__ = f"torchtitan's {name} ({module}) trained by AMSP."
    return build


_LLAMA3 = "torchtitan.models.llama3.config_registry"
_QWEN3 = "torchtitan.models.qwen3.config_registry"
_DEEPSEEK_V3 = "torchtitan.models.deepseek_v3.config_registry"

llama3_debugmodel_amsp = _entry(_LLAMA3, "llama3_debugmodel")
llama3_8b_amsp = _entry(_LLAMA3, "llama3_8b")
llama3_70b_amsp = _entry(_LLAMA3, "llama3_70b")
# float8 rowwise linears (emulated) with LoRA adapters on frozen weights (P only under AMSP)
llama3_debugmodel_float8_emulate_lora_amsp = _entry(_LLAMA3, "llama3_debugmodel_float8_emulate_lora")
qwen3_debugmodel_amsp = _entry(_QWEN3, "qwen3_debugmodel")
qwen3_0_6b_amsp = _entry(_QWEN3, "qwen3_0_6b")
qwen3_1_7b_amsp = _entry(_QWEN3, "qwen3_1_7b")
qwen3_14b_amsp = _entry(_QWEN3, "qwen3_14b")
# MoE (the experts' plan: the [amsp] expert_* keys; EP: parallelism.expert_parallel_degree)
qwen3_moe_debug_amsp = _entry(_QWEN3, "qwen3_moe_debug")
qwen3_30b_a3b_amsp = _entry(_QWEN3, "qwen3_30b_a3b")
deepseek_v3_debugmodel_amsp = _entry(_DEEPSEEK_V3, "deepseek_v3_debugmodel")

ENTRIES = ("llama3_debugmodel_amsp", "llama3_8b_amsp", "llama3_70b_amsp",
           "llama3_debugmodel_float8_emulate_lora_amsp",
           "qwen3_debugmodel_amsp", "qwen3_0_6b_amsp", "qwen3_1_7b_amsp", "qwen3_14b_amsp",
           "qwen3_moe_debug_amsp", "qwen3_30b_a3b_amsp", "deepseek_v3_debugmodel_amsp")
