"""Pipeline parallelism in the cost model: a plan costed on every pipeline rank's stages.

Under pipeline parallelism (torchtitan's ``pipeline_parallel_degree`` pp) one AMSP plan
shards every stage over that stage's data-parallel ranks (W / pp, or W / pp / tp), and a
pipeline rank holds one stage (GPipe, 1F1B) or several (looped schedules: v per rank, as
torchtitan's ``stage_ids_this_rank`` assigns them, "loop" or "v" style). Each stage is an
AMSP root of its own: its blocks, and a root unit with the ends it holds (the embeddings on
the first stage, [final norm, output head] on the last; nothing on the others), so its
collectives are those of a model of that shape (``ModelShape(n_layers=k, embeddings=,
head=)``) run for the schedule's M micro-batches, the gradient sync with the last one
(engine/pipeline.py). torchtitan keeps every unit unsharded between forward and backward
under PP (``reshard_after_forward`` False by default), so there is no backward all-gather.

What a pipeline rank holds at its peak:
- states: every local stage's P, G and OS (exact, the stages' own parameter shapes);
- activations: the schedule decides how many micro-batches each local stage has in flight
  (forwards run, backwards not yet). The count is read from torch's own schedule: the
  multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
  DualPipeV) build their per-rank action lists in ``__init__`` from the stages' indices
  and group size alone, so stand-in stages give the exact list; a forward adds one
  micro-batch to its stage, a full backward (or the weight half of a split one) removes
  it. The single-stage ones are known: GPipe holds all M, 1F1B min(M, pp - rank);
- temp: the largest of the local stages' backward buffers, the optimizer step's peak of
  the rank's units.

Step time: each local stage's own timeline (cost/step.py: compute, the collectives the
engine cannot hide, the optimizer), summed over the rank's stages, the slowest rank; plus
the pipeline's bubble, (pp - 1) / v micro-batch slots of the slowest rank (an upper bound
for the zero-bubble schedules, which fill part of it). The stages' point-to-point sends
are not modelled: they are the same for every plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from .comm import PlannedComm, group_shape
from .models import ModelShape

__all__ = ["Stage", "Pipeline", "stages_of_fqns", "stage_model", "with_p_gathers"]

SINGLE_STAGE = {"gpipe": "GPipe", "1f1b": "1F1B"}
# torch's computation types (_ComputationType names and short forms) as F, B, I, W
KINDS = {"F": "F", "FORWARD": "F", "B": "B", "FULL_BACKWARD": "B", "I": "I",
         "BACKWARD_INPUT": "I", "W": "W", "BACKWARD_WEIGHT": "W"}


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its transformer blocks and the ends it holds."""

    n_layers: int
    embeddings: bool = False
    head: bool = False


def stages_of_fqns(module_names_per_stage: list[list[str]]) -> list[Stage]:
    """Stages from torchtitan's module split (``generate_llm_fqn_per_model_part`` or
    ``module_fqns_per_model_part``): lists of "tok_embeddings", "layers.i", "norm",
    "output"."""
    out = []
    for names in module_names_per_stage:
        unknown = [n for n in names if n not in ("tok_embeddings", "norm", "output")
                   and not n.startswith("layers.")]
        if unknown:
            raise ValueError(f"pipeline stage modules {unknown}: the cost model knows "
                             "tok_embeddings, layers.<i>, norm and output")
        out.append(Stage(sum(n.startswith("layers.") for n in names),
                         "tok_embeddings" in names, "output" in names))
    return out


def stage_model(model: ModelShape, stage: Stage) -> ModelShape:
    """The shape of one stage, costed as a model of its own ("blocks" layout)."""
    return replace(model, name=f"{model.name}[stage]", n_layers=stage.n_layers,
                   embeddings=stage.embeddings, head=stage.head, layout="blocks")


@dataclass(frozen=True)
class Pipeline:
    """pp ranks running ``stages`` (every virtual stage, in model order) with torch's
    schedule ``schedule`` (a name ``get_schedule_class`` knows) over ``micro_batches``
    micro-batches per step."""

    degree: int
    schedule: str
    micro_batches: int
    stages: tuple[Stage, ...]
    # torchtitan's policy under PP ("default"): units stay unsharded between forward and
    # backward; True with fsdp_reshard_after_forward = "always" (an int: hpZ)
    reshard_after_forward: bool | int = False
    # the job's ranks per node (0: every stage fills whole nodes), for where the pipeline
    # group's collective (the gradient norm's all-reduce) runs
    ranks_per_node: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.degree < 2:
            raise ValueError(f"pipeline degree {self.degree}: a pipeline has 2 or more ranks")
        if len(self.stages) % self.degree:
            raise ValueError(f"{len(self.stages)} pipeline stages on {self.degree} ranks: "
                             "every rank needs the same number of stages")
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches={self.micro_batches}: must be >= 1")

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // self.degree

    @property
    def style(self) -> str:
        """torchtitan's stage placement: "v" for the V-shaped schedules, else "loop"."""
        return "v" if self.schedule.lower() in ("zbvzerobubble", "dualpipev") else "loop"

    @property
    def split_backward(self) -> bool:
        """Whether the schedule splits backwards into input and weight halves."""
        return self.schedule.lower() in ("interleavedzerobubble", "zbvzerobubble",
                                         "dualpipev")

    def norm_all_reduce(self, plan, tp: int = 1) -> PlannedComm:
        """clip_grad_norm_'s all-reduce of the stages' norms over the pipeline ranks (one
        fp32 scalar), torchtitan's mesh order: pp outermost, so the pipeline ranks of a
        group are one stage (plan.world_size x tp ranks) apart."""
        stage_world = plan.world_size * tp
        per_node = self.ranks_per_node or plan.ranks_per_node * tp
        g = group_shape(self.degree, stage_world, stage_world * self.degree, per_node)
        return PlannedComm("all_reduce", "pp", g.size, 4, g.inter_node, "step", 1, -1,
                           g.stride, g.nodes)

    def stage_ids(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` runs (torchtitan's stage_ids_this_rank)."""
        v, pp = self.stages_per_rank, self.degree
        if self.style == "v":
            if v != 2:
                raise ValueError(f"schedule {self.schedule}: V-style placement needs 2 stages "
                                 f"per rank, got {v}")
            return [rank, len(self.stages) - 1 - rank]
        return [rank + i * pp for i in range(v)]

    def actions(self, rank: int) -> list[tuple[int, str]]:
        """Rank ``rank``'s computations in schedule order: (stage id, "F" forward, "B"
        full backward, "I" / "W" input / weight half). GPipe: every forward, then every
        backward; 1F1B: min(M, pp - 1 - rank) warm-up forwards, then forward-backward
        pairs, then the remaining backwards (torch's Schedule1F1B); the multi-stage
        schedules: torch's own per-rank list (module docstring)."""
        M, pp, ids = self.micro_batches, self.degree, self.stage_ids(rank)
        key = self.schedule.lower()
        if key in SINGLE_STAGE:
            if len(ids) != 1:
                raise ValueError(f"schedule {self.schedule} runs one stage per rank, got "
                                 f"{len(ids)}")
            warm = M if key == "gpipe" else min(M, pp - 1 - rank)
            kinds = ["F"] * warm + ["F", "B"] * (M - warm) + ["B"] * warm
            return [(ids[0], k) for k in kinds]
        out = []
        for action in _rank_actions(self.schedule, pp, len(self.stages), ids, rank, M):
            for a in getattr(action, "sub_actions", None) or (action,):
                kind = KINDS.get(str(a.computation_type).rsplit(".", 1)[-1].upper())
                if kind is not None:
                    out.append((a.stage_index, kind))
        return out

    def in_flight(self, rank: int) -> list[dict[int, int]]:
        """Every state of rank ``rank``'s schedule: {stage id: micro-batches whose forward
        ran and whose backward has not freed them} (module docstring)."""
        counts = {s: 0 for s in self.stage_ids(rank)}
        states = []
        for stage, kind in self.actions(rank):
            counts[stage] += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            states.append(dict(counts))
        return states or [counts]

    def all_gathers(self, rank: int) -> dict[int, tuple[int, int]]:
        """{stage id: (forward, backward) all-gathers over "p" of each of its units per
        step}: an FSDP2 unit gathers when its parameters are sharded, reshards after a
        forward only with reshard_after_forward, and after a backward only at the
        stage's last one of the step (engine/pipeline.py, as torch's stage does for
        FSDP2); so with torchtitan's default under PP, one gather per step."""
        resharding = self.reshard_after_forward is not False
        sharded = {s: True for s in self.stage_ids(rank)}
        done = {s: 0 for s in sharded}
        count = {s: [0, 0] for s in sharded}
        for stage, kind in self.actions(rank):
            if kind == "W":
                continue
            if sharded[stage]:
                count[stage][0 if kind == "F" else 1] += 1
            if kind == "F":
                sharded[stage] = resharding
            else:
                done[stage] += 1
                sharded[stage] = done[stage] == self.micro_batches
        return {s: (f, b) for s, (f, b) in count.items()}


def with_p_gathers(events: list[PlannedComm], p_gathers: tuple[int, int]) -> list[PlannedComm]:
    """``events`` (predicted_events of one stage) with each unit's all-gathers over "p"
    counted as ``p_gathers`` (forward, backward) per step instead of per micro-batch."""
    kept = [ev for ev in events if not (ev.op == "all_gather" and ev.dim == "p")]
    out = []
    for ev in events:
        if ev.op == "all_gather" and ev.dim == "p" and ev.phase == "forward":
            out += [replace(ev, phase=phase, count=n)
                    for phase, n in zip(("forward", "backward"), p_gathers) if n]
    return out + kept


def _rank_actions(schedule: str, pp: int, n_stages: int, ids: list[int], rank: int, M: int):
    """Rank ``rank``'s actions as torch's multi-stage schedule ``schedule`` orders them."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(schedule)
    # stand-ins with what the schedules read to build their order (no process group)
    stand_ins = [SimpleNamespace(stage_index=i, num_stages=n_stages, group_size=pp,
                                 group_rank=rank, is_first=i == 0, is_last=i == n_stages - 1,
                                 submod=None, stage_index_to_group_rank=None) for i in ids]
    try:
        sched = cls(stand_ins, n_microbatches=M)
    except (ValueError, AssertionError) as e:
        raise ValueError(f"schedule {schedule} with {M} micro-batches on {pp} ranks: {e}") from None
    order = getattr(sched, "pipeline_order", None)
    if not order or rank not in order:
        raise ValueError(f"schedule {schedule}: no per-rank action list to cost")
    return [a for a in order[rank] if a is not None]
