"""torchtitan 0.2.2 integration of amsp_dtensor (the only package that imports torchtitan).

Importing it (``[experimental] custom_import = "amsp_dtensor.titan"``) applies the CPU shims
when no accelerator exists, then registers the TrainSpec ``llama3_amsp``: torchtitan's
llama3 spec with AMSP's parallelize_fn, optimizer builder and metrics processor. The
``[amsp]`` TOML section comes from ``[job] custom_config_module = "amsp_dtensor.titan.config"``.
"""

from . import cpu_compat

cpu_compat.apply()  # before anything imports torchtitan (shims 1 and 2 act at import time)

import dataclasses  # noqa: E402

from torchtitan.models.llama3 import get_train_spec as _llama3_spec  # noqa: E402
from torchtitan.protocols import train_spec as _train_spec  # noqa: E402

from ..compat import titan_extra_train_specs  # noqa: E402
from .metrics import build_amsp_metrics_processor  # noqa: E402
from .optimizer import build_amsp_optimizers  # noqa: E402
from .parallelize import amsp_plan_of, parallelize_llama_amsp  # noqa: E402
from .validate import AmspConfigError, resolve_plan  # noqa: E402

TRAIN_SPEC_NAME = "llama3_amsp"


def amsp_train_spec():
    return dataclasses.replace(
        _llama3_spec(),
        parallelize_fn=parallelize_llama_amsp,
        pipelining_fn=None,  # AMSP shards data-parallel states only
        build_optimizers_fn=build_amsp_optimizers,
        build_metrics_processor_fn=build_amsp_metrics_processor,
    )


def uses_amsp(model_name: str) -> bool:
    """True if the named TrainSpec parallelizes with AMSP."""
    try:
        spec = _train_spec.get_train_spec(model_name)
    except ValueError:
        return False
    return spec.parallelize_fn is parallelize_llama_amsp


if TRAIN_SPEC_NAME not in titan_extra_train_specs():
    _train_spec.register_train_spec(TRAIN_SPEC_NAME, amsp_train_spec())

__all__ = [
    "TRAIN_SPEC_NAME",
    "AmspConfigError",
    "amsp_plan_of",
    "amsp_train_spec",
    "resolve_plan",
    "uses_amsp",
]
