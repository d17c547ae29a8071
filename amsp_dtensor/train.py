"""Entry point: ``torchrun --nproc_per_node 4 -m amsp_dtensor.train --job.config_file X.toml``.

The installed torchtitan decides: on 0.3 the job goes to ``amsp_dtensor.titan.v03.launch``
(the same TOML mapped onto 0.3's config, or a config registry entry); what follows is 0.2.2.

What it adds to ``python -m torchtitan.train``:
  1. the CPU shims (only when no accelerator exists), before torchtitan is imported;
  2. the [amsp] section and the AMSP TrainSpecs (``llama3_amsp``, ``qwen3_amsp``, and
     ``<name>_amsp`` for any other registered TrainSpec ``<name>``, built on demand)
     without needing the two plug-in lines in the TOML (they are added if missing);
  3. validation of [amsp], of [parallelism] (the data-parallel layout decides the plan
     unless [amsp] sets factors), of settings AMSP cannot honour, and of the model (MoE
     flavors are refused) before any process group or model exists: a bad setting stops
     every rank with one line naming the key, and a non-zero exit code (2);
  4. the offline tokenizer and corpus, built on first run when the config points into
     amsp_dtensor.data.DEFAULT_ROOT (outputs/amsp_data), and HF_HOME kept there;
  5. AmspTrainer: torchtitan's Trainer with no_sync on all but the last micro-batch.
"""

from __future__ import annotations

import os
import sys

from amsp_dtensor.launching import (_rank, _shown_rank, log_plan, prepare_data_at,
                                    quiet_other_ranks, refuse, run_trainer)

CONFIG_MODULE = "amsp_dtensor.titan.config"
CONFIG_MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")


class UsageError(Exception):
    """A config problem reported as one line (no traceback)."""


def _with_config_module(argv: list[str], toml_values: dict | None) -> list[str]:
    in_cli = any(a.split("=")[0] in CONFIG_MODULE_FLAGS for a in argv)
    in_toml = bool(((toml_values or {}).get("job") or {}).get("custom_config_module"))
    return argv if in_cli or in_toml else argv + ["--job.custom_config_module", CONFIG_MODULE]


def parse_job_config(argv: list[str]):
    """torchtitan's ConfigManager, after checking the TOML's [amsp] keys ourselves."""
    return read_job_config(argv)[0]


def read_job_config(argv: list[str]):
    """(the JobConfig, whether [amsp] keys were given in the TOML or on the command line)."""
    import importlib
    import logging

    import amsp_dtensor.titan  # noqa: F401  (CPU shims, the AMSP TrainSpecs)
    from torchtitan.config import ConfigManager

    from amsp_dtensor import compat
    from amsp_dtensor.titan.validate import check_amsp_flags, check_toml_keys

    manager = ConfigManager()
    titan_log = logging.getLogger()  # torchtitan's logger
    level = titan_log.level
    # torchtitan logs the traceback of a file it cannot read; the one line below says it
    titan_log.setLevel(logging.CRITICAL)
    try:
        toml_values = compat.titan_load_toml(manager, argv)
    except FileNotFoundError as e:
        raise UsageError(f"job.config_file: {e}") from None
    except Exception as e:  # tomllib.TOMLDecodeError
        raise UsageError(f"job.config_file: not valid TOML: {e}") from None
    finally:
        titan_log.setLevel(level)
    check_toml_keys(toml_values)
    check_amsp_flags(argv)
    # Make the offline data before torchtitan's config check looks for the tokenizer folder.
    toml_paths = ((toml_values or {}).get("model", {}).get("hf_assets_path"),
                  (toml_values or {}).get("training", {}).get("dataset_path"))
    prepare_data_at(toml_paths)
    try:
        config = manager.parse_args(_with_config_module(argv, toml_values))
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    if config.experimental.custom_import:
        importlib.import_module(config.experimental.custom_import)
    from amsp_dtensor.titan import ensure_registered

    ensure_registered(config.model.name)  # <name>_amsp for any registered <name>
    amsp_given = bool((toml_values or {}).get("amsp")) or any(
        a.startswith("--amsp.") for a in argv)
    return config, amsp_given


def prepare_data(job_config) -> None:
    prepare_data_at([job_config.model.hf_assets_path, job_config.training.dataset_path])


NEVER_SHOWN_WARNINGS = (
    # torchdata's StatefulDataLoader calls torch.set_vital, deprecated in torch 2.13: a
    # note to torchdata's authors that no job setting changes.
    r"'set_vital' is deprecated",
)

# Log records (logger name, text in the message) that never concern a job, hidden the same
# way. The second group only where no CUDA device exists.
NEVER_SHOWN_LOGS = (
    # torch 2.13's pytree registry, at torchao's import (torchtitan 0.3 imports it with its
    # config): torchao registers Enum types that torch now supports natively; a note to
    # torchao's authors.
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)
NO_CUDA_HIDDEN_LOGS = (
    # torchao's CUDA kernel libraries (mxfp8, cutlass) cannot load without CUDA; the float8
    # training path AMSP supports does not use them.
    ("torchao", "Failed to load "),
)


class _HiddenLog:
    """A logging filter dropping the records whose message contains ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def quiet_warnings() -> None:
    """Python warnings: once per job, not once per rank.

    [Note: one console, many ranks] torchrun interleaves every rank's output, so each
    warning would print once per rank. Only the ranks in LOG_RANK (default "0"; torchtitan's
    run_train.sh has torchrun's --local-ranks-filter for this) show Python warnings; every
    rank still raises and prints its errors. Warnings and log records that never concern a
    job (NEVER_SHOWN_WARNINGS, NEVER_SHOWN_LOGS, and NO_CUDA_HIDDEN_LOGS on machines without
    CUDA) are hidden everywhere. Runs before anything imports torchtitan.
    """
    import logging
    import warnings

    import torch

    for message in NEVER_SHOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    hidden = NEVER_SHOWN_LOGS + (() if torch.cuda.is_available() else NO_CUDA_HIDDEN_LOGS)
    for name, text in hidden:
        logging.getLogger(name).addFilter(_HiddenLog(text))
    if not _shown_rank():
        warnings.simplefilter("ignore")


def warn_multi_node_restarts() -> None:
    """One warning when torchrun may restart a job of several nodes and shares its
    rendezvous store with the ranks: compat.init_process_group keeps restart attempts apart
    on one node only (each node's agent counts its own restarts), so there restarted ranks
    can meet the previous attempt's entries and hang in init_process_group."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if (restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("GROUP_WORLD_SIZE", "1") != "1" and _rank() == 0):
        from torchtitan.tools.logging import logger

        logger.warning(
            f"torchrun --max-restarts {restarts} on several nodes shares its rendezvous store "
            "with the ranks, and restarted ranks can hang in init_process_group (torch 2.13): "
            "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment")


def check_amsp(job_config, amsp_given: bool = False):
    """Validate [amsp] and the model for this world (WORLD_SIZE / LOCAL_WORLD_SIZE);
    None if not an AMSP model (then a warning if ``amsp_given``: its keys are unused)."""
    from amsp_dtensor.titan import amsp_name, check_model, job_plan, uses_amsp

    if not uses_amsp(job_config.model.name):
        amsp_cfg = getattr(job_config, "amsp", None)
        if _rank() == 0 and amsp_given and not (
            amsp_cfg is not None and amsp_cfg.init_like_single_process
        ):
            from torchtitan.tools.logging import logger

            logger.warning(
                f"model.name={job_config.model.name!r} uses torchtitan's own parallelism; the "
                f"[amsp] settings are not used (for AMSP: --model.name "
                f"{amsp_name(job_config.model.name)})"
            )
        return None
    plan = job_plan(job_config)  # [amsp], [parallelism], settings AMSP cannot honour (kept)
    check_model(job_config)
    return plan


def run(job_config) -> int:
    """The body of torchtitan.train.main, with AmspTrainer (exit code: launching.run_trainer)."""
    from amsp_dtensor.titan.trainer import AmspTrainer

    return run_trainer(lambda: AmspTrainer(job_config),
                       job_config.checkpoint.create_seed_checkpoint)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_warnings()
    from amsp_dtensor.titan.version import is_titan03

    if is_titan03():  # the installed torchtitan decides
        from amsp_dtensor.titan.v03 import launch

        return launch.main(argv)
    from amsp_dtensor.titan import cpu_compat

    cpu_compat.apply()
    from torchtitan.tools.logging import init_logger

    from amsp_dtensor.titan.validate import AmspConfigError

    init_logger()
    quiet_other_ranks()
    warn_multi_node_restarts()
    try:
        job_config, amsp_given = read_job_config(argv)
        plan = check_amsp(job_config, amsp_given)
    except (AmspConfigError, UsageError) as e:
        return refuse(e)
    if plan is not None:
        log_plan(plan, job_config.parallelism.tensor_parallel_degree)
    prepare_data(job_config)
    return run(job_config)


if __name__ == "__main__":
    sys.exit(main())
