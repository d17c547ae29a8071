"""What Muon adds to a step under AMSP: each matrix orthogonalized by one owner of the
shard group (engine/sharded_muon.py, [Note: one owner per matrix]; the owners are
plan/muon_owners.py's, the engine's own assignment).

- ``owner_flops``: each member's Newton-Schulz work in a step;
- ``predicted_muon_events``: the two all-to-alls of one step on rank 0, in bfloat16, as
  the recorder sees them (rank 0 is member (p 0, OS chunk 0) of its shard group and the
  first in its rank order).
"""

from __future__ import annotations

from typing import Sequence, Union

from ..muon_owners import assign_owners, newton_schulz_flops
from ..sharding_plan import ResolvedPlan, ShardingPlan
from .comm import PlannedComm, _as_resolved, dim_group
from .memory import _chunk_len

__all__ = ["owner_flops", "predicted_muon_events"]

MUON_EXCHANGE_BYTES = 2  # bfloat16: what torch's Newton-Schulz reads and returns


def owner_flops(shapes: Sequence[Sequence[int]], members: int, ns_steps: int = 5) -> list[int]:
    """Newton-Schulz FLOPs of each member of a shard group of ``members`` for one step
    over matrices of ``shapes`` (in the optimizer's order)."""
    costs = [newton_schulz_flops(s, ns_steps) for s in shapes]
    load = [0] * members
    for cost, owner in zip(costs, assign_owners(costs, members)):
        load[owner] += cost
    return load


def predicted_muon_events(
    plan: Union[ResolvedPlan, ShardingPlan],
    matrix_shapes: Sequence[Sequence[int]],
    ns_steps: int = 5,
    *,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
) -> list[PlannedComm]:
    """Rank 0's Muon collectives of one step: an all-to-all over the shard group sending
    its rows of every matrix to their owners, and one sending back the whole results of
    the matrices it owns (member 0's), 2 bytes an element; none when s_os = 1."""
    p = _as_resolved(plan, world_size, ranks_per_node)
    if p.s_os == 1 or not matrix_shapes:
        return []
    k = p.s_os // p.s_p
    # rank 0 holds OS chunk 0 of P shard 0 of every matrix
    sent = sum(_chunk_len(_chunk_len(int(s[0]), p.s_p, 0), k, 0) * int(s[1])
               for s in matrix_shapes)
    owners = assign_owners([newton_schulz_flops(s, ns_steps) for s in matrix_shapes], p.s_os)
    returned = sum(int(s[0]) * int(s[1]) for s, o in zip(matrix_shapes, owners) if o == 0)
    g = dim_group(p, "shard")
    return [PlannedComm("all_to_all", "shard", g.size, MUON_EXCHANGE_BYTES * n, g.inter_node,
                        "step", 1, -1, g.stride, g.nodes)
            for n in (sent, returned)]
