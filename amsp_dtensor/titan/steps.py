"""AMSP's step on torchtitan's Trainer, for either torchtitan (a mixin placed before each
version's Trainer: ``trainer.AmspTrainer`` for 0.2.2, ``v03.trainer.AmspTrainer`` for 0.3).

torchtitan's train_step runs every micro-batch's backward the same way; under AMSP that
would sync gradients across replicas on every micro-batch. Here all micro-batches but the
last run under ``amsp.no_sync(model)``, torchtitan's ``clip_grad_norm_`` call goes to the
AMSP optimizer (the model's params carry no .grad), and each step's collectives and
per-state memory are recorded for the metrics logger. A model that is not AMSP's (the
torchtitan baseline) gets torchtitan's own step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

import torchtitan.distributed.utils as dist_utils
from torchtitan.tools.logging import logger

from ..engine.compression import residual_norm
from ..engine.overlap import set_overlap
from .units import expert_plan_of


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


class AmspSteps:
    amsp_plan = None  # the ResolvedPlan of an AMSP model (set by the trainer), else None

    def _amsp_steps_init(self) -> None:
        self._microbatch = 0
        self.last_comm_events: list = []  # CommEvents of the last logged step
        # (step, CommRecorder, memory_by_state, residual norm or None) not yet logged
        self._unlogged_steps: list = []

    def _amsp_overlap(self, amsp_cfg, overlap_update: bool) -> None:
        """[amsp]'s four overlap switches on the optimizers and the model parts."""
        for opt in self.optimizers.optimizers:
            opt.overlap_param_update = overlap_update
        for part in self.model_parts:
            overlap = set_overlap(part, grad_sync=amsp_cfg.overlap_grad_sync,
                                  prefetch=amsp_cfg.overlap_prefetch,
                                  step=amsp_cfg.overlap_step)
        logger.info(f"AMSP {overlap}")  # all four switches, param_update included

    def _training_steps(self) -> int:
        raise NotImplementedError

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
            expert_plan = expert_plan_of(model)
            if expert_plan is not None:  # the experts' part of it, on their own plan
                experts = amsp.memory_by_state(model, self.optimizers.optimizers[0],
                                               group="expert")
                memory = {**memory, **{f"expert/{k}": v for k, v in experts.items()}}
            residual = (residual_norm(model) if "residual" in memory else None)
            self._unlogged_steps.append((self.step, rec, memory, residual))
        last = self.step >= self._training_steps()
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
                                                memory, residual,
                                                expert_plan_of(self.model_parts[0]))
        self._unlogged_steps = self._unlogged_steps[len(ready):]
