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
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import compat
from . import handle
from ..plan import ResolvedPlan, ShardingPlan
from ..plan.sharding_plan import data_parallel_world

MESH_DIMS = ("rep", "p", "g", "os")
TP_DIM = "tp"

__all__ = ["MESH_DIMS", "TP_DIM", "init_mesh", "MeshInfo", "mesh_info"]


@dataclass
class MeshInfo:
    """What the engine needs to know about an AMSP mesh beyond the DeviceMesh."""

    mesh: DeviceMesh
    plan: ResolvedPlan  # resolved over the data-parallel world (W / tp ranks)
    tp: int = 1  # tensor-parallel degree: the size of the "tp" dim (no such dim when 1)
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
        """Ranks per node of the job (DP ranks per node times tp)."""
        return self.plan.ranks_per_node * self.tp

    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D "tp" sub-mesh, for ``parallelize_module`` (None without TP)."""
        return self.mesh[TP_DIM] if self.tp > 1 else None

    def group(self, dim: str) -> dist.ProcessGroup:
        """Process group of a mesh dim, or "shard" = p x g x os (one full model copy)."""
        if dim not in self._groups:
            if dim == "shard":
                self._groups[dim] = compat.flatten_mesh(self.mesh["p", "g", "os"], "shard").get_group()
            else:
                self._groups[dim] = self.mesh[dim].get_group()
        return self._groups[dim]

    def size(self, dim: str) -> int:
        if dim == "shard":
            return self.plan.s_os
        if dim == TP_DIM:
            return self.tp
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

    @property
    def os_subgroup_dim(self) -> str | None:
        """The dim that splits one P shard into OS shards (s_os/s_p ranks), if any.

        One of "g"/"os" always has size 1 (s_g is s_p or s_os), so the OS subgroup is
        just the other one.
        """
        if self.plan.s_os == self.plan.s_p:
            return None
        return "g" if self.plan.s_g > self.plan.s_p else "os"


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
) -> DeviceMesh:
    """Build the AMSP DeviceMesh for ``plan`` over the default process group.

    ``ranks_per_node`` defaults to LOCAL_WORLD_SIZE (torchrun sets it). The process
    group must already be initialised (``dist.init_process_group``). ``tp``: the tensor-
    parallel degree (torchtitan's ``tensor_parallel_degree``); it must divide
    ``ranks_per_node``, and the plan's factors are then those of the data-parallel world
    (world / tp ranks, ranks_per_node / tp per node). Apply TP with
    ``parallelize_module(model, mesh["tp"], ...)`` before ``amsp.fully_shard``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_mesh needs an initialised default process group: call "
            "torch.distributed.init_process_group first (torchrun sets the env for it)"
        )
    world_size = dist.get_world_size()
    if ranks_per_node is None:
        ranks_per_node = _ranks_per_node_from_env(world_size)
    _check_tp(tp, ranks_per_node, world_size)
    dp_world, dp_per_node = world_size // tp, ranks_per_node // tp
    if isinstance(plan, ResolvedPlan):
        if plan.world_size != dp_world or plan.ranks_per_node != dp_per_node:
            under = f" under tp={tp}" if tp > 1 else ""
            raise ValueError(
                f"plan was resolved for world {plan.world_size} x {plan.ranks_per_node} per "
                f"node, but this job has {dp_world} data-parallel ranks, {dp_per_node} per "
                f"node{under}: pass the ShardingPlan itself, or resolve it for this job with "
                f".resolve({dp_world}, {dp_per_node})"
            )
        resolved = plan
    elif isinstance(plan, ShardingPlan):
        resolved = _resolve_under_tp(plan, dp_world, dp_per_node, tp)
    else:
        raise TypeError(
            f"plan must be amsp.ShardingPlan (or a resolved plan), got {type(plan).__name__}"
        )
    device_type = device_type or _default_device_type()
    shape = resolved.mesh_shape
    if tp == 1:
        rank_tensor = (
            torch.arange(world_size)
            .reshape(shape["rep"], shape["os"], shape["g"], shape["p"])
            .permute(0, 3, 2, 1)
            .contiguous()
        )
        mesh = DeviceMesh(device_type, rank_tensor, mesh_dim_names=MESH_DIMS)
    else:  # the Note above: "tp" first in DTensor order, fastest in rank order
        rank_tensor = (
            torch.arange(world_size)
            .reshape(shape["rep"], shape["os"], shape["g"], shape["p"], tp)
            .permute(4, 0, 3, 2, 1)
            .contiguous()
        )
        mesh = DeviceMesh(device_type, rank_tensor, mesh_dim_names=(TP_DIM, *MESH_DIMS))
    info = MeshInfo(mesh, resolved, tp=tp)
    # Make every group now: group creation is collective, so doing it lazily (say, at the
    # first clip_grad_norm_) would hang if one rank got there by another path.
    for dim in (*MESH_DIMS, "shard", *((TP_DIM,) if tp > 1 else ())):
        info.group(dim)
    handle.set_mesh_info(mesh, info)
    return mesh


def _check_tp(tp, ranks_per_node: int, world_size: int) -> None:
    """tp divides the ranks per node, and the world is whole nodes (plan/sharding_plan.py)."""
    if tp == 1 and not isinstance(tp, bool):
        return
    data_parallel_world(world_size, ranks_per_node, tp, name="tp")


def _resolve_under_tp(plan: ShardingPlan, dp_world: int, dp_per_node: int, tp: int):
    if tp == 1:
        return plan.resolve(dp_world, dp_per_node)
    try:
        return plan.resolve(dp_world, dp_per_node)
    except ValueError as e:
        raise ValueError(
            f"under tp={tp} the plan's factors are those of the data-parallel world "
            f"({dp_world} ranks, {dp_per_node} per node): {e}"
        ) from None


def mesh_info(mesh: DeviceMesh, plan: ShardingPlan | ResolvedPlan | None = None) -> MeshInfo:
    """The MeshInfo of a mesh made by init_mesh, checked against ``plan`` if given."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh from amsp.init_mesh, got {type(mesh).__name__}")
    info = handle.mesh_info_of(mesh)
    if info is None:
        raise ValueError(
            f"mesh {mesh.mesh_dim_names} was not made by amsp.init_mesh(plan): build it with "
            "amsp.init_mesh so its dims match the plan"
        )
    if plan is not None:
        if isinstance(plan, ShardingPlan):
            want = plan.resolve(info.plan.world_size, info.plan.ranks_per_node)
        elif isinstance(plan, ResolvedPlan):
            want = plan
        else:
            raise TypeError(f"plan must be amsp.ShardingPlan, got {type(plan).__name__}")
        got = info.plan
        if (want.s_p, want.s_g, want.s_os) != (got.s_p, got.s_g, got.s_os):
            raise ValueError(
                f"plan {want.name} does not match the mesh, which was built for {got.name}: "
                "pass the same plan to init_mesh and fully_shard"
            )
    return info
