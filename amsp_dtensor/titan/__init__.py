"""torchtitan integration of amsp_dtensor (the only package that imports torchtitan).

Which torchtitan is installed decides what importing it does (``version``):

- torchtitan 0.2.2: importing it (``[experimental] custom_import = "amsp_dtensor.titan"``)
  applies the CPU shims when no accelerator exists, then registers the AMSP variant
  ``<name>_amsp`` of torchtitan's dense LLM TrainSpecs (``llama3_amsp``, ``qwen3_amsp``):
  the same spec with AMSP's parallelize_fn, optimizer builder and metrics processor (see
  ``specs``). The ``[amsp]`` TOML section comes from ``[job] custom_config_module =
  "amsp_dtensor.titan.config"``.
- torchtitan 0.3: nothing of the above (0.3 has no TrainSpecs nor TOML); the integration
  is ``amsp_dtensor.titan.v03`` (config registry entries ``*_amsp``, the AMSP trainer).

``config`` and ``validate`` (the [amsp] keys and the one plan resolution) import no
torchtitan and serve both.
"""

from .version import is_titan03

if not is_titan03():
    from ._v022 import *  # noqa: F401,F403
    from ._v022 import __all__  # noqa: F401
else:
    from .config import AmspConfigError  # noqa: F401
    from .validate import resolve_plan  # noqa: F401

    __all__ = ["AmspConfigError", "resolve_plan"]
