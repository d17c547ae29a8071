"""torchtitan 0.3's Trainer with AMSP: ``AmspTrainer.Config`` is 0.3's ``Trainer.Config``
plus the ``amsp`` section (the keys of the TOML ``[amsp]`` table, ``titan.config.Amsp``).

``config.build()`` makes an AmspTrainer. When the config's ModelSpec is AMSP's
(``v03.parallelize.amsp_model_spec``, as the ``*_amsp`` config registry entries set it),
the trainer, before torchtitan's own ``__init__`` (so before any process group):
resolves the plan once (``titan.validate.job_plan`` on ``v03.job.job_view``), refuses what
AMSP cannot train on 0.3 in one line (``check_job``; under torchtitan's own launcher the
trainer prints it and exits 2 itself), binds the plan to the spec's
parallelize_fn, and makes the optimizer, metrics and text data loader components AMSP's
(the loader resumes on another data-parallel world). It then runs
the step of ``titan.steps.AmspSteps``. With any other ModelSpec it is torchtitan's
Trainer (the baseline of the equivalence tests), optionally initialised like one process
(``amsp.init_like_single_process``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ... import launching as launcher
from ...compat import pipeline_step_takes_microbatches
from ..checkpoint_guard import refuse_misfits
from ..reshard_data import Reshardable, dataloader_keys_before_load
from ..config import Amsp, AmspConfigError
from ..rng import STATE_KEY as RNG_KEY
from ..rng import RngState
from ..steps import AmspSteps
from ..units import amsp_plan_of
from ..validate import check_model_experts, job_expert_plan, job_plan
from ..weights import reinit_like_single_process
from .dataloader import amsp_dataloader_config
from .job import job_view
from .metrics import AmspMetricsProcessor, amsp_metrics_config
from .optimizer import AmspOptimizersContainer, amsp_optimizer_config, titan_optimizer_config
from .parallelize import bind, is_amsp


def check_job(config) -> None:
    """What AMSP cannot train on torchtitan 0.3, refused as one AmspConfigError line.
    The one place for these refusals: every launch path (the TOML, ``--module/--config``,
    torchtitan's own launcher) reaches it through ``prepare`` before any process group."""
    pp = config.parallelism.pipeline_parallel_degree
    if pp > 1 and not pipeline_step_takes_microbatches():
        import torch

        raise AmspConfigError(
            f"parallelism.pipeline_parallel_degree={pp}: torchtitan 0.3 hands torch's pipeline "
            f"schedule its micro-batches already split, which torch {torch.__version__} does "
            "not take (every rank would stop with \"Expecting 8 arg_mbs but got 1\", "
            "torchtitan's own runs too); use torch 2.14 or later, or set it to 1")
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        raise AmspConfigError(
            "loss=ChunkedLossWrapper: it runs the lm_head chunk by chunk outside the model's "
            "forward, each chunk with its own backward, which AMSP's [norm, lm_head] unit "
            "does not schedule; use CrossEntropyLoss (the *_amsp config entries do)")
    check_experts(config)
    if not config.training.disable_cuda_graphs:
        raise AmspConfigError(
            "training.disable_cuda_graphs=False: AMSP allocates and frees its gradient "
            "buffers each step, which a captured CUDA graph cannot replay; set it to true")
    if config.parallelism.enable_fsdp_symm_mem:
        raise AmspConfigError(
            "parallelism.enable_fsdp_symm_mem=True: a switch of torchtitan's FSDP2 path, "
            "which AMSP replaces (its collectives run on its own groups); set it to false")
    if config.compile.enable_async_tensor_parallel:
        raise AmspConfigError(
            "compile.enable_async_tensor_parallel=True: async TP is not wired into AMSP's "
            "tensor-parallel path on torchtitan 0.3; set it to false")
    if config.parallelism.spmd_backend != "partial_dtensor":
        raise AmspConfigError(
            f"parallelism.spmd_backend={config.parallelism.spmd_backend!r}: AMSP's units hold "
            "plain parameters and DTensors of the tensor-parallel dimension only; use "
            "\"partial_dtensor\"")


def check_cp_blocks(config) -> None:
    """Under context parallelism with FlexAttention (llama3's and qwen3's in 0.3) torch
    builds each cp rank's block mask only for a sequence of whole cp x 128 blocks; one
    line here instead of torch's NotImplementedError on every rank in the first step.
    The rest (cp against the world and the nodes, the head-tail split, the experts) is
    ``titan.validate.context_parallel_degree``'s, before this."""
    from torchtitan.models.common.attention import FlexAttention

    from ...compat import flex_block_size

    cp = config.parallelism.context_parallel_degree
    first = getattr(config.model_spec.model, "first_attention", None)
    if cp <= 1 or not isinstance(getattr(first, "inner_attention", None), FlexAttention.Config):
        return
    seq_len, block = config.training.seq_len, flex_block_size()
    if seq_len % (cp * block):
        raise AmspConfigError(
            f"parallelism.context_parallel_degree={cp}: training.seq_len={seq_len} is not a "
            f"whole number of FlexAttention blocks per cp rank ({cp} x {block}, torch's "
            f"context-parallel block mask); use a multiple of {cp * block}")


def check_experts(config) -> None:
    """[parallelism] expert_parallel_degree and the [amsp] expert keys against the
    config's model, as 0.2.2 refuses them (``titan.validate.check_model_experts``): on a
    model without MoE layers, or an EP degree that does not divide its experts. Read off
    the model's config (its MoE layer configs), before anything is built. The rest (the
    expert factors against the expert world, ep beside tp, plan = "auto" beside expert
    factors, compile with the experts on their own unit) is ``job_plan``'s, shared with
    0.2.2."""
    from torchtitan.models.common.moe import MoE

    spec = config.model_spec
    experts = [_experts_of(moe) for _, moe, _, _ in spec.model.traverse(MoE.Config)]
    job = config if hasattr(config, "amsp") else SimpleNamespace(
        parallelism=config.parallelism, amsp=Amsp())
    check_model_experts(job, f"{spec.name} {spec.flavor}", experts)


def _experts_of(moe_config) -> int | None:
    """The routed experts of one MoE layer config (its grouped experts' count)."""
    inner = getattr(getattr(moe_config, "routed_experts", None), "inner_experts", None)
    return getattr(inner, "num_experts", None) or getattr(moe_config, "num_experts", None)


def prepare(config):
    """Resolve the plan (once) and make ``config``'s components AMSP's; returns the plan.
    No-op (None) for a ModelSpec that is not AMSP's."""
    if not is_amsp(config.model_spec):
        return None
    check_job(config)
    job = job_view(config)
    plan = job_plan(job)  # validates [amsp] and [parallelism]; kept on config.amsp
    check_cp_blocks(config)  # after job_plan's checks of the cp degree itself
    expert_plan = job_expert_plan(job)  # None when the experts belong to their blocks
    config.model_spec = bind(config.model_spec, plan, job, expert_plan)
    if config.checkpoint.create_seed_checkpoint:
        # torchtitan 0.3 skips the parallelize_fn for a seed checkpoint (the initialised
        # model saved on one rank): there are no AMSP units to build an AMSP optimizer on
        # ("Llama3Model is not an AMSP root"), so the optimizer is torchtitan's own
        if isinstance(config.optimizer, AmspOptimizersContainer.Config):
            config.optimizer = titan_optimizer_config(config.optimizer)
        return plan
    if type(config.optimizer) is OptimizersContainer.Config:
        config.optimizer = amsp_optimizer_config(config.optimizer)
    elif not isinstance(config.optimizer, AmspOptimizersContainer.Config):
        raise AmspConfigError(
            f"optimizer={type(config.optimizer).__qualname__}: AMSP builds its own optimizer "
            "container; give OptimizersContainer.Config (or AmspOptimizersContainer.Config)")
    if type(config.metrics) is MetricsProcessor.Config:
        config.metrics = amsp_metrics_config(config.metrics)
    config.dataloader = amsp_dataloader_config(config.dataloader)
    return plan


class AmspTrainer(AmspSteps, Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        amsp: Amsp = field(default_factory=Amsp)
        """The [amsp] section: factors or plan = "auto", ranks_per_node, overlap and
        compression switches (titan/config.py)."""

    def __init__(self, config: Config):
        self.amsp_plan = None
        try:
            prepare(config)  # again after amsp_dtensor.train's check: the same plan object
        except AmspConfigError as e:
            # torchtitan's own launcher (python -m torchtitan.train --module
            # amsp_dtensor.titan.v03 ...) builds the trainer without amsp_dtensor.train's
            # check: the same one line and exit 2, still before any process group
            raise SystemExit(launcher.refuse(e, prog="amsp_dtensor.titan.v03")) from None
        super().__init__(config)
        self.amsp_plan = amsp_plan_of(self.model_parts[0])
        amsp_cfg = config.amsp
        if self.amsp_plan is None and amsp_cfg.init_like_single_process:
            # plain torch optimizers hold no state before their first step
            reinit_like_single_process(self.model_parts[0], config.model_spec.model.build,
                                       config)
        if self.amsp_plan is not None:
            self._amsp_overlap(amsp_cfg, amsp_cfg.overlap_param_update)
            if getattr(self.checkpointer, "enable", False):
                self.checkpointer.states[RNG_KEY] = RngState()
                self.checkpointer.dcp_load = refuse_misfits(
                    self.checkpointer.dcp_load, pipelined=self.parallel_dims.pp > 1)
                if isinstance(self.dataloader, Reshardable):
                    self.checkpointer.dcp_load = dataloader_keys_before_load(
                        self.checkpointer.dcp_load, self.dataloader)
            logger.info(f"[amsp] plan {self.amsp_plan.name} on {self.amsp_plan.world_size} "
                        f"data-parallel ranks ({self.amsp_plan.ranks_per_node} per node)")
        self._amsp_steps_init()

    def _training_steps(self) -> int:
        return self.config.training.steps


__all__ = ["AmspMetricsProcessor", "AmspOptimizersContainer", "AmspTrainer", "check_job",
           "prepare"]
