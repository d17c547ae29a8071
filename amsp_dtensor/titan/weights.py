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
Under pipeline parallelism the parallelize_fn sees one part of the model at a time; each part
takes its weights from one initialisation of the whole model (``whole_model_of_parts``), so
every pipeline degree starts from the weights of the unsplit model.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

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
    """Materialise a meta model and initialise it from the job's seed (rank-independent).

    Inside ``whole_model_of_parts`` ``model`` is one pipeline part: its parameters and
    buffers are those of the whole model's initialisation, by name."""
    if _WHOLE:
        _init_part_from_whole(model, _WHOLE[-1], job_config)
    else:
        _init_from_seed(model, job_config)


@torch.no_grad()
def _init_from_seed(model: nn.Module, job_config) -> None:
    init_device, buffer_device = init_devices(job_config)
    model.to_empty(device=init_device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed(job_config))
        model.init_weights(buffer_device=buffer_device)


# [Note: pipeline parts start from the whole model] torchtitan's pipelining_fn (pipeline_llm)
# cuts the meta model into parts and calls the parallelize_fn on each. A part's own
# init_weights, seeded alike on every part, would draw the same numbers for the first
# layers of every part (same-shaped parts got identical weights: the interleaved schedule's
# loss started at 15.5 instead of 8.2). So while the parts are cut, the whole meta model is
# kept here, initialised once (on the first part's request) and each part's tensors copied
# from it by name; the part and the whole name their tensors alike (pipeline_llm deletes
# modules, it does not rename them).
_WHOLE: list[dict] = []  # the pipeline being cut: {"meta": model, "init": model | None}


@contextlib.contextmanager
def whole_model_of_parts(model: nn.Module):
    """While torchtitan's pipelining_fn cuts ``model`` (on the meta device) into parts,
    ``init_full_model`` initialises each part from one initialisation of ``model``; the
    initialised copy is dropped on exit."""
    _WHOLE.append({"meta": model, "init": None})
    try:
        yield
    finally:
        _WHOLE.pop()


def _init_part_from_whole(part: nn.Module, whole: dict, job_config) -> None:
    if whole["init"] is None:  # one copy per pipeline, shared by this rank's parts
        whole["init"] = copy.deepcopy(whole["meta"])
        _init_from_seed(whole["init"], job_config)
    reference = whole["init"]
    tensors = dict(itertools.chain(reference.named_parameters(), reference.named_buffers()))
    part.to_empty(device=init_devices(job_config)[0])
    for name, param in part.named_parameters():
        param.copy_(_source(tensors, name, part))
    for name, _ in list(part.named_buffers()):
        # as init_weights places them (buffer_device), not where to_empty put them
        owner, _, leaf = name.rpartition(".")
        part.get_submodule(owner)._buffers[leaf] = _source(tensors, name, part).clone()


def _source(tensors: dict, name: str, part: nn.Module) -> torch.Tensor:
    try:
        return tensors[clean_fqn(name)]
    except KeyError:
        raise ValueError(
            f"init_full_model: pipeline part {type(part).__name__} has {name!r}, which the "
            "whole model does not; initialise it with [amsp] init_full_model = false or "
            "load a seed checkpoint (checkpoint.initial_load_path)") from None


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
