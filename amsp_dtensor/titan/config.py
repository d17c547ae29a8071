"""The ``[amsp]`` section of a torchtitan job config.

torchtitan 0.2.2 merges a module's ``JobConfig`` dataclass into its own when the TOML says
``[job] custom_config_module = "amsp_dtensor.titan.config"`` (or the CLI passes
``--job.custom_config_module``), so ``[amsp] param_shard = 2`` in TOML and
``--amsp.param_shard 2`` on the command line both land in ``job_config.amsp``.

Factors are ints or strategy names ("replica" = 1, "node" = ranks per node, "full" =
world size), or "dp" (the default): torchtitan's data-parallel layout decides, i.e.
``[parallelism] data_parallel_replicate_degree`` R x ``data_parallel_shard_degree`` S over
the data-parallel world gives the factor S (plan pS-gS-osS, R replicas); with torchtitan's
defaults (R = 1, S = -1) that is the whole data-parallel world, as "full". tyro parses
``int | str`` CLI values as int when they look like one.
"""


from dataclasses import dataclass, field

FROM_DP = "dp"
"""The value of an [amsp] factor or reshard_after_forward that leaves it to torchtitan's
[parallelism] data-parallel settings (the default)."""


@dataclass
class Amsp:
    param_shard: int | str = FROM_DP
    """s_p: ranks sharing one copy of the parameters (P). Int factor, replica/node/full, or
    "dp" = parallelism.data_parallel_shard_degree (after data_parallel_replicate_degree)."""

    grad_shard: int | str = FROM_DP
    """s_g: ranks sharing one copy of the gradients (G); must equal param_shard or optim_shard."""

    optim_shard: int | str = FROM_DP
    """s_os: ranks sharing one copy of fp32 master weights + optimizer states (OS)."""

    expert_param_shard: int | str = FROM_DP
    """The experts' s_p (mixture-of-experts models): ranks holding the same experts that
    share one copy of their parameters, a factor of the expert data-parallel world (the
    data-parallel world / parallelism.expert_parallel_degree). "dp" = as torchtitan shards
    experts: data_parallel_shard_degree / expert_parallel_degree."""

    expert_grad_shard: int | str = FROM_DP
    """The experts' s_g; must equal expert_param_shard or expert_optim_shard."""

    expert_optim_shard: int | str = FROM_DP
    """The experts' s_os: fp32 master weights + optimizer states of the experts."""

    plan: str = ""
    """"" = use the three factors above; "auto" = let amsp_dtensor's planner choose them."""

    ranks_per_node: int = 0
    """Ranks per (real or simulated) node; 0 = LOCAL_WORLD_SIZE from torchrun."""

    reshard_after_forward: bool | int | str = FROM_DP
    """FSDP2's reshard_after_forward for the P path: True, False, an int (hpZ-style), or
    "dp" = as parallelism.fsdp_reshard_after_forward says ("default"/"always": True,
    "never": False)."""

    overlap_param_update: bool = True
    """True: the post-step all-gather of the new weights into the P shards runs under the
    next step's forward (AMSP's overlap; torchtitan reads parameters only through forward
    and checkpoints, which wait for it). False: every optimizer step waits for it."""

    overlap_grad_sync: bool = True
    """True: each stage of a unit's gradient sync is issued as soon as its input is ready
    and the last stages complete inside the optimizer step. False: every gradient
    collective is waited for right after it is issued (amsp.set_overlap(grad_sync=))."""

    overlap_prefetch: bool = True
    """True: explicit FSDP2 prefetch of the next unit's all-gather in forward and backward
    (async all-gathers on CPU). False: FSDP2's defaults (amsp.set_overlap(prefetch=))."""

    overlap_step: bool = True
    """True: elementwise optimizers step the units in a few batches, each as soon as its
    gradients have landed, and start their post-step all-gathers right away
    (amsp.set_overlap(step=)); with gradient clipping on the norm still needs every
    gradient first."""

    compress_grads: str = ""
    """"" = exact; "bf16" or "int8": the gradient stages whose group spans nodes (the
    reduce-scatter over g or os, the replica all-reduce) are sent compressed, with error
    feedback (amsp.set_compression(grads=)). Stages inside a node stay exact."""

    compress_weights: str = ""
    """"" = exact; "bf16" or "int8": the post-step all-gather of the new weights, when its
    group spans nodes, is sent compressed (amsp.set_compression(weights=))."""

    compress_error_feedback: bool = True
    """With compress_grads: add what quantization dropped to the next step's gradients
    (False only to measure what the feedback does)."""

    gpu_memory_gib: float = 0.0
    """Memory per rank the planner may use (plan = "auto"); 0 = ask the device."""

    bandwidth_table: str = ""
    """plan = "auto": a measured bandwidth profile (python -m amsp_dtensor.plan.profile); "" = the
    planner's default alpha-beta model."""

    init_full_model: bool = True
    """True: every rank materialises and seeds the FULL model before sharding, so any two
    plans start from identical weights (CPU runs, equivalence tests). False: torchtitan's
    own flow, sharding the meta model and initialising each rank's shards afterwards
    (needed when the full model does not fit one rank, e.g. 70B; initial weights then
    depend on the layout, as with FSDP on CPU)."""

    init_like_single_process: bool = False
    """For non-AMSP baselines (e.g. --model.name llama3): initialise weights from one full
    seeded model, as AMSP runs always do, so runs with different layouts start equal."""


class AmspConfigError(ValueError):
    """An invalid [amsp] setting; str() is the one-line message for the user."""


@dataclass
class JobConfig:
    amsp: Amsp = field(default_factory=Amsp)


KNOWN_KEYS = tuple(Amsp.__dataclass_fields__)


def unknown_amsp_key(name: str) -> AmspConfigError:
    """The one-line refusal of ``amsp.<name>``, a key [amsp] does not have (in a TOML file
    or as a ``--amsp.`` flag, on either torchtitan)."""
    return AmspConfigError(f"amsp.{name}: unknown key in [amsp]; known keys: "
                           f"{', '.join(KNOWN_KEYS)}")
