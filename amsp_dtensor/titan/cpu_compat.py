"""The shims that let torchtitan 0.2.2 train on CPU (gloo) with torch 2.13-2.15, in one place.

Applied by ``apply()`` only when no accelerator exists (``torch.accelerator.is_available()``
is False); on a GPU machine this module changes nothing. Each shim names the error it
answers, seen on torch 2.13+cpu with torchtitan 0.2.2, and which torch versions need it:
most answer torchtitan 0.2.2 assuming CUDA, which no torch version changes; (4) and (6)
answer torch behaviour that torch 2.13, 2.14 and 2.15 all still have (docs/torch_versions.md),
(10) torch 2.13's (2.14 and 2.15 unchecked: it probes). (1) and (10) let torchtitan's own
MoE models (its FSDP2 and expert parallelism) train on CPU, with the numbers its GPU path
computes. Where the bug is absent a shim does nothing: (1) when a real triton is installed
(the CUDA builds of torch bring one), (2) when torch finds a device, (10) when CPU histc
takes int64. ``apply()`` must run
before ``torchtitan`` is first imported (shims 1 and 2 act at import time); it is
idempotent.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import warnings
from datetime import timedelta

import torch

from ..compat import set_pg_timeout

_applied = False


def needed() -> bool:
    """True when there is no accelerator, i.e. torchtitan would wrongly assume CUDA."""
    return not torch.accelerator.is_available()


def apply() -> bool:
    """Apply all shims if no accelerator exists. Returns True if they were applied."""
    global _applied
    if _applied:
        return True
    if not needed():
        return False
    _stub_moe_triton_kernels()
    _force_cpu_device_probe()
    _cpu_memory_monitor()
    _fsdp_sum_reduction_for_gloo()
    _pg_timeouts_without_device_ids()
    _tied_output_in_the_root_fsdp_unit()
    _no_nccl_error_handling_env()
    _no_gpu_peak_flops_probe()
    _cpu_only_profiler()
    _integer_histc_for_moe_routing()
    _applied = True
    return True


# (1) `import torchtitan` -> components/quantization -> models/moe/utils.py imports the
#     triton kernels module at import time:
#       ModuleNotFoundError: No module named 'triton'
#     The kernels are only used by MoE token permutation (models/moe/utils.py's _permute,
#     under expert parallelism or grouped_mm experts), and torchtitan ships a CPU
#     reference beside them (`generate_permute_indices(..., use_cpu=True)`, which fills
#     the indices with `fill_indices_cpu`). A stand-in module holds torchtitan's own
#     `generate_permute_indices` and `fill_indices_cpu`, taken from the installed
#     kernels.py without its triton parts (nothing named triton is imported), and its
#     `fill_indices_wrapper` (the triton launch) runs `fill_indices_cpu`: _permute's call
#     (use_cpu left False) then computes the same indices, sizes and offsets as the
#     kernel. If that source lacks the two functions, the names fail loudly when called.
#     Needed wherever triton is missing (torch's CPU wheels, any version); the CUDA builds
#     of torch 2.14.1 and 2.15.0 install triton, and then nothing is stubbed.
def _stub_moe_triton_kernels() -> None:
    name = "torchtitan.models.moe.kernels"
    if name in sys.modules:
        return
    try:
        import triton  # noqa: F401

        return  # a real triton exists: nothing to stub
    except ImportError:
        pass
    stub = types.ModuleType(name)
    stub.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    if not _load_cpu_permute_indices(stub):
        def _needs_triton(*args, **kwargs):
            raise RuntimeError(
                "torchtitan MoE token permutation needs triton (GPU), and this torchtitan's "
                "models/moe/kernels.py has no fill_indices_cpu / generate_permute_indices "
                "to run on CPU"
            )

        stub.generate_permute_indices = _needs_triton
        stub.fill_indices_wrapper = _needs_triton
    sys.modules[name] = stub


def _load_cpu_permute_indices(stub: types.ModuleType) -> bool:
    """Put torchtitan's ``fill_indices_cpu`` and ``generate_permute_indices`` (from the
    installed models/moe/kernels.py, its imports of triton and its triton kernel left
    out) into ``stub``, with ``fill_indices_wrapper`` running ``fill_indices_cpu``.
    False if the source or either function is missing."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torchtitan")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(list(spec.submodule_search_locations)[0], "models", "moe", "kernels.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except OSError:
        return False
    wanted = {"fill_indices_cpu", "generate_permute_indices"}
    body = [node for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name in wanted]
    if {node.name for node in body} != wanted:
        return False
    stub.__file__ = path
    stub.torch = torch
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), stub.__dict__)
    fill_indices_cpu = stub.fill_indices_cpu

    def fill_indices_wrapper(tokens_per_expert_group, start_index_values, write_offsets,
                             experts_per_rank, num_ranks, max_len, block_size=128,
                             max_blocks=1024):
        # the triton launch's signature; block_size and max_blocks only shape its grid
        return fill_indices_cpu(tokens_per_expert_group, start_index_values, write_offsets,
                                experts_per_rank, num_ranks, max_len)

    stub.fill_indices_wrapper = fill_indices_wrapper
    return True


# (2) torchtitan/tools/utils.py probes `_get_available_device_type() or "cuda"`, so with no
#     accelerator it picks CUDA (there is no config option) and Trainer.__init__ fails on
#     `device_module.set_device(...)`:
#       AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'
#     Make the probe answer "cpu" while that module is imported, and fix up any torchtitan
#     module that already copied the wrong values. A torchtitan 0.2.2 bug: needed on every
#     torch in range (the probe answers None without an accelerator on 2.13-2.15).
def _force_cpu_device_probe() -> None:
    from ..compat import device_probe, set_device_probe

    original = device_probe()

    @contextlib.contextmanager
    def _probe_says_cpu():
        set_device_probe(lambda: original() or "cpu")
        try:
            yield
        finally:
            set_device_probe(original)

    with _probe_says_cpu():
        import torchtitan.tools.utils  # noqa: F401  (computes device_type at import)

    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("torchtitan") and getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
            if hasattr(mod, "device_module"):
                mod.device_module = torch.cpu


# (3) components/metrics.py's DeviceMemoryMonitor calls CUDA-only APIs that torch.cpu
#     lacks:
#       AttributeError: module 'torch.cpu' has no attribute 'get_device_name'
#     Replace it with a monitor of this process's resident memory (VmRSS / VmHWM peak from
#     /proc; the peak is reset by writing 5 to /proc/self/clear_refs). Needed with
#     torchtitan 0.2.2 on torch 2.13-2.15: none of them has torch.cpu.get_device_name or
#     torch.cpu.memory_stats.
class CpuMemoryMonitor:
    device_name = "cpu"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.device_index = 0
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2**30
        self.reset_peak_stats()

    @staticmethod
    def _status_bytes(key: str) -> int:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return -1

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        active = self._status_bytes("VmRSS")
        peak = self._status_bytes("VmHWM")
        return DeviceMemStats(
            active / 2**30,
            100 * active / self.device_capacity,
            peak / 2**30,
            100 * peak / self.device_capacity,
            0,
            0,
        )

    def reset_peak_stats(self) -> None:
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


def _cpu_memory_monitor() -> None:
    import torchtitan.components.metrics as metrics

    metrics.build_device_memory_monitor = CpuMemoryMonitor


# (4) torchtitan's apply_fsdp calls set_gradient_divide_factor(1.0) on every FSDP module;
#     FSDP2 then reduces with ReduceOp.PREMUL_SUM, which gloo rejects in the first backward:
#       RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo
#     With factor 1.0 a plain SUM is the same math; FSDP2 has a switch for it. (Used by the
#     torchtitan FSDP baseline run; the AMSP engine chooses its own reduce ops.) Needed on
#     torch 2.13-2.15: gloo rejects PREMUL_SUM in each (the message is in all three
#     libtorch_cpu builds).
def _fsdp_sum_reduction_for_gloo() -> None:
    import torchtitan.models.llama3.infra.parallelize as llama_par

    llama_par.disable_fsdp_gradient_division = with_force_sum_reduction(
        llama_par.disable_fsdp_gradient_division)


def with_force_sum_reduction(disable_fsdp_gradient_division):
    """``disable_fsdp_gradient_division`` followed by FSDP2's force-sum switch on every FSDP
    module it saw (shim (4), shared with torchtitan 0.3's shims)."""
    from torch.distributed.fsdp import FSDPModule

    def wrapped(model: torch.nn.Module) -> None:
        disable_fsdp_gradient_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return wrapped


# (5) After step 1, Trainer.train calls dist_utils.set_pg_timeouts, which does
#     `barrier(device_ids=[device_module.current_device()])`; on CPU current_device() is the
#     string "cpu" and gloo's barrier rejects it:
#       TypeError: (): incompatible function arguments.
#     Same function, barrier without device_ids. A torchtitan 0.2.2 bug (it passes a
#     string where barrier takes device indices), needed on torch 2.13-2.15; the timeout
#     is set through compat.set_pg_timeout (torch's public set_timeout on 2.14+).
def _pg_timeouts_without_device_ids() -> None:
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
        torch.distributed.barrier()
        groups = [
            mesh.get_group()
            for mesh in parallel_dims.get_all_one_dimensional_meshes().values()
        ] + [None]
        with warnings.catch_warnings():
            # torch 2.13's private setter warns that only nccl/gloo support it, even for
            # gloo groups (2.14+'s public set_timeout does not)
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            for group in groups:
                set_pg_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


# (6) torchtitan's qwen3 FSDP path (llama4's apply_fsdp) shards tok_embeddings, then
#     [norm, output], then the root, each as its own unit; in qwen3's tied flavors
#     (debugmodel, 0.6B-4B) output.weight IS tok_embeddings.weight, and torch 2.13's
#     FSDP2 refuses a parameter in two units (first forward, on every rank):
#       ValueError: Parameter 'tok_embeddings.weight' is shared with a parameter already
#       managed by another FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) ...
#     (not CPU-specific: torch 2.13 with torchtitan 0.2.2.) When the output head is tied
#     to the embeddings, the separate tok_embeddings and [norm, output] units are skipped,
#     so all three land in the root unit, as AMSP shards them. Used by the qwen3 FSDP
#     baseline. Needed on torch 2.13-2.15: FSDP2 refuses a shared parameter in two units
#     in each (the same check, same message).
def _tied_output_in_the_root_fsdp_unit() -> None:
    import torchtitan.models.llama3.infra.parallelize as llama_par
    import torchtitan.models.llama4.infra.parallelize as llama4_par
    import torchtitan.models.qwen3.infra.parallelize as qwen3_par

    # shim (4) for modules that copied disable_fsdp_gradient_division before it was patched
    for mod in (llama4_par, qwen3_par):
        mod.disable_fsdp_gradient_division = llama_par.disable_fsdp_gradient_division

    original_apply = llama4_par.apply_fsdp
    original_fully_shard = llama4_par.fully_shard
    tied: list[tuple] = []  # (root module, ids of its tied params) per apply_fsdp call

    def fully_shard(module, *args, **kwargs):
        root, shared = tied[-1] if tied else (None, set())
        modules = module if isinstance(module, list) else [module]
        if module is not root and any(id(p) in shared for m in modules for p in m.parameters()):
            return module  # the embeddings or [norm, output]: the root unit takes them
        return original_fully_shard(module, *args, **kwargs)

    def apply_fsdp(model, *args, **kwargs):
        output = getattr(model, "output", None)
        embed = getattr(model, "tok_embeddings", None)
        shared = set()
        if output is not None and embed is not None and output.weight is embed.weight:
            shared.add(id(output.weight))
        tied.append((model, shared))
        try:
            return original_apply(model, *args, **kwargs)
        finally:
            tied.pop()

    llama4_par.fully_shard = fully_shard
    llama4_par.apply_fsdp = apply_fsdp
    qwen3_par.apply_fsdp = apply_fsdp


# (7) torchtitan's init_distributed sets TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (for NCCL's
#     flight recorder) and warns on every rank when the variable exists already, which it
#     does under torchrun:
#       WARNING - ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config
#     No accelerator means gloo, which does not read it: drop the variable, torchtitan sets
#     its value without the warning. torchtitan 0.2.2, any torch.
def _no_nccl_error_handling_env() -> None:
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)


# (8) torchtitan's get_peak_flops runs `lspci` to find an NVIDIA H100 and otherwise assumes
#     an A100, warning twice per call (the Trainer and the metrics processor each call it,
#     on every rank):
#       WARNING - Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use device_name
#       WARNING - Peak flops undefined for: cpu, fallback to A100
#     A CPU's peak FLOP rate is unknown: answer NaN, so "mfu" reads nan% instead of a
#     fraction of an A100 (the AMSP metrics drop it from TensorBoard, see titan/metrics.py).
#     torchtitan 0.2.2, any torch.
def _no_gpu_peak_flops_probe() -> None:
    import torchtitan.tools.utils as titan_utils

    original = titan_utils.get_peak_flops

    def get_peak_flops(device_name: str) -> float:
        if device_name == "cpu":
            return float("nan")
        return original(device_name)

    titan_utils.get_peak_flops = get_peak_flops


# (9) torchtitan's profiler (`--profiling.enable_profiling`) asks for the CPU and the GPU
#     activity, the latter None when there is no CUDA or XPU device:
#       TypeError: Expected ProfilerActivity or dict, got <class 'NoneType'>
#     The torch its profiling module sees is torch with a `profiler.profile` that drops
#     the None. torchtitan 0.2.2, any torch.
def _cpu_only_profiler() -> None:
    import torchtitan.tools.profiling as titan_profiling

    real = torch.profiler.profile

    def profile(*args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        return real(*args, activities=activities, **kwargs)

    profiler = types.ModuleType("torch.profiler")
    profiler.__dict__.update(vars(torch.profiler))
    profiler.profile = profile
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # the rest is torch's own
    proxy.profiler = profiler
    titan_profiling.torch = proxy


# (10) torchtitan's MoE router and token reorderer (models/moe/moe.py) count the tokens of
#     each expert with torch.histc on the int64 expert ids (qwen3 *_moe, deepseek_v3,
#     llama4 flavors), which the CUDA kernel accepts and the CPU kernel does not (first
#     forward, every rank):
#       NotImplementedError: "histogram_cpu" not implemented for 'Long'
#     The torch that module sees is torch with a histc that, for an integer input, counts
#     in float64 and returns the input's dtype, as the CUDA kernel does: the counts are
#     integers (exact in float64 below 2**53) and with torchtitan's bins = max - min = the
#     number of experts each id lands in its own bin, so the counts, their dtype, and the
#     all-to-all splits built from them are the GPU path's. Floating inputs go to torch's
#     histc unchanged. Seen with torchtitan 0.2.2 on torch 2.13 (its CPU histogram kernel
#     is floating-only); 2.14 and 2.15 are not checked here, so the shim probes: where CPU
#     histc takes int64 it does nothing.
def _integer_histc_for_moe_routing() -> None:
    real = torch.histc
    try:
        real(torch.zeros(1, dtype=torch.int64), bins=1, min=0, max=1)
        return  # this torch counts integers on CPU: nothing to shim
    except (NotImplementedError, RuntimeError):
        pass
    import torchtitan.models.moe.moe as moe

    def histc(input, bins=100, min=0, max=0, *, out=None):
        if out is not None or input.is_floating_point():
            return real(input, bins=bins, min=min, max=max, out=out)
        return real(input.double(), bins=bins, min=min, max=max).to(input.dtype)

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # the rest is torch's own
    proxy.histc = histc
    moe.torch = proxy
