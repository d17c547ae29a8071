"""Checks of the ``[amsp]`` section before any process group or model exists.

Every problem becomes one AmspConfigError whose text starts with the offending key and its
value ("amsp.optim_shard=3: ...") and says what to change; amsp_dtensor.train prints it
as one line and exits non-zero. The paper's rules themselves live in amsp_dtensor.plan.
"""

from __future__ import annotations

import os
from typing import Any

from amsp_dtensor.plan.sharding_plan import STRATEGY_NAMES, ResolvedPlan, ShardingPlan, valid_factors
from amsp_dtensor.plan.sharding_plan import _resolve_factor
from amsp_dtensor.plan.compression import CODECS, Compression

from .config import KNOWN_KEYS, Amsp, AmspConfigError

FACTOR_KEYS = ("param_shard", "grad_shard", "optim_shard")


def check_toml_keys(toml_values: dict[str, Any] | None) -> None:
    """Unknown keys in the TOML's [amsp] table (torchtitan would raise a long ValueError)."""
    section = (toml_values or {}).get("amsp")
    if section is None:
        return
    if not isinstance(section, dict):
        raise AmspConfigError(f"amsp={section!r}: [amsp] must be a TOML table")
    for key in section:
        if key not in KNOWN_KEYS:
            raise AmspConfigError(
                f"amsp.{key}: unknown key in [amsp]; known keys: {', '.join(KNOWN_KEYS)}"
            )


def world_from_env() -> tuple[int, int]:
    """(world size, ranks per node) as torchrun exports them; (1, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return world, local


def _factor_value(key: str, value: Any, world: int, rpn: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise AmspConfigError(
            f"amsp.{key}={value!r}: must be an int factor or one of {', '.join(STRATEGY_NAMES)}"
        )
    if isinstance(value, str) and not value.strip().isdigit() and (
        value.strip().lower() not in STRATEGY_NAMES
    ):
        raise AmspConfigError(
            f"amsp.{key}={value!r}: not a strategy; use an int factor or one of "
            f"{', '.join(STRATEGY_NAMES)}"
        )
    try:  # names -> ints and positivity, by the plan module's own parser
        s = _resolve_factor(key, value, world, rpn)
    except ValueError as e:
        raise AmspConfigError(f"amsp.{key}={value!r}: {e}") from None
    ok = valid_factors(world, rpn)
    if s not in ok:
        why = (
            f"does not divide the world size {world}"
            if world % s
            else f"spans nodes without filling them ({rpn} ranks per node)"
        )
        raise AmspConfigError(
            f"amsp.{key}={value!r}: {why}; valid factors on {world} ranks ({rpn} per node): "
            f"{', '.join(map(str, ok))}"
        )
    return s


def _chain_key(s_p: int, s_g: int, s_os: int) -> str:
    """Which key to blame when the factors break the chain rules."""
    if s_g < s_p or s_g % s_p:
        return "grad_shard"
    if s_os < s_g or s_os % s_g:
        return "optim_shard"
    return "grad_shard"  # s_g strictly between s_p and s_os


def resolve_explicit(cfg: Amsp, world: int, ranks_per_node: int) -> ResolvedPlan:
    s = {k: _factor_value(k, getattr(cfg, k), world, ranks_per_node) for k in FACTOR_KEYS}
    s_p, s_g, s_os = s["param_shard"], s["grad_shard"], s["optim_shard"]
    try:
        return ShardingPlan(s_p, s_g, s_os).resolve(world, ranks_per_node)
    except ValueError as e:
        key = _chain_key(s_p, s_g, s_os)
        detail = str(e).split("): ", 1)[-1]  # drop the plan module's own preamble
        raise AmspConfigError(
            f"amsp.{key}={getattr(cfg, key)!r}: plan param={s_p}, grad={s_g}, optim={s_os} "
            f"breaks {detail}"
        ) from None


def check_reshard_after_forward(cfg: Amsp, plan: ResolvedPlan) -> None:
    r = cfg.reshard_after_forward
    if isinstance(r, bool):
        return
    if not isinstance(r, int) or r < 1 or plan.s_p % r or r >= plan.s_p:
        raise AmspConfigError(
            f"amsp.reshard_after_forward={r!r}: use true, false, or an int that divides "
            f"param_shard={plan.s_p} and is smaller than it (reshard to that many ranks)"
        )


# torchtitan's other parallelisms, which AMSP does not compose with (yet): key -> name
UNSUPPORTED_PARALLELISM = {
    "context_parallel_degree": "context parallelism",
    "pipeline_parallel_degree": "pipeline parallelism",
    "expert_parallel_degree": "expert parallelism",
}


def tensor_parallel_degree(job_config, ranks_per_node: int) -> int:
    """[parallelism] checked for AMSP: CP, PP and EP refused; the TP degree returned once
    it divides the ranks per node (TP groups inside a node) and the sequence length (as
    torchtitan's sequence parallelism needs)."""
    parallelism = job_config.parallelism
    for key, name in UNSUPPORTED_PARALLELISM.items():
        degree = getattr(parallelism, key)
        if degree != 1:
            raise AmspConfigError(
                f"parallelism.{key}={degree}: AMSP composes with data and tensor parallelism "
                f"only; set it to 1 ({name} with AMSP is not implemented)"
            )
    tp = parallelism.tensor_parallel_degree
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise AmspConfigError(f"parallelism.tensor_parallel_degree={tp!r}: must be a positive int")
    if ranks_per_node % tp:
        raise AmspConfigError(
            f"parallelism.tensor_parallel_degree={tp}: does not divide the {ranks_per_node} "
            "ranks per node; tensor-parallel groups must lie inside a node (use a divisor "
            "of the ranks per node)"
        )
    seq_len = job_config.training.seq_len
    if seq_len % tp:
        raise AmspConfigError(
            f"parallelism.tensor_parallel_degree={tp}: training.seq_len={seq_len} is not a "
            "multiple of it (sequence parallelism splits the sequence over the tp ranks)"
        )
    return tp


def resolve_plan(job_config, world: int | None = None, ranks_per_node: int | None = None):
    """Validate job_config.amsp (and [parallelism]) for this world; return the ResolvedPlan
    to run, over the data-parallel world (world / tp ranks, ranks_per_node / tp per node).

    plan = "auto" asks amsp_dtensor's planner (see planner_bridge). Raises AmspConfigError.
    """
    cfg: Amsp = job_config.amsp
    env_world, env_local = world_from_env()
    world = env_world if world is None else world
    if ranks_per_node is None:
        ranks_per_node = cfg.ranks_per_node or env_local
    if isinstance(cfg.ranks_per_node, bool) or not isinstance(cfg.ranks_per_node, int) or (
        cfg.ranks_per_node < 0
    ):
        raise AmspConfigError(
            f"amsp.ranks_per_node={cfg.ranks_per_node!r}: must be 0 (= LOCAL_WORLD_SIZE) or a "
            "positive int"
        )
    if ranks_per_node < 1 or world % ranks_per_node:
        raise AmspConfigError(
            f"amsp.ranks_per_node={ranks_per_node}: the world size {world} is not a multiple "
            "of it; every (simulated) node must hold the same number of ranks"
        )
    if cfg.plan not in ("", "auto"):
        raise AmspConfigError(
            f"amsp.plan={cfg.plan!r}: use \"auto\" (planner chooses) or \"\" (use "
            "param_shard/grad_shard/optim_shard)"
        )
    tp = tensor_parallel_degree(job_config, ranks_per_node)
    if cfg.plan == "auto":
        from .planner_bridge import plan_auto

        plan = plan_auto(job_config, world, ranks_per_node)
    else:
        try:
            plan = resolve_explicit(cfg, world // tp, ranks_per_node // tp)
        except AmspConfigError as e:
            if tp == 1:
                raise
            raise AmspConfigError(
                f"{e} (under parallelism.tensor_parallel_degree={tp} the factors are those of "
                f"the data-parallel world: {world} / {tp} ranks)") from None
    check_reshard_after_forward(cfg, plan)
    compression_of(cfg)
    return plan


def compression_of(cfg: Amsp) -> Compression:
    """amsp.compress_grads / amsp.compress_weights as amsp.set_compression's setting."""
    values = {}
    for key in ("grads", "weights"):
        value = getattr(cfg, f"compress_{key}")
        if not isinstance(value, str) or (value and value not in CODECS):
            raise AmspConfigError(
                f"amsp.compress_{key}={value!r}: use one of {', '.join(CODECS)}, or \"\" to "
                f"send {key} exactly")
        values[key] = value or None
    return Compression(**values, error_feedback=bool(cfg.compress_error_feedback))
