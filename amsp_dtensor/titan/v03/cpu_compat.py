"""The shims that let torchtitan 0.3 train on CPU (gloo) with torch 2.13, in one place.

The 0.3 counterpart of ``titan/cpu_compat.py`` (0.2.2's): applied by ``apply()`` only when
no accelerator exists; on a GPU machine it changes nothing. Each shim names the error it
answers, seen with torchtitan 0.3.0 on torch 2.13.0+cpu (4 gloo ranks, llama3
debugmodel). ``apply()`` runs before torchtitan is first imported (shims 1 and 2 act at
import time) and is idempotent. What 0.2.2 needed and 0.3 no longer does: nothing of
0.2.2's shim (6) (qwen3's tied output), whose FSDP path 0.3 rewrote.
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta

import torch

from ...compat import set_pg_timeout
from ..cpu_compat import (  # the shims 0.3 needs exactly as 0.2.2 did
    _cpu_memory_monitor,
    _force_cpu_device_probe,
    _no_gpu_peak_flops_probe,
    needed,
    with_force_sum_reduction,
)

_applied = False

# Modules that import triton at import time, all of them GPU kernels of features a run on
# CPU never calls (the minimal_async_ep comm backend, fused MLA / SwiGLU overrides; the
# "standard" expert-parallel all-to-all dispatch runs on CPU without them).
TRITON_KERNEL_MODULES = (
    "torchtitan.distributed.minimal_async_ep.kernels",
)


def apply() -> bool:
    """Apply all shims if no accelerator exists. Returns True if they were applied."""
    global _applied
    if _applied:
        return True
    if not needed():
        return False
    _stub_triton_kernels()
    _force_cpu_device_probe()
    _cpu_memory_monitor()
    _fsdp_sum_reduction_for_gloo()
    _pg_timeouts_without_device_ids()
    _no_gpu_peak_flops_probe()
    _flex_attention_in_eager_math()
    _applied = True
    return True


# (1) `import torchtitan.trainer` -> components/quantization -> models/common/decoder ->
#     moe -> token_dispatcher -> distributed/minimal_async_ep imports its triton kernels:
#       ModuleNotFoundError: No module named 'triton'
#     (0.2.2 had the same in models/moe/kernels.py.) A stub module answers every name
#     with a function that fails loudly if one of those kernels is ever called on CPU.
def _stub_triton_kernels() -> None:
    try:
        import triton  # noqa: F401

        return  # a real triton exists: nothing to stub
    except ImportError:
        pass
    for name in TRITON_KERNEL_MODULES:
        if name in sys.modules:
            continue
        stub = types.ModuleType(name)

        def __getattr__(attr, _module=name):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def _needs_triton(*args, **kwargs):
                raise RuntimeError(f"{_module}.{attr} is a triton (GPU) kernel; on CPU use "
                                   "torchtitan's standard MoE comm backend")

            return _needs_triton

        stub.__getattr__ = __getattr__
        sys.modules[name] = stub


# (2) torchtitan/tools/utils.py picks `_get_available_device_type() or "cuda"`, so with no
#     accelerator it picks CUDA and Trainer.__init__ fails on `device_module.set_device`:
#       AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'
#     Same bug in 0.3: 0.2.2's shim (2), _force_cpu_device_probe, is applied as it is.


# (3) components/metrics.py's DeviceMemoryMonitor calls CUDA-only APIs torch.cpu lacks:
#       AttributeError: module 'torch.cpu' has no attribute 'get_device_name'
#     0.2.2's shim (3), its resident-memory monitor, is applied as it is (same interface).


# (4) distributed/fsdp.py's disable_fsdp_gradient_division sets the divide factor 1.0 on
#     every FSDP module; FSDP2 then reduces with ReduceOp.PREMUL_SUM, which gloo rejects:
#       RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo
#     With factor 1.0 a plain SUM is the same math (FSDP2's force-sum switch). Used by the
#     torchtitan FSDP baseline; the AMSP engine chooses its own reduce ops.
def _fsdp_sum_reduction_for_gloo() -> None:
    import torchtitan.distributed.fsdp as titan_fsdp

    original = titan_fsdp.disable_fsdp_gradient_division
    wrapped = with_force_sum_reduction(original)
    for mod_name, mod in list(sys.modules.items()):  # the module and those that imported it
        if mod_name.startswith("torchtitan") and getattr(
                mod, "disable_fsdp_gradient_division", None) is original:
            mod.disable_fsdp_gradient_division = wrapped


# (5) After step 1 Trainer.train calls dist_utils.set_pg_timeouts, which runs
#     `barrier(device_ids=[device_module.current_device()])`: on CPU a string, rejected:
#       TypeError: (): incompatible function arguments.
#     Same function with a plain barrier (as 0.2.2's shim (5)).
def _pg_timeouts_without_device_ids() -> None:
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [mesh.get_group()
                  for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            set_pg_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


# (6) get_peak_flops runs `lspci` and otherwise assumes an A100 (two warnings per rank):
#     a CPU's peak is unknown, NaN. Same function in 0.3: 0.2.2's shim (8),
#     _no_gpu_peak_flops_probe, is applied as it is.


# (7) 0.3's llama3 and qwen3 attention is FlexAttention (block-causal over the documents of
#     a sample; 0.3 refuses sdpa for language models). CPU FlexAttention has no eager
#     backward, the first backward fails on every rank:
#       NotImplementedError: FlexAttention does not support backward on CPU.
#     (and its compiled form would cost minutes of inductor codegen per rank on CPU).
#     The same attention, eagerly: the BlockMask's mask_mod made a dense boolean mask and
#     torch's math SDPA run with it (a log-sum-exp computed alongside when one is asked
#     for). Exact up to fp32 round-off of the summation order; score_mod is refused.
def _flex_attention_in_eager_math() -> None:
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torchtitan.models.common.attention import FlexAttention

    def flex_attention_math(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                            enable_gqa=False, return_aux=None, kernel_options=None):
        if score_mod is not None:
            raise NotImplementedError("amsp_dtensor's CPU FlexAttention shim: score_mod is "
                                      "not supported (block masks only)")
        batch, _, q_len, _ = q.shape
        kv_len = k.shape[2]
        mask = None
        if block_mask is not None:
            mask_batch = block_mask.shape[0] if block_mask.shape[0] == batch else None
            mask = create_mask(block_mask.mask_mod, mask_batch, None, q_len, kv_len,
                               device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        lse = None
        if return_aux is not None and getattr(return_aux, "lse", False):
            kk = k
            if enable_gqa and k.shape[1] != q.shape[1]:
                kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            s = scale if scale is not None else q.shape[-1] ** -0.5
            scores = (q @ kk.transpose(-2, -1)) * s
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            lse = torch.logsumexp(scores, dim=-1)
        return out, AuxOutput(lse=lse, max_scores=None)

    FlexAttention._compiled_flex_attn = staticmethod(flex_attention_math)
