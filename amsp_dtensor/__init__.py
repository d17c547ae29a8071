"""amsp_dtensor: AMSP (Chen et al., arXiv 2311.00257) on PyTorch DTensor and FSDP2.

Parameters (P), gradients (G) and optimizer states (OS) each get their own sharding
factor; see docs/layouts.md.
"""

from .cost.comm import predicted_events
from .cost.planner import NoPlanFits
from .cost.planner import choose_plan as auto_plan
from .grad import no_sync, set_gradient_divide_factor
from .layouts import G_PLACEMENTS, OS_PLACEMENTS, P_PLACEMENTS, gather_full
from .mesh import init_mesh
from .observe import CommEvent, CommRecorder, record_comms
from .observe.backward_memory import track_backward_memory
from .observe.memory import memory_by_state
from .optim import AMSPOptimizer
from .param_update import ParamWrittenWhilePending
from .overlap import Overlap, set_overlap
from .plan import BASELINES, ResolvedPlan, ShardingPlan, enumerate_plans
from .shard import fully_shard

__all__ = [
    "AMSPOptimizer",
    "NoPlanFits",
    "Overlap",
    "ParamWrittenWhilePending",
    "auto_plan",
    "predicted_events",
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
    "gather_full",
    "init_mesh",
    "memory_by_state",
    "no_sync",
    "record_comms",
    "set_gradient_divide_factor",
    "set_overlap",
    "track_backward_memory",
]
