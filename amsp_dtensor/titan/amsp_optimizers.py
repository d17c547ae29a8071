"""The AMSP optimizers behind torchtitan's OptimizersContainer, for either torchtitan.

``AmspOptimizers`` holds one amsp.AMSPOptimizer per model part (fp32 master weights and
optimizer states in the OS layout; a torch.optim.Optimizer subclass, so torchtitan's
LambdaLR schedulers drive its param_groups' lr), clips by the global norm, and gives the
checkpoint its entries keyed by parameter name with the compression residuals. Each
torchtitan's container class (``optimizer`` for 0.2.2, ``v03.optimizer`` for 0.3) puts it
before its own OptimizersContainer and adds only how it is built.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpoint import OPTIMIZER
from torchtitan.tools.logging import logger

from ..checkpoint import CheckpointMismatch, fit_residuals, residual_entry, restore_residuals
from ..engine.optim import param_groups_by_regex
from .validate import OPTIMIZER_NAMES
from .weights import clean_fqn

OPTIMIZER_CLASSES = {name: getattr(torch.optim, name) for name in OPTIMIZER_NAMES}
RESIDUALS = "amsp_residuals"  # + ".<part>": one model part's residuals, under OPTIMIZER
_PART_KEYED = "amsp_optim"  # + ".<part>" / ".stage<i>": the optimizer entries of older checkpoints
# model part -> its pipeline stage index (units.amsp_pipelining_fn notes it)
PIPELINE_STAGE_OF: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


class AmspOptimizers:
    """What torchtitan's OptimizersContainer does, for AMSPOptimizers (a mixin placed
    before each version's OptimizersContainer): one AMSPOptimizer per model part, the
    global-norm clip, and the checkpoint entries keyed by parameter name (with the
    compression residuals)."""

    def _build_amsp_optimizers(self, model_parts: list[nn.Module], optimizer_cls,
                               optimizer_kwargs: dict[str, Any],
                               param_groups: list[tuple[str, dict]] | None = None,
                               ) -> list[nn.Parameter]:
        """Set ``model_parts`` and ``optimizers``; returns the trainable parameters (for
        torchtitan's own container bookkeeping, which the caller runs). ``param_groups``:
        [(regex, the group's kwargs)], each parameter in the group of the first regex
        found in its name (torchtitan 0.3's ParamGroupConfig rule)."""
        import amsp_dtensor as amsp

        self.model_parts = model_parts
        self.optimizers = [
            amsp.AMSPOptimizer(m, optimizer_cls, **optimizer_kwargs,
                               param_groups=_groups_by_pattern(m, param_groups))
            for m in model_parts]
        # While torchtitan loads a checkpoint: each part's residual entry fitted to it
        # (state_dict() offers these), and why the others start from zero
        self._fitted: dict[str, dict] | None = None
        self._residuals_reset: dict[str, str] = {}
        return [p for m in model_parts for p in m.parameters() if p.requires_grad]

    def expect_checkpoint(self, path, metadata=None) -> None:
        """Told by the trainer around torchtitan's dcp_load (None after): which checkpoint
        (and its metadata, if read) the next state_dict() calls are loaded from. The
        residual entries are fitted to that file here, once per load."""
        self._fitted, self._residuals_reset = None, {}
        if path is None:
            return
        fitted, reset = {}, {}  # kept only once every part is fitted (a raise keeps none)
        for i in range(len(self.model_parts)):
            entry, name = self._residual_entry(i), self._residual_key(i)
            if entry is None:
                continue
            why = fit_residuals(path, entry, (OPTIMIZER, name), metadata)
            if why:
                reset[name] = why
            else:
                fitted[name] = entry
        self._fitted, self._residuals_reset = fitted, reset

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the true global norm (model params have no .grad: grads live in the
        engine): one norm over every model part of this rank and, under pipeline
        parallelism, over every stage of the pipeline."""
        import amsp_dtensor as amsp

        if len(self.optimizers) > 1 or self._pipelined():
            return amsp.clip_grad_norm_(self.optimizers, max_norm)
        norms = [opt.clip_grad_norm_(max_norm) for opt in self.optimizers]
        norms = [n.full_tensor() if isinstance(n, DTensor) else torch.as_tensor(n) for n in norms]
        return norms[0]

    def _pipelined(self) -> bool:
        return any(part in PIPELINE_STAGE_OF for part in self.model_parts)

    def _residual_key(self, i: int) -> str:
        """A model part's residual entry: by its index on this rank, or under pipeline
        parallelism by its stage (one DCP key is written by one rank only)."""
        stage = PIPELINE_STAGE_OF.get(self.model_parts[i])
        return f"{RESIDUALS}.{i}" if stage is None else f"{RESIDUALS}.stage{stage}"

    def _residual_entry(self, i: int) -> dict | None:
        """residual_entry of part ``i``; under pipeline parallelism its key also names the
        stage's parameters (first..last), so residuals come back only into the same cut
        (the units of a stage differ with the split)."""
        part = self.model_parts[i]
        entry = residual_entry(part)
        if entry is not None and part in PIPELINE_STAGE_OF:
            fqns = [clean_fqn(fqn) for fqn, _ in part.named_parameters()]
            entry["key"] += (f", pipeline stage {PIPELINE_STAGE_OF[part]} holding "
                             f"{fqns[0]}..{fqns[-1]}")
        return entry

    # [Note: the optimizer's checkpoint entries are keyed by parameter name]
    # torchtitan's get_optimizer_state_dict expects the model's params in the optimizer;
    # AMSP's optimizer holds OS-layout masters instead, so the entries come from its own
    # state_dict(), flattened as torchtitan's OptimizersContainer flattens its state dict
    # (torch.distributed.checkpoint.state_dict's flatten_optimizer_state_dict):
    #   state.<fqn>.<key>         master, exp_avg, exp_avg_sq, step (DTensors, OS layout)
    #   param_groups.<fqn>.<key>  lr, betas, eps, ... of the group holding <fqn>
    # <fqn> is the parameter's name in the full model. torchtitan's pipeline split keeps
    # those names on every stage, so the entries do not depend on how many model parts or
    # stages hold them: a checkpoint saved under any pipeline degree and schedule (or none)
    # loads under any other, and, the values being DTensors, under any plan. The names
    # leave out activation checkpointing's "_checkpoint_wrapped_module." and
    # torch.compile's "_orig_mod." (as torchtitan's model state dict does), so a checkpoint
    # loads into a job with other AC / compile settings. With compressed gradients, each
    # part's error-feedback residuals ride along as "amsp_residuals.<i>" (under pipeline
    # parallelism ".stage<i>"; see [Note: error-feedback residuals in a checkpoint]).
    def state_dict(self) -> dict[str, Any]:
        state, groups, placeholder = {}, {}, []
        for opt in self.optimizers:
            sd = _clean_keys(opt.state_dict())
            state.update(sd["state"])
            for group in sd["param_groups"]:
                settings = {k: v for k, v in group.items() if k != "params"}
                groups.update({fqn: dict(settings) for fqn in group["params"]})
            placeholder.append(sd["state_is_placeholder"])
        # every part of a rank steps together: all placeholders (before the first step) or none
        sd = {"state": state, "param_groups": groups, "state_is_placeholder": all(placeholder)}
        if self._fitted is not None:
            return sd | self._fitted
        for i in range(len(self.model_parts)):
            entry = self._residual_entry(i)
            if entry is not None:
                sd[self._residual_key(i)] = entry
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, opt in enumerate(self.optimizers):
            live = opt.state_dict()
            wrapped = {clean_fqn(fqn): fqn for fqn in live["state"]}
            groups = [dict(state_dict["param_groups"][clean_fqn(g["params"][0])], params=g["params"])
                      for g in live["param_groups"]]
            opt.load_state_dict({
                "state": {fqn: state_dict["state"][name] for name, fqn in wrapped.items()},
                "param_groups": groups,
                "state_is_placeholder": state_dict["state_is_placeholder"]})
            if self._residual_key(i) in state_dict:
                restore_residuals(self.model_parts[i], state_dict[self._residual_key(i)])
        for why in sorted(set(self._residuals_reset.values())):
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                logger.warning(f"[amsp] {why}")
        self._residuals_reset = {}


def _groups_by_pattern(model: nn.Module, patterns: list[tuple[str, dict]] | None):
    """AMSPOptimizer's param_groups of ``model`` for [(regex, kwargs)]: each trainable
    parameter in the group of the first regex found in its name; a regex that finds none
    raises as torchtitan's own container does, and so does a parameter no regex finds."""
    if patterns is None:
        return None
    groups, unmatched = param_groups_by_regex(
        ((n, p) for n, p in model.named_parameters() if p.requires_grad), patterns)
    for (pattern, _), group in zip(patterns, groups):  # torchtitan's check, first
        if not group["params"]:
            raise ValueError(f"Optimizer param_groups pattern '{pattern}' matched no parameters")
    if unmatched:
        names = [clean_fqn(n) for n in unmatched]
        raise ValueError(f"no optimizer param_groups pattern matches {', '.join(names[:3])}"
                         f"{', ...' if len(names) > 3 else ''}: end the list with a "
                         "catch-all pattern '.*'")
    return groups


def refuse_part_keyed(path, metadata) -> None:
    """Raise CheckpointMismatch if the checkpoint at ``path`` (its DCP ``metadata``) keys
    the AMSP optimizer state by model part, as amsp_dtensor did before it keyed it by
    parameter name: DCP would find none of this optimizer's entries in it."""
    part_keyed = sorted(k for k in metadata.state_dict_metadata
                        if k.startswith(f"{OPTIMIZER}.{_PART_KEYED}."))
    if part_keyed:
        raise CheckpointMismatch(
            f"{path} keys its AMSP optimizer state by model part ({part_keyed[0]}), a layout "
            f"this version does not read (it keys it by parameter name, {OPTIMIZER}.state.<fqn>"
            ".<state>): resume it with the amsp_dtensor version that saved it, or load all "
            "but the optimizer state (--checkpoint.exclude_from_loading optimizer)")


def _rename_keys(sd: dict[str, Any], rename) -> dict[str, Any]:
    out = dict(sd)
    out["state"] = {rename(fqn): entry for fqn, entry in sd["state"].items()}
    out["param_groups"] = [dict(g, params=[rename(f) for f in g["params"]])
                           for g in sd["param_groups"]]
    return out


def _clean_keys(sd: dict[str, Any]) -> dict[str, Any]:
    return _rename_keys(sd, clean_fqn)
