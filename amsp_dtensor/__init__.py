"""amsp_dtensor: AMSP (Chen et al., arXiv 2311.00257) on PyTorch DTensor and FSDP2.

Parameters (P), gradients (G) and optimizer states (OS) each get their own sharding
factor; see docs/layouts.md.
"""

from .grad import no_sync, set_gradient_divide_factor
from .layouts import G_PLACEMENTS, OS_PLACEMENTS, P_PLACEMENTS
from .mesh import init_mesh
from .observe import CommEvent, CommRecorder, record_comms
from .observe.memory import memory_by_state
from .optim import AMSPOptimizer
from .plan import BASELINES, ResolvedPlan, ShardingPlan, enumerate_plans
from .shard import fully_shard

__all__ = [
    "AMSPOptimizer",
    "BASELINES",
    "CommEvent",
    "CommRecorder",
    "G_PLACEMENTS",
    "OS_PLACEMENTS",
    "P_PLACEMENTS",
    "ResolvedPlan",
    "ShardingPlan",
    "enumerate_plans",
    "fully_shard",
    "init_mesh",
    "memory_by_state",
    "no_sync",
    "record_comms",
    "set_gradient_divide_factor",
]
