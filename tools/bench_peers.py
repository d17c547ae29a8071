"""The peers: DeepSpeed ZeRO and Megatron-FSDP, through their public APIs, on CPU and gloo.

``python -m tools.bench install-peers`` puts DeepSpeed 0.19.8 and Megatron-FSDP 0.6.1 under
runs/peers/ (pip --target --no-deps: torch stays the one installed), and DeepSpeed 0.19.6
for MiCS, which 0.19.7 removed (MiCS runs in a process set of its own, ``ENVS``). Keys:
``ds_z1`` / ``ds_z2`` / ``ds_z3`` (ZeRO stage, 3 built under zero.Init), ``ds_hpz:<s>``
(ZeRO++ hpZ partition size), ``ds_mics:<s>`` (MiCS shard size), ``mfsdp_z3`` and
``mfsdp_hfsdp:<s>`` (its hybrid mode, optimizer states also sharded over the outer
dimension). Settings as their documentation recommends for the size (DeepSpeed: overlap_comm
and the model-size rules of its "auto" values); our torch AdamW as client optimizer, our
initial weights. The CPU and gloo fixes are in ``_cpu_fixes`` and ``_CudaShim``, each with
the error it answers and the version it was seen on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tools import bench_systems as S

ROOT = Path(__file__).resolve().parents[1] / "runs" / "peers"
# process set -> the folders on its sys.path (the first holds its DeepSpeed)
ENVS = {"main": ("ds0198", "common"), "mics": ("ds0196", "common")}
PINS = {"ds0198": ["deepspeed==0.19.8"], "ds0196": ["deepspeed==0.19.6"],
        "common": ["megatron-fsdp==0.6.1", "hjson", "msgpack", "ninja", "psutil"]}


def env_of(key: str) -> str:
    """The process set a configuration runs in."""
    return "mics" if key.startswith("ds_mics") else "main"


def install() -> int:
    """pip --target installs of the peers under runs/peers/ (never touches torch)."""
    env = dict(os.environ, DS_BUILD_OPS="0")  # no compiled ops: training uses none on CPU
    for folder, pins in PINS.items():
        # DeepSpeed is an sdist whose setup imports torch: build against the installed one
        extra = ["--no-build-isolation", "--no-binary", "deepspeed"] if "ds" in folder else []
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--target",
               str(ROOT / folder), *extra, *pins]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=env)
        if rc:
            return rc
    return 0


def missing(key: str) -> str | None:
    """Why configuration `key` cannot run here (one line), or None."""
    if not key.startswith(("ds_", "mfsdp")):
        return None
    need = ENVS[env_of(key)][0] if key.startswith("ds_") else "common"
    if not (ROOT / need / ("deepspeed" if need != "common" else "megatron_fsdp")).is_dir():
        return (f"{key}: runs/peers/{need} is not installed "
                "(python -m tools.bench install-peers)")
    return None


def moe_refusal(key: str) -> str:
    """Why peer configuration `key` does not run the MoE flavour (one line)."""
    if key.startswith("ds_"):
        return ("DeepSpeed's expert parallelism runs only its own MoE layer "
                "(deepspeed.moe.layer.MoE: a gate with a capacity factor that drops tokens past "
                "capacity and renormalises the top-k weights, one module per expert), not "
                "torchtitan's MoE block, so it would train another model; its ZeRO stages "
                "without that layer have no EP")
    return ("this harness drives Megatron-FSDP through its standalone fully_shard over one "
            "data-parallel mesh; its expert-data-parallel layout is set up by Megatron-Core's "
            "model adapter for Megatron-Core's own MoE layer (not tried here)")


def activate(env: str) -> None:
    """Put this process set's peers on sys.path (before anything imports them)."""
    for folder in reversed(ENVS[env]):
        if (ROOT / folder).is_dir():
            sys.path.insert(0, str(ROOT / folder))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _cpu_fixes(deepspeed, mics: bool) -> None:
    """Run-time patches of DeepSpeed, idempotent; nothing else is changed."""
    # 0.19.6 and 0.19.8: init_distributed JIT-compiles a C++ shared-memory op for
    # inference_all_reduce (1.5-3 min per fresh machine, DS_BUILD_OPS=0 does not stop it);
    # training never calls it. (`import deepspeed.comm.torch as m` would give torch itself.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")  # wraps our process group
    if not mics:
        return
    # 0.19.6 MiCS on gloo: "Backend gloo does not implement startCoalescing"; without the
    # coalescing manager it issues the plain all-gather, still over its shard group.
    import deepspeed.comm.comm as dcc

    dcc.cdb.has_coalescing_manager = False
    # 0.19.6 MiCS with more than one shard group deadlocks in the first step: stage 3 takes
    # the partition group from param.ds_process_group (the world under MiCS_Init), so ranks
    # outside the first shard group hold "no real data" and the replica all-reduce waits
    # forever. Partition over the MiCS shard group, as MiCS_Init placed the parameters.
    from deepspeed.runtime.zero.mics import MiCS_Optimizer

    if hasattr(MiCS_Optimizer, "_get_param_partition_group"):
        MiCS_Optimizer._get_param_partition_group = (
            lambda self, p: p.comm.param_shard_group if hasattr(p, "comm")
            else self.dp_process_group)


class _CudaShim:
    """Megatron-FSDP 0.6.1 is CUDA-only as shipped: ``MegatronFSDP.__init__`` calls
    torch.cuda.current_device() ("Torch not compiled with CUDA enabled"), and it records
    streams and events around every gather and reduce; uneven_dtensor calls ``.cuda()``.
    On CPU those are no-ops (one stream, ops in program order). Installed for the life of
    one Megatron-FSDP system only, and undone in ``restore``.

    Its parameter all-gathers are issued asynchronously and a gathered bucket is recycled
    once the stream events say it is free; with no-op events a bucket could be recycled
    while gloo still wrote into it: "malloc(): unaligned tcache chunk detected" (SIGABRT)
    in the hybrid mode at 4x2, once the sweep's idle process groups were gone. So its
    coalesced all-gathers wait for their work before returning."""

    class _Nop:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: True if name == "query" else _CudaShim._Nop()

    def __init__(self):
        nop = _CudaShim._Nop()
        self._patches = [(torch.cuda, "Stream", _CudaShim._Nop), (torch.cuda, "Event", _CudaShim._Nop),
                         (torch.cuda, "stream", lambda s=None: contextlib.nullcontext()),
                         (torch.cuda, "current_stream", lambda *a, **k: nop),
                         (torch.cuda, "synchronize", lambda *a, **k: None),
                         (torch.cuda, "current_device", lambda: 0),
                         (torch.cuda, "empty_cache", lambda: None),
                         (torch.Tensor, "cuda", lambda self, *a, **k: self)]
        if importlib.util.find_spec("megatron_fsdp"):
            from megatron_fsdp import param_and_grad_buffer as buffers

            coalesced = buffers._coalescing_manager
            self._patches.append((buffers, "_coalescing_manager",
                                  lambda group=None, device=None, async_ops=False:
                                  coalesced(group, device, async_ops=False)))
        self._saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self._patches]
        for obj, name, value in self._patches:
            setattr(obj, name, value)

    def restore(self) -> None:
        for obj, name, value in self._saved:
            setattr(obj, name, value)


class DeepSpeedSystem(S.System):
    def __init__(self, key: str, model_args, seed: int, lr: float, micro_batches: int,
                 micro_batch: int, hpz_groups: dict):
        import deepspeed
        from deepspeed.utils import groups

        head, _, arg = key.partition(":")
        mics = head == "ds_mics"
        _cpu_fixes(deepspeed, mics)
        h = model_args.dim
        zero = {"stage": {"ds_z1": 1, "ds_z2": 2}.get(head, 3), "overlap_comm": True,
                "contiguous_gradients": True, "reduce_bucket_size": h * h}
        if zero["stage"] == 3:
            zero.update(stage3_prefetch_bucket_size=int(0.9 * h * h),
                        stage3_param_persistence_threshold=10 * h)
        if head == "ds_hpz":
            zero["zero_hpz_partition_size"] = int(arg)
        if mics:
            zero.update(mics_shard_size=int(arg), mics_hierarchical_params_gather=False)
        # gradient_clipping: DeepSpeed clips the norm at 1.0 unless told otherwise (0.19.6
        # and 0.19.8); no other system here clips
        cfg = {"train_micro_batch_size_per_gpu": micro_batch,
               "gradient_accumulation_steps": micro_batches, "zero_optimization": zero,
               "gradient_clipping": 0.0, "steps_per_print": 10**9}
        # DeepSpeed keeps one hpZ group per process and asserts "ZeRO parameter intra
        # parallel group is already initialized" when a second engine asks for one: hand
        # each engine the group of its size, built once (None: not hpZ, or first time)
        hpz = int(arg) if head == "ds_hpz" else 0
        groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = hpz_groups.get(hpz)
        ours = S.build_model(model_args, seed)
        if zero["stage"] == 3:
            init = (deepspeed.zero.MiCS_Init if mics else deepspeed.zero.Init)
            group = {"zero_param_parallel_group": hpz_groups[hpz]} if hpz in hpz_groups else {}
            with init(config_dict_or_path=cfg, **group):
                model = S.build_model(model_args, seed)
            # zero.Init / MiCS_Init draw their own initial values: copy ours in
            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if dist.get_rank() == 0:
                    for (_, p), q in zip(model.named_parameters(), ours.parameters()):
                        p.data.copy_(q.data)
            del ours
        else:
            model = ours
        self.model, self.optim, _, _ = deepspeed.initialize(
            model=model, optimizer=S.adamw(model.parameters(), lr), config=cfg)
        if hpz:
            hpz_groups[hpz] = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
        import psutil

        self._rss0 = psutil.Process().memory_info().rss

    def train_step(self, batches, probe=lambda: None, before_step=lambda: None) -> float:
        # DeepSpeed's loop: backward and step on every micro-batch; the engine reduces where
        # its stage does and steps at the accumulation boundary. The boundary and the 1/M
        # scale are given per step, not taken from the configured M, so that a step of fewer
        # micro-batches (a short warm-up) is the same step as in every other system
        total = 0.0
        for i, (tokens, labels) in enumerate(batches):
            self.model.set_gradient_accumulation_boundary(i == len(batches) - 1)
            loss = S.lm_loss(self.model, tokens, labels)
            self.model.backward(loss / len(batches), scale_wrt_gas=False)
            probe()
            if i == len(batches) - 1:
                before_step()
            self.model.step()
            total += loss.item() / len(batches)
        probe()
        return total

    def state_bytes(self) -> dict[str, int]:
        """P: this rank's parameter storage (ZeRO-3: its partitions), G: the optimizer's
        gradient partitions and buffers, OS: fp32 partitions and AdamW's moments."""
        seen: set[int] = set()
        params = [getattr(p, "ds_tensor", p) for p in self.model.module.parameters()]
        opt = self.optim
        out = {"param": S._bytes(params, seen), "grad": 0, "optim": 0}
        for name, value in vars(opt).items():
            ts = _tensors(value)
            part = "grad" if "grad" in name else "optim" if "fp32" in name else None
            if part and ts:
                out[part] += S._bytes(ts, seen)
        out["optim"] += S._bytes(S.optim_states(getattr(opt, "optimizer", opt)), seen)
        return out

    def reported_bytes(self) -> dict[str, int]:
        # see_memory_usage's "MA" under DS_ACCELERATOR=cpu is the process RSS
        from deepspeed.accelerator import get_accelerator

        return {"rss_delta": get_accelerator().memory_allocated() - self._rss0}


def _tensors(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class MegatronFSDPSystem(S.System):
    def __init__(self, key: str, model_args, seed: int, lr: float, meshes: S.Meshes):
        head, _, arg = key.partition(":")
        self._shim = _CudaShim()
        from megatron_fsdp import fully_shard
        from torchtitan.models.llama3.model.model import TransformerBlock

        model = S.build_model(model_args, seed)
        opt = S.adamw(model.parameters(), lr)
        if head == "mfsdp_hfsdp":
            s = int(arg)
            mesh = meshes.get((meshes.world // s, s, 1), ("outer", "fsdp", "tp"))
            flat = meshes._cache.setdefault(("flat", s), mesh["outer", "fsdp"]._flatten())
            hybrid = dict(dp_outer_dim="outer", hybrid_fsdp_group=flat.get_group(),
                          outer_dp_sharding_strategy=1)
        else:
            mesh, hybrid = meshes.get((meshes.world, 1), ("fsdp", "tp")), {}
        # fully_shard's optimizer wrapper runs one AdamW step on zero gradients to create
        # the states: with weight decay 0 it leaves the weights as they are, and dropping
        # those states makes our first step AdamW's step 1, as in every other system
        for g in [opt.defaults, *opt.param_groups]:
            g["weight_decay"] = 0.0
        self.model, self.optim = fully_shard(
            model, opt, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
            fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=3,
            # its setting for gradient accumulation: sync on the last micro-batch (no_sync
            # before it). The default (True) also runs the hybrid outer all-reduce on every
            # micro-batch, over the gradients accumulated so far, which counts the earlier
            # micro-batches again (loss off DDP's by 1.6e-3 after 3 steps at 2x2, 0.6.1)
            sync_model_each_microbatch=False, device=torch.device("cpu"), **hybrid)
        self.optim.state.clear()
        for g in [self.optim.defaults, *self.optim.param_groups]:
            g["weight_decay"] = 0.1
        # gloo has no PREMUL_SUM ("unsupported reduce op"): scale, then sum
        self.model.ddp_config.gradient_reduce_div_fusion = False

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()

    def close(self) -> None:
        self._shim.restore()


def make_system(key: str, model_args, seed: int, lr: float, meshes, workload) -> S.System:
    if key.startswith("ds_"):
        return DeepSpeedSystem(key, model_args, seed, lr, workload.micro_batches,
                               workload.micro_batch, meshes._cache.setdefault("hpz", {}))
    if key.startswith("mfsdp"):
        return MegatronFSDPSystem(key, model_args, seed, lr, meshes)
    raise ValueError(f"unknown configuration {key!r}")
