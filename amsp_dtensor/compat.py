"""Every private torch / torchtitan name the project relies on, each named once.

The engine needs a few things FSDP2, DTensor, autograd and torchtitan do not expose
publicly (a unit's FSDPParams, FSDP's copy-in stream, a DTensor's global offset, ...).
They are reached only through the small functions below, so a torch or torchtitan upgrade
that moves one of them breaks here, by name, and ``tests/test_compat.py`` says which.
``PRIVATE_NAMES`` lists them for that test: (module, dotted attribute path).
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from typing import Iterator

import torch
import torch.nn as nn

# Supported torch: 2.11 to 2.15 (pyproject.toml; docs/torch_versions.md). Where
# torch changed a name or a behaviour inside that range, the choice is made once, below,
# by feature detection (what the installed torch has), not by version number: a backport
# or a nightly then takes the right branch too. Each such choice says which versions take
# which branch.


def public_set_timeout(dist_module=None):
    """``torch.distributed.set_timeout`` where it exists (torch 2.14+), else None (2.13,
    which only has the private ``distributed_c10d._set_pg_timeout``; 2.14+ keeps that one
    as a deprecated alias that warns with a FutureWarning on every call)."""
    dist_module = torch.distributed if dist_module is None else dist_module
    return getattr(dist_module, "set_timeout", None)


def fsdp_reset_keeps_accumulated_grads(fsdp_param_cls=None) -> bool:
    """Whether FSDP2's ``reset_iter_state`` leaves an interrupted backward's gradients in
    the unsharded params (torch 2.13, 2.14: yes, see ``fsdp_reset_iteration``).

    Detected from ``FSDPParam.unsharded_accumulated_grad``: up to 2.14 it is plain
    per-instance state that the reset does not touch (so it can, and must, be cleared by
    hand); torch 2.15 made it a read-only property derived from the unsharded param's
    grad, and its reset clears that grad itself (assigning the property then raises
    "property 'unsharded_accumulated_grad' of 'FSDPParam' object has no setter"). The
    attribute being settable is exactly what the workaround needs to write, so it decides.
    """
    if fsdp_param_cls is None:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        fsdp_param_cls = FSDPParam
    attr = getattr(fsdp_param_cls, "unsharded_accumulated_grad", None)
    return not isinstance(attr, property) or attr.fset is not None


def private_names(dist_module=None, fsdp_module_cls=None) -> tuple[tuple[str, str], ...]:
    """``PRIVATE_NAMES`` for the torch described by ``dist_module`` and ``fsdp_module_cls``
    (default: the installed ``torch.distributed`` and ``FSDPModule``): a name only some
    versions need is listed only on those. (``FSDPState._fsdp_param_group`` is a class-level
    property from 2.12 on and an instance attribute in 2.11: checked through
    ``fsdp_params`` on a real unit.)"""
    names = _ALWAYS_PRIVATE
    if public_set_timeout(dist_module) is None:  # torch 2.11 to 2.13
        names += (("torch.distributed.distributed_c10d", "_set_pg_timeout"),)
    if not fsdp_has_reset_iter_state(fsdp_module_cls):  # 2.11, 2.12: the reset by hand (fsdp_reset_iteration); instance attributes
        names += (("torch.distributed.fsdp._fully_shard._fsdp_common", "TrainingState"),
                  ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                   "FSDPParamGroup._to_sharded"),
                  ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                   "FSDPParamGroup._wait_all_gather_streams_on_event"))
    return names


def fsdp_has_reset_iter_state(fsdp_module_cls=None) -> bool:
    """Whether FSDP2 has ``FSDPModule.reset_iter_state`` (torch 2.13+); 2.11 and 2.12 do
    not, and ``fsdp_reset_iteration`` resets by hand there."""
    if fsdp_module_cls is None:
        from torch.distributed.fsdp import FSDPModule

        fsdp_module_cls = FSDPModule
    return hasattr(fsdp_module_cls, "reset_iter_state")


# [Note: the tensor collectives' names]
# torch 2.13 named the single-tensor all-gather and reduce-scatter
# ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` and kept
# ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` as deprecated forms that forward
# to them; torch 2.11 and 2.12 have only the latter (``AttributeError: module
# 'torch.distributed' has no attribute 'reduce_scatter_single'``). Every caller in the
# project goes through ``all_gather_single`` / ``reduce_scatter_single`` below, which call
# the name this torch has, looked up on ``torch.distributed`` at each call (so a wrapper a
# benchmark or test installs there sees the call). Code that wraps torch's entry points to
# count or time them wraps ``TENSOR_COLLECTIVES``: the base names, which FSDP2 and the
# deprecated forms call too, so nothing counts twice.
def tensor_collective_names(dist_module=None) -> dict[str, str]:
    """{"all_gather": name, "reduce_scatter": name}: the base single-tensor collectives of
    the torch described by ``dist_module`` (default: the installed ``torch.distributed``)."""
    dist_module = torch.distributed if dist_module is None else dist_module
    if hasattr(dist_module, "all_gather_single"):  # torch 2.13+
        return {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    return {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}


TENSOR_COLLECTIVES: dict[str, str] = tensor_collective_names()


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """``dist.all_gather_single`` (2.13+) or ``dist.all_gather_into_tensor`` (2.11, 2.12)."""
    return getattr(torch.distributed, TENSOR_COLLECTIVES["all_gather"])(
        output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=None, group=None,
                          async_op: bool = False):
    """``dist.reduce_scatter_single`` (2.13+) or ``dist.reduce_scatter_tensor`` (2.11,
    2.12); ``op`` defaults to SUM."""
    dist = torch.distributed
    return getattr(dist, TENSOR_COLLECTIVES["reduce_scatter"])(
        output, input, op=dist.ReduceOp.SUM if op is None else op, group=group,
        async_op=async_op)


# Module- and class-level names, checked statically by tests/test_compat.py. Instance
# attributes (FSDPParam._orig_size, FSDPState._comm_ctx, ...) are checked there by calling
# the accessors below on a real one-rank FSDP2 model.
_ALWAYS_PRIVATE: tuple[tuple[str, str], ...] = (
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "DefaultAllGather"),
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "DefaultReduceScatter"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset"),
    ("torch._C", "_current_graph_task_id"),
    ("torch.autograd", "Variable._execution_engine.queue_callback"),
    ("torch._utils", "_get_available_device_type"),
    ("torchtitan.protocols.train_spec", "_extra_train_specs"),
    ("torchtitan.models", "_supported_models"),
    ("torchtitan.models.llama3.infra.parallelize", "_op_sac_save_list"),
    ("torchtitan.models.qwen3.infra.parallelize", "_op_sac_save_list"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    ("torchtitan.models.llama3.model.model", "Transformer._precompute_freqs_cis"),
    ("torch.cuda", "_sleep"),
    ("torch.distributed.fsdp", "FSDPModule._set_unshard_async_op"),
    ("torch.utils._python_dispatch", "TorchDispatchMode"),
    ("torch", "Tensor._version"),
    ("torch", "_chunk_cat"),
    ("torch.autograd", "_profiler_enabled"),
    ("torch", "_foreach_copy_"),
    ("torch", "_foreach_div"),
    ("torch.distributed.tensor", "DTensor._local_tensor"),
    ("torchtitan.config", "ConfigManager._maybe_load_toml"),
    ("torchtitan.components.optimizer", "OptimizersContainer._validate_length"),
    ("torchtitan.components.optimizer", "OptimizersContainer._post_init"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam"),
    ("torch.distributed.pipelining._backward", "stage_backward"),
    ("torch.optim._muon", "_zeropower_via_newtonschulz"),
    ("torch.optim._muon", "_adjust_lr"),
    ("torch.optim.optimizer", "_to_scalar"),
    ("torch.distributed.pipelining._backward", "stage_backward_input"),
    ("torch.distributed.pipelining._backward", "stage_backward_weight"),
    ("torch.distributed.pipelining.stage", "_PipelineStageBase"),
    ("torch.distributed._functional_collectives", "AsyncCollectiveTensor"),
    ("torch.distributed._functional_collectives", "all_to_all_single_autograd"),
    ("torch.distributed._functional_collectives", "all_to_all_single"),
    ("torch", "ops._c10d_functional.all_to_all_single.default"),
    ("torch", "ops._c10d_functional.all_gather_into_tensor.default"),
    ("torch", "ops._c10d_functional.reduce_scatter_tensor.default"),
    ("torch.distributed.tensor.experimental._context_parallel._cp_custom_ops",
     "flex_cp_allgather"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl"),
    ("torch.nn.attention.flex_attention", "_DEFAULT_SPARSE_BLOCK_SIZE"),
)
PRIVATE_NAMES: tuple[tuple[str, str], ...] = private_names()


def resolve(module: str, path: str):
    """Import ``module`` and follow ``path``'s attributes (AttributeError names the gap)."""
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


# ---- FSDP2 -------------------------------------------------------------------------
def fsdp_all_gather_base():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    return DefaultAllGather


def fsdp_reduce_scatter_base():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter


def fsdp_params(module: nn.Module) -> list:
    """FSDP2's FSDPParam objects of a module passed to ``fully_shard`` (one param group)."""
    return module._get_fsdp_state()._fsdp_param_group.fsdp_params


def fsdp_param_layout(fsdp_param) -> tuple[torch.Size, int, int]:
    """(global shape, this rank's real rows, padded rows per rank) of one FSDPParam."""
    rows = fsdp_param.sharded_size[0] if len(fsdp_param.sharded_size) else 1
    padded = fsdp_param.padded_sharded_param_size
    return fsdp_param._orig_size, rows, (padded[0] if len(padded) else 1)


def fsdp_sharded_storage(fsdp_param) -> torch.Tensor:
    """The padded local shard FSDP2 keeps for one param (what the P state costs)."""
    return fsdp_param._sharded_param_data


def fsdp_reset_iteration(module: nn.Module) -> None:
    """FSDP2's ``reset_iter_state()`` for one unit after a forward or backward raised
    (the root's resets every unit's FSDP state), plus, where FSDP2 needs it, the part it
    leaves out.

    Workaround for torch 2.13 and 2.14 (``fsdp_reset_keeps_accumulated_grads``): the reset
    reshards every param group but keeps the gradients autograd already accumulated into
    the *unsharded* params of a unit whose post-backward never ran (the output head's, when
    backward stopped in the blocks), so the retried backward adds to them: the retried step
    trains on a gradient that counts part of the failed micro-batch twice (seen as a 1e-5
    loss drift one step later). torch 2.15's reset clears those gradients itself, and its
    ``unsharded_accumulated_grad`` is a read-only property, so there the reset alone runs."""
    if _RESET_KEEPS_ACCUMULATED_GRADS:
        for fsdp_param in fsdp_params(module):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            fsdp_param.unsharded_accumulated_grad = None
    if module._get_fsdp_state()._is_root is not False:
        if hasattr(module, "reset_iter_state"):  # torch 2.13+
            module.reset_iter_state()
        else:
            _fsdp_reset_iter_state(module._get_fsdp_state())


_RESET_KEEPS_ACCUMULATED_GRADS = fsdp_reset_keeps_accumulated_grads()


def _fsdp_reset_iter_state(state) -> None:
    """torch 2.13's ``FSDPState._reset_iter_state`` (behind ``FSDPModule.reset_iter_state``)
    for torch 2.11 and 2.12, which have no reset: wait for the in-flight all-gather and
    reduce-scatter events, drop their state, reshard every param group, clear the
    iteration's trackers. Without it, after a forward or backward that raised, the next
    forward finds units still FORWARD / PRE_BACKWARD with unsharded params and a stale
    forward root. 2.11 keeps one ``reduce_scatter_state`` and one ``_fsdp_param_group``
    per state; 2.12 has 2.13's lists (``reduce_scatter_states``, ``_fsdp_param_groups``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    stream = state._device_handle.current_stream()
    ctx = state._comm_ctx
    if ctx.all_gather_state is not None:
        if ctx.all_gather_state.event is not None:
            stream.wait_event(ctx.all_gather_state.event)
        ctx.all_gather_state = None
    if hasattr(ctx, "reduce_scatter_states"):  # 2.12
        rs_states, ctx.reduce_scatter_states = list(ctx.reduce_scatter_states), []
    else:  # 2.11
        rs_states, ctx.reduce_scatter_state = [ctx.reduce_scatter_state], None
    for rs_state in rs_states:
        if rs_state is not None and rs_state.event is not None:
            stream.wait_event(rs_state.event)
    ctx.post_forward_order.clear()
    for each in state._state_ctx.all_states:
        each._modules_to_run_forward.clear()
        each._training_state = TrainingState.IDLE
        groups = getattr(each, "_fsdp_param_groups", None)
        for group in groups if groups is not None else [each._fsdp_param_group]:
            if group is not None:
                _fsdp_reset_param_group(group, stream, TrainingState.IDLE)
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def _fsdp_reset_param_group(group, stream, idle) -> None:
    """torch 2.13's ``FSDPParamGroup._reset_iter_state`` (see _fsdp_reset_iter_state)."""
    if group._all_gather_result is not None:
        if group._all_gather_result.all_gather_event is not None:
            stream.wait_event(group._all_gather_result.all_gather_event)
        work = group._all_gather_result.all_gather_work
        if isinstance(work, torch.distributed.distributed_c10d.Work):
            work.wait()
        group._all_gather_result = None
    if group._post_reduce_event is not None:
        stream.wait_event(group._post_reduce_event)
        group._post_reduce_event = None
    if group._all_reduce_state is not None and group._all_reduce_state.event is not None:
        stream.wait_event(group._all_reduce_state.event)
    group._all_reduce_state = None
    if group._reshard_after_forward_event is not None:
        group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
        group._reshard_after_forward_event = None
    group._partial_reduce_output = None
    group._post_forward_indices.clear()
    group._training_state = idle
    group._to_sharded()


def fsdp_mixed_precision(mp_policy):
    """``mp_policy`` with its ``reduce_dtype`` made explicit, for handing to FSDP2: the
    engine's meaning of ``reduce_dtype=None`` ("reduce in the compute dtype:
    ``param_dtype``, else the parameters' dtype") on every torch version.

    torch 2.13 and 2.14 read ``reduce_dtype=None`` so (gradients are computed in
    ``param_dtype``, and reduced as they are); torch 2.15 changed the default to reducing
    in the parameters' grad dtype, which would turn a bf16-compute, fp32-parameter unit's
    reduce-scatter (and the G buffers the engine builds from its output) into fp32: twice
    the bytes, other numerics. An explicit ``reduce_dtype`` means the same on all three,
    so the resolved policy is version-proof. None (no policy) stays None."""
    if mp_policy is None or mp_policy.reduce_dtype is not None or mp_policy.param_dtype is None:
        return mp_policy
    import dataclasses

    return dataclasses.replace(mp_policy, reduce_dtype=mp_policy.param_dtype)


def fsdp_reads_reduce_output_after_hook(reduce_dtype: torch.dtype,
                                         param_dtype: torch.dtype) -> bool:
    """Whether FSDP2 reads its reduce-scatter output after the all-reduce hook returns
    (torch 2.11-2.15 ``foreach_reduce``): it casts the buffer to the sharded parameters'
    dtype for ``.grad`` when the two dtypes differ; otherwise it only makes ``.grad``
    views of it (no read: the engine drops those views, so nothing is accumulated into
    them either). A collective that writes that buffer in place while FSDP2 may read it
    must run on a copy (engine/collectives.py, Note: buffers in flight)."""
    return reduce_dtype != param_dtype


def fsdp_unsharded_grads(module: nn.Module) -> list:
    """The ``.grad`` of each unsharded param of a unit (None where there is none); read
    by tests of the memory model (cost/memory.py's backward moments)."""
    return [getattr(getattr(p, "_unsharded_param", None), "grad", None)
            for p in fsdp_params(module)]


def fsdp_retained_reduce_scatter_inputs(module: nn.Module) -> list[torch.Tensor]:
    """The reduce-scatter inputs FSDP2 keeps alive after their reduce-scatter (shared by
    every unit of one root); read by tests of the memory model."""
    comm_ctx = module._get_fsdp_state()._fsdp_param_group.comm_ctx
    return [state.reduce_scatter_input for state in comm_ctx.reduce_scatter_states]


def fsdp_forward_prefetch_modules(module: nn.Module) -> list[nn.Module]:
    """Modules FSDP2 all-gathers ahead from this unit's pre-forward
    (``set_modules_to_forward_prefetch``)."""
    states = module._get_fsdp_state()._states_to_forward_prefetch
    return [s._modules[0] for s in states if s._modules]


def fsdp_set_unshard_async_op(module: nn.Module, async_op: bool) -> None:
    """Issue this unit's pre-forward / pre-backward / prefetch all-gathers with
    ``async_op`` (FSDP2 keeps the setter private in torch 2.13). Without streams (CPU) an
    async all-gather is the only way a prefetched one runs while the current unit computes."""
    module._set_unshard_async_op(async_op)


def fsdp_unshard_async_op(module: nn.Module) -> bool:
    """Whether this unit's all-gathers are issued async (``fsdp_set_unshard_async_op``)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return bool(group is not None and group.unshard_async_op)


def fsdp_copy_in_stream(module: nn.Module):
    """The stream FSDP2 copies a unit's shards on before all-gathering them (its
    all-gather input); None before lazy init."""
    return _fsdp_comm_stream(module, "all_gather_copy_in_stream")


def fsdp_reduce_scatter_stream(module: nn.Module):
    """The stream FSDP2 runs a unit's reduce-scatter on (and allocates its output, the
    input of our all-reduce hook, on); None before lazy init."""
    return _fsdp_comm_stream(module, "reduce_scatter_stream")


def _fsdp_comm_stream(module: nn.Module, name: str):
    comm_ctx = getattr(module._get_fsdp_state(), "_comm_ctx", None)
    return getattr(comm_ctx, name, None) if comm_ctx else None


# ---- DTensor, DeviceMesh, c10d -----------------------------------------------------------
def global_offset(dtensor) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return tuple(offset)



def dtensor_local(dtensor) -> torch.Tensor:
    """A DTensor's local tensor, read as an attribute (what FSDP2 reads on its hot path):
    ``to_local()`` runs an autograd Function per call, a cost the engine paid per param
    per unit several times a step. Only for values, never for a graph (no grad_fn)."""
    return dtensor._local_tensor


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """``out`` ([num_chunks, n]) row i = chunk i (dim 0, torch.chunk sizes rounded up, zero
    padded) of every tensor, laid end to end: FSDP2's reduce-scatter copy-in, one kernel."""
    torch._chunk_cat(tensors, dim=0, num_chunks=num_chunks, out=out)


def unflatten_dense(flat: torch.Tensor, templates) -> list[torch.Tensor]:
    """Views of ``flat`` laid end to end, shaped like each of ``templates`` (whose sizes
    alone are read: meta tensors do): one C++ call instead of a narrow and a view per
    tensor in Python. Every template must have elements (an empty one gets a fresh
    empty tensor, not a view)."""
    return torch._C._nn.unflatten_dense_tensors(flat, templates)


def foreach_copy_(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dest.copy_(src)`` for each pair (casting as copy_ does), in one foreach call."""
    torch._foreach_copy_(dests, srcs)


def foreach_div(tensors: list[torch.Tensor], divisor: float) -> list[torch.Tensor]:
    """``[t / divisor for t in tensors]`` in one foreach call (the same values)."""
    return list(torch._foreach_div(tensors, divisor))


def profiler_enabled() -> bool:
    """Whether a torch profiler is collecting (``record_function`` ranges are kept)."""
    return torch.autograd._profiler_enabled()


def op_schema(op):
    """The schema of an aten OpOverload (its name, and which returns alias an input)."""
    return op._schema


def tensor_version(t: torch.Tensor) -> int:
    """The in-place write counter autograd keeps on a tensor (shared with its views)."""
    return t._version


def set_pg_timeout(timeout, group) -> None:
    """Set ``group``'s timeout for later collectives: the public
    ``torch.distributed.set_timeout`` (torch 2.14+), else the private
    ``distributed_c10d._set_pg_timeout`` (2.13, which has no public one)."""
    if _SET_TIMEOUT is not None:
        _SET_TIMEOUT(timeout, group)
    else:
        torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


_SET_TIMEOUT = public_set_timeout()


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch's fake backend: this process is one rank of a ``world_size`` job; collectives
    return at once and move no data (for checks at a scale this machine cannot run)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank,
                                         world_size=world_size)


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for ``cycles`` GPU cycles (delays what follows)."""
    torch.cuda._sleep(cycles)


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """``torch.distributed.init_process_group(backend)`` for a job torchrun launched (env://),
    with each restart attempt of a one-node job in its own key space of torchrun's store.

    Workaround for torchrun on torch 2.13 sharing its rendezvous TCPStore with the workers
    (the default; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` turns it off): under
    ``--max-restarts`` a restarted worker can read the previous attempt's addresses from that
    store and fail in ``init_process_group`` with "Gloo connectFullMesh failed ... Connection
    refused" (NCCL: "Failed to connect"), or hang there. It did here in the second of two
    restarts. The key space is named by TORCHELASTIC_RESTART_COUNT, which each node's agent
    counts for itself: on several nodes the counts can differ after a restart, so there the
    plain call is made (launch torchrun with the variable above instead).
    """
    import os

    from torch.distributed import distributed_c10d  # the definition, never the patched name

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    one_node = os.environ.get("GROUP_WORLD_SIZE") == "1"
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt is None
            or not one_node or kwargs.get("store") is not None
            or kwargs.get("init_method") not in (None, "env://")):
        distributed_c10d.init_process_group(backend, **kwargs)
        return
    kwargs.pop("init_method", None)
    world_size = int(os.environ["WORLD_SIZE"])
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world_size,
        is_master=False, **({"timeout": kwargs["timeout"]} if kwargs.get("timeout") else {}))
    kwargs.update(rank=int(os.environ["RANK"]), world_size=world_size)
    distributed_c10d.init_process_group(
        backend, store=torch.distributed.PrefixStore(f"amsp/attempt_{attempt}", store), **kwargs)


@contextlib.contextmanager
def torchrun_restart_safe_init() -> Iterator[None]:
    """While active, ``torch.distributed.init_process_group`` is ``init_process_group``
    above: for torchtitan's ``init_distributed``, which calls it by that name."""
    original = torch.distributed.init_process_group
    torch.distributed.init_process_group = init_process_group
    try:
        yield
    finally:
        torch.distributed.init_process_group = original


def destroy_process_group_at_exit() -> None:
    """End a CLI's process group: drop unreferenced objects while the group still lives,
    align the ranks, destroy. Workaround for gloo on torch 2.13: the validate CLI aborted
    at exit in 1 of 20 runs on a loaded machine ("terminate called without an active
    exception", SIGABRT) after ``destroy_process_group()`` alone; gloo's completed async
    Work objects, and tensors they hold, freed only during interpreter finalization are a
    known way to get there (the spawned test ranks aborted so in 1 of 20 runs too). Callers
    ``del`` their model and optimizer first."""
    import gc
    from datetime import timedelta

    gc.collect()
    if torch.distributed.get_backend() == "gloo":
        # a rank that failed never arrives: give up after a minute instead of hanging
        torch.distributed.monitored_barrier(timeout=timedelta(seconds=60))
    else:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ---- tensor parallelism ------------------------------------------------------------------
# [Note: tensor parallelism applied after amsp.fully_shard] parallelize_module hands each
# target module to DTensor's distribute_module, whose first act is
# ``if getattr(module, "_distribute_module_applied", False): raise ...`` (torch 2.13
# torch/distributed/tensor/_api.py), before any parameter is touched or any collective
# issued. amsp.fully_shard sets that flag on every module whose parameters it sharded to an
# object whose truth test raises our refusal, so the user reads what to change instead of
# torch's "Cannot distribute a DTensor with device mesh ... to a different device mesh"
# (s_p > 1) or, for s_p = 1, a plan that silently stopped matching the parameters. A module
# TP already split keeps torch's True (its own "only be called once" check). Pinned by
# tests/test_tensor_parallel_errors.py: a torch that stops reading the flag fails there.
class _ShardedBeforeTensorParallel:
    def __init__(self, message: str) -> None:
        self.message = message

    def __bool__(self) -> bool:
        raise RuntimeError(self.message)


def refuse_tensor_parallel_after_shard(module: nn.Module, message: str) -> None:
    """Make a later ``distribute_module(module, ...)`` raise RuntimeError(``message``)."""
    if module.__dict__.get("_distribute_module_applied") is True:
        return
    module._distribute_module_applied = _ShardedBeforeTensorParallel(message)


# ---- autograd ------------------------------------------------------------------------
def torch_dispatch_mode_base() -> type:
    """The base class of modes that see every aten op (used by tools/bench_memory to
    sample memory after each op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def model_collective_ops() -> dict:
    """The ops a dispatch mode sees of a model's own collectives, each -> (the recorder's op
    name, whether its buffer is the input or the gathered output, the indices of its
    tensor arguments, the index and keyword of its group name):

    - functional all-to-alls (``all_to_all_single`` and, forward and backward,
      ``all_to_all_single_autograd``): expert parallelism's token exchange;
    - functional all-gathers and reduce-scatters;
    - torch's context-parallel K/V exchange for FlexAttention (``flex_cp_allgather``:
      all-gathers of K and V over the sequence; its backward reduce-scatters their
      gradients), a custom op the mode sees whole (torchtitan's apply_cp_to_forward)."""
    funcol = torch.ops._c10d_functional
    ops = {
        funcol.all_to_all_single.default: ("all_to_all", "input", (0,), 3, "group_name"),
        funcol.all_gather_into_tensor.default: ("all_gather", "output", (0,), 2, "group_name"),
        funcol.reduce_scatter_tensor.default: ("reduce_scatter", "input", (0,), 3, "group_name"),
    }
    cp = _flex_cp_ops()
    if cp is not None:
        gather, scatter = cp
        ops[gather] = ("all_gather", "output", (0, 1), 3, "pg_name")
        ops[scatter] = ("reduce_scatter", "input", (0, 1), 3, "pg_name")
    return ops


def _flex_cp_ops():
    """(flex_cp_allgather, its backward) as ops, or None where torch has no such op."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _cp_custom_ops  # noqa: F401
    except ImportError:
        return None
    return (torch.ops.cplib.flex_cp_allgather.default,
            torch.ops.cplib.flex_cp_allgather_backward.default)


def flex_cp_allgather(k: torch.Tensor, v: torch.Tensor, seq_dim: int, group):
    """K and V gathered over ``group`` along ``seq_dim``, differentiable (the backward
    reduce-scatters their gradients): torch's context-parallel K/V exchange for
    FlexAttention, as torchtitan's apply_cp_to_forward uses it."""
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import (
        flex_cp_allgather as gather)

    return gather(k.contiguous(), v.contiguous(), seq_dim, group.group_name)


def flex_block_size() -> int:
    """FlexAttention's block (128): under context parallelism torch builds each cp rank's
    block mask only when the sequence is a multiple of cp x this ("Q_LEN ... is not
    divisible by CP mesh world size ... * BLOCK_SIZE")."""
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    return _DEFAULT_SPARSE_BLOCK_SIZE


def all_to_all_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Each rank's ``counts`` split evenly over ``group`` and exchanged, waited for: expert
    parallelism's token-count exchange, as torchtitan's (a functional collective)."""
    from torch.distributed._functional_collectives import all_to_all_single

    return all_to_all_single(counts, None, None, group).wait()


def in_backward() -> bool:
    """True while an autograd graph task runs (inside backward)."""
    return torch._C._current_graph_task_id() != -1


def queue_end_of_backward_callback(callback) -> None:
    """Run ``callback`` once the current backward has finished (not after an exception)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# [Note: post-accumulate-grad hooks and the garbage collector] torch's garbage collector
# does not see a tensor's post-accumulate-grad hooks (the tensor's traversal visits its
# pre-hooks only; seen on torch 2.13, and tests/test_compat.py fails on a torch that
# collects them), so a cycle through one is never collected:
# param -> hook -> the unit it closes over -> param keeps the unit, its buffers, its
# module and every tensor they reach alive after the model is dropped (about 30 MB per
# rank per model of the MoE benchmark's size, each configuration of a sweep adding its
# own). The hook below reaches its owner through a weak reference instead: the owner is
# kept alive by the model it belongs to, and the cycle is gone.
def register_post_accumulate_grad_hook(param: torch.Tensor, owner, hook):
    """``param.register_post_accumulate_grad_hook`` of ``hook(owner, param)``, holding
    ``owner`` weakly (see the Note above); a hook whose owner is gone does nothing."""
    ref = weakref.ref(owner)

    def call(tensor: torch.Tensor) -> None:
        if (live := ref()) is not None:
            hook(live, tensor)

    return param.register_post_accumulate_grad_hook(call)


def pipeline_stage_base() -> type:
    """The base class of torch's pipeline stages (``PipelineStage`` and the tracer's)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return _PipelineStageBase


def pipeline_schedule_stages(schedule) -> list:
    """The stages a ``torch.distributed.pipelining`` schedule runs on this rank (its
    ``_stage`` when single-stage, its ``_stages`` otherwise; checked on real schedules by
    tests/test_pipeline.py)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def pipeline_stage_backward(stage_output, output_grads, input_values):
    """One micro-batch's full backward of a pipeline stage, as torch's ``PipelineStage``
    runs it (``torch.distributed.pipelining._backward.stage_backward``): autograd over
    the stage's outputs, returning the gradients of its inputs."""
    from torch.distributed.pipelining._backward import stage_backward

    return stage_backward(stage_output, output_grads, input_values)


def pipeline_stage_backward_input(stage_output, output_grads, input_values, weights):
    """The input half of a split backward (zero-bubble schedules), as torch's
    ``PipelineStage`` runs it (``_backward.stage_backward_input``): the gradients of the
    stage's inputs and the autograd state its weight half needs (``param_groups``); no
    weight's ``.grad`` is touched."""
    from torch.distributed.pipelining._backward import stage_backward_input

    return stage_backward_input(stage_output, output_grads, input_values, weights)


def pipeline_stage_backward_weight(weights, param_groups) -> None:
    """The weight half of a split backward (``_backward.stage_backward_weight``): it
    computes the weights' gradients outside autograd's engine and adds them to each
    weight's ``.grad`` by hand (no post-accumulate-grad hook runs)."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    stage_backward_weight(weights, param_groups)


# ---- torch.compile -------------------------------------------------------------------
def settle_async_collective(value):
    """``value``, or, when it is the not-yet-waited result of an asynchronous DTensor
    redistribution (an AsyncCollectiveTensor, what ``to_local()`` returns after
    ``redistribute(..., async_op=True)``), a plain tensor with its data and autograd
    history.

    Workaround (torch 2.13, CPU and CUDA alike): a torch.compile'd function given such a
    tensor as an input returns its gradient in backward as a plain tensor of the DTensor's
    global shape, and the redistribution's backward fails with "AttributeError: 'Tensor'
    object has no attribute '_local_tensor'" (in NestedRedistribute.forward). Tensor
    parallelism makes one: torchtitan's TP plan gives the token embeddings'
    RowwiseParallel an async redistribution to the sequence-sharded layout, whose local
    output enters the first compiled transformer block. The clone (one activation per
    step) is where eager mode would wait anyway: the block's first op.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value


def all_to_all_autograd(input: torch.Tensor, output_split_sizes: list[int],
                        input_split_sizes: list[int], group) -> torch.Tensor:
    """An all-to-all with uneven splits that autograd differentiates (its backward is the
    all-to-all back): expert parallelism's token dispatch, as torchtitan's."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(input, output_split_sizes, input_split_sizes, group)
    return settle_async_collective(out)


def no_reentrant_checkpoint_impl():
    """torch's CheckpointImpl.NO_REENTRANT: what torchtitan's activation checkpointing
    wraps a block with (its MoE load balancing halves the token counts of such blocks)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return CheckpointImpl.NO_REENTRANT


# ---- torch / torchtitan for the CPU shims ------------------------------------------------
def recompute_rope_table(model) -> None:
    """torchtitan llama3's complex RoPE buffer, rebuilt after ``model.to(bf16)`` cast it to
    real (torchtitan's Transformer._precompute_freqs_cis)."""
    model.freqs_cis = model._precompute_freqs_cis()


def device_probe():
    """torch._utils._get_available_device_type, which torchtitan calls to pick a device."""
    import torch._utils as torch_utils

    return torch_utils._get_available_device_type


def set_device_probe(probe) -> None:
    import torch._utils as torch_utils

    torch_utils._get_available_device_type = probe


def titan_extra_train_specs() -> dict:
    """torchtitan 0.2.2's registry of train specs added at run time."""
    from torchtitan.protocols import train_spec

    return train_spec._extra_train_specs


def titan_load_toml(manager, argv: list[str]) -> dict | None:
    """The TOML file named by ``--job.config_file`` in ``argv``, parsed (None: none given),
    as torchtitan 0.2.2's ConfigManager reads it before merging the command line."""
    return manager._maybe_load_toml(argv)


def titan_optimizers_container_init(container, all_params: list, optimizer_kwargs: dict) -> None:
    """What torchtitan 0.2.2's OptimizersContainer.__init__ does after building its
    optimizers: check one optimizer per model part, and register the parameters for its
    step hooks and ``torch.optim.Optimizer`` bookkeeping."""
    container._validate_length(len(container.model_parts))
    container._post_init(all_params, optimizer_kwargs)


def titan03_optimizers_container_post_init(container, all_params: list) -> None:
    """What torchtitan 0.3's OptimizersContainer.__init__ does after building its
    optimizers: register the parameters for its step hooks and ``torch.optim.Optimizer``
    bookkeeping (0.3's ``_post_init`` takes the parameters only)."""
    container._post_init(all_params)


def titan03_load_registry_config(manager, argv: list[str]):
    """torchtitan 0.3's ConfigManager reading ``--module/--config`` from ``argv``: (the
    registry entry's config, the arguments left for tyro) (0.3 keeps it private)."""
    return manager._load_config(argv)


def titan03_compile_settings() -> None:
    """The dynamo settings torchtitan 0.3's ``apply_compile`` makes before it compiles each
    block, for AMSP's per-block compile on 0.3: scalar outputs captured (MoE's
    data-dependent dispatch) and the forward's side effects not replayed in an activation
    checkpoint's recompute. Without the second, the CPU FlexAttention shim's ``create_mask``
    (a torch function mode entered in forward) stops every compiled block under AC with
    "HOP: Unsafe side effect ... Attempted to mutate TorchFunctionModeStackVariable()"."""
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def pipeline_step_takes_microbatches() -> bool:
    """Whether torch's pipeline schedules take the micro-batches already split
    (``step(arg_mbs=, kwarg_mbs=, target_mbs=)``: torch 2.14+), as torchtitan 0.3's
    trainer passes them. torch 2.13's ``step`` has no such parameters: they land in its
    ``**kwargs`` and are split again, and every rank stops in the first step with
    "Expecting 8 arg_mbs but got 1" (torchtitan 0.3's own pipeline runs too)."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "arg_mbs" in inspect.signature(PipelineScheduleSingle.step).parameters


def titan03_pipeline_split(parallel_dims, parallelism, model_config) -> list[list[str]]:
    """torchtitan 0.3's pipeline_llm split of a model config into the module names of each
    stage (``_get_pipeline_metadata`` and ``_generate_llm_fqn_per_model_part``; 0.3 made
    0.2.2's public ``generate_llm_fqn_per_model_part`` private). Raises their ValueError."""
    from torchtitan.distributed import pipeline_parallel as pp

    stages, layers, first, last = pp._get_pipeline_metadata(parallel_dims, parallelism,
                                                            model_config)
    return pp._generate_llm_fqn_per_model_part(stages, layers, first, last)


def titan03_validate_config(manager) -> None:
    """torchtitan 0.3's ConfigManager checks of ``manager.config``, as its parse_args runs
    them after tyro (0.3 keeps them private)."""
    manager._validate_config()


def titan_builtin_models() -> frozenset:
    """Names of the model folders torchtitan 0.2.2 ships (``torchtitan.models``)."""
    import torchtitan.models as models

    return frozenset(models._supported_models)


def titan_sac_save_list(module) -> set | None:
    """The ops a torchtitan model's parallelize module saves under selective activation
    checkpointing (``_op_sac_save_list``, passed to ``apply_ac``); None if it has none."""
    return getattr(module, "_op_sac_save_list", None)


def muon_orthogonalize(matrix: torch.Tensor, ns_coefficients, ns_steps: int,
                       eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalisation of one whole matrix (in
    bfloat16, as torch returns it), the function its step calls, so an update computed
    from the same matrix is torch's bit for bit."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(matrix, ns_coefficients, ns_steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn, shape) -> float:
    """torch.optim.Muon's learning rate for a matrix of ``shape`` ("original" or
    "match_rms_adamw" scaling), as its step computes it."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, torch.Size(shape))


def optimizer_scalar(value):
    """A torch optimizer's hyperparameter as its step reads it (a tensor lr as a Python
    number), as torch.optim's own steps convert it."""
    from torch.optim.optimizer import _to_scalar

    return _to_scalar(value)
