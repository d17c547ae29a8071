"""torchtitan's MetricsProcessor plus AMSP's own scalars.

torchtitan already logs loss, throughput (tokens/s per rank), TFLOPS, MFU and memory.
This subclass adds, through the same logger (TensorBoard/W&B):
  comm/<op>/<dim>/{bytes,seconds,count}   per step, from amsp.record_comms (CommEvents)
  comm/{intra,inter}_node_bytes           bytes by locality of the group
  comm/exposed_seconds                    time this rank was blocked waiting for them
  comm/hidden_fraction                    1 - exposed / issue-to-completion time
                                          (engine/recorder.py, Note: comm timing)
  comm/compressed_bytes                   bytes sent in a codec (amsp.set_compression)
  amsp/residual_norm                      this rank's error-feedback residual norm
  memory_by_state/{param,grad,optim}(MiB) this rank's model states, amsp.memory_by_state
                                          (and residual, when gradients are compressed)
  memory_by_state/expert/...(MiB)         of them, the routed experts' (MoE models with
                                          an expert plan; comm/<op>/expert_<dim>/... are
                                          the experts' collectives)
  amsp/{s_p,s_g,s_os}                     the plan being run
  amsp/expert_{s_p,s_g,s_os}              the experts' plan (MoE models with one)
and drops "mfu(%)" where the peak FLOP rate is unknown (on CPU torchtitan would silently
divide by an A100's peak).
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.tools.utils import device_type

from ..engine.recorder import overlap_summary

UNKNOWN_PEAK_KEYS = ("mfu(%)",)


class _DropKeys(BaseLogger):
    def __init__(self, inner: BaseLogger, drop: tuple[str, ...]) -> None:
        self.inner, self.drop = inner, drop

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.inner.log({k: v for k, v in metrics.items() if k not in self.drop}, step)

    def close(self) -> None:
        self.inner.close()


def comm_scalars(events) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in events:
        base = f"comm/{e.op}/{e.dim}"
        out[f"{base}/bytes"] = out.get(f"{base}/bytes", 0) + e.nbytes
        out[f"{base}/seconds"] = out.get(f"{base}/seconds", 0.0) + e.seconds
        out[f"{base}/count"] = out.get(f"{base}/count", 0) + 1
        if e.codec is not None:
            out["comm/compressed_bytes"] = out.get("comm/compressed_bytes", 0) + e.nbytes
        loc = "inter" if e.inter_node else "intra"
        out[f"comm/{loc}_node_bytes"] = out.get(f"comm/{loc}_node_bytes", 0) + e.nbytes
    out.setdefault("comm/intra_node_bytes", 0)
    out.setdefault("comm/inter_node_bytes", 0)
    summary = overlap_summary(events)
    out["comm/exposed_seconds"] = summary["exposed_seconds"]
    out["comm/hidden_fraction"] = summary["hidden_fraction"]
    return out


def memory_scalars(by_state: dict[str, int]) -> dict[str, float]:
    return {f"memory_by_state/{k}(MiB)": v / 2**20 for k, v in by_state.items()}


class AmspMetrics:
    """The AMSP scalars on a torchtitan MetricsProcessor (a mixin placed before either
    torchtitan's MetricsProcessor; v03.metrics has 0.3's)."""

    def _drop_unknown_peak(self) -> None:
        self.peak_flops_known = device_type != "cpu"
        if not self.peak_flops_known:
            self.logger = _DropKeys(self.logger, UNKNOWN_PEAK_KEYS)

    def log_amsp(self, step: int, plan, events, memory_by_state: dict[str, int],
                 residual_norm: float | None = None, expert_plan=None) -> dict[str, float]:
        metrics = {"amsp/s_p": plan.s_p, "amsp/s_g": plan.s_g, "amsp/s_os": plan.s_os}
        if expert_plan is not None:
            metrics.update({"amsp/expert_s_p": expert_plan.s_p,
                            "amsp/expert_s_g": expert_plan.s_g,
                            "amsp/expert_s_os": expert_plan.s_os})
        if residual_norm is not None:
            metrics["amsp/residual_norm"] = residual_norm
        metrics.update(comm_scalars(events))
        metrics.update(memory_scalars(memory_by_state))
        self.logger.log(metrics, step)
        return metrics


class AmspMetricsProcessor(AmspMetrics, MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self._drop_unknown_peak()


def build_amsp_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return AmspMetricsProcessor(job_config, parallel_dims, tag)
