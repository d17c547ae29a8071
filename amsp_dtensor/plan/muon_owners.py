"""Which rank of a shard group orthogonalizes each of Muon's matrices: the engine's
assignment (engine/sharded_muon.py) and the cost model's (plan/cost/muon.py) are this one.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["assign_owners", "newton_schulz_flops"]


def newton_schulz_flops(shape, ns_steps: int = 5) -> int:
    """Multiply-add FLOPs of torch's Newton-Schulz on a matrix of ``shape`` (m <= n after
    its transpose): per step X @ X.T (2 m^2 n), the Gram polynomial (2 m^3) and its
    product with X (2 m^2 n)."""
    m, n = sorted(int(d) for d in shape[:2])
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs: Sequence[int], members: int) -> list[int]:
    """The owner of each matrix: largest cost first, each to the least loaded member
    (the lowest index on a tie); deterministic, so every member computes the same."""
    load = [0] * members
    owners = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        owner = min(range(members), key=lambda m: (load[m], m))
        owners[j] = owner
        load[owner] += costs[j]
    return owners
