"""A TOML job file (torchtitan 0.2.2's format, the project's recipes) on torchtitan 0.3.

``load(argv)`` reads ``--job.config_file X.toml`` and the ``--section.key value``
overrides after it (0.2.2's command line: ``--checkpoint.enable``, ``--amsp.no-overlap-step``,
``--training.steps 4``), and builds an ``AmspTrainer.Config``. Every key is mapped by the
table below, in one place; a key 0.3 removed, a key that never existed, or a value 0.3
cannot take is refused as one AmspConfigError line naming the key and the fix, before any
process group. Keys are not silently dropped: the few that carry no setting in 0.3 are
accepted only with the value that means nothing there (``job.custom_config_module`` and
``experimental.custom_import`` naming amsp_dtensor, which 0.3 needs no plug-in lines for;
``job.description``, a label).

What maps to what (0.2.2 TOML -> 0.3 Trainer.Config):
  [model] name            "llama3_amsp" / "qwen3_amsp" / "deepseek_v3_amsp": torchtitan's
                          model_registry(flavor) as AMSP's ModelSpec; "llama3" / "qwen3" /
                          "deepseek_v3": torchtitan's own FSDP2 (+ TP, + EP)
  [model] flavor          model_registry's flavor; hf_assets_path -> hf_assets_path
  [optimizer]             name, lr, beta1, beta2, eps, weight_decay -> one param group ".*"
                          (optimizer_kwargs); implementation -> optimizer.implementation
  [training] dataset, dataset_path -> dataloader (HuggingFaceTextDataLoader.Config)
  [training] other keys   -> training.<key> (same names in 0.3)
  [activation_checkpoint] mode "none" / "full" / "selective" (op-level) -> None / FullAC /
                          SelectiveAC; selective_ac_option "op" only
  [job] dump_folder       -> dump_folder; print_config -> debug.print_config
  [metrics] [lr_scheduler] [parallelism] [compile] [checkpoint] [debug] [comm] [amsp]
                          -> the section of the same name, key by key
  loss                    cross-entropy (0.2.2's), the SPMD backend "partial_dtensor"
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from ..config import KNOWN_KEYS as AMSP_KEYS
from ..config import AmspConfigError, unknown_amsp_key

CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
PLUGIN_VALUES = {
    ("job", "custom_config_module"): "amsp_dtensor.titan.config",
    ("experimental", "custom_import"): "amsp_dtensor.titan",
}
# 0.2.2 keys 0.3 removed or moved, with what to do instead (the rest: "no such key")
REMOVED = {
    ("model", "tokenizer_path"): "0.3 reads the tokenizer from model.hf_assets_path",
    ("model", "converters"): "0.3 sets converters in its config registry (ModelSpec); "
                             "the AMSP entries train without them",
    ("model", "print_after_conversion"): "0.3 has no model conversion step in its config",
    ("optimizer", "early_step_in_backward"): "0.3 removed it (and AMSP steps after the "
                                              "gradient sync)",
    ("parallelism", "disable_loss_parallel"): "0.3's tensor-parallel plan decides loss "
                                              "parallelism itself",
    ("parallelism", "enable_async_tensor_parallel"): "0.3 moved it to "
                                                     "compile.enable_async_tensor_parallel",
    ("parallelism", "pipeline_parallel_split_points"): "0.3 has module_fqns_per_model_part",
    ("training", "mixed_precision_param_dtype"): "use training.mixed_precision_param",
    ("activation_checkpoint", "per_op_sac_force_recompute_mm_shapes_by_fqns"):
        "0.3's SelectiveAC has force_recompute_mm_shapes_by_fqns",
    ("job", "use_for_integration_test"): "0.3 has no such switch",
    ("validation", "dataset"): "0.3's validator takes its own dataloader config",
    ("validation", "dataset_path"): "0.3's validator takes its own dataloader config",
    ("metrics", "enable_wandb_logging"): "use metrics.enable_wandb",
    ("experimental", "custom_args_module"): "0.3 extends its config by subclassing "
                                            "Trainer.Config",
}
SAME_NAME_SECTIONS = {  # TOML section -> attribute of Trainer.Config holding those keys
    "metrics": "metrics", "lr_scheduler": "lr_scheduler", "parallelism": "parallelism",
    "compile": "compile", "checkpoint": "checkpoint", "debug": "debug", "comm": "comm",
    "training": "training",
}
MODELS = {"llama3": "torchtitan.models.llama3", "qwen3": "torchtitan.models.qwen3",
          "deepseek_v3": "torchtitan.models.deepseek_v3"}
OPTIMIZER_DEFAULTS = {"name": "AdamW", "lr": 8e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                      "weight_decay": 0.1, "implementation": "fused"}  # 0.2.2's defaults


class UsageError(AmspConfigError):
    """A command-line or file problem, one line."""


# ---- reading: the file, then the command line over it --------------------------------
def _value(text: str) -> Any:
    """A command-line value as TOML reads it (``4`` int, ``true`` bool, ``"x"`` or x str)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def read(argv: list[str]) -> tuple[dict, Path | None]:
    """({section: {key: value}}, the TOML path) from ``argv``: the file first, then each
    ``--section.key [value]`` over it (a flag without a value is true, ``--section.no-key``
    false)."""
    path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise UsageError(f"{arg}: expected --section.key [value] (e.g. --training.steps 4)")
        flag, eq, text = arg[2:].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            text, eq = argv[i + 1], "="
            i += 1
        i += 1
        if f"--{flag}" in CONFIG_FILE_FLAGS:
            path = Path(text)
            continue
        section, _, key = flag.partition(".")
        section, key = section.replace("-", "_"), key.replace("-", "_")
        if eq:
            overrides.append((section, key, _value(text)))
        elif key.startswith("no_"):
            overrides.append((section, key[3:], False))
        else:
            overrides.append((section, key, True))
    values: dict = {}
    if path is not None:
        try:
            values = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise UsageError(f"job.config_file: no such file: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"job.config_file: not valid TOML: {e}") from None
    for section, key, value in overrides:
        values.setdefault(section, {})[key] = value
    for section, table in values.items():
        if not isinstance(table, dict):
            raise UsageError(f"{section}={table!r}: [{section}] must be a TOML table")
    return values, path


# ---- mapping ------------------------------------------------------------------------------
def _type_ok(current: Any, value: Any) -> bool:
    if current is None:
        return True
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(current, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(current, str):
        return isinstance(value, str)
    if isinstance(current, (list, tuple)):
        return isinstance(value, (list, tuple))
    return True


def _set(obj, section: str, key: str, value: Any) -> None:
    names = {f.name for f in dataclasses.fields(obj) if f.init}
    if key not in names:
        _unknown(section, key)
    current = getattr(obj, key)
    if isinstance(current, list) and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]  # 0.2.2's "a,b" lists
    if not _type_ok(current, value):
        raise AmspConfigError(
            f"{section}.{key}={value!r}: must be {type(current).__name__} like 0.3's default "
            f"{current!r}")
    setattr(obj, key, list(value) if isinstance(current, list) else value)


def _unknown(section: str, key: str):
    why = REMOVED.get((section, key))
    if why is not None:
        raise AmspConfigError(f"{section}.{key}: torchtitan 0.3 has no such key ({why}); "
                              "remove it from the job file")
    raise AmspConfigError(f"{section}.{key}: unknown key for torchtitan 0.3's config; "
                          "remove it (docs/torchtitan.md lists what maps to what)")


def _model(values: dict):
    """(ModelSpec, whether AMSP trains it) from [model] name and flavor."""
    import importlib

    from .parallelize import amsp_model_spec

    model = values.get("model", {})
    for key in model:
        if key not in ("name", "flavor", "hf_assets_path"):
            _unknown("model", key)
    name = model.get("name", "llama3")
    base = name[: -len("_amsp")] if name.endswith("_amsp") else name
    if base not in MODELS:
        raise AmspConfigError(
            f"model.name={name!r}: on torchtitan 0.3 the TOML path knows "
            f"{', '.join(sorted(MODELS))} (and their _amsp variants); for other models use "
            "a config registry entry (python -m torchtitan.train --module ... --config ...)")
    flavor = model.get("flavor", "debugmodel")
    registry = importlib.import_module(MODELS[base]).model_registry
    try:
        spec = registry(flavor)
    except KeyError:
        raise AmspConfigError(f"model.flavor={flavor!r}: {base} has no such flavor") from None
    amsp = name.endswith("_amsp")
    return (amsp_model_spec(spec) if amsp else spec), amsp


def _optimizer(values: dict):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    opt = dict(OPTIMIZER_DEFAULTS)
    for key, value in values.get("optimizer", {}).items():
        if key not in OPTIMIZER_DEFAULTS:
            if key == "early_step_in_backward" and value is False:
                continue  # 0.2.2's default: nothing to honour
            _unknown("optimizer", key)
        if not _type_ok(OPTIMIZER_DEFAULTS[key], value):
            raise AmspConfigError(f"optimizer.{key}={value!r}: must be "
                                  f"{type(OPTIMIZER_DEFAULTS[key]).__name__}")
        opt[key] = value
    kwargs = {"lr": opt["lr"], "betas": (opt["beta1"], opt["beta2"]), "eps": opt["eps"],
              "weight_decay": opt["weight_decay"]}
    return OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=opt["name"],
                                       optimizer_kwargs=kwargs)],
        implementation=opt["implementation"])


def _activation_checkpoint(values: dict):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    ac = dict(values.get("activation_checkpoint", {}))
    mode = ac.pop("mode", "selective")
    option = ac.pop("selective_ac_option", "op")
    if mode == "none":
        config = None
    elif mode == "full":
        config = FullAC.Config()
    elif mode == "selective":
        if option != "op":
            raise AmspConfigError(
                f"activation_checkpoint.selective_ac_option={option!r}: torchtitan 0.3's "
                "SelectiveAC is op-level only; use \"op\" or mode = \"full\"")
        config = SelectiveAC.Config()
    else:
        raise AmspConfigError(f"activation_checkpoint.mode={mode!r}: use none, full or "
                              "selective")
    for key, value in ac.items():
        if config is None:
            _unknown("activation_checkpoint", key)
        _set(config, "activation_checkpoint", key, value)
    return config


def build(values: dict, path: Path | None = None):
    """The AmspTrainer.Config of a TOML job (``values`` as ``read`` returns them)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from .config_registry import amsp_config, baseline_config
    from .trainer import AmspTrainer

    handled = {"job", "experimental", "model", "optimizer", "activation_checkpoint", "amsp",
               "validation", *SAME_NAME_SECTIONS}
    for section in values:
        if section not in handled:
            raise AmspConfigError(f"{section}: unknown section for torchtitan 0.3's config "
                                  "(docs/torchtitan.md lists what maps to what)")
    for (section, key), wanted in PLUGIN_VALUES.items():
        given = values.get(section, {}).get(key, wanted)
        if given != wanted:
            raise AmspConfigError(
                f"{section}.{key}={given!r}: torchtitan 0.3 has no plug-in modules; the AMSP "
                f"config is built in (only {wanted!r} is accepted, for 0.2.2 job files)")
    for key in values.get("experimental", {}):
        if key != "custom_import":
            _unknown("experimental", key)
    for key, value in values.get("validation", {}).items():
        if not (key == "enable" and value is False):
            raise AmspConfigError(
                f"validation.{key}: the TOML path on torchtitan 0.3 runs without validation "
                "(0.3's validator takes its own dataloader config); remove [validation] or "
                "set enable = false")

    spec, amsp = _model(values)
    base = AmspTrainer.Config(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        optimizer=_optimizer(values),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
    )
    config = (amsp_config if amsp else baseline_config)(base)
    config.model_spec = spec
    config.activation_checkpoint = _activation_checkpoint(values)
    model = values.get("model", {})
    if "hf_assets_path" in model:
        _set(config, "model", "hf_assets_path", model["hf_assets_path"])
    for key, value in values.get("job", {}).items():
        if key == "dump_folder":
            _set(config, "job", "dump_folder", value)
        elif key == "print_config":
            _set(config.debug, "job", "print_config", value)
        elif key not in ("description", "custom_config_module", "config_file"):
            _unknown("job", key)
    for section, attr in SAME_NAME_SECTIONS.items():
        for key, value in values.get(section, {}).items():
            if section == "training" and key in ("dataset", "dataset_path"):
                _set(config.dataloader, section, key, value)
                continue
            _set(getattr(config, attr), section, key, value)
    amsp_values = values.get("amsp", {})
    for key, value in amsp_values.items():
        if key not in AMSP_KEYS:
            raise unknown_amsp_key(key)
        setattr(config.amsp, key, value)
    return config


__all__ = ["UsageError", "build", "read"]
