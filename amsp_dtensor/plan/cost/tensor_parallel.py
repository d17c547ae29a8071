"""Tensor parallelism's own collectives: what torchtitan 0.2.2's llama3 TP plan (with
sequence parallelism) sends over the TP group in one step, per FSDP unit.

With TP degree t the t ranks of a TP group are consecutive ranks of one node ("tp" is the
innermost mesh dim, as torchtitan builds it), so every collective below stays inside the
node. The AMSP factors shard over the data-parallel world beside it (sharding_plan.py,
``data_parallel_world``); their collectives are ``comm.predicted_events`` on the TP-local
parameter shapes (``ModelShape.unit_param_shapes(tp)``).

Per micro-batch of T = seq_len x micro_batch tokens, e = the compute dtype's bytes, h = dim
(recorder convention: AG output, RS input, AR tensor), from ``apply_tp`` and DTensor's
redistributions (checked against DTensor on torch's fake process group by
tests/test_planner_tp.py):

  every block, forward    AG  T*h*e  attention's PrepareModuleInput: Shard(1) -> Replicate
                          RS  T*h*e  wo (RowwiseParallel, output Shard(1)): Partial -> Shard(1)
                          AG  T*h*e  feed_forward's PrepareModuleInput
                          RS  T*h*e  w2 (RowwiseParallel, output Shard(1))
  every block, backward   the same four, reversed (the gradient of an AG is an RS and of an
                          RS an AG); under full activation checkpointing the recomputed
                          forward issues its four again in the backward
                          AR  h*e x 2  the norms' weight gradients: SequenceParallel keeps
                          the weight Replicate while the norm runs on a sequence shard, so
                          its gradient is Partial(sum); FSDP2 redistributes it to the
                          parameter's Replicate placement (an all-reduce over TP) before its
                          reduce-scatter, on every micro-batch. Small (one row per norm)
                          but one latency each, on the critical path of the post-backward.
  embeddings, forward     RS  T*h*e  RowwiseParallel(output_layouts=Shard(1)): Partial -> Shard(1)
  embeddings, backward    AG  T*h*e
  final norm + output     AG  T*h*e  forward: ColwiseParallel(input_layouts=Shard(1)) gathers
                                     the sequence; RS T*h*e in backward; AR h*e (norm weight)
  loss, loss_parallel     AR  4T x 3  forward: torch's loss_parallel log-softmax all-reduces
  (torchtitan's default)             the fp32 row max and sum of exponentials, and the
                                     picked logit (masked gather), over the vocab shards;
                                     its backward needs no collective
  loss, no loss_parallel  AG  T*V*e  forward: the logits gathered to Replicate (the
  (disable_loss_parallel)            backward takes the local chunk, no collective)
  clip_grad_norm_         AR  4      once per step: the engine adds the TP pieces' squared
                                     norms over "tp" (the only TP collective the engine
                                     issues itself, so the only one amsp.record_comms sees)

Time: these collectives are on the critical path: each one's result is the next op's
input (torchtitan's async TP, which overlaps them with the matmuls, needs torch.compile
and is not modelled), so cost/step.py adds their time to the unit's compute rather than
queueing them beside the data-parallel collectives. The DP collectives that run at the
same time share NVLink with them; that contention is not modelled.
"""

from __future__ import annotations

from typing import Sequence

from .comm import GroupShape, PlannedComm, TimeModel
from .models import ModelShape, tp_chunk

__all__ = ["tp_group", "tp_events", "tp_seconds_per_micro_batch", "check_sequence_parallel"]


def tp_group(tp: int) -> GroupShape:
    """The TP group: tp consecutive ranks of one node."""
    return GroupShape(tp, 1, tp, 1)


def check_sequence_parallel(seq_len: int, tp: int) -> None:
    """torchtitan asserts seq_len % (tp x 2 x cp) == 0 (ParallelDims.seq_len_divisor;
    cp = 1 here): sequence parallelism splits the sequence over the TP ranks."""
    if tp > 1 and seq_len % (2 * tp):
        raise ValueError(
            f"seq_len={seq_len} is not a multiple of 2 x tensor_parallel_degree = {2 * tp} "
            "(torchtitan's sequence-parallel requirement); change seq_len or the TP degree"
        )


def tp_events(
    model: ModelShape, tp: int, *, seq_len: int, micro_batch: int, micro_batches: int,
    dtype_bytes: int, activation_checkpointing: str = "none", loss_parallel: bool = True,
    clip: bool = False,
) -> list[PlannedComm]:
    """TP's collectives of one optimizer step (M micro-batches), per unit, with counts
    (module docstring). Units are indexed as ``model.units()``: the blocks, and the
    embeddings and head in the root unit ("blocks" layout) or in units 0 and L + 1
    ("titan"); clip's all-reduce has unit -1. Empty for tp = 1."""
    if tp == 1:
        return []
    model.check_tensor_parallel(tp)
    check_sequence_parallel(seq_len, tp)
    if activation_checkpointing not in ("none", "full"):
        raise ValueError(
            f"activation_checkpointing={activation_checkpointing!r}; use 'none' or 'full'")
    M, e, h = int(micro_batches), int(dtype_bytes), model.dim
    T = seq_len * micro_batch
    act = T * h * e  # one (micro_batch, seq, dim) activation in the compute dtype
    g = tp_group(tp)
    out: list[PlannedComm] = []

    def add(op, nbytes, phase, count, unit, per_micro_batch=True):
        out.append(PlannedComm(op, "tp", tp, int(nbytes), False, phase,
                               count * M if per_micro_batch else count, unit, g.stride,
                               g.nodes))

    L = model.n_layers
    titan = model.layout == "titan"
    recompute = 2 if activation_checkpointing == "full" else 0
    for i in range(L):
        u = i + 1 if titan else i
        add("all_gather", act, "forward", 2, u)
        add("reduce_scatter", act, "forward", 2, u)
        add("all_gather", act, "backward", 2 + recompute, u)
        add("reduce_scatter", act, "backward", 2 + recompute, u)
        add("all_reduce", h * e, "backward", 2, u)  # attention_norm, ffn_norm grads
    emb = 0 if titan else model.root_unit_index
    head = model.root_unit_index
    if model.embeddings:  # a pipeline stage has the ends it holds
        add("reduce_scatter", act, "forward", 1, emb)
        add("all_gather", act, "backward", 1, emb)
    if model.head:
        add("all_gather", act, "forward", 1, head)
        add("reduce_scatter", act, "backward", 1, head)
        add("all_reduce", h * e, "backward", 1, head)  # the final norm's grad
        if loss_parallel:
            add("all_reduce", 4 * T, "forward", 3, head)
        else:
            add("all_gather", T * tp * tp_chunk(model.vocab_size, tp) * e, "forward", 1, head)
    if clip:
        add("all_reduce", 4, "step", 1, -1, per_micro_batch=False)
    return out


def tp_seconds_per_micro_batch(
    events: Sequence[PlannedComm], time_model: TimeModel, micro_batches: int,
) -> dict[tuple[int, str], float]:
    """{(unit, phase): seconds of TP collectives per micro-batch} for cost/step.py (the
    once-per-step clip all-reduce, (-1, "step"), per step)."""
    out: dict[tuple[int, str], float] = {}
    for ev in events:
        per = 1 if ev.phase == "step" else micro_batches
        t = time_model.time(ev.op, ev.nbytes, ev.group) * ev.count / per
        out[(ev.unit, ev.phase)] = out.get((ev.unit, ev.phase), 0.0) + t
    return out
