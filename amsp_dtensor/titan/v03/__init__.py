"""amsp_dtensor on torchtitan 0.3 (the config-registry torchtitan).

Importing it applies the CPU shims when no accelerator exists (``cpu_compat``), before
anything of torchtitan is imported. The pieces, each a 0.3 component:

- ``trainer.AmspTrainer`` and its ``Config`` (0.3's Trainer.Config plus ``amsp``);
- ``config_registry``: ``llama3_debugmodel_amsp``, ``llama3_8b_amsp``, ... for
  ``--module amsp_dtensor.titan.v03 --config <entry>``;
- ``parallelize``: the ModelSpec parallelize_fn; ``optimizer`` / ``metrics``: the
  Configurable containers; ``job``: a 0.3 config as the shared plan checks read it;
- ``toml_config``: a 0.2.2 TOML job file (the project's recipes) mapped onto the 0.3
  config, keys 0.3 removed refused; ``launch``: ``python -m amsp_dtensor.train`` on 0.3.

The plan resolution, the AMSP units, the optimizer state and the step are shared with the
0.2.2 integration (``titan.validate``, ``titan.units``, ``titan.amsp_optimizers``,
``titan.steps``).
"""

from . import cpu_compat

cpu_compat.apply()  # before anything imports torchtitan (shims 1 and 2 act at import time)
