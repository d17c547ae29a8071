"""The systems compared by tools/bench.py, each built with its own (torch's) code.

Every system gets the same model (torchtitan llama3, same seed), the same AdamW, the same
data, all-fp32 (see docs/benchmarks.md: bf16 matmuls are ~20x slower than fp32 on this
AVX2-only CPU), and its best settings for gradient accumulation over M micro-batches:
  ddp     torch DistributedDataParallel, no_sync() on all but the last micro-batch,
          Python allreduce_hook (same algorithm as the built-in; lets bench_comm count it)
  zero1   ZeroRedundancyOptimizer(AdamW) under the same DDP
  zero3   FSDP2 fully_shard per block + root on the 1-D world mesh (reduce-scatter every
          micro-batch: FSDP2 keeps only sharded grads)
  zero3_keep  the same with reshard_after_forward=False (gathered blocks kept from forward
          to backward: no backward all-gather, more memory)
  hsdp    FSDP2 fully_shard on the 2-D mesh (replicate = nodes, shard = ranks of a node),
          set_requires_all_reduce(False) on all but the last micro-batch (the replica
          all-reduce runs once per step)
  hsdp:<s>  the same with shard groups of s consecutive ranks, replicate = world / s
  hpz     FSDP2 fully_shard on the world mesh, reshard_after_forward = ranks per node
          (ZeRO++ hpZ: backward all-gathers inside the node)
  amsp    amsp_dtensor.fully_shard + AMSPOptimizer with a ShardingPlan, amsp.no_sync;
          torchtitan's units by default (tok_embeddings, each block, [norm, output], root)
FSDP-based systems get explicit forward and backward prefetch of the next block (on CPU
there are no streams, so FSDP2's implicit prefetch does not overlap anything) and force-sum
reductions (gloo rejects PREMUL_SUM/AVG).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

SYSTEM_LABELS = {
    "ddp": "DDP",
    "zero1": "ZeRO-1",
    "zero3": "ZeRO-3 (FSDP2)",
    "zero3_keep": "ZeRO-3 (FSDP2, no reshard after forward)",
    "hsdp": "HSDP (MiCS)",
    "hpz": "hpZ (ZeRO++)",
}


def model_args(flavor: str, seq_len: int, **overrides):
    # torchtitan's import needs triton; the project's CPU shims stub it (and patch only
    # torchtitan internals the benchmark does not use)
    from amsp_dtensor.titan import cpu_compat

    cpu_compat.apply()
    from torchtitan.models.llama3 import llama3_args

    return dataclasses.replace(llama3_args[flavor], max_seq_len=seq_len, **overrides)


def build_model(args, seed: int) -> nn.Module:
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values())


def lm_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class System:
    """One training setup: ``train_step(batches)`` = M micro-batches + optimizer step."""

    name: str
    model: nn.Module
    optim: torch.optim.Optimizer

    def no_sync(self, last: bool):
        return contextlib.nullcontext()

    def before_micro_batch(self, last: bool) -> None:
        pass

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                   before_step: Callable[[], None] | None = None,
                   probe: Callable[[], None] | None = None) -> float:
        """Loss summed over micro-batches / M (this rank's part of the global mean).
        ``before_step`` runs after the last backward, before the optimizer step;
        ``probe`` (a memory sample) after every backward and after the step, before
        ``zero_grad``."""
        M = len(batches)
        total = 0.0
        for i, (tokens, labels) in enumerate(batches):
            last = i == M - 1
            self.before_micro_batch(last)
            with self.no_sync(last):
                loss = lm_loss(self.model, tokens, labels) / M
                loss.backward()
            if probe is not None:
                probe()
            total += loss.item()
        if before_step is not None:
            before_step()
        self.optim.step()
        if probe is not None:
            probe()
        self.optim.zero_grad(set_to_none=True)
        return total

    def state_bytes(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer states this rank holds (unique storages)."""
        seen: set[int] = set()

        def size(t) -> int:
            if t is None or not isinstance(t, torch.Tensor):
                return 0
            local = t.to_local() if hasattr(t, "to_local") else t
            key = local.untyped_storage().data_ptr()
            if key in seen or local.numel() == 0:
                return 0
            seen.add(key)
            return local.untyped_storage().nbytes()

        param = sum(size(p) for p in self.model.parameters())
        grad = sum(size(p.grad) for p in self.model.parameters())
        optim = 0
        for opt in self._inner_optimizers():
            for st in opt.state.values():
                optim += sum(size(v) for v in st.values() if isinstance(v, torch.Tensor)
                             and v.numel() > 1)
        return {"param": param, "grad": grad, "optim": optim}

    def _inner_optimizers(self):
        return [self.optim]

    def close(self) -> None:
        pass


def _adamw(params, lr: float):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=True)


class DDPSystem(System):
    def __init__(self, model, lr, zero1: bool = False):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.name = "zero1" if zero1 else "ddp"
        self.model = DDP(model, forward_sync_buffers=False, gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, allreduce_hook)
        if zero1:
            self.optim = ZeroRedundancyOptimizer(
                self.model.parameters(), optimizer_class=torch.optim.AdamW, lr=lr,
                weight_decay=0.1, foreach=True, parameters_as_bucket_view=True)
        else:
            self.optim = _adamw(self.model.parameters(), lr)

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()

    def _inner_optimizers(self):
        return [getattr(self.optim, "optim", self.optim)]


class FSDPSystem(System):
    def __init__(self, name, model, lr, mesh, reshard_after_forward=True, hsdp=False):
        from torch.distributed.fsdp import fully_shard

        self.name = name
        self.hsdp = hsdp
        blocks = blocks_of(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        # root: FSDP2's default (None) keeps it unsharded after forward, no backward AG
        fully_shard(model, mesh=mesh)
        set_prefetch(model, blocks)
        for m in [model, *blocks]:
            m.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optim = _adamw(model.parameters(), lr)

    def before_micro_batch(self, last: bool) -> None:
        if self.hsdp:
            self.model.set_requires_all_reduce(last, recurse=True)


def set_prefetch(model, blocks) -> None:
    """Explicit prefetch of the next block's all-gather in forward and backward."""
    from torch.distributed.fsdp import FSDPModule

    fsdp_blocks = [b for b in blocks if isinstance(b, FSDPModule)]
    for i, block in enumerate(fsdp_blocks):
        if i + 1 < len(fsdp_blocks):
            block.set_modules_to_forward_prefetch([fsdp_blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([fsdp_blocks[i - 1]])


class AMSPSystem(System):
    """``layout``: "titan" = torchtitan's units (tok_embeddings, each block, [norm, output]
    as one unit with reshard_after_forward=False, then the root); "blocks" = each block,
    then the root holding the embeddings, norm and output. ``overlap``: keyword arguments
    for ``amsp.set_overlap`` (grad_sync / prefetch / step); ``overlap_param_update``: the
    optimizer's post-step all-gather overlaps the next forward."""

    def __init__(self, model, lr, plan, mesh, layout: str = "titan",
                 overlap: dict | None = None, overlap_param_update: bool = True):
        import amsp_dtensor as amsp

        self.amsp = amsp
        self.plan = plan
        self.name = f"amsp:{plan.name}"
        self.layout = layout
        units = amsp_units(model, layout)
        splan = plan.as_plan()
        for unit in units:
            if isinstance(unit, list):
                try:
                    amsp.fully_shard(unit, mesh=mesh, plan=splan, reshard_after_forward=False)
                except (TypeError, AttributeError) as e:
                    raise RuntimeError(
                        "amsp.fully_shard does not accept a list of modules in this checkout "
                        f"({type(e).__name__}: {e}); use the 'blocks' layout "
                        "(AMSPSystem(layout='blocks'), --layout blocks)") from e
            else:
                amsp.fully_shard(unit, mesh=mesh, plan=splan)
        amsp.fully_shard(model, mesh=mesh, plan=splan)
        engine_switches = hasattr(amsp, "set_overlap")
        if overlap and not engine_switches:
            raise RuntimeError(f"overlap switches {overlap} need amsp.set_overlap, which this "
                               "checkout of amsp_dtensor does not have yet")
        if engine_switches:
            # the engine sets up the explicit forward/backward prefetch itself (prefetch=)
            kwargs = dict(overlap or {})
            if os.environ.get("AMSP_BENCH_PREFETCH", "1") == "0":  # diagnostic switch
                kwargs["prefetch"] = False
            self.overlap = amsp.set_overlap(model, **kwargs)
        else:
            self.overlap = None
            if os.environ.get("AMSP_BENCH_PREFETCH", "1") != "0":  # diagnostic switch
                set_prefetch(model, [u[0] if isinstance(u, list) else u for u in units])
        self.model = model
        # the post-step all-gather overlaps the next forward, as in the paper's engine
        self.optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=lr, weight_decay=0.1,
                                        foreach=True, overlap_param_update=overlap_param_update)

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.amsp.no_sync(self.model)

    def state_bytes(self) -> dict[str, int]:
        return dict(self.amsp.memory_by_state(self.model, self.optim))


def amsp_units(model: nn.Module, layout: str) -> list:
    """The modules (or lists of modules) sharded before the root, in wrap order."""
    if layout == "blocks":
        return blocks_of(model)
    if layout == "titan":
        return [model.tok_embeddings, *blocks_of(model), [model.norm, model.output]]
    raise ValueError(f"unknown AMSP unit layout {layout!r}; use 'titan' or 'blocks'")


def amsp_unit_shapes(model: nn.Module, layout: str) -> tuple[list[list[tuple]], int]:
    """(unit param shapes, root unit index) for amsp_dtensor.plan.cost.comm.predicted_events.
    titan: [norm, output] keeps its params after forward (no backward all-gather), which
    the cost model describes as the root unit; the real root then owns no params."""
    from amsp_dtensor.plan.cost.check import unit_param_shapes_of

    if layout == "blocks":
        return unit_param_shapes_of(model, blocks_of(model))
    units = [[tuple(p.shape) for m in (u if isinstance(u, list) else [u])
              for p in m.parameters()] for u in amsp_units(model, layout)]
    return units, len(units) - 1


class MeshCache:
    """Build each process group once per process (gloo groups are slow to create)."""

    def __init__(self, world: int, ranks_per_node: int):
        self.world, self.rpn = world, ranks_per_node
        self._meshes: dict = {}

    def world_mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if "world" not in self._meshes:
            self._meshes["world"] = init_device_mesh("cpu", (self.world,), mesh_dim_names=("dp",))
        return self._meshes["world"]

    def hsdp_mesh(self, shard: int | None = None):
        """(replicate, shard) mesh; shard groups of `shard` consecutive ranks (default:
        the ranks of a node)."""
        from torch.distributed.device_mesh import init_device_mesh

        shard = shard or self.rpn
        key = "hsdp" if shard == self.rpn else ("hsdp", shard)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(
                "cpu", (self.world // shard, shard),
                mesh_dim_names=("replicate", "shard"))
        return self._meshes[key]

    def amsp_mesh(self, plan):
        import amsp_dtensor as amsp

        key = ("amsp", plan.name)
        if key not in self._meshes:
            self._meshes[key] = amsp.init_mesh(plan.as_plan(), ranks_per_node=self.rpn,
                                               device_type="cpu")
        return self._meshes[key]


def make_system(key: str, model: nn.Module, lr: float, meshes: MeshCache, plan=None,
                amsp_layout: str = "titan") -> System:
    if key == "ddp":
        return DDPSystem(model, lr)
    if key == "zero1":
        return DDPSystem(model, lr, zero1=True)
    if key == "zero3":
        return FSDPSystem(key, model, lr, meshes.world_mesh())
    if key == "zero3_keep":
        return FSDPSystem(key, model, lr, meshes.world_mesh(), reshard_after_forward=False)
    if key == "hsdp":
        return FSDPSystem(key, model, lr, meshes.hsdp_mesh(), hsdp=True)
    if key.startswith("hsdp:"):
        shard = int(key.split(":", 1)[1])
        if meshes.world % shard:
            raise ValueError(f"{key}: shard group size {shard} does not divide the world "
                             f"({meshes.world} ranks)")
        return FSDPSystem(key, model, lr, meshes.hsdp_mesh(shard), hsdp=True)
    if key == "hpz":
        return FSDPSystem(key, model, lr, meshes.world_mesh(), reshard_after_forward=meshes.rpn)
    if key.startswith("amsp"):
        return AMSPSystem(model, lr, plan, meshes.amsp_mesh(plan), layout=amsp_layout)
    raise ValueError(f"unknown system {key!r}; use one of {list(SYSTEM_LABELS)}, hsdp:<shard> "
                     "or amsp:<plan>")
