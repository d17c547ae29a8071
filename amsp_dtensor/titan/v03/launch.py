"""``python -m amsp_dtensor.train`` on torchtitan 0.3 (amsp_dtensor.train hands over here
when 0.3 is installed).

Two ways to name the job:
  --job.config_file X.toml [--section.key value ...]   a TOML recipe (toml_config)
  --module M --config C [tyro flags ...]                a 0.3 config registry entry, e.g.
                                                        --module amsp_dtensor.titan.v03
                                                        --config llama3_debugmodel_amsp
Then, before any process group: the AMSP checks and the one plan resolution
(v03.trainer.prepare); a refused setting, or a flag the config does not have, stops every
rank with one line and exit 2. Then
the offline data (when the paths point into outputs/amsp_data) and torchtitan's training
loop with the AmspTrainer.
"""

from __future__ import annotations

import dataclasses
import difflib

from ... import compat
from ... import launching as launcher
from . import cpu_compat

cpu_compat.apply()


def load_config(argv: list[str]):
    """(the AmspTrainer.Config, whether [amsp] keys were given)."""
    from ..config import AmspConfigError

    if any(a in ("--module", "--config") or a.startswith(("--module=", "--config="))
           for a in argv):
        from ..validate import check_amsp_flags
        from .trainer import AmspTrainer

        check_amsp_flags(argv)  # an unknown --amsp.<key>: the TOML path's line
        try:
            config = parse_registry_args(argv)
        except (ValueError, ImportError) as e:
            raise AmspConfigError(str(e).splitlines()[0]) from None
        if not isinstance(config, AmspTrainer.Config):
            raise AmspConfigError(
                f"--config: {type(config).__qualname__} is not an AmspTrainer.Config; use an "
                "*_amsp entry of amsp_dtensor.titan.v03 (or torchtitan's own launcher)")
        return config, any(a.startswith("--amsp.") for a in argv)
    from . import toml_config

    values, _ = toml_config.read(argv)
    return toml_config.build(values), bool(values.get("amsp"))


def parse_registry_args(argv: list[str]):
    """torchtitan's ``ConfigManager().parse_args(argv)``, except that a flag the config
    does not have is one AmspConfigError line naming it (tyro would print a box of help)."""
    import tyro
    from torchtitan.config import ConfigManager
    from torchtitan.config.manager import custom_registry

    from ..config import AmspConfigError

    manager = ConfigManager()
    # the registry entry; --module/--config taken
    loaded, args = compat.titan03_load_registry_config(manager, argv)
    config, unknown = tyro.cli(type(loaded), args=args, default=loaded,
                               registry=custom_registry, return_unknown_args=True)
    if unknown:
        flag = next((a for a in unknown if a.startswith("-")), unknown[0])
        name = flag.split("=", 1)[0]
        if not name.startswith("-"):
            raise AmspConfigError(f"{name!r}: unexpected argument (a value without its flag?)")
        close = difflib.get_close_matches(name.replace("-", "_"), _flags(loaded), n=1)
        hint = f"; did you mean {close[0]}?" if close else " (--help lists them)"
        raise AmspConfigError(f"{name}: unknown flag for torchtitan 0.3's "
                              f"{type(loaded).__qualname__}{hint}")
    manager.config = config
    compat.titan03_validate_config(manager)
    return config


def _flags(config, prefix: str = "--") -> list[str]:
    """The ``--section.key`` flags of a config's fields (underscore spelling), nested
    dataclasses followed: the candidates for a misspelt flag."""
    flags = []
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        value = getattr(config, f.name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            flags += _flags(value, f"{prefix}{f.name}.")
        else:
            flags.append(f"{prefix}{f.name}")
    return flags


def main(argv: list[str]) -> int:
    from torchtitan.tools.logging import init_logger, logger

    from ..config import AmspConfigError
    from .parallelize import is_amsp
    from .trainer import prepare

    init_logger()
    launcher.quiet_other_ranks()
    try:
        config, amsp_given = load_config(argv)
        plan = prepare(config)  # the AMSP checks and the plan, before any process group
    except AmspConfigError as e:
        return launcher.refuse(e)
    if plan is not None:
        launcher.log_plan(plan, config.parallelism.tensor_parallel_degree, " (torchtitan 0.3)",
                          config.parallelism.context_parallel_degree)
    elif amsp_given and not config.amsp.init_like_single_process and launcher._rank() == 0:
        logger.warning(f"model {config.model_spec.name} uses torchtitan's own parallelism; the "
                       "[amsp] settings are not used (for AMSP: model.name <name>_amsp)")
    assert plan is None or is_amsp(config.model_spec)
    launcher.prepare_data_at([config.hf_assets_path,
                              getattr(config.dataloader, "dataset_path", None)])
    return run(config)


def run(config) -> int:
    """The body of torchtitan.train.main, with the AmspTrainer ``config`` builds (exit code:
    launching.run_trainer)."""
    return launcher.run_trainer(config.build, config.checkpoint.create_seed_checkpoint)
