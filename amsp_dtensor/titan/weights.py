"""Weight initialisation that does not depend on the sharding layout.

Two reasons this exists:
1. amsp.fully_shard needs real (non-meta) parameters, but torchtitan's parallelize_fn runs
   on the meta-device model and initialises weights only afterwards. So the AMSP
   parallelize_fn materialises and initialises the full model first (every rank, same
   seed), shards it, and tells torchtitan's later ``to_empty`` + ``init_weights`` to
   leave the sharded weights alone (``keep_weights``).
   Cost: each rank holds the full model once, before sharding; fine for the debug and
   8B models, not for 70B (see docs/torchtitan.md).
2. On CPU, DTensor's random ops are not offset-based: each rank draws its local shard
   from the same seed, so FSDP's initial weights depend on the layout. To compare a
   torchtitan FSDP run with AMSP runs step by step, ``[amsp] init_like_single_process``
   re-initialises the baseline's sharded params from one full, seeded initialisation.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchtitan.tools.utils import device_type

from ..engine.fqn import clean_fqn


def init_seed(job_config) -> int:
    return job_config.debug.seed if job_config.debug.seed is not None else 0


def init_devices(job_config) -> tuple[str, torch.device | None]:
    """(init_device, buffer_device) exactly as torchtitan's Trainer chooses them."""
    if job_config.checkpoint.create_seed_checkpoint:
        return "cpu", None
    if job_config.training.enable_cpu_offload:
        return "cpu", torch.device(device_type)
    return device_type, None


@torch.no_grad()
def init_full_model(model: nn.Module, job_config) -> None:
    """Materialise a meta model and initialise it from the job's seed (rank-independent)."""
    init_device, buffer_device = init_devices(job_config)
    model.to_empty(device=init_device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed(job_config))
        model.init_weights(buffer_device=buffer_device)


def keep_weights(model: nn.Module) -> None:
    """Make torchtitan's post-parallelize ``to_empty`` / ``init_weights`` no-ops on ``model``.

    Trainer.__init__ calls both on whatever parallelize_fn returns; the weights are already
    initialised and sharded, and the engine's units hold the sharded params.
    """
    model.to_empty = lambda *args, **kwargs: model
    model.init_weights = lambda *args, **kwargs: None


@torch.no_grad()
def reinit_like_single_process(model: nn.Module, build, job_config) -> None:
    """Overwrite ``model``'s (possibly sharded) params with one full seeded initialisation
    of the model ``build()`` makes (called on the meta device)."""
    with torch.device("meta"):
        reference = build()
    init_full_model(reference, job_config)
    full = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        source = full[clean_fqn(name)].to(param.dtype)
        if isinstance(param, DTensor):
            source = distribute_tensor(
                source, param.device_mesh, param.placements, src_data_rank=None
            )
        param.copy_(source)
