"""``--experimental.custom_import`` for the grad-norm comparison with torchtitan's own run:
torchtitan's ``clip_grad_norm_`` runs unchanged, and before it rank 0 appends the float64
norm of the same gradients to ``$AMSP_EXACT_GRAD_NORM_FILE`` (one line per step).

    AMSP_EXACT_GRAD_NORM_FILE=norms.txt torchrun ... -m amsp_dtensor.train \\
        --model.name llama3 --experimental.custom_import amsp_dtensor.testing.exact_grad_norm

Under pipeline parallelism each rank holds its own stages' gradients only: the float64 sum
of squares is summed over the ``pp_mesh`` that torchtitan passes to its clip (one float64
all-reduce), so rank 0 writes the norm of the whole model, as torchtitan's clip reduces its
own fp32 norm over the same group.

In an AMSP run the same import records the float64 norm of AMSP's own gradients before
AMSP's clip: each fp32 master grad made the DTensor of its master (the optimizer's OS rows)
and taken whole with ``full_tensor()``, so every element is counted once by DTensor's
placements, not by the engine's own grouping. This is the reference for AMSP's norm at the
steps after the first, where the two runs' weights no longer agree bit for bit.

Why a second norm: torchtitan's is fp32 (``torch.nn.utils.get_total_norm``), and on CPU the
fp32 norm kernel is off by up to ~2e-5 relative for one large tensor (the debug model's
2048 x 256 output-projection grad, single process: 1.9e-5; under pp 2 x dp 2 one stage's
1024 x 256 shard of it: 4.4e-5 low), more than the 1e-6 the comparison asks. AMSP sums its
squares with torch's sum (pairwise), not the norm kernel, and is within 1e-7 of this
float64 norm. Comparing both with the float64 norm of torchtitan's own gradients compares
the gradients, not two roundings.

``AMSP_EXACT_GRAD_NORM_CLIP=1`` (by hand): torchtitan's run clips by the float64 norm, not
its own fp32 one (and prints it). Under pp 2 x dp 2 (1F1B) AMSP's norm then equals the
float64 norm of torchtitan's gradients within 1e-7 at every one of 10 steps, where with
torchtitan's fp32 clip the two drift apart by up to 4.4e-6 after step 1: the drift is the
fp32 norm's, through the clip coefficient, not a difference in the gradients.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.distributed import utils as dist_utils

from amsp_dtensor.titan.amsp_optimizers import AmspOptimizers

_torchtitan_clip = dist_utils.clip_grad_norm_
_SIGNATURE = inspect.signature(_torchtitan_clip)


def exact_total_norm(grads: list[torch.Tensor], pp_mesh=None) -> float:
    """The 2-norm over all ``grads`` in float64; a DTensor counted by its full tensor, so a
    grad sharded over dp and tp is counted once per element and a replicated one once;
    with ``pp_mesh``, the sum of squares also summed over the pipeline stages.
    Collective (``full_tensor``, the pp all-reduce): every rank calls it."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        total += full.double().pow(2).sum().cpu()
    if pp_mesh is not None:
        # gloo and nccl both reduce float64; on a GPU job the scalar travels on its device
        device = grads[0].device if grads else torch.device("cpu")
        total = total.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
    return total.sqrt().item()


def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    bound = _SIGNATURE.bind(parameters, max_norm, *args, **kwargs)
    bound.apply_defaults()
    exact = exact_total_norm([p.grad for p in parameters if p.grad is not None],
                             bound.arguments["pp_mesh"])
    _write(exact)
    if os.environ.get("AMSP_EXACT_GRAD_NORM_CLIP") == "1" and bound.arguments["norm_type"] == 2:
        # by hand only: torchtitan clips by (and returns) the float64 norm instead of its
        # fp32 one, to tell the fp32 norm's effect on the trajectory from the gradients'
        total = torch.tensor(exact, dtype=torch.float32)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total,
                                             bound.arguments["foreach"])
        return total
    return _torchtitan_clip(parameters, max_norm, *args, **kwargs)


def _write(exact: float) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.environ["AMSP_EXACT_GRAD_NORM_FILE"], "a") as out:
            out.write(f"{exact!r}\n")


def amsp_full_grads(optimizer) -> list[DTensor]:
    """An AMSPOptimizer's gradients as DTensors of its masters' placements (the grads the
    clip is about to read: fp32, already divided by the gradient divide factor)."""
    optimizer._prepare_master_grads()  # what clip_grad_norm_ does first (idempotent)
    return [DTensor.from_local(p.grad, m.device_mesh, m.placements, run_check=False,
                               shape=m.shape, stride=m.stride())
            for p, m in zip(optimizer._opt_params, optimizer._masters) if p.grad is not None]


def _amsp_clip(original):
    def clip_grad_norm_(self, max_norm):
        grads = [g for optimizer in self.optimizers for g in amsp_full_grads(optimizer)]
        info = self.optimizers[0]._root.info
        _write(exact_total_norm(grads, info.pp_mesh["pp"] if info.pp > 1 else None))
        return original(self, max_norm)
    return clip_grad_norm_


dist_utils.clip_grad_norm_ = clip_grad_norm_
# an AMSP run: titan/steps.py routes torchtitan's clip call to AMSP's, so record before that
AmspOptimizers.clip_grad_norm_ = _amsp_clip(AmspOptimizers.clip_grad_norm_)
