"""What Muon adds to a step under AMSP: each matrix orthogonalized by one owner of the
shard group (engine/sharded_muon.py, [Note: one owner per matrix]; the owners are
plan/muon_owners.py's, the engine's own assignment).

- ``owner_flops``: each member's Newton-Schulz work in a step;
- ``predicted_muon_events``: the two all-to-alls of one step on rank 0, in bfloat16, as
  the recorder sees them (rank 0 is member (p 0, OS chunk 0) of its shard group and the
  first in its rank order);
- ``muon_matrices`` and ``muon_step``: what the planner charges a plan under Muon
  (choose_plan(optimizer="muon")): those events, the busiest member's Newton-Schulz
  FLOPs, the optimizer states Muon's one momentum saves against AdamW's two moments, and
  the step's buffers ([Note: Muon's step buffers]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from ..muon_owners import assign_owners, newton_schulz_flops
from ..sharding_plan import ResolvedPlan, ShardingPlan
from .comm import PlannedComm, _as_resolved, dim_group
from .memory import _chunk_len
from .models import ModelShape
from .padding import shard_numel

__all__ = ["MuonStep", "muon_matrices", "muon_step", "owner_flops", "predicted_muon_events"]

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


def muon_matrices(model: ModelShape) -> list[tuple[int, int]]:
    """The matrices Muon steps, in the optimizer's order: every block's 2-D weights. The
    embeddings, the output head and the norms go to a group's own optimizer (AdamW), as
    Moonlight's recipe trains them and as the engine requires (ShardedMuon.check_params)."""
    skip = {model.root_unit_index} | ({0} if model.layout == "titan" else set())
    return [tuple(s) for i, unit in enumerate(model.unit_param_shapes()) if i not in skip
            for s in unit if len(s) == 2]


@dataclass(frozen=True)
class MuonStep:
    """What Muon adds to one rank's optimizer step under a plan (muon_step)."""

    events: list[PlannedComm]  # rank 0's two all-to-alls (predicted_muon_events)
    member_flops: list[int]  # each member of the shard group's Newton-Schulz FLOPs
    os_bytes_saved: int  # one fp32 momentum where AdamW keeps two moments, on this rank
    scratch_bytes: int  # the busiest member's step buffers ([Note: Muon's step buffers])

    @property
    def busiest_flops(self) -> int:
        return max(self.member_flops, default=0)

    def balance(self) -> tuple[float, float]:
        """(max / mean - 1, min / mean - 1) of the members' Newton-Schulz FLOPs."""
        mean = sum(self.member_flops) / len(self.member_flops)
        return max(self.member_flops) / mean - 1, min(self.member_flops) / mean - 1


def muon_step(model: ModelShape, plan: ResolvedPlan, ns_steps: int = 5) -> MuonStep:
    """Muon's events, FLOPs, state and step buffers for ``model`` under ``plan`` (the
    owners are the engine's: plan/muon_owners.py over the s_os members of the shard
    group)."""
    shapes = muon_matrices(model)
    costs = [newton_schulz_flops(s, ns_steps) for s in shapes]
    owners = assign_owners(costs, plan.s_os)
    owned = [0] * plan.s_os
    widest = [0] * plan.s_os  # the largest Newton-Schulz workspace a member needs
    for (m, n), o in zip(shapes, owners):
        owned[o] += m * n
        widest[o] = max(widest[o], 4 * m * n + 4 * min(m, n) ** 2)
    rows = shard_numel(shapes, plan.s_os)
    busiest = max(range(plan.s_os), key=lambda o: 6 * owned[o] + widest[o])
    scratch = 4 * rows + 2 * 2 * rows + 6 * owned[busiest] + widest[busiest]
    return MuonStep(events=predicted_muon_events(plan, shapes, ns_steps),
                    member_flops=owner_flops(shapes, plan.s_os, ns_steps),
                    os_bytes_saved=4 * rows, scratch_bytes=scratch)


# [Note: Muon's step buffers] ShardedMuon.step on one member of the shard group, with R
# elements of Muon rows on this rank and O elements of the matrices it owns (bytes):
# - 4R: the Nesterov updates of every matrix's rows (fp32), alive through the step;
# - 2R + 2R: their bfloat16 copies and the all-to-all's flat send buffer (the second
#   all-to-all's 2R output takes the flat buffer's place later);
# - 6O: the owned matrices received (bfloat16), their results, and the flat buffer that
#   sends the results back;
# - the Newton-Schulz of the largest owned m x n matrix: the whole matrix assembled, the
#   Gram matrix and its update (min(m, n) squared each) and the next iterate, bfloat16:
#   4mn + 4 min(m, n)^2.
# An upper bound (every buffer counted at once). Against a measured step (glibc's bytes in
# use after every op, rank 0 of a fake 16-rank job, TinyLlama dim 256, fp32; the step's
# peak over the bytes before it, step_bytes' gather + scratch): p8-g8-os16 3.64 MB
# measured / 4.62 MB modelled, p16-g16-os16 3.65 / 4.62, p1-g1-os1 49.85 / 58.89; without
# these buffers the model stays below every one (tests/test_cost_muon.py).
