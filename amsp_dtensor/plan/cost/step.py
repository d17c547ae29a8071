"""Step time with overlap: compute from FLOPs, collectives placed where the engine runs them.

Compute. Per token, forward FLOPs of one transformer block are 2 x (its parameters) for the
matmuls plus 2 x seq x dim for causal attention (QK^T and AV, half the score matrix);
the root adds the output projection, 2 x vocab x dim (the embedding is a lookup). Backward
costs twice the forward; full activation checkpointing adds one more forward per block.
Seconds = FLOPs / ``compute_flops`` (the rate a GPU sustains on this model's matmuls: a
stated number, ``--tflops``). The optimizer step is memory-bound: ``OPTIM_STEP_BYTES``
per OS element through HBM at ``hbm_bw``.
MFU = model FLOPs (no recompute) / (step time x ``peak_flops``).

Overlap. A discrete timeline with one compute stream and one communication queue (the
collectives of one rank run one after another; they share the links), following what the
engine issues (docs/layouts.md) and when it waits:

- forward: FSDP2 gathers unit k+1 while unit k computes (its prefetch keeps one all-gather
  ahead); the root unit is gathered first (the embedding runs first) and stays gathered;
- backward: FSDP2 prefetches the next unit's all-gather while this one computes; after a
  unit's backward its reduce-scatter over "p", the engine's reduce-scatter over "g" and,
  on the last micro-batch, the sync reduce-scatter over "os" are queued; the engine waits
  for them when the next unit's gradients arrive, so the backward of the unit after next
  cannot start before they are done; the all-reduce over "rep" is waited for only at the
  end of the backward. The root's gradients are complete last (the embedding), so its
  reduce-scatters and sync run after the last block, exposed;
- step: clip_grad_norm_'s scalar all-reduce, the optimizer, then the all-gather of the
  updated parameters over the OS subgroup. With ``overlap_param_update=False`` (the
  engine's default) ``step()`` waits for it; with True each unit's all-gather is queued at
  the start of the next forward, ahead of that unit's forward all-gather, so only what
  the forward cannot hide is exposed.

Compression (opt-in; cost/comm.py, plan/compression.py). A compressed stage adds its
encode and decode, memory-bound elementwise passes, to the time of its collective on
the communication queue (they sit between the collective and the data it consumes or
produces): ``codec_bytes_touched(event) / hbm_bw``. Per call, with raw = the stage's
data uncompressed and nbytes = its compressed buffer: a gradient stage sent by
all-to-all reads its input and the error-feedback residual, writes the compressed
buffer and the new residual (3*raw + nbytes), then reads what arrives and writes the
decoded sum (nbytes + raw): 4*raw + 2*nbytes; an all-gather (weights, or the second
half of a compressed all-reduce over "rep") encodes (raw + nbytes) and decodes
(nbytes + raw): 2*raw + 2*nbytes. Reported as ``codec_seconds`` (also inside
``seconds``; not in ``comm_sum_seconds``, which stays the collectives' own times).

Tensor parallelism (degree t): each rank computes 1/t of every matmul and of the
attention (its heads), so a unit's compute is its FLOPs / t; TP's own collectives
(cost/tensor_parallel.py: per block two all-gathers and two reduce-scatters of the
activations each way, the norms' gradient all-reduces, the embedding's and the head's)
sit on the critical path, added to the unit's compute time, not overlapped (async TP is
not modelled). They are counted in ``exposed_comm_seconds`` and, separately, in
``tp_comm_seconds``. MFU counts the model FLOPs of one GPU: the DP rank's / t.

Mixture of experts. A block's compute is that of its active parameters (the dense
group's and top_k routed experts'; block_flops_per_token). An expert unit's collectives
are queued right after its block's own (the same unit index on the timeline): its
all-gathers before the block computes, its reduce-scatters after. EP's token
all-to-alls (counts, tokens out, outputs back; their gradients in backward) sit on the
critical path of each MoE block like TP's collectives: the block waits for its tokens.
They are counted in ``exposed_comm_seconds`` and, separately, in ``ep_comm_seconds``.

Context parallelism (degree cp): each rank computes seq_len / cp tokens of every sequence,
each attending over as many keys as without cp (torchtitan's head-tail split balances
the causal mask), so a unit's compute is 1/cp of the sequence's. CP's K/V exchange
(cost/comm.py predicted_cp_events: per block two all-gathers in forward, two
reduce-scatters of their gradients in backward) sits on the critical path of every block
like TP's collectives: the attention waits for the gathered K and V. It is counted in
``exposed_comm_seconds`` and, separately, in ``cp_comm_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..sharding_plan import EXPERT_DIM_PREFIX
from .comm import PlannedComm, TimeModel
from .models import ModelShape

__all__ = ["ComputeModel", "StepTime", "step_time", "model_flops_per_token",
           "OPTIM_STEP_BYTES", "codec_bytes_touched"]

# AdamW step per OS element: read fp32 master, bf16 grad, exp_avg, exp_avg_sq; write the
# three fp32 tensors and the bf16 param: 4+2+4+4 + 4+4+4+2.
OPTIM_STEP_BYTES = 28


@dataclass(frozen=True)
class ComputeModel:
    """compute_flops: sustained FLOP/s of one GPU on the model's matmuls; peak_flops: for
    MFU; hbm_bw: memory bandwidth for the optimizer step (bytes/s). Defaults: A800/A100
    bf16 dense peak 312 TFLOP/s, 200 TFLOP/s sustained (64%), HBM2e 2.0 TB/s."""

    compute_flops: float = 200e12
    peak_flops: float = 312e12
    hbm_bw: float = 2.0e12


def block_flops_per_token(model: ModelShape, seq_len: int) -> float:
    """block_numel is a block's active parameters (with experts: the dense group's and
    top_k routed experts', the mean over the blocks); attention_width is dim for llama3."""
    return 2.0 * model.block_numel + 2.0 * seq_len * model.attention_width


def root_flops_per_token(model: ModelShape) -> float:
    """The output projection (a pipeline stage without the head has none)."""
    return 2.0 * model.vocab_size * model.dim if model.head else 0.0


def model_flops_per_token(model: ModelShape, seq_len: int) -> float:
    """Forward + backward FLOPs per token (3x forward), without recompute."""
    return 3.0 * (model.n_layers * block_flops_per_token(model, seq_len)
                  + root_flops_per_token(model))


@dataclass
class StepTime:
    seconds: float  # predicted step time (overlap)
    compute_seconds: float  # compute stream busy time (incl. optimizer)
    comm_sum_seconds: float  # sum of all collective times (no overlap)
    exposed_comm_seconds: float  # seconds - compute_seconds (TP's collectives included)
    mfu: float
    tokens: int  # tokens per data-parallel rank per step
    tp_comm_seconds: float = 0.0  # TP's collectives, on the critical path
    codec_seconds: float = 0.0  # encode/decode of compressed stages (comm queue)
    ep_comm_seconds: float = 0.0  # EP's token all-to-alls, on the critical path
    cp_comm_seconds: float = 0.0  # CP's K/V exchange, on the critical path

    def as_dict(self) -> dict:
        return dict(seconds=self.seconds, compute_seconds=self.compute_seconds,
                    comm_sum_seconds=self.comm_sum_seconds,
                    exposed_comm_seconds=self.exposed_comm_seconds, mfu=self.mfu,
                    tokens_per_rank=self.tokens, tp_comm_seconds=self.tp_comm_seconds,
                    codec_seconds=self.codec_seconds, ep_comm_seconds=self.ep_comm_seconds,
                    cp_comm_seconds=self.cp_comm_seconds)


class _Timeline:
    def __init__(self) -> None:
        self.compute_free = 0.0
        self.comm_free = 0.0
        self.compute_busy = 0.0
        self.comm_busy = 0.0
        self.tp_busy = 0.0

    def comm(self, ready: float, seconds: float) -> float:
        """Queue a collective that may start at `ready`; returns its end."""
        start = max(ready, self.comm_free)
        self.comm_free = start + seconds
        self.comm_busy += seconds
        return self.comm_free

    def compute(self, ready: float, seconds: float, tp: float = 0.0) -> tuple[float, float]:
        """Run `seconds` of compute and `tp` seconds of TP collectives between its ops
        (the compute waits for them) from `ready`; returns (start, end)."""
        start = max(ready, self.compute_free)
        self.compute_free = start + seconds + tp
        self.compute_busy += seconds
        self.tp_busy += tp
        return start, self.compute_free


def codec_bytes_touched(ev: PlannedComm) -> int:
    """HBM bytes one call's encode + decode reads and writes (0 for an exact stage);
    see the module docstring."""
    if ev.codec is None:
        return 0
    if ev.op == "all_to_all":  # a gradient stage, with its error-feedback residual
        return 4 * ev.raw_nbytes + 2 * ev.nbytes
    return 2 * ev.raw_nbytes + 2 * ev.nbytes


def _per_call(events: Iterable[PlannedComm], model: TimeModel, hbm_bw: float = 0.0,
              shape: ModelShape | None = None) -> tuple[dict, float, float, float]:
    """{(unit, phase, op, dim): seconds per call incl. codec}, the collectives' sum
    (no codec), the clip's, and the codec's seconds per step. An expert unit's
    collective ("expert_p", ...) is charged to its block's (unit, phase, op, dim), after
    the block's own on the queue; the model's own exchanges (EP, CP) are not here (_exchange_seconds)."""
    table: dict = {}
    total = 0.0
    clip = 0.0
    codec = 0.0
    for ev in events:
        t = model.time(ev.op, ev.nbytes, ev.group)
        total += t * ev.count
        if ev.unit < 0:
            clip += t * ev.count
            continue
        if ev.codec is not None and hbm_bw > 0:
            tc = codec_bytes_touched(ev) / hbm_bw
            codec += tc * ev.count
            t += tc
        unit, dim = ev.unit, ev.dim
        if dim.startswith(EXPERT_DIM_PREFIX):
            unit, dim = shape.expert_unit_block(unit), dim[len(EXPERT_DIM_PREFIX):]
        key = (unit, ev.phase, ev.op, dim)
        table[key] = table.get(key, 0.0) + t
    return table, total, clip, codec


def is_token_exchange(ev: PlannedComm) -> bool:
    """The model's own exchanges, which its blocks wait for: expert parallelism's
    all-to-alls (cost/comm.py predicted_ep_events) and context parallelism's K/V
    exchange (predicted_cp_events)."""
    return (ev.op == "all_to_all" and ev.dim == "ep") or ev.dim == "cp"


def _exchange_seconds(model: ModelShape, events: list[PlannedComm], time_model: TimeModel,
                      micro_batches: int) -> tuple[dict, dict]:
    """EP's token all-to-alls per MoE block and CP's K/V exchange per block, per
    micro-batch, {(block, phase): seconds}: on the critical path, as TP's collectives
    (the block waits for its tokens, the attention for K and V); and their sums per step,
    {"ep": seconds, "cp": seconds}."""
    table: dict = {}
    totals = {"ep": 0.0, "cp": 0.0}
    for ev in events:
        t = time_model.time(ev.op, ev.nbytes, ev.group) * ev.count
        totals[ev.dim] += t
        layers = [layer for layer in range(model.n_layers)
                  if ev.dim == "cp" or model.is_moe_layer(layer)]
        for layer in layers:
            key = (model.block_unit(layer), ev.phase)
            table[key] = table.get(key, 0.0) + t / (micro_batches * len(layers))
    return table, totals


def step_time(
    model: ModelShape, events: list[PlannedComm], time_model: TimeModel, *, seq_len: int,
    micro_batch: int, micro_batches: int, os_numel: int, compute: ComputeModel | None = None,
    activation_checkpointing: str = "none", overlap_param_update: bool = False,
    tp: int = 1, tp_seconds: dict | None = None, p_gathers: tuple[int, int] | None = None,
    cp: int = 1, step_flops: float = 0.0,
) -> StepTime:
    """Predicted time of one optimizer step on one rank (module docstring).

    events: predicted_events() of the plan; os_numel: OS elements on this rank (for the
    optimizer's memory-bound step). tp: the TP degree; tp_seconds: {(unit, phase):
    seconds per micro-batch} of TP's collectives (tensor_parallel.tp_seconds_per_micro_batch).
    p_gathers: (forward, backward) all-gathers of each unit per step when they are not one
    per micro-batch (a pipeline stage keeps its parameters gathered, cost/pipeline.py);
    charged to the first micro-batches. cp: the context-parallel degree (the rank computes
    seq_len / cp tokens of each sequence; events then hold predicted_cp_events).
    step_flops: matmul FLOPs of the optimizer step on this rank (Muon's Newton-Schulz on
    the busiest owner, cost/muon.py); events not of a unit (unit -1: the clip's
    all-reduces, Muon's all-to-alls) run before the step's compute."""
    cm = compute or ComputeModel()
    L, M = model.n_layers, int(micro_batches)
    tokens = seq_len * micro_batch // cp
    tokens_exchange = [ev for ev in events if is_token_exchange(ev)]
    events = [ev for ev in events if not is_token_exchange(ev)]
    per_call, comm_sum, clip, codec = _per_call(events, time_model, cm.hbm_bw, model)
    ep_seconds, exchanged = _exchange_seconds(model, tokens_exchange, time_model, M)
    ep_sum, cp_sum = exchanged["ep"], exchanged["cp"]
    comm_sum += ep_sum + cp_sum
    if ep_seconds:
        tp_seconds = dict(tp_seconds or {})
        for key, seconds in ep_seconds.items():
            tp_seconds[key] = tp_seconds.get(key, 0.0) + seconds

    def c(unit, phase, op, dim):
        return per_call.get((unit, phase, op, dim), 0.0)

    def c_p(unit, phase):
        """The p all-gather of ``unit`` in micro-batch m's forward or backward: every
        micro-batch's, or (p_gathers) only the first f / b micro-batches'."""
        if p_gathers is not None and m >= p_gathers[0 if phase == "forward" else 1]:
            return 0.0
        return c(unit, phase, "all_gather", "p")

    recompute = 1.0 if activation_checkpointing == "full" else 0.0
    f_block = tokens * block_flops_per_token(model, seq_len) / (cm.compute_flops * tp)
    f_root = tokens * root_flops_per_token(model) / (cm.compute_flops * tp)
    tp_seconds = tp_seconds or {}

    def tpc(unit, phase):  # TP collectives of a unit's forward or backward, per micro-batch
        return tp_seconds.get((unit, phase), 0.0)

    root = L
    order = [root] + list(range(L))  # forward all-gather order
    tl = _Timeline()
    t = 0.0
    post_step = [c(u, "step", "all_gather", d) for u in range(L + 1) for d in ("g", "os")]
    ps = {u: c(u, "step", "all_gather", "g") + c(u, "step", "all_gather", "os")
          for u in range(L + 1)}
    carry_post_step = overlap_param_update and any(post_step)
    for m in range(M):
        last = m == M - 1
        # ---- forward ----
        gathered: dict[int, float] = {}
        issue = t

        def gather(u, ready):
            end = ready
            if m == 0 and carry_post_step and ps[u]:
                end = tl.comm(ready, ps[u])
            return tl.comm(end, c_p(u, "forward"))

        gathered[order[0]] = gather(order[0], issue)
        if len(order) > 1:
            gathered[order[1]] = gather(order[1], issue)
        for i, u in enumerate(order[1:], start=1):
            start, _ = tl.compute(gathered[u], f_block, tpc(u, "forward"))
            if i + 1 < len(order):
                gathered[order[i + 1]] = gather(order[i + 1], start)
        _, fwd_end = tl.compute(gathered[root], f_root, tpc(root, "forward"))
        # ---- backward ----
        pending_sync: list[float] = []
        drain_before: dict[int, float] = {}
        bwd_gather: dict[int, float] = {}
        r_start, r_end = tl.compute(fwd_end, 2 * f_root, tpc(root, "backward"))
        blocks = list(range(L - 1, -1, -1))
        if blocks:
            bwd_gather[blocks[0]] = tl.comm(r_start, c_p(blocks[0], "backward"))
        phase_g = "sync" if last else "backward"

        def grad_chain(u, ready):
            # a compressed stage is an all-to-all (and the "rep" one an all-gather after
            # it) in place of the reduce-scatter / all-reduce: at most one of each pair
            # has a time
            end = tl.comm(ready, c(u, "backward", "reduce_scatter", "p"))
            end = tl.comm(end, c(u, phase_g, "reduce_scatter", "g")
                          + c(u, phase_g, "all_to_all", "g"))
            if last:
                end = tl.comm(end, c(u, "sync", "reduce_scatter", "os")
                              + c(u, "sync", "all_to_all", "os"))
                pending_sync.append(tl.comm(end, c(u, "sync", "all_reduce", "rep")
                                            + c(u, "sync", "all_to_all", "rep")
                                            + c(u, "sync", "all_gather", "rep")))
            return end

        prev_end = r_end
        for i, u in enumerate(blocks):
            ready = max(prev_end, bwd_gather[u], drain_before.get(i, 0.0))
            start, end = tl.compute(ready, (2 + recompute) * f_block, tpc(u, "backward"))
            if i + 1 < len(blocks):
                bwd_gather[blocks[i + 1]] = tl.comm(
                    start, c_p(blocks[i + 1], "backward"))
            chain_end = grad_chain(u, end)
            drain_before[i + 2] = chain_end  # waited for after the next unit's backward
            prev_end = end
        chain_end = grad_chain(root, prev_end)
        t = max([prev_end, chain_end] + pending_sync)
    # ---- step ----
    t = tl.comm(t, clip + tpc(-1, "step"))  # the clip's all-reduces (over "tp" too)
    tl.tp_busy += tpc(-1, "step")
    _, t = tl.compute(t, OPTIM_STEP_BYTES * os_numel / cm.hbm_bw + step_flops / cm.compute_flops)
    if not overlap_param_update:
        for u in range(L + 1):
            t = tl.comm(t, ps[u])
    seconds = t
    flops = tokens * M * model_flops_per_token(model, seq_len) / tp  # one GPU's share
    return StepTime(
        seconds=seconds,
        compute_seconds=tl.compute_busy,
        comm_sum_seconds=comm_sum,
        exposed_comm_seconds=max(0.0, seconds - tl.compute_busy),
        mfu=flops / (seconds * cm.peak_flops) if seconds > 0 else 0.0,
        tokens=tokens * M,
        tp_comm_seconds=max(0.0, tl.tp_busy - ep_sum - cp_sum),
        codec_seconds=codec,
        ep_comm_seconds=ep_sum,
        cp_comm_seconds=cp_sum,
    )
