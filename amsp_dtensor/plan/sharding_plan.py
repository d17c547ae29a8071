"""The ShardingPlan value object: one sharding factor each for P, G and OS.

A factor is how many ranks share one copy of a state (1 = replicated, world = fully
sharded). With ranks numbered node by node, a factor s has an intra-node part
s0 = min(s, R) and an inter-node part s1 = s / s0 (R = ranks per node): the paper's 2-D
factor (s0, s1) is fully determined by s once the rules below hold, so the plan stores
plain integers and derives the 2-D view.

The paper's constraints on the factors (docs/design.md, "Validity rules"), as checked by
`ShardingPlan.resolve`:
  1. every factor divides the world size;
  2. a factor either divides R (stays in a node) or is a multiple of R (fills whole nodes);
  3. s_p | s_g | s_os (chain order with nesting, so each OS shard lies inside its P shard);
  4. s_g is s_p or s_os.

With tensor parallelism (TP, degree t; torchtitan's ``tensor_parallel_degree``, Megatron's
``--tp``) the t ranks of a TP group are consecutive ranks of one node, "tp" being the
innermost mesh dim as torchtitan builds its mesh: rank = dp_rank * t + tp_rank. The AMSP
factors then shard over the data-parallel (DP) world only: D = W / t ranks, R / t of them
per node, and every rule above is checked on (D, R / t) (``data_parallel_world``). "node"
therefore means R / t DP ranks: a node holds R / t DP ranks per TP rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

Factor = Union[int, str]

STRATEGY_NAMES = ("replica", "node", "full")

__all__ = [
    "Factor",
    "ShardingPlan",
    "ResolvedPlan",
    "STRATEGY_NAMES",
    "enumerate_plans",
    "data_parallel_world",
    "BASELINES",
    "resolve_factor",
    "tp_outside_node",
    "expert_parallel_world",
    "EXPERT_DIM_PREFIX",
]

# How the collectives of the expert mesh are named (recorder and cost model alike):
# "expert_p", "expert_os", ... (the expert-parallel dim itself is "ep")
EXPERT_DIM_PREFIX = "expert_"


def resolve_factor(key: str, value: Factor, world_size: int, ranks_per_node: int) -> int:
    """One factor as an int: a strategy name ("replica", "node", "full") or a positive
    int (or its digits); TypeError / ValueError naming ``key`` otherwise. The rules
    between factors and the world are checked by ``ShardingPlan.resolve``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{key} must be an int factor or one of {STRATEGY_NAMES}, got "
            f"{type(value).__name__} {value!r}"
        )
    if isinstance(value, str):
        name = value.strip().lower()
        if name.isdigit():
            return resolve_factor(key, int(name), world_size, ranks_per_node)
        if name == "replica":
            return 1
        if name == "node":
            return min(ranks_per_node, world_size)
        if name == "full":
            return world_size
        raise ValueError(
            f"{key}={value!r} is not a strategy; use an int factor or one of {STRATEGY_NAMES}"
        )
    if value < 1:
        raise ValueError(f"{key}={value} must be a positive factor (1 = replica)")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_factors(world_size: int, ranks_per_node: int) -> list[int]:
    """Factors that obey rules 1 and 2: divisors of R, or multiples of R dividing W."""
    out = set()
    for d in _divisors(world_size):
        if d <= ranks_per_node and ranks_per_node % d == 0:
            out.add(d)
        elif d % ranks_per_node == 0:
            out.add(d)
    return sorted(out)


@dataclass(frozen=True)
class ShardingPlan:
    """What the user asks for: a factor or strategy name per state.

    ``param`` shards parameters (P), ``grad`` gradients (G), ``optim`` the fp32 master
    weights and optimizer states (OS). Names: "replica" (1), "node" (ranks per node),
    "full" (world size). Resolve against a world with :meth:`resolve`.
    """

    param: Factor = "full"
    grad: Factor = "full"
    optim: Factor = "full"

    @classmethod
    def from_name(cls, name: str) -> "ShardingPlan":
        """The plan a ``ResolvedPlan.name`` such as "p2-g2-os4" stands for."""
        match = re.fullmatch(r"p?(\d+)-g?(\d+)-(?:os)?(\d+)", name.strip())
        if match is None:
            raise ValueError(f"plan {name!r}: write it as p<s_p>-g<s_g>-os<s_os>, e.g. p2-g2-os4")
        return cls(*(int(x) for x in match.groups()))

    def resolve(
        self, world_size: int, ranks_per_node: int, tensor_parallel_degree: int = 1,
    ) -> "ResolvedPlan":
        """The plan with integer factors for this world. With ``tensor_parallel_degree``
        t > 1 the result describes the data-parallel mesh: its ``world_size`` is W / t and
        its ``ranks_per_node`` R / t (module docstring); a plan that does not fit that
        world is refused naming the TP degree."""
        if tensor_parallel_degree != 1:
            dp_world, dp_per_node = data_parallel_world(
                world_size, ranks_per_node, tensor_parallel_degree)
            try:
                return self.resolve(dp_world, dp_per_node)
            except ValueError as exc:
                raise ValueError(
                    f"under tensor_parallel_degree={tensor_parallel_degree} the AMSP factors "
                    f"shard the data-parallel world, {world_size} / {tensor_parallel_degree} = "
                    f"{dp_world} ranks ({dp_per_node} per node): {exc}"
                ) from None
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if world_size % ranks_per_node != 0:
            raise ValueError(
                f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}: "
                "every node must run the same number of ranks"
            )
        s_p = resolve_factor("param", self.param, world_size, ranks_per_node)
        s_g = resolve_factor("grad", self.grad, world_size, ranks_per_node)
        s_os = resolve_factor("optim", self.optim, world_size, ranks_per_node)
        resolved = ResolvedPlan(s_p, s_g, s_os, world_size, ranks_per_node)
        problem = resolved.violation()
        if problem is not None:
            nearest = nearest_valid(s_p, s_g, s_os, world_size, ranks_per_node)
            raise ValueError(
                f"invalid plan param={s_p}, grad={s_g}, optim={s_os} on {world_size} ranks "
                f"({ranks_per_node} per node): {problem}; nearest valid plan: "
                f"param={nearest.s_p}, grad={nearest.s_g}, optim={nearest.s_os}"
            )
        return resolved


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan with integer factors for one world. Construct via ShardingPlan.resolve."""

    s_p: int
    s_g: int
    s_os: int
    world_size: int
    ranks_per_node: int

    def violation(self) -> str | None:
        """The first broken rule as text, or None if the plan is valid."""
        W, R = self.world_size, self.ranks_per_node
        for key, s in (("param", self.s_p), ("grad", self.s_g), ("optim", self.s_os)):
            if W % s != 0:
                return f"rule 'factor divides world': {key}={s} does not divide {W}"
            if s > R and s % R != 0:
                return (
                    f"rule 'fill a node before spanning nodes': {key}={s} spans nodes but is "
                    f"not a multiple of {R} ranks per node"
                )
            if s < R and R % s != 0:
                return (
                    f"rule 'factor divides the node': {key}={s} does not divide "
                    f"{R} ranks per node"
                )
        if not (self.s_p <= self.s_g <= self.s_os):
            return (
                "rule 'param <= grad <= optim': grads are made from local params and "
                "optimizer states update from synced grads"
            )
        if self.s_g % self.s_p or self.s_os % self.s_g:
            return "rule 'nested factors': param must divide grad and grad must divide optim"
        if self.s_g not in (self.s_p, self.s_os):
            return "rule 'grad follows param or optim': grad must equal param or optim"
        return None

    # --- the paper's 2-D view (s0 = intra-node part, s1 = inter-node part) ---
    def intra(self, s: int) -> int:
        return min(s, self.ranks_per_node)

    def inter(self, s: int) -> int:
        return s // self.intra(s)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Sizes of the named mesh dims, in mesh order (see amsp_dtensor.engine.mesh)."""
        return {
            "rep": self.world_size // self.s_os,
            "p": self.s_p,
            "g": self.s_g // self.s_p,
            "os": self.s_os // self.s_g,
        }

    @property
    def name(self) -> str:
        return f"p{self.s_p}-g{self.s_g}-os{self.s_os}"

    def as_plan(self) -> ShardingPlan:
        return ShardingPlan(self.s_p, self.s_g, self.s_os)

    def to_toml(self) -> str:
        return (
            "[amsp]\n"
            f"param_shard = {self.s_p}\n"
            f"grad_shard = {self.s_g}\n"
            f"optim_shard = {self.s_os}\n"
        )


def data_parallel_world(
    world_size: int, ranks_per_node: int, tensor_parallel_degree: int,
    name: str = "tensor_parallel_degree",
) -> tuple[int, int]:
    """(D, R_dp): the data-parallel world and its ranks per node under TP degree t.

    TP ranks are consecutive ranks of one node (torchtitan puts "tp" innermost), so t must
    divide the ranks per node; the DP world is then W / t ranks, R / t per node. ``name``:
    what the caller calls t in its messages (``amsp.init_mesh``: "tp")."""
    t = tensor_parallel_degree
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"{name} must be a positive int (the tensor-parallel degree), got {t!r}")
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
            or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    problem = tp_outside_node(t, ranks_per_node, f"{name}={t}", f"ranks_per_node={ranks_per_node}")
    if problem is not None:
        raise ValueError(problem)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if world_size % ranks_per_node:
        raise ValueError(
            f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}: "
            "every node must run the same number of ranks"
        )
    return world_size // t, ranks_per_node // t


def expert_parallel_world(dp_world: int, dp_per_node: int, ep, tp: int = 1) -> tuple[int, int]:
    """(W_e, R_e): the expert data-parallel world under expert parallelism of degree ep,
    and its ranks per node.

    The ep ranks that split the experts are consecutive ranks (torchtitan carves "ep" out
    of its innermost data-parallel dims, and beside tensor parallelism out of the tp ranks
    too: its (efsdp, ep) mesh unflattens dp_shard x cp x tp), so an EP group either sits
    inside a node (ep divides the ranks per node) or spans whole nodes (a multiple of
    them). The ranks holding the same experts, one per EP group, form the expert world:
    W x tp / ep ranks, R x tp / ep per node, or 1 when an EP group spans nodes (W, R: the
    data-parallel ranks and those per node). The expert plan's factors are factors of
    that world, checked by the same rules."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive int (the expert-parallel degree), got {ep!r}")
    world, per_node = dp_world * tp, dp_per_node * tp
    under = "" if tp == 1 else f" x tp {tp}"
    if world % ep:
        raise ValueError(
            f"ep={ep} does not divide the data-parallel world{under} of {world} ranks: every "
            "expert-parallel group needs the same number of ranks; choose ep dividing it")
    if per_node % ep and ep % per_node:
        raise ValueError(
            f"ep={ep} with {per_node} data-parallel{under} ranks per node: an expert-parallel "
            "group must fit in a node or span whole nodes (consecutive ranks); choose ep "
            f"dividing {per_node} or a multiple of it")
    return world // ep, max(1, per_node // ep)


def check_context_parallel(cp, dp_world: int, dp_per_node: int, experts: bool = False) -> None:
    """The one rule of where cp groups sit: cp divides the data-parallel world (``dp_world``
    ranks, ``dp_per_node`` per node, the cp ranks among them), and its groups (cp
    consecutive data-parallel ranks, as torchtitan places them) fit in a node or span whole
    nodes; not beside experts (``experts``: expert parallelism or an expert plan) yet.
    Raises ValueError naming the fix."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int (the context-parallel degree), got {cp!r}")
    if cp == 1:
        return
    if dp_world % cp:
        raise ValueError(f"cp={cp} does not divide the {dp_world} data-parallel ranks: choose "
                         f"a divisor of {dp_world}")
    if dp_per_node % cp and cp % dp_per_node:
        raise ValueError(
            f"cp={cp} with {dp_per_node} data-parallel ranks per node: a cp group (consecutive "
            "ranks) must fit in a node or span whole nodes; choose cp dividing, or a multiple "
            f"of, {dp_per_node}")
    if experts:
        raise ValueError(f"cp={cp} with expert parallelism or an expert plan is not supported "
                         "yet; use cp=1 or a dense model")


def tp_outside_node(tp: int, ranks_per_node: int, tp_as: str, node_as: str) -> str | None:
    """The one rule of where TP groups sit: TP ranks are consecutive ranks of one node
    ("tp" innermost, as torchtitan builds its mesh), so the degree must divide the ranks
    per node. None when it does, else the refusal, naming the degree and the node as the
    caller calls them (``tp_as``, ``node_as``: "tp=3", "ranks_per_node=4")."""
    if ranks_per_node % tp == 0:
        return None
    fits = ", ".join(str(d) for d in _divisors(ranks_per_node))
    return (f"{tp_as} does not divide {node_as}: a TP group must sit inside one node "
            f"(consecutive ranks, tp innermost); use one of {fits}")


def enumerate_plans(
    world_size: int, ranks_per_node: int, tensor_parallel_degree: int = 1,
) -> list[ResolvedPlan]:
    """Every valid plan for the world, sorted by (s_p, s_g, s_os). With
    ``tensor_parallel_degree`` t > 1: every valid plan of the data-parallel world
    (W / t ranks, R / t per node)."""
    if tensor_parallel_degree != 1:
        return enumerate_plans(*data_parallel_world(world_size, ranks_per_node,
                                                    tensor_parallel_degree))
    ShardingPlan(1, 1, 1).resolve(world_size, ranks_per_node)  # validates the world
    factors = valid_factors(world_size, ranks_per_node)
    plans = []
    for s_p in factors:
        for s_os in factors:
            if s_os % s_p:
                continue
            for s_g in sorted({s_p, s_os}):
                plan = ResolvedPlan(s_p, s_g, s_os, world_size, ranks_per_node)
                if plan.violation() is None:
                    plans.append(plan)
    return plans


def nearest_valid(s_p: int, s_g: int, s_os: int, world_size: int, ranks_per_node: int):
    """The valid plan closest to the request (log-distance of factors, then more sharding)."""
    import math

    def dist(plan: ResolvedPlan) -> tuple:
        d = sum(
            abs(math.log2(a) - math.log2(max(b, 1)))
            for a, b in ((plan.s_p, s_p), (plan.s_g, s_g), (plan.s_os, s_os))
        )
        return (d, -plan.s_os, -plan.s_g, -plan.s_p)

    return min(enumerate_plans(world_size, ranks_per_node), key=dist)


# Existing systems in the same notation (docs/design.md, "The three factors"). "node" for
# HSDP/MiCS = shard in a node.
BASELINES: dict[str, ShardingPlan] = {
    "ddp": ShardingPlan("replica", "replica", "replica"),
    "zero1": ShardingPlan("replica", "replica", "full"),
    "zero2": ShardingPlan("replica", "full", "full"),
    "zero3": ShardingPlan("full", "full", "full"),
    "hsdp": ShardingPlan("node", "node", "node"),
}
