"""torchtitan's Trainer with AMSP's once-per-step gradient sync and global-norm clipping.

torchtitan 0.2.2's Trainer with the step of ``steps.AmspSteps`` (no_sync on all
micro-batches but the last, the clip routed to the AMSP optimizer, the step's collectives
and per-state memory recorded for the metrics logger). Here also: it lets the
AMSP data loader see which keys a checkpoint holds before it is loaded (so a job resumes on
another world size, see dataloader.py). A checkpoint that does not fit the model or the
optimizer stops every rank with one line before DCP's collective load starts, and
torchrun restarts (``--max-restarts``) get a process group of their own (see
compat.init_process_group). For any
non-AMSP model (e.g. ``--model.name llama3``, torchtitan's own FSDP) it is the plain
torchtitan Trainer, which is how the equivalence tests get their baseline.
"""

from __future__ import annotations

import torch
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from .. import compat
from .dataloader import ReshardableDataloader
from .reshard_data import dataloader_keys_before_load as _dataloader_keys_before_load
from .checkpoint_guard import refuse_misfits as _refuse_misfits
from .rng import STATE_KEY as RNG_KEY
from .rng import RngState
from .steps import AmspSteps
from .parallelize import amsp_plan_of
from .weights import reinit_like_single_process


def float8_scales_after_step(job_config, parallel_dims) -> bool:
    """Whether torchtitan's float8 converter precomputes the weights' scales in a post-step
    hook (its Float8LinearConverter.precompute_scale, same conditions)."""
    float8 = job_config.quantize.linear.float8
    return ("quantize.linear.float8" in job_config.model.converters
            and float8.recipe_name is None and parallel_dims.dp_shard_enabled
            and float8.enable_fsdp_float8_all_gather
            and float8.precompute_float8_dynamic_scale_for_fsdp)


class AmspTrainer(AmspSteps, Trainer):
    def init_distributed(self):
        with compat.torchrun_restart_safe_init():
            return super().init_distributed()

    def __init__(self, job_config):
        super().__init__(job_config)
        self.amsp_plan = amsp_plan_of(self.model_parts[0])
        amsp_cfg = getattr(job_config, "amsp", None)
        if self.amsp_plan is None and amsp_cfg is not None and amsp_cfg.init_like_single_process:
            # Plain torch optimizers hold no state before their first step, so the params
            # can still be overwritten here.
            reinit_like_single_process(
                self.model_parts[0], lambda: self.train_spec.model_cls(self.model_args),
                job_config)
        if self.amsp_plan is not None and amsp_cfg is not None:
            overlap_update = amsp_cfg.overlap_param_update
            if overlap_update and float8_scales_after_step(job_config, self.parallel_dims):
                # torchtitan's post-step hook computes every float8 weight's scale from the
                # sharded weights right after optimizer.step() (torchao's
                # precompute_float8_dynamic_scale_for_fsdp): the step must return with them
                # updated, so the post-step all-gather cannot wait for the next forward.
                overlap_update = False
                logger.info("[amsp] overlap_param_update off: the float8 weight scales are "
                            "computed from the updated weights right after each step")
            self._amsp_overlap(amsp_cfg, overlap_update)
        if self.amsp_plan is not None:
            self.checkpointer.states[RNG_KEY] = RngState()
            self.checkpointer.dcp_load = _refuse_misfits(self.checkpointer.dcp_load,
                                                         pipelined=self.parallel_dims.pp > 1)
        if isinstance(self.dataloader, ReshardableDataloader):
            self.checkpointer.dcp_load = _dataloader_keys_before_load(
                self.checkpointer.dcp_load, self.dataloader)
        self._amsp_steps_init()

    def _training_steps(self) -> int:
        return self.job_config.training.steps
