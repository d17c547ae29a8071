"""torchtitan 0.2.2: the CPU shims, then the AMSP TrainSpecs (see the package docstring)."""

from . import cpu_compat

cpu_compat.apply()  # before anything imports torchtitan (shims 1 and 2 act at import time)

from .parallelize import amsp_plan_of, parallelize_llama_amsp  # noqa: E402
from .specs import (  # noqa: E402
    EAGER_BASES,
    amsp_name,
    amsp_variant,
    check_model,
    ensure_registered,
    register_amsp_variant,
    register_eager_variants,
    uses_amsp,
)
from .validate import AmspConfigError, job_plan, resolve_plan  # noqa: E402

TRAIN_SPEC_NAME = "llama3_amsp"


def amsp_train_spec(base_name: str = "llama3"):
    """The AMSP variant of torchtitan's TrainSpec ``base_name`` (not registered)."""
    from torchtitan.protocols import train_spec as _train_spec

    return amsp_variant(_train_spec.get_train_spec(base_name), base_name)


register_eager_variants()

__all__ = [
    "EAGER_BASES",
    "TRAIN_SPEC_NAME",
    "AmspConfigError",
    "amsp_name",
    "amsp_plan_of",
    "amsp_train_spec",
    "check_model",
    "ensure_registered",
    "job_plan",
    "parallelize_llama_amsp",
    "register_amsp_variant",
    "resolve_plan",
    "uses_amsp",
]
