"""torchtitan's Trainer with AMSP's once-per-step gradient sync and global-norm clipping.

torchtitan 0.2.2's train_step runs every micro-batch's backward the same way; under AMSP
that would sync gradients across replicas on every micro-batch. AmspTrainer runs all
micro-batches but the last under ``amsp.no_sync(model)``, routes torchtitan's
``clip_grad_norm_`` call to the AMSP optimizer (the model's params carry no .grad), and
records the step's collectives and per-state memory for the metrics logger, and lets the
AMSP data loader see which keys a checkpoint holds before it is loaded (so a job resumes on
another world size, see dataloader.py). A checkpoint that does not fit the model or the
optimizer stops every rank with one line before DCP's collective load starts, and
torchrun restarts (``--max-restarts``) get a process group of their own (see
compat.init_process_group). For any
non-AMSP model (e.g. ``--model.name llama3``, torchtitan's own FSDP) it is the plain
torchtitan Trainer, which is how the equivalence tests get their baseline.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader

import torchtitan.distributed.utils as dist_utils
from torchtitan.components.checkpoint import OPTIMIZER
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from .. import compat
from ..engine.compression import residual_norm
from ..engine.overlap import set_overlap
from ..checkpoint import OTHER_SETTINGS, check_complete, check_entries_fit
from .dataloader import ReshardableDataloader, checkpoint_keys
from .optimizer import RESIDUALS, AmspOptimizersContainer, refuse_part_keyed
from .rng import STATE_KEY as RNG_KEY
from .rng import RngState
from .parallelize import amsp_plan_of
from .weights import reinit_like_single_process


@contextlib.contextmanager
def _clip_through(optimizers) -> Iterator[None]:
    """Within one train_step, torchtitan's dist_utils.clip_grad_norm_ goes to the AMSP optimizer.

    torchtitan calls ``dist_utils.clip_grad_norm_(model params, max_norm, ...)`` from the
    middle of train_step; replacing the module attribute for the step's duration is the
    narrowest hook (the alternative is copying train_step).
    """
    original = dist_utils.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        return optimizers.clip_grad_norm_(max_norm)

    dist_utils.clip_grad_norm_ = clip_grad_norm_
    try:
        yield
    finally:
        dist_utils.clip_grad_norm_ = original


def _dataloader_keys_before_load(dcp_load, dataloader: ReshardableDataloader):
    """CheckpointManager.dcp_load, telling the data loader first which of its keys the
    checkpoint holds.

    [Note: keys a resharded resume may ask for] DCP loads the keys the live state_dict
    offers and fails on one the checkpoint lacks; a rank the saving run did not have (e.g.
    rank 5 resuming a 4-rank checkpoint) would offer ``dp_rank_5``. dcp_load is the one
    place that knows the checkpoint folder before DCP asks the data loader for its keys.
    """

    def load(state_dict, checkpoint_id, *args, **kwargs):
        if not any(value is dataloader for value in state_dict.values()):
            return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        dataloader.expect_checkpoint(checkpoint_keys(checkpoint_id))
        try:
            return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        finally:
            dataloader.expect_checkpoint(None)

    return load


# torchtitan's CheckpointManager state keys that are not tensors of the model
_TITAN_SECTIONS = ("optimizer", "lr_scheduler", "dataloader", "train_state", RNG_KEY)


def _refuse_misfits(dcp_load, pipelined: bool = False):
    """Wrap CheckpointManager.dcp_load: compare the checkpoint's metadata with the model's
    and the AMSP optimizer's tensors first (a local read on every rank, so all of them
    raise the same one-line CheckpointMismatch and none waits in DCP's load). Under
    pipeline parallelism a rank holds its stages' entries only: the others' are expected
    in the file, its own must be there."""

    def load(state_dict, checkpoint_id, *args, **kwargs):
        from_hf = kwargs.get("from_hf", args[0] if args else False)
        if from_hf:
            return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
        check_complete(checkpoint_id)
        metadata = FileSystemReader(checkpoint_id).read_metadata()
        optimizers = state_dict.get(OPTIMIZER)
        amsp_optimizers = isinstance(optimizers, AmspOptimizersContainer)
        if optimizers is not None:
            refuse_part_keyed(checkpoint_id, metadata)
        try:
            if amsp_optimizers:  # its residual entries fit this file (or are left out) from now
                optimizers.expect_checkpoint(checkpoint_id, metadata)
            wanted = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
            if optimizers is not None:
                wanted[OPTIMIZER] = optimizers.state_dict()
            # every non-tensor state (torchtitan's and any other) is its own section; the
            # residuals are per rank, fitted above, not compared
            others = tuple(_TITAN_SECTIONS) + tuple(
                k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
            check_entries_fit(checkpoint_id, wanted,
                              [("", "model", ""), (OPTIMIZER, "optimizer state", OTHER_SETTINGS)],
                              others=(*others, f"{OPTIMIZER}.{RESIDUALS}"), metadata=metadata,
                              partial=pipelined)
            rng = state_dict.get(RNG_KEY)
            if rng is None:
                return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
            rng.expect_checkpoint(set(metadata.state_dict_metadata))
            try:
                return dcp_load(state_dict, checkpoint_id, *args, **kwargs)
            finally:
                rng.expect_checkpoint(None)
        finally:
            if amsp_optimizers:
                optimizers.expect_checkpoint(None)

    return load


def float8_scales_after_step(job_config, parallel_dims) -> bool:
    """Whether torchtitan's float8 converter precomputes the weights' scales in a post-step
    hook (its Float8LinearConverter.precompute_scale, same conditions)."""
    float8 = job_config.quantize.linear.float8
    return ("quantize.linear.float8" in job_config.model.converters
            and float8.recipe_name is None and parallel_dims.dp_shard_enabled
            and float8.enable_fsdp_float8_all_gather
            and float8.precompute_float8_dynamic_scale_for_fsdp)


class AmspTrainer(Trainer):
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
                self.model_parts[0], self.train_spec.model_cls, self.model_args, job_config
            )
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
            for opt in self.optimizers.optimizers:
                opt.overlap_param_update = overlap_update
            for part in self.model_parts:
                overlap = set_overlap(part, grad_sync=amsp_cfg.overlap_grad_sync,
                                      prefetch=amsp_cfg.overlap_prefetch,
                                      step=amsp_cfg.overlap_step)
            logger.info(f"AMSP {overlap}")  # all four switches, param_update included
        if self.amsp_plan is not None:
            self.checkpointer.states[RNG_KEY] = RngState()
            self.checkpointer.dcp_load = _refuse_misfits(self.checkpointer.dcp_load,
                                                         pipelined=self.parallel_dims.pp > 1)
        if isinstance(self.dataloader, ReshardableDataloader):
            self.checkpointer.dcp_load = _dataloader_keys_before_load(
                self.checkpointer.dcp_load, self.dataloader)
        self._microbatch = 0
        self.last_comm_events: list = []  # CommEvents of the last logged step
        # (step, CommRecorder, memory_by_state, residual norm or None) not yet logged
        self._unlogged_steps: list = []

    @property
    def amsp_enabled(self) -> bool:
        return self.amsp_plan is not None

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        self._microbatch += 1
        last = self._microbatch >= self.gradient_accumulation_steps
        ctx = contextlib.ExitStack()
        if self.amsp_enabled and not last:
            import amsp_dtensor as amsp

            for part in self.model_parts:  # every pipeline stage of this rank
                ctx.enter_context(amsp.no_sync(part))
        with ctx:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )

    def train_step(self, data_iterator):
        self._microbatch = 0
        if not self.amsp_enabled:
            return super().train_step(data_iterator)
        import amsp_dtensor as amsp

        with amsp.record_comms() as rec, _clip_through(self.optimizers):
            super().train_step(data_iterator)
        if self.metrics_processor.should_log(self.step):
            model = self.model_parts[0]
            memory = amsp.memory_by_state(model, self.optimizers.optimizers[0])
            residual = (residual_norm(model) if "residual" in memory else None)
            self._unlogged_steps.append((self.step, rec, memory, residual))
        last = self.step >= self.job_config.training.steps
        if last:
            # Nothing left to overlap the post-step all-gather with: complete it now.
            for opt in self.optimizers.optimizers:
                opt.wait_param_update()
        self._log_comms(keep_newest=not last)

    def _log_comms(self, keep_newest: bool) -> None:
        """Log each step's collectives once they have all completed.

        With ``[amsp] overlap_param_update = true`` the post-step all-gather (OS -> P) of
        step N is issued in N's optimizer step but completes, and is recorded into N's
        recorder, in step N+1's forward. So step N's comm scalars are written after step
        N+1 has run (without overlap they are complete already; the lag is harmless).
        """
        ready = self._unlogged_steps[:-1] if keep_newest else self._unlogged_steps
        for step, rec, memory, residual in ready:
            self.last_comm_events = list(rec.events)
            if hasattr(self.metrics_processor, "log_amsp"):
                self.metrics_processor.log_amsp(step, self.amsp_plan, self.last_comm_events,
                                                memory, residual)
        self._unlogged_steps = self._unlogged_steps[len(ready):]
