"""AMSP variants of torchtitan TrainSpecs: ``<name>_amsp`` for any registered ``<name>``.

A torchtitan job picks its model *and* its parallelism through ``[model] name``: the
TrainSpec registered under that name carries the parallelize_fn. The AMSP variant of a
spec is the same spec (model, flavors, tokenizer, dataset, loss, LR schedulers,
validator, state-dict adapter) with AMSP's parallelize_fn, optimizer container and
metrics processor, torchtitan's text data loader made resumable on another world size
(``dataloader``), and the spec's own pipelining_fn (pipeline_llm), whose stages, each
parallelized by AMSP's parallelize_fn, are handed to the engine (``amsp.pipeline_stage``).
So

    --model.name qwen3       torchtitan's own FSDP2 (the baseline; [amsp] is not read)
    --model.name qwen3_amsp  the same model trained under the [amsp] plan

Importing ``amsp_dtensor.titan`` registers the variants of torchtitan's dense LLMs
(``EAGER_BASES``: llama3, qwen3); ``amsp_dtensor.train`` registers any other
``<name>_amsp`` on demand (a torchtitan model or experiment, or a spec your
``[experimental] custom_import`` registered). With ``python -m torchtitan.train``, call
``register_amsp_variant("<name>")`` from your own custom_import module.

An expert setting the MoE flavor cannot take (expert parallelism or ``[amsp] expert_*``
factors that do not fit it, or on a dense flavor) and loss parallel with a loss other than
cross-entropy are refused before any process group exists (``check_model``): one line.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util

import torch
import torch.nn as nn

from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.protocols import train_spec as _train_spec

from ..compat import titan_builtin_models, titan_extra_train_specs
from .config import AmspConfigError
from .dataloader import reshardable_dataloader_fn
from .metrics import build_amsp_metrics_processor
from .optimizer import build_amsp_optimizers
from .parallelize import _blocks, amsp_parallelize_fn, is_amsp_parallelize_fn, tp_apply_fn
from .units import amsp_pipelining_fn
from .validate import check_model_experts

SUFFIX = "_amsp"
EAGER_BASES = ("llama3", "qwen3")  # torchtitan's dense decoder LLMs (0.2.2)


def amsp_name(base_name: str) -> str:
    return base_name + SUFFIX


def base_name_of(name: str) -> str | None:
    """``"qwen3"`` for ``"qwen3_amsp"``; None for a name without the suffix."""
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) and len(name) > len(SUFFIX) else None


def amsp_variant(base_spec, base_name: str | None = None):
    """``base_spec`` with AMSP's parallelize_fn, optimizers and metrics, its pipelining_fn
    handing each stage to the engine, and torchtitan's text data loader replaced by one
    that resumes on another dp world size."""
    if is_amsp_parallelize_fn(base_spec.parallelize_fn):
        return base_spec
    return dataclasses.replace(
        base_spec,
        parallelize_fn=amsp_parallelize_fn(base_spec.parallelize_fn, base_name),
        pipelining_fn=amsp_pipelining_fn(base_spec.pipelining_fn),
        build_optimizers_fn=_amsp_optimizers_like(base_spec.build_optimizers_fn),
        build_metrics_processor_fn=build_amsp_metrics_processor,
        build_dataloader_fn=reshardable_dataloader_fn(base_spec.build_dataloader_fn),
    )


def _amsp_optimizers_like(base_fn):
    """The AMSP optimizers builder for a TrainSpec whose own is ``base_fn``: with
    torchtitan's MoE load balancing exactly where the base has it."""
    if base_fn is build_optimizers_with_moe_load_balancing:
        return functools.partial(build_amsp_optimizers, balance_load=True)
    return build_amsp_optimizers


def register_amsp_variant(base_name: str) -> str:
    """Register ``<base_name>_amsp`` (idempotent); returns its name.

    Raises AmspConfigError if torchtitan knows no TrainSpec ``base_name``.
    """
    name = amsp_name(base_name)
    if name in titan_extra_train_specs():
        return name
    try:
        base = _train_spec.get_train_spec(base_name)
    except (ValueError, ImportError) as e:
        raise AmspConfigError(
            f"model.name={name!r}: no TrainSpec {base_name!r} to build it from ({e}); "
            f"torchtitan's models: {', '.join(sorted(titan_builtin_models()))}"
        ) from None
    _train_spec.register_train_spec(name, amsp_variant(base, base_name))
    return name


def ensure_registered(name: str) -> bool:
    """Register ``name`` if it is ``<base>_amsp`` and missing. True if it is an AMSP spec."""
    if name not in titan_extra_train_specs() and base_name_of(name) is not None:
        register_amsp_variant(base_name_of(name))
    return uses_amsp(name)


def uses_amsp(model_name: str) -> bool:
    """True if the named TrainSpec parallelizes with AMSP."""
    try:
        spec = _train_spec.get_train_spec(model_name)
    except (ValueError, ImportError):
        return False
    return is_amsp_parallelize_fn(spec.parallelize_fn)


def register_eager_variants() -> None:
    for base in EAGER_BASES:
        register_amsp_variant(base)


# ---- model checks before any process group exists ------------------------------------
def _moe_modules(model: nn.Module) -> list[nn.Module]:
    from torchtitan.models.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def check_loss_parallel(job_config, spec) -> None:
    """Under TP with loss parallel (torchtitan's default), the output projection returns
    vocabulary-sharded logits and torchtitan computes the loss and its backward inside
    ``torch.distributed.tensor.parallel.loss_parallel()``, which implements cross-entropy
    only. Any other loss meets the sharded logits as a DTensor: beside plain label tensors
    it fails on every rank with DTensor's "got mixed torch.Tensor and DTensor" (a frame
    the engine never sees), and one written for DTensor would still see one vocabulary
    shard per rank. So it is refused here, once, before start-up."""
    from torchtitan.components.loss import build_cross_entropy_loss

    parallelism = job_config.parallelism
    tp = parallelism.tensor_parallel_degree
    if tp == 1 or parallelism.disable_loss_parallel or spec.build_loss_fn is build_cross_entropy_loss:
        return
    loss = getattr(spec.build_loss_fn, "__qualname__", repr(spec.build_loss_fn))
    raise AmspConfigError(
        f"parallelism.disable_loss_parallel=false with tensor_parallel_degree={tp}: loss "
        f"parallel computes cross-entropy only, and {job_config.model.name}'s loss is built by "
        f"{loss}; set parallelism.disable_loss_parallel = true (the output projection then "
        "returns full logits to that loss)"
    )


# torchtitan's converters that are torchao's float8 / MX training (quantize.linear.mx etc.)
_TORCHAO_CONVERTERS = ("quantize.linear.float8", "quantize.grouped_mm.float8",
                       "quantize.linear.mx", "quantize.grouped_mm.mx")


def check_converters(job_config) -> None:
    """A float8 / MX converter without torchao installed: torchtitan would raise its
    ImportError on every rank after the process group started; one line instead."""
    wanted = [c for c in job_config.model.converters if c in _TORCHAO_CONVERTERS]
    if wanted and importlib.util.find_spec("torchao") is None:
        raise AmspConfigError(
            f"model.converters={job_config.model.converters!r}: {wanted[0]} is torchao's "
            "training recipe and torchao is not installed; pip install amsp_dtensor[float8] "
            "(or pip install torchao)"
        )


def check_model(job_config) -> None:
    """Refuse what AMSP cannot train, as one AmspConfigError line: a model without its
    blocks in ``model.layers``, tensor parallelism on a recipe without ``apply_tp``, loss
    parallel with a loss that is not cross-entropy (``check_loss_parallel``), expert
    parallelism or [amsp] expert factors on a model without MoE layers, and an EP degree
    that does not divide the experts.

    Builds the flavor on the meta device, as torchtitan's Trainer does, and looks for
    torchtitan MoE layers.
    """

    check_converters(job_config)
    name, flavor = job_config.model.name, job_config.model.flavor
    spec = _train_spec.get_train_spec(name)
    tp = job_config.parallelism.tensor_parallel_degree
    base_module = getattr(spec.parallelize_fn, "amsp_base_module", None)
    if tp > 1 and base_module is not None:
        tp_apply_fn(base_module, tp)  # a recipe without apply_tp
    check_loss_parallel(job_config, spec)
    pp = job_config.parallelism.pipeline_parallel_degree
    if pp > 1 and spec.pipelining_fn is None:  # torchtitan says so only after start-up
        raise AmspConfigError(
            f"parallelism.pipeline_parallel_degree={pp}: {name} has no pipelining_fn in "
            "torchtitan (its TrainSpec cannot be cut into stages); set it to 1")
    if flavor not in spec.model_args:
        return  # torchtitan's own KeyError names the flavors
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    moe = _moe_modules(model)
    _blocks(model)  # one unit per transformer block, found in model.layers
    check_model_experts(job_config, f"{name} {flavor}",
                        [getattr(getattr(m, "experts", None), "num_experts", None)
                         for m in moe])
