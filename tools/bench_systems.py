"""The configurations the benchmark compares, and the torch-built ones (DDP, FSDP2, AMSP).

A key names a system and its settings (``sweep``: a topology's configuration space): ``ddp``;
FSDP2 ``zero3`` / ``zero3_keep`` (reshard_after_forward True / False), ``hsdp:<s>`` (shard
groups of s ranks); the peers ``ds_*`` / ``mfsdp_*`` (tools/bench_peers.py);
``amsp:<plan>[/<switches off>][+g-<codec>][+w-<codec>][+noef]`` (``+``: amsp.set_compression
grads= / weights= / error_feedback=False). Same model, seed, data, AdamW, all fp32. FSDP2
gets explicit prefetch of the next block (no streams on CPU) and force-sum reductions (gloo
has no PREMUL_SUM).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
import torch.distributed.distributed_c10d as c10d
from torch.distributed import device_mesh
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import amsp_dtensor as amsp
from amsp_dtensor.plan import ShardingPlan, enumerate_plans

FAMILIES = {"ddp": "DDP", "fsdp2": "FSDP2", "ds_z1": "DeepSpeed ZeRO-1",
            "ds_z2": "DeepSpeed ZeRO-2", "ds_z3": "DeepSpeed ZeRO-3",
            "ds_hpz": "DeepSpeed ZeRO++ hpZ", "ds_mics": "DeepSpeed MiCS",
            "mfsdp": "Megatron-FSDP", "amsp": "AMSP"}
OVERLAP = {"all_on": ({}, True), "grad_sync_off": ({"grad_sync": False}, True),
           "prefetch_off": ({"prefetch": False}, True), "step_off": ({"step": False}, True),
           "param_update_off": ({}, False),
           "none": ({"grad_sync": False, "prefetch": False, "step": False}, False)}


def shard_sizes(world: int, rpn: int) -> list[int]:
    """Shard-group sizes other than 1 and the world: divisors of the world that stay in a
    node or fill whole nodes."""
    return [s for s in range(2, world) if world % s == 0
            and ((s <= rpn and rpn % s == 0) or s % rpn == 0)]


def sweep(world: int, rpn: int) -> list[str]:
    """Every configuration of this topology: FSDP2's, the peers', then every AMSP plan."""
    sizes = shard_sizes(world, rpn)
    keys = ["ddp", "zero3", "zero3_keep", *[f"hsdp:{s}" for s in sizes]]
    keys += ["ds_z1", "ds_z2", "ds_z3", *[f"ds_hpz:{s}" for s in sizes if s <= rpn]]
    keys += [f"ds_mics:{s}" for s in sizes]
    keys += ["mfsdp_z3", *[f"mfsdp_hfsdp:{s}" for s in sizes]]
    return keys + [f"amsp:{p.name}" for p in enumerate_plans(world, rpn)]


def amsp_key(arg: str) -> tuple[str, str, dict]:
    """'p2-g2-os4/step_off+g-int8+w-bf16' -> (plan, switches, set_compression kwargs)."""
    base, *extra = arg.split("+")
    plan, _, switches = base.partition("/")
    codecs = {"g": "grads", "w": "weights"}
    kw = {codecs[e[0]]: e[2:] for e in extra if e[:2] in ("g-", "w-")}
    if "noef" in extra:
        kw["error_feedback"] = False
    if len(kw) != len(extra):
        raise ValueError(f"unknown compression in amsp:{arg} (+g-CODEC, +w-CODEC, +noef)")
    return plan, switches, kw


def family(key: str) -> str:
    head = key.split(":", 1)[0]
    if head in ("zero3", "zero3_keep", "hsdp"):
        return "fsdp2"
    if head.startswith("mfsdp"):
        return "mfsdp"
    if head in FAMILIES:
        return head
    raise ValueError(f"unknown configuration {key!r}")


def label(key: str, rpn: int) -> str:
    head, _, arg = key.partition(":")
    if head == "amsp":
        plan, switches, _ = amsp_key(arg)
        return (f"AMSP {plan}" + (f" ({switches.replace('_', ' ')})" if switches else "")
                + "".join(f" +{c}" for c in arg.split("+")[1:]))
    return {"ddp": "DDP", "zero3": "FSDP2 reshard", "zero3_keep": "FSDP2 keep",
            "hsdp": f"FSDP2 HSDP shard {arg}",
            "ds_z1": "DS ZeRO-1", "ds_z2": "DS ZeRO-2", "ds_z3": "DS ZeRO-3",
            "ds_hpz": f"DS hpZ {arg}", "ds_mics": f"DS MiCS shard {arg}",
            "mfsdp_z3": "MFSDP ZeRO-3", "mfsdp_hfsdp": f"MFSDP hybrid shard {arg}"}[head]


def model_args(flavor: str, seq_len: int):
    # torchtitan's import needs triton; the project's CPU shims stub it
    from amsp_dtensor.titan import cpu_compat

    cpu_compat.apply()
    from torchtitan.models.llama3 import llama3_args

    return dataclasses.replace(llama3_args[flavor], max_seq_len=seq_len)


def build_model(args, seed: int) -> nn.Module:
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values())


def make_batches(step: int, world: int, rank: int, micro_batches: int, micro_batch: int,
                 seq: int, vocab: int):
    """This rank's M micro-batches of step `step` (the global batch is the same for every
    world split, drawn from a generator seeded by the step)."""
    g = torch.Generator().manual_seed(10_000 + step)
    data = torch.randint(0, vocab, (micro_batches, world * micro_batch, seq + 1), generator=g)
    mine = data[:, rank * micro_batch:(rank + 1) * micro_batch]
    return [(mine[i, :, :-1].contiguous(), mine[i, :, 1:].contiguous())
            for i in range(micro_batches)]


def lm_loss(model, tokens, labels) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())


def adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, foreach=True)


class System:
    """One training setup; ``train_step`` = M micro-batches + the optimizer step."""

    model: nn.Module
    optim: torch.optim.Optimizer

    def no_sync(self, last: bool):
        return contextlib.nullcontext()

    def before_micro_batch(self, last: bool) -> None:
        pass

    def train_step(self, batches, probe=lambda: None, before_step=lambda: None) -> float:
        """This rank's loss (sum over micro-batches / M). ``probe`` (a memory sample) runs
        after every backward and after the step; ``before_step`` before the step."""
        total = 0.0
        for i, (tokens, labels) in enumerate(batches):
            last = i == len(batches) - 1
            self.before_micro_batch(last)
            with self.no_sync(last):
                loss = lm_loss(self.model, tokens, labels) / len(batches)
                loss.backward()
            probe()
            total += loss.item()
        before_step()
        self.optim.step()
        probe()
        self.optim.zero_grad(set_to_none=True)
        return total

    def finish(self) -> None:
        """Wait for anything the step left in flight (AMSP's post-step all-gather)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer states this rank holds (unique storages)."""
        seen: set[int] = set()
        return {"param": _bytes(list(self.model.parameters()), seen),
                "grad": _bytes([p.grad for p in self.model.parameters()], seen),
                "optim": _bytes(optim_states(getattr(self.optim, "optim", self.optim)), seen)}

    def reported_bytes(self) -> dict[str, int] | None:
        """The memory figures the system itself reports (peers), or None."""
        return None

    def close(self) -> None:
        """Undo what building the system changed in the process (peers)."""


def _bytes(tensors, seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` (DTensors: their local shard) not in ``seen``."""
    total = 0
    for t in filter(torch.is_tensor, tensors):
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if local.numel() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optim_states(optim) -> list:
    """An optimizer's state tensors (not its one-element step counts)."""
    return [v for st in optim.state.values() for v in st.values()
            if torch.is_tensor(v) and v.numel() > 1]


class DDPSystem(System):
    def __init__(self, model, lr):
        self.model = DDP(model, forward_sync_buffers=False, gradient_as_bucket_view=True)
        # the Python hook runs the same all-reduce as the built-in one, where bench_comm sees it
        self.model.register_comm_hook(None, allreduce_hook)
        self.optim = adamw(self.model.parameters(), lr)

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDPSystem(System):
    def __init__(self, model, lr, mesh, reshard_after_forward=True, hsdp=False):
        self.hsdp = hsdp
        blocks = blocks_of(model)
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)  # root: kept after forward (FSDP2's default)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
        for m in [model, *blocks]:
            m.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optim = adamw(model.parameters(), lr)

    def before_micro_batch(self, last: bool) -> None:
        if self.hsdp:
            self.model.set_requires_all_reduce(last, recurse=True)


class AMSPSystem(System):
    """torchtitan's units: tok_embeddings, each block, [norm, output] kept after forward,
    the root. ``switches``: a key of OVERLAP (the four overlap switches)."""

    def __init__(self, model, lr, plan, mesh, switches: str = "all_on", compression=None):
        self.amsp = amsp
        splan = plan.as_plan()
        for unit in [model.tok_embeddings, *blocks_of(model), [model.norm, model.output]]:
            amsp.fully_shard(unit, mesh=mesh, plan=splan,
                             **({"reshard_after_forward": False} if isinstance(unit, list) else {}))
        amsp.fully_shard(model, mesh=mesh, plan=splan)
        overlap, param_update = OVERLAP[switches]
        self.overlap = amsp.set_overlap(model, **overlap)
        if compression:  # before the optimizer (compressed weights keep separate masters)
            amsp.set_compression(model, **compression)
        self.model = model
        self.optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=lr, weight_decay=0.1,
                                        foreach=True, overlap_param_update=param_update)

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.amsp.no_sync(self.model)

    def finish(self) -> None:
        self.optim.wait_param_update()

    def state_bytes(self) -> dict[str, int]:
        return dict(self.amsp.memory_by_state(self.model, self.optim))


class GroupPool:
    """Process groups shared by the sweep's meshes: the n-th group one mesh asks for over
    some ranks is the n-th one ever made over them (the Note in bench_worker says why).
    Every rank asks in the same order, so all make the same groups."""

    def __init__(self):
        self._groups: dict[tuple, list] = {}
        self._asked: collections.Counter = collections.Counter()
        self._new_group = device_mesh.new_group
        device_mesh.new_group = self.new_group  # what DeviceMesh builds its dims with
        # and what new_subgroups_by_enumeration calls (AMSP's "shard" group, engine/mesh.py)
        c10d.new_group = self.new_group

    def new_group(self, ranks=None, **options):
        key = (tuple(ranks or ()), *sorted((k, repr(v)) for k, v in options.items()
                                            if k != "group_desc"))
        made, n = self._groups.setdefault(key, []), self._asked[key]
        self._asked[key] += 1
        if n == len(made):
            made.append(self._new_group(ranks=ranks, **options))
        return made[n]

    def next_mesh(self) -> None:
        self._asked.clear()


class Meshes:
    """Each device mesh built once per process, its groups from one GroupPool."""

    def __init__(self, world: int, rpn: int):
        self.world, self.rpn, self._cache = world, rpn, {}
        self._pool = GroupPool()

    def get(self, shape: tuple[int, ...], names: tuple[str, ...]):
        if (shape, names) not in self._cache:
            self._pool.next_mesh()
            self._cache[(shape, names)] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return self._cache[(shape, names)]

    def of(self, key: str):
        """The mesh configuration `key` trains on (None: DDP, and the peers, which build
        theirs with ``get``); for AMSP, ``amsp.init_mesh``'s for the plan."""
        head, _, arg = key.partition(":")
        if head == "hsdp":
            return self.get((self.world // int(arg), int(arg)), ("replicate", "shard"))
        if head in ("zero3", "zero3_keep"):
            return self.get((self.world,), ("dp",))
        if head != "amsp":
            return None
        plan = ShardingPlan.from_name(amsp_key(arg)[0]).resolve(self.world, self.rpn)
        if ("amsp", plan.name) not in self._cache:
            self._pool.next_mesh()
            self._cache[("amsp", plan.name)] = amsp.init_mesh(
                plan.as_plan(), ranks_per_node=self.rpn, device_type="cpu")
        return self._cache[("amsp", plan.name)]


def make_system(key: str, model_args, seed: int, lr: float, meshes: Meshes, workload) -> System:
    """Build configuration `key` from a model made from `model_args` and `seed`."""
    head, _, arg = key.partition(":")
    if head.startswith(("ds_", "mfsdp")):
        from tools import bench_peers

        return bench_peers.make_system(key, model_args, seed, lr, meshes, workload)
    model = build_model(model_args, seed)
    if head == "ddp":
        return DDPSystem(model, lr)
    if head in ("zero3", "zero3_keep", "hsdp"):
        return FSDPSystem(model, lr, meshes.of(key), reshard_after_forward=head != "zero3_keep",
                          hsdp=head == "hsdp")
    if head == "amsp":
        plan, switches, compression = amsp_key(arg)
        p = ShardingPlan.from_name(plan).resolve(meshes.world, meshes.rpn)
        return AMSPSystem(model, lr, p, meshes.of(key), switches or "all_on", compression)
    raise ValueError(f"unknown configuration {key!r}")
