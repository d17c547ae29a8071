"""``--experimental.custom_import`` for the grad-norm comparison with torchtitan's own run:
torchtitan's ``clip_grad_norm_`` runs unchanged, and before it rank 0 appends the float64
norm of the same gradients to ``$AMSP_EXACT_GRAD_NORM_FILE`` (one line per step).

    AMSP_EXACT_GRAD_NORM_FILE=norms.txt torchrun ... -m amsp_dtensor.train \\
        --model.name llama3 --experimental.custom_import amsp_dtensor.testing.exact_grad_norm

Why a second norm: torchtitan's is fp32 (``torch.nn.utils.get_total_norm``), and on CPU the
fp32 norm kernel is off by up to ~2e-5 relative for one large tensor (the debug model's
2048 x 256 output-projection grad, single process: 1.9e-5), more than the 1e-6 the
comparison asks. AMSP accumulates its norm in float64. Comparing both with the float64
norm of torchtitan's own gradients compares the gradients, not two roundings.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.distributed import utils as dist_utils

_torchtitan_clip = dist_utils.clip_grad_norm_


def exact_total_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm over all ``grads`` in float64; a DTensor counted by its full tensor, so a
    grad sharded over dp and tp is counted once per element and a replicated one once.
    Collective (``full_tensor``): every rank calls it with the same grads."""
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        full = grad.full_tensor() if isinstance(grad, DTensor) else grad
        total += full.double().pow(2).sum()
    return total.sqrt().item()


def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    parameters = list(parameters)
    exact = exact_total_norm([p.grad for p in parameters if p.grad is not None])
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.environ["AMSP_EXACT_GRAD_NORM_FILE"], "a") as out:
            out.write(f"{exact!r}\n")
    return _torchtitan_clip(parameters, max_norm, *args, **kwargs)


dist_utils.clip_grad_norm_ = clip_grad_norm_
