"""A torchtitan 0.3 ``Trainer.Config`` as the shared checks read a job.

The plan is resolved, and [amsp] / [parallelism] validated, by ``titan.validate`` (one
code for both torchtitans). It reads a job as 0.2.2's JobConfig spelled it:
``amsp``, ``parallelism``, ``training``, ``optimizer.name``, ``model.name/flavor``,
``activation_checkpoint.mode``, ``debug.seed``, ``checkpoint``. ``job_view`` presents a 0.3
config that way: the sections 0.3 kept are 0.3's own objects; what 0.3 moved (the
optimizer's name into param groups, the AC mode into a config class, the model into a
ModelSpec) is read out here, the one place that knows both spellings. Settings the AMSP
trainer cannot honour on 0.3 are refused here as one AmspConfigError line.
"""

from __future__ import annotations

import types

from ..config import AmspConfigError
from ..validate import OPTIMIZER_NAMES

CATCH_ALL = (".*", r".*", "")


def optimizer_of(optimizer_config) -> tuple[str, dict, str, list | None]:
    """(optimizer name, its kwargs, implementation, param groups) of a 0.3
    OptimizersContainer.Config. One group matching every parameter (default_adamw's) is
    (its name, its kwargs, ..., None). Several are [(pattern, the group's kwargs)], matched
    as torchtitan matches them (first pattern wins), with the kwargs each group names and
    no shared ones; their optimizer is the one they all name, or, where Adam and AdamW
    mix, Adam with each group's ``decoupled_weight_decay`` (torch's AdamW is Adam with
    ``decoupled_weight_decay=True``: the same update, element for element)."""
    groups = list(optimizer_config.param_groups)
    if not groups:
        raise AmspConfigError("optimizer.param_groups is empty: give at least one group "
                              "(default_adamw's matches every parameter)")
    for group in groups:
        if group.optimizer_name not in OPTIMIZER_NAMES:
            raise AmspConfigError(
                f"optimizer.name={group.optimizer_name!r}"
                + ("" if len(groups) == 1 else f" (param group {group.pattern!r})")
                + f": AMSP supports {', '.join(OPTIMIZER_NAMES)}")
        if "decoupled_weight_decay" in group.optimizer_kwargs:
            raise AmspConfigError(
                f"optimizer param group {group.pattern!r} sets decoupled_weight_decay: name "
                "the optimizer instead (AdamW decouples the weight decay, Adam does not)")
    if optimizer_config.implementation not in ("for-loop", "foreach", "fused"):
        raise AmspConfigError(
            f"optimizer.implementation={optimizer_config.implementation!r}: AMSP keeps fp32 "
            "optimizer states; use for-loop, foreach or fused")
    if optimizer_config.optimizer_factory_kwargs_by_name:
        raise AmspConfigError(
            "optimizer.optimizer_factory_kwargs_by_name: AMSP builds torch.optim's Adam/AdamW "
            "itself and takes no factory arguments; leave it empty")
    if len(groups) == 1 and groups[0].pattern in CATCH_ALL:
        return (groups[0].optimizer_name, _kwargs(groups[0]),
                optimizer_config.implementation, None)
    names = {g.optimizer_name for g in groups}
    if len(names) == 1:
        return names.pop(), {}, optimizer_config.implementation, [
            (g.pattern, _kwargs(g)) for g in groups]
    return "Adam", {}, optimizer_config.implementation, [
        (g.pattern, dict(_kwargs(g), decoupled_weight_decay=g.optimizer_name == "AdamW"))
        for g in groups]


def _kwargs(group) -> dict:
    """A ParamGroupConfig's optimizer kwargs as torch takes them (betas a tuple: a config
    read from the command line gives a list)."""
    kwargs = dict(group.optimizer_kwargs)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def ac_mode(ac_config) -> str:
    """0.2.2's activation_checkpoint.mode of a 0.3 AC config (None = no AC)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if ac_config is None:
        return "none"
    if isinstance(ac_config, FullAC.Config):
        return "full"
    if isinstance(ac_config, SelectiveAC.Config):
        return "selective"
    raise AmspConfigError(
        f"activation_checkpoint={type(ac_config).__qualname__}: AMSP runs torchtitan's "
        "FullAC and SelectiveAC (or none); memory-budget AC needs the whole model compiled")


def model_name(config) -> str:
    spec = config.model_spec
    return spec.name if spec is not None else ""


def planner_model(config):
    """The model's shapes for the planner (plan = "auto"), read off 0.3's model config
    built on the meta device."""
    import torch

    from ...plan.cost.models import ModelShape

    model_config = config.model_spec.model
    with torch.device("meta"):
        model = model_config.build()
    from torchtitan.models.common.moe import MoE

    moe = [found[1] for found in model_config.traverse(MoE.Config)]
    if moe:  # torchtitan 0.3's MoE models: read off the parameters, checked there
        return _moe_planner_model(config, model_config, model, moe[0].router.top_k)
    attention = [getattr(layer, "attention", None) for layer in model_config.layers]
    attention = [a for a in attention if a is not None and hasattr(a, "n_heads")]
    n_heads = attention[0].n_heads if attention else None
    qkv = getattr(attention[0], "qkv_linear", None) if attention else None
    n_kv = (getattr(attention[0], "n_kv_heads", None) if attention else None) or getattr(
        qkv, "n_kv_heads", None)
    w1 = next((p for n, p in model.named_parameters() if n.endswith("feed_forward.w1.weight")),
              None)
    if n_heads is None or w1 is None:
        raise AmspConfigError(
            f"amsp.plan='auto': the planner models llama-style decoders and "
            f"{model_name(config)} {config.model_spec.flavor} is not one; set param_shard, "
            "grad_shard and optim_shard")
    return ModelShape(name=f"{model_name(config)}_{config.model_spec.flavor}",
                      dim=model_config.dim, n_layers=len(model.layers), n_heads=n_heads,
                      vocab_size=model_config.vocab_size, ffn_hidden=w1.shape[0],
                      n_kv_heads=n_kv)


def _moe_planner_model(config, model_config, model, top_k: int):
    from ...plan.cost.models import from_named_shapes

    layers = list(model.layers.values() if hasattr(model.layers, "values") else model.layers)
    blocks = [{n: tuple(p.shape) for n, p in layer.named_parameters()} for layer in layers]
    in_blocks = {id(p) for layer in layers for p in layer.parameters()}
    root = {n: tuple(p.shape) for n, p in model.named_parameters() if id(p) not in in_blocks}
    attention = next(layer.attention for layer in model_config.layers)
    name = f"{model_name(config)}_{config.model_spec.flavor}"
    try:
        return from_named_shapes(name, dim=model_config.dim, n_heads=attention.n_heads,
                                 top_k=top_k, blocks=blocks, root=root)
    except ValueError as e:
        raise AmspConfigError(f"amsp.plan='auto': {e}; set param_shard, grad_shard, "
                              "optim_shard and the expert_* factors") from None


class _Parallelism:
    """0.3's ParallelismConfig plus what 0.2.2 had and the checks read."""

    def __init__(self, parallelism):
        self._p = parallelism
        # 0.3 has no loss-parallel switch: its TP plan decides (the planner's input only)
        self.disable_loss_parallel = True

    def __getattr__(self, name):
        return getattr(self._p, name)


def job_view(config) -> types.SimpleNamespace:
    """``config`` (an AmspTrainer.Config) as ``titan.validate`` reads a job."""
    name, kwargs, implementation, _ = optimizer_of(config.optimizer)
    spec = config.model_spec
    view = types.SimpleNamespace(
        amsp=config.amsp,
        parallelism=_Parallelism(config.parallelism),
        training=config.training,
        optimizer=types.SimpleNamespace(name=name, early_step_in_backward=False,
                                        implementation=implementation, **kwargs),
        model=types.SimpleNamespace(name=model_name(config),
                                    flavor=spec.flavor if spec is not None else ""),
        activation_checkpoint=types.SimpleNamespace(mode=ac_mode(config.activation_checkpoint)),
        job=types.SimpleNamespace(dump_folder=config.dump_folder),
        debug=config.debug,
        checkpoint=config.checkpoint,
        compile=config.compile,
    )
    view.planner_model_args = lambda: planner_model(config)
    view.pipeline_stage_modules = lambda pp: pipeline_stage_modules(config, pp)
    return view


def pipeline_stage_modules(config, pp: int) -> list[list[str]]:
    """The module names of every pipeline stage, as torchtitan 0.3's pipeline_llm cuts
    them (its own two functions, on the model config), or the config's
    module_fqns_per_model_part. Where pipeline_llm would raise after start-up, one
    AmspConfigError line now."""
    from ...compat import titan03_pipeline_split

    parallelism = config.parallelism
    if parallelism.module_fqns_per_model_part is not None:
        return parallelism.module_fqns_per_model_part  # the user's own split: torchtitan checks it
    try:
        return titan03_pipeline_split(types.SimpleNamespace(pp=pp), parallelism,
                                      config.model_spec.model)
    except ValueError as e:
        raise AmspConfigError(f"parallelism.pipeline_parallel_degree={pp}: "
                              f"{str(e).splitlines()[0]}") from None
