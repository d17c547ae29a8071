"""``--experimental.custom_import`` for fp32 MoE parity on torchtitan 0.2.2: the AMSP plug-in,
plus an ``<flavor>_fp32`` flavor of every qwen3 MoE flavor whose routed experts run
torchtitan's own for-loop path (``MoEArgs.use_grouped_mm = False``) in the model's dtype.

    torchrun ... -m amsp_dtensor.train --model.name qwen3 --model.flavor debugmodel_moe_fp32 \\
        --experimental.custom_import amsp_dtensor.testing.fp32_experts

Why: qwen3's grouped experts cast activations and weights to bf16 for ``torch._grouped_mm``
(``_run_experts_grouped_mm``), on CPU too, so two fp32 runs that split the same tokens
differently (another EP degree, another micro-batch order) round differently in bf16 and
drift apart by up to 1e-4 relative within 10 steps, torchtitan's own EP 1 against its own
EP 2 included. deepseek_v3 already takes the for-loop path off Hopper GPUs
(``DeepSeekV3ModelArgs.update_from_config``); this gives qwen3 the same, both for
torchtitan's own run (``qwen3``) and for AMSP's (``qwen3_amsp`` reads the same flavors).
"""

from __future__ import annotations

import dataclasses

import amsp_dtensor.titan  # noqa: F401  (what the recipe's custom_import would import)
from torchtitan.models.qwen3 import qwen3_args

SUFFIX = "_fp32"

for _name, _args in list(qwen3_args.items()):
    if _args.moe_enabled and not _name.endswith(SUFFIX):
        qwen3_args[_name + SUFFIX] = dataclasses.replace(
            _args, moe_args=dataclasses.replace(_args.moe_args, use_grouped_mm=False))
