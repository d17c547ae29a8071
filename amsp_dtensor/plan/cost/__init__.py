"""Cost model and planner: memory per rank, the per-step comm schedule and its time, and
the search over plans (the AMSP paper's memory model, communication model and planner)."""

from .bandwidth import BandwidthTable, BandwidthTableError, load_table
from .comm import (
    AlphaBeta,
    PlannedComm,
    event_counter,
    predicted_events,
    recorded_counter,
    step_comm_time,
    time_breakdown,
)
from ..compression import Compression
from .memory import estimate_memory, state_bytes
from .models import MODELS, ModelShape, get_model
from .nccl import NcclModel
from .planner import NoPlanFits, PlanReport, auto_plan, choose_plan
from .step import ComputeModel, StepTime, step_time

__all__ = [
    "AlphaBeta",
    "BandwidthTable",
    "BandwidthTableError",
    "ComputeModel",
    "Compression",
    "MODELS",
    "ModelShape",
    "NcclModel",
    "NoPlanFits",
    "PlanReport",
    "PlannedComm",
    "auto_plan",
    "choose_plan",
    "estimate_memory",
    "event_counter",
    "get_model",
    "load_table",
    "predicted_events",
    "recorded_counter",
    "state_bytes",
    "step_comm_time",
    "step_time",
    "StepTime",
    "time_breakdown",
]
