"""The configurations the benchmark compares, and the torch-built ones (DDP, FSDP2, AMSP).

A key names a system and its settings (``sweep``: a topology's configuration space): ``ddp``;
FSDP2 ``zero3`` / ``zero3_keep`` (reshard_after_forward True / False), ``hsdp:<s>`` (shard
groups of s ranks); the peers ``ds_*`` / ``mfsdp_*`` (tools/bench_peers.py);
``amsp:<plan>[/<switches off>][+g-<codec>][+w-<codec>][+noef]`` (``+``: amsp.set_compression
grads= / weights= / error_feedback=False). Same model, seed, data, AdamW, all fp32. FSDP2
gets explicit prefetch of the next block (no streams on CPU) and force-sum reductions (gloo
has no PREMUL_SUM).

The mixture-of-experts flavour (``--flavor moe``, MOE_FLAVOR) splits the routed experts over
``ep`` consecutive ranks with torchtitan's own ExpertParallel and gives them a layout of
their own over the expert world (W / ep ranks, ``expert_parallel_world``): ``zero3`` /
``zero3_keep`` are torchtitan's FSDP2 + EP layout (dense over the W ranks, experts over the
W / ep of "efsdp"), ``hsdp:<s>/<se>`` the dense part in shard groups of s and the experts
in shard groups of se (torchtitan's own HSDP is se = s / ep), ``amsp:<dense plan>+e-<expert
plan>`` a plan pair, and ``ddp`` the loss reference: every expert on every rank, no EP.
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
from amsp_dtensor.plan import ShardingPlan, enumerate_plans, expert_parallel_world

FAMILIES = {"ddp": "DDP", "fsdp2": "FSDP2", "ds_z1": "DeepSpeed ZeRO-1",
            "ds_z2": "DeepSpeed ZeRO-2", "ds_z3": "DeepSpeed ZeRO-3",
            "ds_hpz": "DeepSpeed ZeRO++ hpZ", "ds_mics": "DeepSpeed MiCS",
            "mfsdp": "Megatron-FSDP", "amsp": "AMSP"}
OVERLAP = {"all_on": ({}, True), "grad_sync_off": ({"grad_sync": False}, True),
           "prefetch_off": ({"prefetch": False}, True), "step_off": ({"step": False}, True),
           "param_update_off": ({}, False),
           "none": ({"grad_sync": False, "prefetch": False, "step": False}, False)}


MOE_FLAVOR = "moe"


def shard_sizes(world: int, rpn: int) -> list[int]:
    """Shard-group sizes other than 1 and the world: divisors of the world that stay in a
    node or fill whole nodes."""
    return [s for s in range(2, world) if world % s == 0
            and ((s <= rpn and rpn % s == 0) or s % rpn == 0)]


def sweep(world: int, rpn: int, ep: int = 0) -> list[str]:
    """Every configuration of this topology: FSDP2's, the peers', then every AMSP plan;
    with ``ep`` (the MoE flavour's expert-parallel degree), moe_sweep's."""
    if ep:
        return moe_sweep(world, rpn, ep)
    sizes = shard_sizes(world, rpn)
    keys = ["ddp", "zero3", "zero3_keep", *[f"hsdp:{s}" for s in sizes]]
    keys += ["ds_z1", "ds_z2", "ds_z3", *[f"ds_hpz:{s}" for s in sizes if s <= rpn]]
    keys += [f"ds_mics:{s}" for s in sizes]
    keys += ["mfsdp_z3", *[f"mfsdp_hfsdp:{s}" for s in sizes]]
    return keys + [f"amsp:{p.name}" for p in enumerate_plans(world, rpn)]


def moe_sweep(world: int, rpn: int, ep: int) -> list[str]:
    """The MoE flavour's configurations: DDP (no EP), FSDP2 + EP with every shard size of
    each group (the dense one over the world, the experts' over the expert world; s = the
    world and se = the expert world are zero3's), every AMSP plan pair. No peer trains
    this model with EP (tools/bench_peers.moe_refusal says why)."""
    e_world, e_rpn = expert_parallel_world(world, rpn, ep)
    dense = [*shard_sizes(world, rpn), world]
    experts = [1, *shard_sizes(e_world, e_rpn), *([e_world] if e_world > 1 else [])]
    keys = ["ddp", "zero3", "zero3_keep"]
    keys += [f"hsdp:{s}/{se}" for s in dense for se in experts if (s, se) != (world, e_world)]
    return keys + [f"amsp:{p.name}+e-{e.name}" for p in enumerate_plans(world, rpn)
                   for e in enumerate_plans(e_world, e_rpn)]


def fsdp_sizes(key: str, world: int, ep: int) -> tuple[int, int | None]:
    """An FSDP2 key's shard-group sizes (dense, experts; experts None without ``ep``):
    zero3 / zero3_keep (world, world / ep); 'hsdp:4/2' (4, 2); 'hsdp:4' (4, None), or with
    experts torchtitan's coupling (4, 4 / ep)."""
    head, _, arg = key.partition(":")
    if head != "hsdp":
        return world, (world // ep if ep else None)
    s, _, se = arg.partition("/")
    if se:
        return int(s), int(se)
    return int(s), (int(s) // ep if ep else None)


def amsp_key(arg: str) -> tuple[str, str, dict, str | None]:
    """'p2-g2-os4/step_off+e-p1-g1-os2+g-int8+w-bf16' -> (plan, switches, set_compression
    kwargs, expert plan or None)."""
    base, *extra = arg.split("+")
    plan, _, switches = base.partition("/")
    experts = [e[2:] for e in extra if e.startswith("e-")]
    extra = [e for e in extra if not e.startswith("e-")]
    codecs = {"g": "grads", "w": "weights"}
    kw = {codecs[e[0]]: e[2:] for e in extra if e[:2] in ("g-", "w-")}
    if "noef" in extra:
        kw["error_feedback"] = False
    if len(kw) != len(extra) or len(experts) > 1:
        raise ValueError(f"unknown setting in amsp:{arg} (+e-EXPERT_PLAN, +g-CODEC, "
                         "+w-CODEC, +noef)")
    return plan, switches, kw, (experts[0] if experts else None)


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
        plan, switches, _, experts = amsp_key(arg)
        return (f"AMSP {plan}" + (f" / experts {experts}" if experts else "")
                + (f" ({switches.replace('_', ' ')})" if switches else "")
                + "".join(f" +{c}" for c in arg.split("+")[1:] if not c.startswith("e-")))
    if head == "hsdp" and "/" in arg:
        return "FSDP2 HSDP shard {} / experts {}".format(*arg.split("/"))
    return {"ddp": "DDP", "zero3": "FSDP2 reshard", "zero3_keep": "FSDP2 keep",
            "hsdp": f"FSDP2 HSDP shard {arg}",
            "ds_z1": "DS ZeRO-1", "ds_z2": "DS ZeRO-2", "ds_z3": "DS ZeRO-3",
            "ds_hpz": f"DS hpZ {arg}", "ds_mics": f"DS MiCS shard {arg}",
            "mfsdp_z3": "MFSDP ZeRO-3", "mfsdp_hfsdp": f"MFSDP hybrid shard {arg}"}[head]


def model_args(flavor: str, seq_len: int):
    """torchtitan model args: a llama3 flavour, or MOE_FLAVOR (moe_args)."""
    # torchtitan's import needs triton; the project's CPU shims stub it
    from amsp_dtensor.titan import cpu_compat

    cpu_compat.apply()
    if flavor == MOE_FLAVOR:
        return moe_args(seq_len)
    from torchtitan.models.llama3 import llama3_args

    return dataclasses.replace(llama3_args[flavor], max_seq_len=seq_len)


def moe_args(seq_len: int):
    """torchtitan's deepseek_v3 at a size where, as on a real cluster, the routed experts are
    most of the bytes (9.4M of 12.4M parameters, 76%) and few of the FLOPs (top 2 of 16):
    dim 256, 4 blocks (the first dense), latent attention with 4 heads, each MoE block 16
    routed SwiGLU experts of 256 and 1 shared, softmax top-2 router; its for-loop experts
    in fp32 (torchtitan's own choice off Hopper GPUs), no load-balancing bias."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    args = DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=1024, moe_inter_dim=256, n_layers=4,
        n_dense_layers=1, n_heads=4, q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_seq_len=seq_len,
        moe_args=MoEArgs(num_experts=16, num_shared_experts=1, top_k=2, score_func="softmax",
                         use_grouped_mm=False, load_balance_coeff=None))
    args.moe_impl = "standard"  # what update_from_config sets from the job
    return args


def is_moe(args) -> bool:
    return hasattr(args, "moe_args")


def build_model(args, seed: int) -> nn.Module:
    if is_moe(args):
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model as Model
    else:
        from torchtitan.models.llama3 import Transformer as Model

    torch.manual_seed(seed)
    model = Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


def split_experts(model: nn.Module, ep_mesh) -> list[nn.Module | None]:
    """torchtitan's own expert parallelism (its apply_moe_ep_tp, without TP) over
    ``ep_mesh``; each block's routed experts (None for a dense block)."""
    from torchtitan.models.llama4.infra.parallelize import apply_moe_ep_tp

    from amsp_dtensor.titan.units import routed_experts

    apply_moe_ep_tp(model, tp_mesh=None, ep_mesh=ep_mesh, etp_mesh=None, ep_etp_mesh=None)
    return [routed_experts(b) for b in blocks_of(model)]


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
    """FSDP2 on each block and the root; with ``experts`` (ep mesh, expert mesh),
    torchtitan's FSDP2 + EP: the routed experts split over ep, then each MoE block's experts
    sharded on the expert mesh before their block, their gradients divided by the whole
    data-parallel world (EP brought every rank's tokens to them), prefetch naming them."""

    def __init__(self, model, lr, mesh, reshard_after_forward=True, hsdp=False, experts=None):
        self.hsdp = hsdp
        blocks = blocks_of(model)
        routed = split_experts(model, experts[0]) if experts else [None] * len(blocks)
        for block, ex in zip(blocks, routed):
            if ex is not None:
                fully_shard(ex, mesh=experts[1], reshard_after_forward=reshard_after_forward)
                ex.set_gradient_divide_factor(float(mesh.size()))
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)  # root: kept after forward (FSDP2's default)
        with_experts = [[b] + ([ex] if ex is not None else []) for b, ex in zip(blocks, routed)]
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch(with_experts[i + 1])
            if i > 0:
                block.set_modules_to_backward_prefetch(with_experts[i - 1])
        for m in [model, *blocks, *filter(None, routed)]:
            m.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.optim = adamw(model.parameters(), lr)

    def before_micro_batch(self, last: bool) -> None:
        if self.hsdp:
            self.model.set_requires_all_reduce(last, recurse=True)


class AMSPSystem(System):
    """torchtitan's units: tok_embeddings, each block, [norm, output] kept after forward,
    the root, on ``mesh`` (amsp.init_mesh's: it carries the plan); with ``experts``, each MoE
    block's routed experts split by torchtitan's EP and a unit on the expert mesh first.
    ``switches``: a key of OVERLAP (the four overlap switches)."""

    def __init__(self, model, lr, mesh, switches: str = "all_on", compression=None,
                 experts: bool = False):
        self.amsp = amsp
        blocks = blocks_of(model)
        # each MoE block's routed experts a unit on the expert mesh, before their block
        emesh = amsp.expert_mesh(mesh) if experts else None
        routed = split_experts(model, emesh["ep"]) if experts else [None] * len(blocks)
        amsp.fully_shard(model.tok_embeddings, mesh=mesh)
        for block, ex in zip(blocks, routed):
            if ex is not None:
                amsp.fully_shard(ex, mesh=emesh)
            amsp.fully_shard(block, mesh=mesh)
        amsp.fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False)
        amsp.fully_shard(model, mesh=mesh)
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
    """Each device mesh built once per process, its groups from one GroupPool; ``ep``: the
    MoE flavour's expert-parallel degree (0: a dense model)."""

    def __init__(self, world: int, rpn: int, ep: int = 0):
        self.world, self.rpn, self.ep, self._cache = world, rpn, ep, {}
        self._pool = GroupPool()

    def get(self, shape: tuple[int, ...], names: tuple[str, ...]):
        if (shape, names) not in self._cache:
            self._pool.next_mesh()
            self._cache[(shape, names)] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return self._cache[(shape, names)]

    def expert_meshes(self, se: int):
        """FSDP2 + EP: (the "ep" mesh, the experts' FSDP2 mesh: shard groups of se ranks of
        the expert world, replicated over the rest), ep fastest in rank order."""
        e_world = self.world // self.ep
        m = self.get((e_world // se, se, self.ep), ("erep", "eshard", "ep"))
        return m["ep"], (m["erep", "eshard"] if se < e_world else m["eshard"])

    def of(self, key: str):
        """The mesh configuration `key` trains on (None: DDP, and the peers, which build
        theirs with ``get``); for AMSP, ``amsp.init_mesh``'s for the plan (pair). With
        experts, FSDP2's is (dense mesh, expert_meshes)."""
        head, _, arg = key.partition(":")
        if head in ("hsdp", "zero3", "zero3_keep"):
            s, se = fsdp_sizes(key, self.world, self.ep)
            dense = (self.get((self.world,), ("dp",)) if s == self.world else
                     self.get((self.world // s, s), ("replicate", "shard")))
            return (dense, self.expert_meshes(se)) if self.ep else dense
        if head != "amsp":
            return None
        plan, _, _, experts = amsp_key(arg)
        plan = ShardingPlan.from_name(plan).resolve(self.world, self.rpn)
        if self.ep and experts is None:
            raise ValueError(f"{key}: the MoE flavour's AMSP keys name an expert plan "
                             "(amsp:<plan>+e-<expert plan>)")
        eplan = ShardingPlan.from_name(experts) if experts else None
        tag = ("amsp", plan.name, experts)
        if tag not in self._cache:
            self._pool.next_mesh()
            self._cache[tag] = amsp.init_mesh(
                plan.as_plan(), ranks_per_node=self.rpn, device_type="cpu",
                **({"ep": self.ep, "expert_plan": eplan} if self.ep else {}))
        return self._cache[tag]


def make_system(key: str, model_args, seed: int, lr: float, meshes: Meshes, workload) -> System:
    """Build configuration `key` from a model made from `model_args` and `seed`."""
    head, _, arg = key.partition(":")
    if head.startswith(("ds_", "mfsdp")):
        from tools import bench_peers

        if meshes.ep:
            raise ValueError(f"{key}: {bench_peers.moe_refusal(key)}")
        return bench_peers.make_system(key, model_args, seed, lr, meshes, workload)
    model = build_model(model_args, seed)
    if head == "ddp":  # with experts too: every expert on every rank (the loss reference)
        return DDPSystem(model, lr)
    if head in ("zero3", "zero3_keep", "hsdp"):
        mesh = meshes.of(key)
        dense, experts = mesh if meshes.ep else (mesh, None)
        return FSDPSystem(model, lr, dense, reshard_after_forward=head != "zero3_keep",
                          hsdp=dense.ndim == 2, experts=experts)
    if head == "amsp":
        _, switches, compression, _ = amsp_key(arg)
        return AMSPSystem(model, lr, meshes.of(key), switches or "all_on", compression,
                          experts=bool(meshes.ep))
    raise ValueError(f"unknown configuration {key!r}")
