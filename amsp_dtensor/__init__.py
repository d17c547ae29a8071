"""amsp_dtensor: AMSP (Chen et al., arXiv 2311.00257) on PyTorch DTensor and FSDP2.

Parameters (P), gradients (G) and optimizer states (OS) each get their own sharding
factor; see docs/layouts.md.
"""

from .plan.cost.comm import predicted_events
from .plan.cost.planner import NoPlanFits
from .plan.cost.planner import choose_plan as auto_plan
from .engine.grad import no_sync, set_gradient_divide_factor
from .engine.layouts import G_PLACEMENTS, OS_PLACEMENTS, P_PLACEMENTS, gather_full
from .engine.mesh import context_parallel_mesh, expert_mesh, init_mesh
from .engine.recorder import CommEvent, CommRecorder, record_comms
from .observe.backward_memory import track_backward_memory
from .observe.memory import memory_by_state
from .engine.optim import AMSPOptimizer, clip_grad_norm_
from .engine.pipeline import pipeline_stage
from .engine.param_update import ParamWrittenWhilePending
from .engine.overlap import Overlap, set_overlap
from .engine.compression import Compression, set_compression
from .plan import BASELINES, ResolvedPlan, ShardingPlan, enumerate_plans
from .engine.shard import fully_shard

__all__ = [
    "AMSPOptimizer",
    "NoPlanFits",
    "Overlap",
    "ParamWrittenWhilePending",
    "auto_plan",
    "predicted_events",
    "BASELINES",
    "CommEvent",
    "Compression",
    "CommRecorder",
    "G_PLACEMENTS",
    "OS_PLACEMENTS",
    "P_PLACEMENTS",
    "ResolvedPlan",
    "ShardingPlan",
    "enumerate_plans",
    "fully_shard",
    "gather_full",
    "context_parallel_mesh",
    "expert_mesh",
    "init_mesh",
    "clip_grad_norm_",
    "pipeline_stage",
    "memory_by_state",
    "no_sync",
    "record_comms",
    "set_compression",
    "set_gradient_divide_factor",
    "set_overlap",
    "track_backward_memory",
]
