"""Checks of the ``[amsp]`` section before any process group or model exists.

Every problem becomes one AmspConfigError whose text starts with the offending key and its
value ("amsp.optim_shard=3: ...") and says what to change; amsp_dtensor.train prints it
as one line and exits non-zero. The paper's rules themselves live in amsp_dtensor.plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from amsp_dtensor.plan.sharding_plan import (STRATEGY_NAMES, ResolvedPlan, ShardingPlan,
                                             check_context_parallel, expert_parallel_world,
                                             resolve_factor, tp_outside_node, valid_factors)
from amsp_dtensor.plan.compression import CODECS, Compression

from .config import FROM_DP, KNOWN_KEYS, Amsp, AmspConfigError, unknown_amsp_key
from .planner_bridge import AUTO_EXPERT_PLAN
from .version import is_titan03

FACTOR_KEYS = ("param_shard", "grad_shard", "optim_shard")
EXPERT_KEYS = ("expert_param_shard", "expert_grad_shard", "expert_optim_shard")


def check_toml_keys(toml_values: dict[str, Any] | None) -> None:
    """Unknown keys in the TOML's [amsp] table (torchtitan would raise a long ValueError)."""
    section = (toml_values or {}).get("amsp")
    if section is None:
        return
    if not isinstance(section, dict):
        raise AmspConfigError(f"amsp={section!r}: [amsp] must be a TOML table")
    for key in section:
        if key not in KNOWN_KEYS:
            raise unknown_amsp_key(key)


def check_amsp_flags(argv: list[str]) -> None:
    """Unknown ``--amsp.<key>`` flags on the command line (tyro would print a box of help
    instead of one line). tyro spells a key with ``_`` or ``-``, a false bool as ``no-``."""
    for arg in argv:
        if not arg.startswith("--amsp."):
            continue
        flag = arg.split("=", 1)[0][len("--amsp."):]
        key = flag.replace("-", "_")
        if key not in KNOWN_KEYS and not (key.startswith("no_") and key[3:] in KNOWN_KEYS):
            raise unknown_amsp_key(flag)


def world_from_env() -> tuple[int, int]:
    """(world size, ranks per node) as torchrun exports them; (1, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return world, local


def _factor_value(key: str, value: Any, world: int, rpn: int,
                  world_name: str = "the world size") -> int:
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
        s = resolve_factor(key, value, world, rpn)
    except ValueError as e:
        raise AmspConfigError(f"amsp.{key}={value!r}: {e}") from None
    ok = valid_factors(world, rpn)
    if s not in ok:
        why = (
            f"does not divide {world_name} {world}"
            if world % s
            else f"spans nodes without filling them ({rpn} ranks per node)"
        )
        raise AmspConfigError(
            f"amsp.{key}={value!r}: {why}; valid factors on {world} ranks ({rpn} per node): "
            f"{', '.join(map(str, ok))}"
        )
    return s


def _chain_key(s_p: int, s_g: int, s_os: int, keys=FACTOR_KEYS) -> str:
    """Which key (of ``keys``: P, G, OS) to blame when the factors break the chain rules."""
    if s_g < s_p or s_g % s_p:
        return keys[1]
    if s_os < s_g or s_os % s_g:
        return keys[2]
    return keys[1]  # s_g strictly between s_p and s_os


def resolve_explicit(cfg: Amsp, world: int, ranks_per_node: int,
                     layout: "DataParallelLayout | None" = None) -> ResolvedPlan:
    """The [amsp] factors on this (data-parallel) world; a factor "dp" takes the shard
    degree of ``layout`` (torchtitan's data-parallel layout; without one, the whole world)."""
    layout = layout or DataParallelLayout(1, world, 1, -1)
    s = {}
    for key in FACTOR_KEYS:
        value = getattr(cfg, key)
        s[key] = layout.shard if _is_from_dp(value) else _factor_value(key, value, world,
                                                                        ranks_per_node)
    s_p, s_g, s_os = s["param_shard"], s["grad_shard"], s["optim_shard"]
    check_layout_agrees(cfg, layout, s_p)
    try:
        return ShardingPlan(s_p, s_g, s_os).resolve(world, ranks_per_node)
    except ValueError as e:
        key = _chain_key(s_p, s_g, s_os)
        detail = str(e).split("): ", 1)[-1]  # drop the plan module's own preamble
        raise AmspConfigError(
            f"amsp.{key}={getattr(cfg, key)!r}: plan param={s_p}, grad={s_g}, optim={s_os} "
            f"breaks {detail}"
        ) from None


def _is_from_dp(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == FROM_DP


# --------------------------------------------------------------------------------------
# torchtitan's data-parallel layout: [parallelism] data_parallel_replicate_degree x
# data_parallel_shard_degree, and fsdp_reshard_after_forward.
# --------------------------------------------------------------------------------------
DP_KEYS = ("data_parallel_replicate_degree", "data_parallel_shard_degree")
DP_DEFAULTS = (1, -1)  # torchtitan's: no replication, shard over the rest


@dataclass(frozen=True)
class DataParallelLayout:
    """torchtitan's data-parallel layout resolved on the data-parallel world (world / tp):
    ``replicate`` copies of the model, each sharded over ``shard`` ranks."""

    replicate: int
    shard: int
    given_replicate: int  # as the config says (shard -1 = "the rest")
    given_shard: int

    @property
    def given(self) -> bool:
        """The flags differ from torchtitan's defaults (1, -1), which leave the layout open."""
        return (self.given_replicate, self.given_shard) != DP_DEFAULTS

    def flags(self) -> str:
        return (f"parallelism.data_parallel_replicate_degree={self.given_replicate}, "
                f"data_parallel_shard_degree={self.given_shard}")

    def describe(self) -> str:
        copies = "1 copy" if self.replicate == 1 else f"{self.replicate} copies"
        return (f"{self.flags()} ({copies} of the parameters, each sharded over {self.shard} "
                f"of the {self.replicate * self.shard} data-parallel ranks)")


def data_parallel_layout(parallelism, dp_world: int, ranks_per_node: int,
                         tp: int = 1, cp: int = 1) -> DataParallelLayout:
    """[parallelism]'s data-parallel degrees resolved as torchtitan's ParallelDims does
    (shard -1 = the data-parallel ranks left after the replicate and context-parallel
    degrees) and checked against AMSP's rules: the shard degree is a factor like any
    [amsp] one (it divides a node or spans whole nodes). ``dp_world`` is the ranks the
    [amsp] factors range over (world / pp / tp, the cp ranks among them); under context
    parallelism torchtitan shards the parameters over data_parallel_shard_degree x cp
    ranks (its "fsdp" mesh, dp_shard_cp), which is the layout's ``shard``."""
    replicate = parallelism.data_parallel_replicate_degree
    shard = parallelism.data_parallel_shard_degree
    world_note = f"world {dp_world * tp} / tensor_parallel_degree {tp}" if tp > 1 else "the world"
    if cp > 1:
        world_note += f" / context_parallel_degree {cp}"
        dp_world //= cp  # the ranks that take their own batches
    for key, value, ok in ((DP_KEYS[0], replicate, lambda v: v >= 1),
                           (DP_KEYS[1], shard, lambda v: v == -1 or v >= 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
            allowed = "a positive int" if key == DP_KEYS[0] else "-1 (the rest) or a positive int"
            raise AmspConfigError(f"parallelism.{key}={value!r}: must be {allowed}")
    resolved = shard if shard != -1 else dp_world // replicate
    if shard == -1 and dp_world % replicate:
        raise AmspConfigError(
            f"parallelism.data_parallel_replicate_degree={replicate}: does not divide the "
            f"{dp_world} data-parallel ranks ({world_note}); use a divisor of {dp_world}")
    if replicate * resolved != dp_world:
        raise AmspConfigError(
            f"parallelism.data_parallel_replicate_degree={replicate}, data_parallel_shard_degree="
            f"{shard}: {replicate} x {resolved} is not the {dp_world} data-parallel ranks "
            f"({world_note}); set data_parallel_shard_degree = -1 (the rest) or make the "
            f"product {dp_world}")
    layout = DataParallelLayout(replicate, resolved * cp, replicate, shard)
    ok = valid_factors(dp_world * cp, ranks_per_node)
    if layout.shard not in ok:
        over = f"{resolved} x context_parallel_degree {cp} = " if cp > 1 else ""
        degrees = [f // cp for f in ok if f % cp == 0]
        raise AmspConfigError(
            f"{layout.flags()}: AMSP shards over {over}{layout.shard} ranks, which spans nodes "
            f"without filling them ({ranks_per_node} data-parallel ranks per node); a shard "
            f"group must divide a node or fill whole nodes: use a data_parallel_shard_degree "
            f"in {', '.join(map(str, degrees))} (data_parallel_replicate_degree = {dp_world} / "
            "it)")
    return layout


def check_layout_agrees(cfg: Amsp, layout: DataParallelLayout, s_p: int) -> None:
    """Explicit [amsp] factors beside explicit [parallelism] data-parallel degrees: the
    degrees fix the parameters' layout (R copies, each sharded over S ranks), so
    param_shard must be S; grads and optimizer states may be sharded further (AMSP's
    point). With torchtitan's default degrees the [amsp] factors decide alone."""
    if not layout.given or s_p == layout.shard or _is_from_dp(cfg.param_shard):
        return
    raise AmspConfigError(
        f"amsp.param_shard={cfg.param_shard!r} contradicts {layout.describe()}: set "
        f"amsp.param_shard = {layout.shard} (or \"{FROM_DP}\", to follow [parallelism]), or "
        "leave data_parallel_replicate_degree and data_parallel_shard_degree at torchtitan's "
        "defaults (1, -1) for the [amsp] factors to decide alone")


RESHARD_POLICIES = ("default", "always", "never")


def _reshard_value(value: Any) -> Any:
    """amsp.reshard_after_forward with the CLI's "true"/"false" read as bools."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def reshard_after_forward_of(job_config, plan: ResolvedPlan | None) -> tuple[bool | int, bool]:
    """(reshard_after_forward of the embeddings and blocks, of [final norm, output head]).

    parallelism.fsdp_reshard_after_forward as torchtitan's apply_fsdp maps it:
    "default" -> (True, False), under pipeline parallelism (False, False) (its "not
    pp_enabled": each stage keeps its units unsharded through the micro-batches),
    "always" -> (True, True), "never" -> (False, False).
    amsp.reshard_after_forward, when set (not "dp"), replaces the blocks' setting under
    "default" (True, False, or an int: hpZ); under "always" / "never" it must agree.
    """
    cfg: Amsp = job_config.amsp
    policy = job_config.parallelism.fsdp_reshard_after_forward
    if policy not in RESHARD_POLICIES:
        raise AmspConfigError(
            f"parallelism.fsdp_reshard_after_forward={policy!r}: use one of "
            f"{', '.join(RESHARD_POLICIES)}")
    ends = policy == "always"
    r = _reshard_value(cfg.reshard_after_forward)
    if _is_from_dp(r):
        if policy == "default":
            return job_config.parallelism.pipeline_parallel_degree <= 1, ends
        return policy != "never", ends
    if isinstance(r, str) or not isinstance(r, (bool, int)):
        raise AmspConfigError(
            f"amsp.reshard_after_forward={r!r}: use true, false, an int (reshard to that many "
            f"ranks), or \"{FROM_DP}\" (as parallelism.fsdp_reshard_after_forward says)")
    if plan is not None:  # None: before the planner has chosen one
        check_reshard_after_forward(r, plan)
    want = {"always": True, "never": False}.get(policy)
    if want is not None and r is not want:
        raise AmspConfigError(
            f"amsp.reshard_after_forward={r!r} contradicts parallelism.fsdp_reshard_after_forward="
            f"{policy!r} (reshard_after_forward={want}): set one of them to agree, or "
            f"amsp.reshard_after_forward = \"{FROM_DP}\" (the default) to follow [parallelism]")
    return r, ends


def check_reshard_after_forward(r: bool | int, plan: ResolvedPlan) -> None:
    if isinstance(r, bool):
        return
    if not isinstance(r, int) or r < 1 or plan.s_p % r or r >= plan.s_p:
        raise AmspConfigError(
            f"amsp.reshard_after_forward={r!r}: use true, false, or an int that divides "
            f"param_shard={plan.s_p} and is smaller than it (reshard to that many ranks)"
        )


# torchtitan's schedules whose backward is split in input and weight halves (zero bubble):
# an AMSP stage runs them with s_p = 1 only (engine/pipeline.py, [Note: split backward])
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def pipeline_stage_world(job_config, world: int, ranks_per_node: int) -> tuple[int, int]:
    """(ranks of one pipeline stage, of them per node) under [parallelism]
    pipeline_parallel_degree, checked before any process group: the degree divides the
    world, a stage spans whole nodes or fits in one, and the model's layers split into
    the schedule's stages as torchtitan splits them."""
    parallelism = job_config.parallelism
    pp = parallelism.pipeline_parallel_degree
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise AmspConfigError(f"parallelism.pipeline_parallel_degree={pp!r}: must be a positive int")
    if pp == 1:
        return world, ranks_per_node
    if world % pp:
        raise AmspConfigError(
            f"parallelism.pipeline_parallel_degree={pp}: does not divide the world size "
            f"{world}; every pipeline stage needs the same number of ranks")
    stage = world // pp
    if stage % ranks_per_node and ranks_per_node % stage:
        raise AmspConfigError(
            f"parallelism.pipeline_parallel_degree={pp}: a stage of {world} / {pp} = {stage} "
            f"ranks neither fills whole nodes nor fits in one ({ranks_per_node} ranks per "
            "node); use a degree that makes world / degree a multiple or a divisor of the "
            "ranks per node")
    _check_layers_split(job_config, pp)
    return stage, min(stage, ranks_per_node)


def check_split_backward(parallelism, plan) -> None:
    """A schedule with split backwards (zero bubble: I and W actions) runs on AMSP stages
    whose parameters are not sharded (s_p = 1) only."""
    if parallelism.pipeline_parallel_degree <= 1 or plan.s_p == 1:
        return
    csv = parallelism.pipeline_parallel_schedule_csv
    schedule = parallelism.pipeline_parallel_schedule
    if csv:
        action = _split_backward_actions(csv)
        if not action:
            return
        what = (f"parallelism.pipeline_parallel_schedule_csv={csv!r}: has split backward "
                f"actions ({action})")
    elif schedule in SPLIT_BACKWARD_SCHEDULES:
        what = (f"parallelism.pipeline_parallel_schedule={schedule!r}: splits each backward "
                "into input and weight halves (zero bubble)")
    else:
        return
    raise AmspConfigError(
        f"{what}, which AMSP runs with amsp.param_shard = 1 only (the plan has "
        f"{plan.s_p}): set amsp.param_shard 1 (grad_shard and optim_shard as you like), or "
        "use a schedule with full backwards (1F1B, GPipe, Interleaved1F1B, LoopedBFS)")


def _split_backward_actions(csv_path: str) -> str:
    """The first zero-bubble action (I or W) of a schedule CSV, or "" (torchtitan reads
    the file itself later: one that does not exist is its to report)."""
    import re

    try:
        with open(csv_path) as f:
            text = f.read()
    except OSError:
        return ""
    match = re.search(r"(?<![A-Za-z_])\d+(I|W)(?:\d+)?(?![A-Za-z_])", text)
    return match.group(0) if match else ""


def _check_layers_split(job_config, pp: int) -> None:
    """The stages torchtitan's pipeline_llm will cut, checked before start-up: one line
    instead of its ValueError after start-up (pipeline_stage_modules)."""
    pipeline_stage_modules(job_config, pp)


def pipeline_of(job_config, pp: int):
    """The cost model's Pipeline of this job (plan = "auto" under pipeline parallelism):
    the stages torchtitan cuts, its schedule and micro-batches, its reshard policy."""
    from amsp_dtensor.plan.cost.pipeline import Pipeline, stages_of_fqns

    parallelism = job_config.parallelism
    where = f"amsp.plan='auto' with parallelism.pipeline_parallel_degree={pp}"
    if parallelism.pipeline_parallel_schedule_csv:
        raise AmspConfigError(
            f"{where}: the planner costs torch's named schedules, not a CSV schedule "
            f"({parallelism.pipeline_parallel_schedule_csv!r}); set param_shard, grad_shard and "
            "optim_shard")
    modules = pipeline_stage_modules(job_config, pp)
    if modules is None:
        raise AmspConfigError(f"{where}: the stages of model {job_config.model.name!r} are "
                              "unknown to the planner; set param_shard, grad_shard and "
                              "optim_shard")
    n_micro = job_config.training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    try:
        return Pipeline(pp, parallelism.pipeline_parallel_schedule, n_micro,
                        stages_of_fqns(modules),
                        reshard_after_forward=reshard_after_forward_of(job_config, None)[0],
                        ranks_per_node=job_ranks_per_node(job_config))
    except ValueError as e:
        raise AmspConfigError(f"{where}: {e}") from None


def pipeline_stage_modules(job_config, pp: int) -> list[list[str]] | None:
    """The module names of every pipeline stage, as torchtitan's pipeline_llm cuts them
    (same arithmetic, same split function, on the model's layer count), or the user's
    module_fqns_per_model_part; None for a model torchtitan does not know (it names it
    itself). Raises AmspConfigError where pipeline_llm would raise. A job read off a
    torchtitan 0.3 config brings its own (``v03.job.pipeline_stage_modules``)."""
    import math

    if hasattr(job_config, "pipeline_stage_modules"):  # torchtitan 0.3
        return job_config.pipeline_stage_modules(pp)

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part
    from torchtitan.protocols.train_spec import get_train_spec

    parallelism = job_config.parallelism
    if parallelism.module_fqns_per_model_part is not None:
        return parallelism.module_fqns_per_model_part  # the user's own split: torchtitan checks it
    try:
        spec = get_train_spec(job_config.model.name)
        n_layers = spec.model_args[job_config.model.flavor].n_layers
    except (ValueError, KeyError, AttributeError, ImportError):
        return None  # torchtitan names an unknown model / flavor itself
    try:  # pipeline_llm counts stages by the schedule's class, also with a CSV schedule
        single = issubclass(get_schedule_class(parallelism.pipeline_parallel_schedule),
                            PipelineScheduleSingle)
    except ValueError as e:
        raise AmspConfigError(
            f"parallelism.pipeline_parallel_schedule="
            f"{parallelism.pipeline_parallel_schedule!r}: {e}") from None
    first, last = (parallelism.pipeline_parallel_first_stage_less_layers,
                   parallelism.pipeline_parallel_last_stage_less_layers)
    per_stage = parallelism.pipeline_parallel_layers_per_stage
    where = f"{job_config.model.name} {job_config.model.flavor} has {n_layers} layers"
    if per_stage is not None:
        stages = math.ceil((n_layers + first + last) / per_stage)
        if stages % pp or (single and stages != pp) or (not single and stages < 2 * pp):
            raise AmspConfigError(
                f"parallelism.pipeline_parallel_layers_per_stage={per_stage}: {where}, cut "
                f"into {stages} stages, which the {pp} pipeline ranks cannot run with "
                f"schedule {parallelism.pipeline_parallel_schedule} (it needs "
                + ("one stage per rank" if single else "2 or more stages per rank, the same "
                   "on every rank") + ")")
    else:
        stages = pp if single else 2 * pp
    try:
        return generate_llm_fqn_per_model_part(stages, n_layers, first, last)
    except ValueError as e:
        raise AmspConfigError(
            f"parallelism.pipeline_parallel_degree={pp}: {where}, too few for {stages} "
            f"pipeline stages ({e}); use a smaller degree or a deeper flavor") from None


def tensor_parallel_degree(job_config, ranks_per_node: int) -> int:
    """[parallelism] tensor_parallel_degree checked for AMSP: returned once it divides the
    ranks per node (TP groups inside a node) and the sequence length (as torchtitan's
    sequence parallelism needs)."""
    parallelism = job_config.parallelism
    tp = parallelism.tensor_parallel_degree
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise AmspConfigError(f"parallelism.tensor_parallel_degree={tp!r}: must be a positive int")
    problem = tp_outside_node(tp, ranks_per_node, f"parallelism.tensor_parallel_degree={tp}:",
                              f"the {ranks_per_node} ranks per node")
    if problem is not None:
        raise AmspConfigError(problem)
    seq_len = job_config.training.seq_len
    if seq_len % tp:
        raise AmspConfigError(
            f"parallelism.tensor_parallel_degree={tp}: training.seq_len={seq_len} is not a "
            "multiple of it (sequence parallelism splits the sequence over the tp ranks)"
        )
    return tp


# torchtitan 0.2.2's own context parallelism on CPU (torch's SDPA under DTensor), the
# error it stops with: AMSP's is built and tested on torchtitan 0.3 only
CP_ON_TITAN022 = ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not "
                  "have a sharding strategy")


def context_parallel_degree(job_config, dp_world: int, dp_per_node: int, tp: int) -> int:
    """[parallelism] context_parallel_degree checked for AMSP on the data-parallel world
    (``dp_world`` ranks, ``dp_per_node`` per node: the cp ranks are among them, the
    engine's Note on context parallelism): a cp group (consecutive data-parallel ranks,
    as torchtitan places them) fits in a node or spans whole nodes, the sequence splits
    as torchtitan's trainer splits it, dense models only, torchtitan 0.3 only."""
    parallelism = job_config.parallelism
    cp = parallelism.context_parallel_degree
    key = f"parallelism.context_parallel_degree={cp!r}"
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise AmspConfigError(f"{key}: must be a positive int")
    if cp == 1:
        return 1
    if not is_titan03():
        raise AmspConfigError(
            f"{key}: AMSP runs context parallelism with torchtitan 0.3 (its K/V all-gather "
            "around FlexAttention); torchtitan 0.2.2's runs SDPA through DTensor, untested "
            f"with AMSP (on CPU it stops: \"{CP_ON_TITAN022}\"); use torchtitan 0.3 or set "
            "it to 1")
    ep = parallelism.expert_parallel_degree
    keys = experts_configured(job_config.amsp)
    if ep != 1 or keys:
        why = (f"expert_parallel_degree={ep}" if ep != 1 else
               f"amsp.{keys[0]}={getattr(job_config.amsp, keys[0])!r}")
        raise AmspConfigError(
            f"{key} with {why}: context parallelism beside the experts' own plan is not "
            "supported with AMSP yet; set one of them to 1 (or remove the [amsp] expert_* "
            "factors)")
    try:
        check_context_parallel(cp, dp_world, dp_per_node)
    except ValueError as e:
        detail = str(e).split(" ", 1)[1]  # the plan rule's text without its "cp=N"
        on = f" (world / tensor_parallel_degree {tp})" if tp > 1 else ""
        raise AmspConfigError(f"{key}: {detail}{on}") from None
    seq_len = job_config.training.seq_len
    sp = tp if getattr(parallelism, "enable_sequence_parallel", True) else 1  # as 0.3's trainer
    if seq_len % (2 * cp * sp):
        under = f" x tensor_parallel_degree {tp} (sequence parallelism)" if sp > 1 else ""
        raise AmspConfigError(
            f"{key}: training.seq_len={seq_len} does not split into 2 x {cp} chunks{under} "
            f"(torchtitan's head-tail load balancing); use a multiple of {2 * cp * sp}")
    return cp


def expert_parallel_degree(job_config, dp_world: int, dp_per_node: int, tp: int) -> int:
    """[parallelism] expert_parallel_degree checked for AMSP on the data-parallel world
    (``dp_world`` ranks, ``dp_per_node`` per node) and, beside tensor parallelism, its tp
    ranks (torchtitan 0.3 only): an EP group fits in a node or spans whole nodes
    (engine/mesh.py's Note on expert parallelism), routed experts without tensor
    parallelism of their own."""
    parallelism = job_config.parallelism
    ep = parallelism.expert_parallel_degree
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise AmspConfigError(f"parallelism.expert_parallel_degree={ep!r}: must be a positive int")
    etp = getattr(parallelism, "expert_tensor_parallel_degree", 1)
    if etp != 1:
        raise AmspConfigError(
            f"parallelism.expert_tensor_parallel_degree={etp}: AMSP runs the routed experts "
            "without tensor parallelism; set it to 1")
    if ep > 1 and tp > 1 and not is_titan03():
        raise AmspConfigError(
            f"parallelism.expert_parallel_degree={ep} with tensor_parallel_degree={tp}: AMSP "
            "runs expert parallelism beside tensor parallelism with torchtitan 0.3 (its MoE "
            "layers split their tokens over the tp ranks); on 0.2.2 set one of them to 1")
    try:
        expert_parallel_world(dp_world, dp_per_node, ep, tp)
    except ValueError as e:
        raise AmspConfigError(f"parallelism.expert_parallel_degree={ep}: {e}") from None
    return ep


def experts_configured(cfg: Amsp) -> list[str]:
    """The [amsp] expert keys set to something other than "dp"."""
    return [key for key in EXPERT_KEYS if not _is_from_dp(getattr(cfg, key))]


def check_model_experts(job_config, where: str, experts_per_layer: list) -> None:
    """[parallelism] expert_parallel_degree and the [amsp] expert keys against the model
    ``where`` ("<model name> <flavor>"), whose MoE layers have ``experts_per_layer``
    routed experts each (empty: a dense model; None where a layer does not say): refused
    on a dense model, and an EP degree that does not divide a layer's experts. One code
    for both torchtitans (0.2.2's specs.check_model, 0.3's v03.trainer.check_job)."""
    ep = job_config.parallelism.expert_parallel_degree
    if not experts_per_layer:
        if ep != 1:
            raise AmspConfigError(
                f"parallelism.expert_parallel_degree={ep}: {where} has no MoE layers; set it "
                "to 1")
        configured = experts_configured(job_config.amsp)
        if configured:
            key = configured[0]
            raise AmspConfigError(
                f"amsp.{key}={getattr(job_config.amsp, key)!r}: {where} has no MoE layers; "
                "remove the [amsp] expert_* factors (they shard routed experts)")
        return
    bad = sorted(n for n in set(experts_per_layer) if n is not None and n % ep)
    if bad:
        raise AmspConfigError(
            f"parallelism.expert_parallel_degree={ep}: {where} has {bad[0]} experts per MoE "
            f"layer, which {ep} ranks cannot split evenly; use a divisor of {bad[0]}")


def resolve_expert_plan(job_config, plan: ResolvedPlan) -> ResolvedPlan | None:
    """The experts' plan beside the dense ``plan`` (resolved over the same data-parallel
    world), over the expert world (the data-parallel world / expert_parallel_degree);
    None when the experts simply belong to their blocks (no expert parallelism and no
    [amsp] expert key set). An expert factor left at "dp" shards the experts as
    torchtitan does: over data_parallel_shard_degree / expert_parallel_degree ranks.
    Under plan = "auto" on a model with experts, the planner's expert plan."""
    cfg: Amsp = job_config.amsp
    tp = job_config.parallelism.tensor_parallel_degree
    ep = expert_parallel_degree(job_config, plan.world_size, plan.ranks_per_node, tp)
    auto = getattr(cfg, AUTO_EXPERT_PLAN, None)
    if auto is not None and auto[0] is plan:  # plan = "auto" chose it with this dense plan
        return auto[1]
    if ep == 1 and not experts_configured(cfg):
        return None
    world, per_node = expert_parallel_world(plan.world_size, plan.ranks_per_node, ep, tp)
    ranks = f"{plan.world_size} data-parallel ranks" + (f" x tp {tp}" if tp > 1 else "")
    where = (f"the expert world: {ranks} / expert_parallel_degree {ep} = {world} ranks, "
             f"{per_node} per node")
    layout = data_parallel_layout(job_config.parallelism, plan.world_size,
                                  plan.ranks_per_node, tp)
    s = {}
    for key in EXPERT_KEYS:
        value = getattr(cfg, key)
        if _is_from_dp(value):
            # torchtitan's efsdp: dp_shard x cp (the layout's shard) x tp / ep ranks
            if layout.shard * tp % ep:
                shard = f"data_parallel_shard_degree {layout.shard}" + (
                    f" x tensor_parallel_degree {tp}" if tp > 1 else "")
                raise AmspConfigError(
                    f"amsp.{key}={value!r}: torchtitan would shard the experts over "
                    f"{shard} / expert_parallel_degree {ep} ranks, which is not whole; set "
                    "amsp.expert_param_shard, expert_grad_shard and expert_optim_shard "
                    f"(factors of {where})")
            s[key] = layout.shard * tp // ep
            continue
        try:
            s[key] = _factor_value(key, value, world, per_node, "the expert world size")
        except AmspConfigError as e:
            raise AmspConfigError(f"{e} (expert factors are those of {where})") from None
    s_p, s_g, s_os = (s[k] for k in EXPERT_KEYS)
    try:
        return ShardingPlan(s_p, s_g, s_os).resolve(world, per_node)
    except ValueError as e:
        key = _chain_key(s_p, s_g, s_os, EXPERT_KEYS)
        detail = str(e).split("): ", 1)[-1]
        raise AmspConfigError(
            f"amsp.{key}={getattr(cfg, key)!r}: expert plan param={s_p}, grad={s_g}, "
            f"optim={s_os} breaks {detail} ({where})") from None


def job_ranks_per_node(job_config) -> int:
    """The job's ranks per node: [amsp] ranks_per_node, else LOCAL_WORLD_SIZE."""
    return job_config.amsp.ranks_per_node or world_from_env()[1]


def resolve_plan(job_config, world: int | None = None, ranks_per_node: int | None = None):
    """Validate job_config.amsp (and [parallelism]) for this world; return the ResolvedPlan
    to run, over the data-parallel world (world / tp ranks, ranks_per_node / tp per node;
    under pipeline parallelism, one stage's: world / pp / tp ranks).

    Factors left at "dp" (the default) come from torchtitan's data-parallel layout
    (``data_parallel_layout``: replicate R x shard S gives S); explicit factors beside
    explicit data-parallel degrees must agree with them (``check_layout_agrees``).
    plan = "auto" asks amsp_dtensor's planner (see planner_bridge). Raises AmspConfigError.
    """
    check_unsupported(job_config)  # here too for launchers other than amsp_dtensor.train
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
    job_world = world
    world, ranks_per_node = pipeline_stage_world(job_config, world, ranks_per_node)
    pp = job_world // world
    tp = tensor_parallel_degree(job_config, ranks_per_node)
    cp = context_parallel_degree(job_config, world // tp, ranks_per_node // tp, tp)
    layout = data_parallel_layout(job_config.parallelism, world // tp, ranks_per_node // tp, tp,
                                  cp)
    if cfg.plan == "auto" and experts_configured(cfg):
        key = experts_configured(cfg)[0]
        raise AmspConfigError(
            f"amsp.{key}={getattr(cfg, key)!r} with amsp.plan='auto': the planner chooses the "
            "expert plan too; remove the [amsp] expert_* factors, or drop plan = \"auto\"")
    if cfg.plan == "auto":
        if layout.given:
            raise AmspConfigError(
                f"amsp.plan='auto' with {layout.flags()}: the planner chooses the "
                "data-parallel layout itself; leave those two at torchtitan's defaults (1, -1), "
                "or drop plan = \"auto\" for the layout they ask for")
        from .planner_bridge import plan_auto

        plan = plan_auto(job_config, world, ranks_per_node,
                         pipeline=pipeline_of(job_config, pp) if pp > 1 else None)
    else:
        try:
            plan = resolve_explicit(cfg, world // tp, ranks_per_node // tp, layout)
        except AmspConfigError as e:
            if tp == 1 and pp == 1 and cp == 1:
                raise
            if pp == 1:
                among = (f"{world} / {tp} ranks" if tp > 1 else f"{world} ranks") + (
                    f", the {cp} cp ranks of context_parallel_degree={cp} among them"
                    if cp > 1 else "")
                under = (f"parallelism.tensor_parallel_degree={tp}" if tp > 1 else
                         f"parallelism.context_parallel_degree={cp}")
                raise AmspConfigError(
                    f"{e} (under {under} the factors are those of the data-parallel world: "
                    f"{among})") from None
            raise AmspConfigError(
                f"{e} (under parallelism.pipeline_parallel_degree={pp} the factors are those of "
                f"one stage's data-parallel world: {job_world} / {pp}"
                + (f" / {tp}" if tp > 1 else "") + " ranks)") from None
    check_split_backward(job_config.parallelism, plan)
    reshard_after_forward_of(job_config, plan)
    compression_of(cfg)
    # checked now, and kept for job_expert_plan (resolved once, as the dense plan)
    setattr(cfg, _KEPT_EXPERT, (plan, resolve_expert_plan(job_config, plan)))
    return plan


_KEPT = "_resolved_plan"  # on job_config.amsp: (job world, the ResolvedPlan of job_plan)


def job_plan(job_config, world: int | None = None) -> ResolvedPlan:
    """The job's plan, resolved once per job, as torchtitan's ParallelDims validates itself
    once: the first call validates ``job_config`` for ``world`` (``resolve_plan``) and keeps
    the ResolvedPlan on it; later calls for the same world return that same object.
    amsp_dtensor.train calls it before start-up, the parallelize_fn builds the mesh from it
    (amsp.init_mesh keeps it as the mesh's plan), and every unit reads it from the mesh."""
    world = world_from_env()[0] if world is None else world
    kept = getattr(job_config.amsp, _KEPT, None)
    if kept is not None and kept[0] == world:
        return kept[1]
    plan = resolve_plan(job_config, world=world)
    setattr(job_config.amsp, _KEPT, (world, plan))
    return plan


_KEPT_EXPERT = "_resolved_expert_plan"  # on job_config.amsp: (dense plan, expert plan)


def job_expert_plan(job_config, world: int | None = None) -> ResolvedPlan | None:
    """The job's expert plan (``resolve_expert_plan`` of ``job_plan``), resolved once per
    job like the dense one; None when the experts belong to their blocks."""
    plan = job_plan(job_config, world)
    kept = getattr(job_config.amsp, _KEPT_EXPERT, None)
    if kept is not None and kept[0] is plan:
        return kept[1]
    expert = resolve_expert_plan(job_config, plan)
    setattr(job_config.amsp, _KEPT_EXPERT, (plan, expert))
    return expert


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


OPTIMIZER_NAMES = ("Adam", "AdamW")
"""[optimizer] name values the AMSP optimizer container builds (optimizer.OPTIMIZER_CLASSES)."""


def check_optimizer(optimizer_config, fault_tolerance: bool = False) -> None:
    """[optimizer] (and torchft) settings the AMSP optimizer container cannot honour."""
    if optimizer_config.early_step_in_backward:
        raise AmspConfigError(
            "optimizer.early_step_in_backward=True: not supported with AMSP (the optimizer "
            "steps on OS shards after the gradient sync); set it to false"
        )
    if fault_tolerance:
        raise AmspConfigError("fault_tolerance.enable=True: not supported with AMSP; set it to false")
    name = optimizer_config.name
    if name not in OPTIMIZER_NAMES:
        raise AmspConfigError(f"optimizer.name={name!r}: AMSP supports {', '.join(OPTIMIZER_NAMES)}")


def check_unsupported(job_config) -> None:
    """torchtitan settings an AMSP job cannot honour, refused before start-up: without this
    they would fail on every rank once the process group exists (the optimizer's), or be
    ignored (CPU offload: AMSP keeps P, G and OS on the device)."""
    ft = getattr(job_config, "fault_tolerance", None)  # only with torchft's config module
    check_optimizer(job_config.optimizer, bool(ft is not None and ft.enable))
    if job_config.training.enable_cpu_offload:
        raise AmspConfigError(
            "training.enable_cpu_offload=True: AMSP does not offload parameters, gradients or "
            "optimizer states to the CPU; set it to false (or shard the optimizer states "
            "further: amsp.optim_shard)")
    check_compile_with_experts(job_config)


def check_compile_with_experts(job_config) -> None:
    """Per-block torch.compile (fullgraph) with the routed experts on a unit of their own
    (expert parallelism, or [amsp] expert factors): the experts' unit sits inside the
    compiled block, and dynamo stops at its FSDP2 hooks ("torch._dynamo.decorators.disable
    ... file matches MOD_SKIPLIST", a graph break fullgraph forbids; torchtitan 0.3,
    deepseek_v3 with ep 2). torchtitan's own FSDP2 + EP shards each block as one unit."""
    compile_config = getattr(job_config, "compile", None)
    if compile_config is None or not compile_config.enable or (
            "model" not in compile_config.components):
        return
    ep = job_config.parallelism.expert_parallel_degree
    keys = experts_configured(job_config.amsp)
    if ep > 1 or keys:
        why = (f"parallelism.expert_parallel_degree={ep}" if ep > 1 else
               f"amsp.{keys[0]}={getattr(job_config.amsp, keys[0])!r}")
        raise AmspConfigError(
            f"compile.enable=True with {why}: per-block torch.compile stops at the routed "
            "experts' own AMSP unit inside each MoE block (a graph break at its FSDP2 "
            "hooks); set compile.enable = false, or train the experts with their blocks "
            "(expert_parallel_degree = 1, no [amsp] expert_* factors)")
