"""One DeviceMesh per plan, with the P group innermost in rank order (inside a node).

Mesh dims, in DTensor order: ("rep", "p", "g", "os") with sizes
(W/s_os, s_p, s_g/s_p, s_os/s_g). DTensor splits a tensor dim over several mesh dims in
mesh-dim order, so putting "p" before "g" and "os" makes every G/OS shard a sub-chunk of
the rank's own P shard (the paper's nesting rule). Rank order is a different matter: ranks
are numbered node by node, and we want the P group contiguous (intra-node), so the rank
tensor is arange(W).reshape(rep, os, g, p) permuted to (rep, p, g, os):

    rank = rep_i * s_os + os_i * s_g + g_i * s_p + p_i

[Note: tensor parallelism] With ``tp > 1`` the mesh gets a fifth dim, "tp", FIRST in
DTensor order and LAST (fastest) in rank order, as torchtitan builds its mesh: the tp
ranks of a group are consecutive ranks of one node. The plan's factors are then factors
of the data-parallel world W/tp, with R/tp DP ranks per node (R ranks per node); the
formula above gives the DP rank d, and ``rank = d * tp + tp_i``. "tp" comes first in
DTensor order so that a tensor sharded by TP on dim 0 (ColwiseParallel) and by AMSP on
the rows of its TP-local piece reads as Shard(0) on "tp", then on "p", "g", "os": the
nesting is the same rule as above, one level out. With ``tp = 1`` the mesh is the 4-D
one, unchanged.

[Note: pipeline parallelism] With ``pp > 1`` the job's ranks are split into pp stages
of W/pp consecutive ranks (pp outermost in rank order, as torchtitan builds its mesh), and
``init_mesh`` returns a mesh with a "pp" dim first: ``mesh["pp"]`` is the group of one
pipeline (one rank per stage), for ``PipelineStage(..., group=mesh["pp"].get_group())``.
Inside a stage the mesh is the one above (with "tp" when tp > 1) over that stage's
ranks, and the plan's factors are those of the stage's data-parallel world (W/pp/tp
ranks). A stage spans whole nodes or several stages share one node, so the DP ranks per
node are min(R, W/pp)/tp. Parameters, masters and collectives live on the stage's DP
sub-mesh (``MeshInfo.mesh``): a module sharded on a pp mesh is a model of that stage
alone, exactly as without pp; only the global grad norm reaches across stages (over
``MeshInfo.pp_group``). With ``pp = 1`` the mesh is the one above, unchanged.

[Note: expert parallelism] A mixture-of-experts model has two parameter groups, each with
its own plan. Dense parameters are replicas over the whole data-parallel world and use
the mesh above. Expert parameters are split by expert parallelism (EP, degree ep) over ep
consecutive data-parallel ranks, as torchtitan carves "ep" out of its innermost
data-parallel dims, and the ranks holding the same experts (one per EP group: W/ep ranks,
R/ep per node, or 1 when an EP group spans nodes) are their data-parallel world. With
``ep > 1`` or an ``expert_plan``, ``init_mesh`` also builds the expert mesh, ("ep", "rep",
"p", "g", "os"), over the same ranks: it is the tensor-parallel mesh above with "ep" in
the place of "tp" (first in DTensor order, fastest in rank order: DP rank = e * ep + ep_i,
e the expert-world rank from the formula), and the expert plan resolved over the expert
world. A grouped expert weight [experts, ...] split by EP as Shard(0) on "ep" and by AMSP
on the rows of its EP-local piece reads as Shard(0) on "ep", then "p", "g", "os": the
TP nesting rule again. ``MeshInfo.mp_dim`` names that first dim ("tp" or "ep"), and the
expert mesh records its collectives as "expert_p", "expert_g", ... (``label``).
Beside tensor parallelism (tp > 1), EP spans the tp ranks as well, as torchtitan's sparse
mesh (efsdp, ep) unflattens dp_shard x cp x tp: the model splits each MoE layer's tokens
over its tp ranks before dispatching them (sequence parallel), so every rank sends tokens
of its own. The EP group is then ep consecutive ranks of the stage (tp fastest), the
expert world the stage's W x tp / ep ranks, and the experts' gradients are averaged over
the data-parallel world like the dense ones (each token reaches its experts once).

[Note: context parallelism] Context parallelism (CP, degree cp) splits each sequence over
cp consecutive data-parallel ranks with the same tp index: each computes the gradients of
its part of the sequence from the same weights, so for the engine the cp ranks are
data-parallel ranks like any other. The plan's factors range over the data-parallel world
with the cp ranks in it (W / pp / tp), its node rules apply to that world, and the
gradients are averaged over it (each rank's loss is the mean over its equal share of the
tokens). What CP adds is the model's own exchange of keys and values over the cp group,
``MeshInfo.cp_mesh`` (``amsp.context_parallel_mesh``): cp consecutive DP ranks, inside a
node when cp divides the node's DP ranks, else over whole nodes, as torchtitan's
(pp, dp_replicate, dp_shard, cp, tp) mesh places them (DP rank d = outer * cp + c).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import handle
from .recorder import watch_group
from ..plan import ResolvedPlan, ShardingPlan
from ..plan.sharding_plan import (EXPERT_DIM_PREFIX, check_context_parallel,
                                  data_parallel_world, expert_parallel_world, resolve_factor)

MESH_DIMS = ("rep", "p", "g", "os")
TP_DIM = "tp"
PP_DIM = "pp"
EP_DIM = "ep"
CP_DIM = "cp"

__all__ = ["CP_DIM", "EP_DIM", "MESH_DIMS", "PP_DIM", "TP_DIM", "context_parallel_mesh",
           "expert_mesh", "init_mesh", "MeshInfo", "mesh_info"]


@dataclass
class MeshInfo:
    """What the engine needs to know about an AMSP mesh beyond the DeviceMesh."""

    mesh: DeviceMesh
    plan: ResolvedPlan  # resolved over the data-parallel world (W / tp ranks)
    # the size of the model-parallel dim first in DTensor order, ``mp_dim``: the tensor-
    # parallel degree ("tp"), or on an expert mesh the expert-parallel one ("ep"); no
    # such dim when 1 (the Notes on tensor and expert parallelism)
    tp: int = 1
    # pipeline-parallel degree, and the job's mesh with its "pp" dim (``mesh`` is then this
    # stage's sub-mesh: the Note on pipeline parallelism); None when pp is 1
    pp: int = 1
    pp_mesh: DeviceMesh | None = None
    job_ranks_per_node: int | None = None  # set when pp > 1 (a stage may be under a node)
    mp_dim: str = TP_DIM
    label_prefix: str = ""  # EXPERT_DIM_PREFIX on an expert mesh (what the recorder names)
    # on a dense mesh built with ep > 1 or an expert_plan: the expert mesh's MeshInfo
    expert: "MeshInfo | None" = None
    # context-parallel degree, and this rank's 1-D "cp" mesh (the Note on context
    # parallelism); None when cp is 1
    cp: int = 1
    cp_mesh: DeviceMesh | None = None
    _groups: dict = field(default_factory=dict)
    _crosses_nodes: dict = field(default_factory=dict)

    # [Note: a copied mesh carries no process group] The MeshInfo rides on its DeviceMesh
    # (handle.py), so copying or pickling the mesh copies it too, and so does copying any
    # DTensorSpec on the mesh or on one of its sub-meshes (they point to their root mesh).
    # torch.compile does that whenever a compiled region reads a DTensor (its guard on the
    # spec deep-copies it: under tensor parallelism, every block's TP-sharded params), as
    # does torch.save of a DTensor. ProcessGroups cannot be copied ("TypeError: cannot
    # pickle 'torch._C._distributed_c10d.ProcessGroup' object"), so, as DeviceMesh does
    # with its own group registry, the copy drops the memoised groups; group() makes them
    # again from the (copied) mesh if a copy is ever asked for one.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_groups"], state["_crosses_nodes"] = {}, {}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node of the job (DP ranks per node times tp, without pp)."""
        if self.job_ranks_per_node is not None:
            return self.job_ranks_per_node
        return self.plan.ranks_per_node * self.tp

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The group of this rank's pipeline (one rank per stage); None without pp."""
        return self.pp_mesh[PP_DIM].get_group() if self.pp_mesh is not None else None

    @property
    def is_expert(self) -> bool:
        return self.mp_dim == EP_DIM

    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D model-parallel sub-mesh ("tp", or "ep" on an expert mesh) that the
        parameters are DTensors on (None when that degree is 1)."""
        return self.mesh[self.mp_dim] if self.tp > 1 else None

    def label(self, dim: str) -> str:
        """How the recorder and the cost model name a collective over ``dim``: the dim,
        prefixed on an expert mesh for the data-parallel dims ("expert_os")."""
        return dim if dim in (self.mp_dim, PP_DIM) else self.label_prefix + dim

    def group(self, dim: str) -> dist.ProcessGroup:
        """Process group of a mesh dim, or "shard" = p x g x os (one full model copy)."""
        if dim == PP_DIM:
            return self.pp_group
        if dim not in self._groups:
            if dim == "shard":
                # every stage's rows: all ranks make every group, in one order
                self._groups[dim] = _shard_group(self.pp_mesh or self.mesh)
            else:
                self._groups[dim] = self.mesh[dim].get_group()
        return self._groups[dim]

    def size(self, dim: str) -> int:
        if dim == "shard":
            return self.plan.s_os
        if dim == self.mp_dim:
            return self.tp
        if dim == PP_DIM:
            return self.pp
        return self.plan.mesh_shape[dim]

    def crosses_nodes(self, dim: str) -> bool:
        return self.group_crosses_nodes(self.group(dim))

    def group_crosses_nodes(self, group) -> bool:
        """True when the group's ranks lie on more than one node (memoised per group:
        also asked for FSDP's hpZ group, which is no mesh dim)."""
        if group not in self._crosses_nodes:
            ranks = dist.get_process_group_ranks(group)
            self._crosses_nodes[group] = len({r // self.ranks_per_node for r in ranks}) > 1
        return self._crosses_nodes[group]

    @functools.cached_property
    def coordinate(self) -> dict[str, int]:
        """This rank's index along each mesh dim."""
        return dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))

    @functools.cached_property
    def os_split(self) -> tuple[int, int]:
        """(k, i): this rank is member i of the k = s_os/s_p ranks that split its P shard
        into OS shards ((1, 0) when s_os = s_p)."""
        dim = self.os_subgroup_dim
        return (1, 0) if dim is None else (self.size(dim), self.coordinate[dim])

    @functools.cached_property
    def shard_members(self) -> list[tuple[int, int]]:
        """(p, i) of each member of this rank's "shard" group, in group-rank order: its
        P shard and its OS chunk of it (os_split's i). The group orders its ranks by
        global rank, which need not be the order of their rows (p-major), so a gather
        of rows over the group must place them by these coordinates."""
        names = self.mesh.mesh_dim_names
        dim = self.os_subgroup_dim
        members = []
        for rank in dist.get_process_group_ranks(self.group("shard")):
            where = dict(zip(names, (self.mesh.mesh == rank).nonzero()[0].tolist()))
            members.append((where["p"], 0 if dim is None else where[dim]))
        return members

    @property
    def os_subgroup_dim(self) -> str | None:
        """The dim that splits one P shard into OS shards (s_os/s_p ranks), if any.

        One of "g"/"os" always has size 1 (s_g is s_p or s_os), so the OS subgroup is
        just the other one.
        """
        if self.plan.s_os == self.plan.s_p:
            return None
        return "g" if self.plan.s_g > self.plan.s_p else "os"


def _shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's "shard" group: the ranks of its (pp, tp, rep) coordinate, all of
    p x g x os.

    [Note: the shard group without mesh slicing] Built from the mesh's rank tensor with
    the public ``new_subgroups_by_enumeration`` rather than by slicing and flattening the
    mesh (``mesh["p", "g", "os"]._flatten()``): torch 2.11 and 2.12 refuse that slice
    whenever two of the three dims have size 1 (plan (16, 16, 16) on 16 ranks: ``KeyError:
    "Invalid mesh_dim_names ('p', 'g', 'os') specified. Mesh dim indices should be in
    ascending order."``). Every rank makes every row's group, in row order, as the
    flatten does; a group's ranks are its row, which new_group orders by rank as it
    orders every mesh dim's group.
    """
    lead = mesh.ndim - len(("p", "g", "os"))  # ("pp", "tp",) "rep" come first
    rows = mesh.mesh.reshape(-1, *mesh.mesh.shape[lead:]).flatten(1).tolist()
    group, _ = dist.new_subgroups_by_enumeration(rows, group_desc="shard")
    return group


# The MeshInfo lives on the DeviceMesh object itself (handle.py's Note says why).


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _ranks_per_node_from_env(world_size: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        warnings.warn(
            "LOCAL_WORLD_SIZE is not set (not launched by torchrun?): assuming all "
            f"{world_size} ranks are on one node; pass ranks_per_node= to say otherwise"
        )
        return world_size
    return int(value)


def init_mesh(
    plan: ShardingPlan | ResolvedPlan,
    ranks_per_node: int | None = None,
    device_type: str | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    expert_plan: ShardingPlan | ResolvedPlan | None = None,
    cp: int = 1,
) -> DeviceMesh:
    """Build the AMSP DeviceMesh for ``plan`` over the default process group.

    ``plan``: a ShardingPlan, resolved here for this job, or a ResolvedPlan already
    resolved for it (for its data-parallel world, below), which is checked against the
    job and kept as it is. Either way the mesh carries that one resolved plan
    (``mesh_info(mesh).plan``), and ``amsp.fully_shard`` reads it from the mesh.
    ``ranks_per_node`` defaults to LOCAL_WORLD_SIZE (torchrun sets it). The process
    group must already be initialised (``dist.init_process_group``). ``tp``: the tensor-
    parallel degree (torchtitan's ``tensor_parallel_degree``); it must divide
    ``ranks_per_node``, and the plan's factors are then those of the data-parallel world
    (world / tp ranks, ranks_per_node / tp per node). Apply TP with
    ``parallelize_module(model, mesh["tp"], ...)`` before ``amsp.fully_shard``.
    ``pp``: the pipeline-parallel degree (the Note on pipeline parallelism): the mesh
    gets a "pp" dim first, and the plan's factors are those of one stage's data-parallel
    world (world / pp / tp ranks). Shard each stage's module on this mesh, and hand
    ``mesh["pp"].get_group()`` to torch's ``PipelineStage``.
    ``ep`` and ``expert_plan``: expert parallelism and the experts' own plan (the Note on
    expert parallelism); with either, ``amsp.expert_mesh(mesh)`` is the mesh to split the
    experts over (its "ep" dim) and to shard them on. ``expert_plan`` defaults to
    ``plan`` read on the expert world (a ShardingPlan's names, such as "node", resolve
    there; ints must fit it).
    ``cp``: the context-parallel degree (the Note on context parallelism): cp ranks share
    P, G and OS with the data-parallel ranks, so the plan's factors range over both
    (world / pp / tp ranks); ``amsp.context_parallel_mesh(mesh)`` is the 1-D mesh to split
    the sequence and exchange K/V over.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_mesh needs an initialised default process group: call "
            "torch.distributed.init_process_group first (torchrun sets the env for it)"
        )
    world_size = dist.get_world_size()
    if ranks_per_node is None:
        ranks_per_node = _ranks_per_node_from_env(world_size)
    job_world, job_per_node = world_size, ranks_per_node
    if pp != 1 or isinstance(pp, bool):
        world_size, ranks_per_node = _stage_world(pp, ranks_per_node, world_size)
    _check_tp(tp, ranks_per_node, world_size)
    dp_world, dp_per_node = world_size // tp, ranks_per_node // tp
    resolved = _resolved(plan, "plan", dp_world, dp_per_node, tp, pp)
    # every check before the first group is made: a bad ep, expert plan or cp leaves nothing
    expert = _resolved_expert(plan, expert_plan, ep, dp_world, dp_per_node, tp, pp)
    check_context_parallel(cp, dp_world, dp_per_node, expert is not None)
    device_type = device_type or _default_device_type()
    dims = (job_world, job_per_node, pp)
    info = _build(resolved, device_type, *dims, tp, TP_DIM, "")
    if cp > 1:
        info.cp, info.cp_mesh = cp, _cp_mesh(device_type, job_world, pp, tp, cp)
        # the model's K/V exchange over "cp" (the recorder's Note on the model's collectives)
        watch_group(info.cp_mesh, info.cp_mesh.get_group(), CP_DIM, cp,
                    info.group_crosses_nodes(info.cp_mesh.get_group()))
    if expert is not None:
        info.expert = _build(expert, device_type, *dims, ep, EP_DIM, EXPERT_DIM_PREFIX)
        if ep > 1:  # the model's token all-to-alls over "ep" (the recorder's Note)
            watch_group(info.expert.mesh, info.expert.group(EP_DIM), EP_DIM, ep,
                        info.expert.crosses_nodes(EP_DIM))
    return info.pp_mesh or info.mesh


def context_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D "cp" mesh of a mesh made by ``init_mesh(plan, cp=N)``: the cp consecutive
    data-parallel ranks that split one sequence (hand it to torch's context parallelism,
    or torchtitan's ``apply_cp_to_forward``)."""
    info = mesh_info(mesh)
    if info.cp_mesh is None:
        raise ValueError("this mesh has no context-parallel dim: build it with "
                         "amsp.init_mesh(plan, cp=N)")
    return info.cp_mesh


def _cp_mesh(device_type: str, job_world: int, pp: int, tp: int, cp: int) -> DeviceMesh:
    """This rank's 1-D "cp" mesh: each cp group is cp consecutive data-parallel ranks of
    one stage with the same tp index (ranks d * tp + t, d = outer * cp + c), as
    torchtitan's (pp, dp_replicate, dp_shard, cp, tp) mesh places them. Every group is
    made on every rank (group creation is collective)."""
    stage_world = job_world // pp
    groups = [[s * stage_world + (outer * cp + c) * tp + t for c in range(cp)]
              for s in range(pp) for outer in range(stage_world // tp // cp) for t in range(tp)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    ranks = dist.get_process_group_ranks(mine)
    return DeviceMesh.from_group(mine, device_type, mesh=torch.tensor(ranks),
                                 mesh_dim_names=(CP_DIM,))


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The expert mesh of a mesh made by ``init_mesh(plan, ep=N, expert_plan=...)``:
    split the experts over its "ep" dim and shard them on it (``amsp.fully_shard(experts,
    mesh=amsp.expert_mesh(mesh))``)."""
    info = mesh_info(mesh)
    if info.is_expert:
        return mesh
    if info.expert is None:
        raise ValueError(
            "this mesh has no expert mesh: build it with amsp.init_mesh(plan, ep=N) (expert "
            "parallelism) or amsp.init_mesh(plan, expert_plan=...) (experts on their own plan)")
    return info.expert.pp_mesh or info.expert.mesh


def _resolved(plan, key: str, dp_world: int, dp_per_node: int, tp: int, pp: int,
              world: str = "") -> ResolvedPlan:
    """``plan`` (``key``: what the caller named it) resolved for its data-parallel world
    of ``dp_world`` ranks, ``dp_per_node`` per node; ``world``: what that world is, when
    it is not the job's data-parallel world."""
    if isinstance(plan, ResolvedPlan):
        if plan.world_size != dp_world or plan.ranks_per_node != dp_per_node:
            under = " and ".join(f"{n}={d}" for n, d in (("pp", pp), ("tp", tp)) if d > 1)
            under = f" under {under}" if under else ""
            raise ValueError(
                f"{key} was resolved for world {plan.world_size} x {plan.ranks_per_node} per "
                f"node, but this job has {dp_world} {world or 'data-parallel'} ranks, "
                f"{dp_per_node} per node{under}: pass the ShardingPlan itself, or resolve it "
                f"for this job with .resolve({dp_world}, {dp_per_node})"
            )
        return plan
    if isinstance(plan, ShardingPlan):
        if world:
            try:
                return plan.resolve(dp_world, dp_per_node)
            except ValueError as e:
                raise ValueError(f"{key}: the expert plan's factors are those of the {world} "
                                 f"({dp_world} ranks, {dp_per_node} per node): {e}") from None
        return _resolve_under_tp(plan, dp_world, dp_per_node, tp, pp)
    raise TypeError(
        f"{key} must be amsp.ShardingPlan (or a resolved plan), got {type(plan).__name__}"
    )


def _resolved_expert(plan, expert_plan, ep, dp_world, dp_per_node, tp, pp):
    """The expert plan resolved over the expert world, or None when there is no expert
    mesh (ep 1 and no expert_plan)."""
    if expert_plan is None and ep == 1 and not isinstance(ep, bool):
        return None
    e_world, e_per_node = expert_parallel_world(dp_world, dp_per_node, ep, tp)
    if expert_plan is None:
        if isinstance(plan, ResolvedPlan):
            plan = ShardingPlan(plan.s_p, plan.s_g, plan.s_os)
        key, expert_plan = "plan (the expert plan by default; pass expert_plan=)", plan
    else:
        key = "expert_plan"
    world = (f"expert world: the ranks holding the same experts, one per ep={ep} group"
             + (" of each stage" if pp > 1 else ""))
    return _resolved(expert_plan, key, e_world, e_per_node, tp, pp, world=world)


def _build(resolved: ResolvedPlan, device_type: str, job_world: int, job_per_node: int,
           pp: int, mp: int, mp_dim: str, label_prefix: str) -> MeshInfo:
    """One AMSP mesh over the job: (["pp",] [mp_dim,] "rep", "p", "g", "os"), with every
    group made now (the Notes at the top)."""
    stage_world = job_world // pp
    stage = _stage_rank_tensor(resolved.mesh_shape, stage_world, mp)
    stage_dims = (*((mp_dim,) if mp > 1 else ()), *MESH_DIMS)
    if pp == 1:
        stage_mesh = DeviceMesh(device_type, stage.contiguous(), mesh_dim_names=stage_dims)
        job_mesh = None
    else:
        rank_tensor = torch.stack([stage + i * stage_world for i in range(pp)]).contiguous()
        job_mesh = DeviceMesh(device_type, rank_tensor, mesh_dim_names=(PP_DIM, *stage_dims))
        stage_mesh = job_mesh[stage_dims]
    # a dense mesh without pp keeps its ranks per node from its plan (job_ranks_per_node
    # None), as before expert meshes existed
    per_node = job_per_node if (pp > 1 or label_prefix) else None
    info = MeshInfo(stage_mesh, resolved, tp=mp, pp=pp, pp_mesh=job_mesh,
                    job_ranks_per_node=per_node, mp_dim=mp_dim, label_prefix=label_prefix)
    # Make every group now: group creation is collective, so doing it lazily (say, at the
    # first clip_grad_norm_) would hang if one rank got there by another path.
    for dim in (*MESH_DIMS, "shard", *((mp_dim,) if mp > 1 else ())):
        info.group(dim)
    if job_mesh is not None:
        info.pp_group  # made now, on every rank (group creation is collective)
        handle.set_mesh_info(job_mesh, info)
    handle.set_mesh_info(stage_mesh, info)
    return info


def _stage_rank_tensor(shape: dict, stage_world: int, tp: int) -> torch.Tensor:
    """The rank tensor of one stage's mesh (stage-local ranks), as init_mesh builds it;
    ``tp``: the size of the model-parallel dim (fastest in rank order)."""
    if tp == 1:
        return (torch.arange(stage_world)
                .reshape(shape["rep"], shape["os"], shape["g"], shape["p"])
                .permute(0, 3, 2, 1))
    return (torch.arange(stage_world)
            .reshape(shape["rep"], shape["os"], shape["g"], shape["p"], tp)
            .permute(4, 0, 3, 2, 1))


def _stage_world(pp, ranks_per_node: int, world_size: int) -> tuple[int, int]:
    """(ranks of one pipeline stage, of them per node): pp divides the world, and a
    stage spans whole nodes or fits in one."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be a positive int (the pipeline-parallel degree), got {pp!r}")
    if world_size % pp:
        raise ValueError(f"pp={pp} does not divide the world size {world_size}: every "
                         "pipeline stage needs the same number of ranks")
    stage = world_size // pp
    if stage % ranks_per_node and ranks_per_node % stage:
        raise ValueError(
            f"pp={pp} on {world_size} ranks, {ranks_per_node} per node: a stage of {stage} "
            "ranks must span whole nodes or fit in one (stages are consecutive ranks, pp "
            "outermost); choose pp so that world/pp is a multiple or a divisor of the ranks "
            "per node")
    return stage, min(stage, ranks_per_node)


def _check_tp(tp, ranks_per_node: int, world_size: int) -> None:
    """tp divides the ranks per node, and the world is whole nodes (plan/sharding_plan.py)."""
    if tp == 1 and not isinstance(tp, bool):
        return
    data_parallel_world(world_size, ranks_per_node, tp, name="tp")


def _resolve_under_tp(plan: ShardingPlan, dp_world: int, dp_per_node: int, tp: int,
                      pp: int = 1):
    if tp == 1 and pp == 1:
        return plan.resolve(dp_world, dp_per_node)
    try:
        return plan.resolve(dp_world, dp_per_node)
    except ValueError as e:
        under = " and ".join(f"{n}={d}" for n, d in (("pp", pp), ("tp", tp)) if d > 1)
        world = "data-parallel world" if pp == 1 else "data-parallel world of one stage"
        raise ValueError(
            f"under {under} the plan's factors are those of the {world} "
            f"({dp_world} ranks, {dp_per_node} per node): {e}"
        ) from None


def mesh_info(mesh: DeviceMesh, plan: ShardingPlan | ResolvedPlan | None = None) -> MeshInfo:
    """The MeshInfo of a mesh made by init_mesh (its ``plan`` is the one resolved plan the
    mesh was built for), checked against ``plan`` if given."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh from amsp.init_mesh, got {type(mesh).__name__}")
    info = handle.mesh_info_of(mesh)
    if info is None:
        raise ValueError(
            f"mesh {mesh.mesh_dim_names} was not made by amsp.init_mesh(plan): build it with "
            "amsp.init_mesh so its dims match the plan"
        )
    if plan is not None and plan is not info.plan:
        _check_plan_agrees(plan, info.plan)
    return info


def _check_plan_agrees(plan: ShardingPlan | ResolvedPlan, got: ResolvedPlan) -> None:
    """``plan`` asks for the factors the mesh was built for (``got``). A ShardingPlan's
    names are read on the mesh's world; the plan is not resolved again (init_mesh did)."""
    if isinstance(plan, ResolvedPlan):
        want = (plan.s_p, plan.s_g, plan.s_os)
    elif isinstance(plan, ShardingPlan):
        world, per_node = got.world_size, got.ranks_per_node
        want = tuple(resolve_factor(key, value, world, per_node) for key, value in
                     (("param", plan.param), ("grad", plan.grad), ("optim", plan.optim)))
    else:
        raise TypeError(f"plan must be amsp.ShardingPlan, got {type(plan).__name__}")
    if want != (got.s_p, got.s_g, got.s_os):
        asked = "p{}-g{}-os{}".format(*want)
        raise ValueError(
            f"plan {asked} does not match the mesh, which was built for {got.name}: pass "
            "the same plan to init_mesh and fully_shard, or leave fully_shard's plan out "
            "(it reads the mesh's)"
        )
