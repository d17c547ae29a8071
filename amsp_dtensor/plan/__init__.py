"""The planner: the sharding plan (the value object every other part takes), the cost
model that prices it (``cost/``: memory, collectives, step time, the search over plans),
and ``python -m amsp_dtensor.plan`` (choose a plan). The commands that drive the engine to
check the model, ``profile`` (measure this cluster's bandwidth table), ``simulate`` (one
rank of a large job on torch's fake process group) and ``validate`` (a real run against
the model), live in amsp_dtensor.harness; ``python -m amsp_dtensor.plan.<command>`` runs
them. Nothing here imports another part of amsp_dtensor (tests/test_layout.py).

Importing this package loads only the value object; the cost model is imported where it
is used.
"""

from .sharding_plan import (
    BASELINES,
    STRATEGY_NAMES,
    Factor,
    ResolvedPlan,
    ShardingPlan,
    data_parallel_world,
    enumerate_plans,
    expert_parallel_world,
    resolve_factor,
    tp_outside_node,
)

__all__ = ["BASELINES", "Factor", "ResolvedPlan", "STRATEGY_NAMES", "ShardingPlan",
           "data_parallel_world", "enumerate_plans", "expert_parallel_world", "resolve_factor",
           "tp_outside_node"]
