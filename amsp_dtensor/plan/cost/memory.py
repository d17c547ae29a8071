"""Memory model: bytes one rank holds for P, G, OS, activations and temporary buffers.

Model states (the paper's memory model, section 3): D_states = 2*Phi/s_p + 2*Phi/s_g + 12*Phi/s_os in
bf16 mode (bf16 params and grads, fp32 master + Adam exp_avg + exp_avg_sq in the OS layout);
fp32 mode keeps 4/s_p + 4/s_g + 8/s_os (the fp32 P shard is its own master: the OS keeps
the two Adam moments; see optim.py's Note). Computed per
tensor with the engine's Shard(0) padding: a tensor of dim0 d0 and cols c sharded over s
holds ceil(d0/s)*c elements on every rank (cost/padding.py), so the numbers equal the
engine's tensor bytes exactly, not Phi/s.

Activations (D_activation): the tensors autograd saves for backward in torchtitan's llama3
block in eager PyTorch, listed one by one (checked against saved_tensors_hooks in
tests/test_cost_memory.py). Per token of one micro-batch, with h = dim, f = ffn hidden,
h_kv = n_kv_heads*head_dim, a = n_heads, e = activation element bytes:
  - 2 RMSNorms, composite (eager): fp32 copy of the input (4h), fp32 normalised x (4h),
    fp32 rstd (4), and the e-byte output the next linears save (e*h)      = 2*(9h + 4)
    ("fused" norm: input e*h + rstd 4 + output e*h)
  - attention, SDPA flash/efficient: q (e*h), k and v (2*e*h_kv) after RoPE, output (e*h,
    the same storage the wo linear saves), logsumexp (4a)
    (math attention adds the a*s attention probabilities and scores: 2*e*a*s per token)
  - SwiGLU: w1 out, silu(w1 out), w3 out, their product (the w2 input): 4*e*f
  This is Korthikanti et al.'s per-layer sbh(34 + 5as/h) (GPT, fp16) rebuilt for Llama's
  blocks. Root: token ids (8), final norm (as above), fp32 log-softmax of the logits (4V,
  torchtitan's loss calls .float()), labels (8).
  Full activation checkpointing keeps only each block's input (e*h per token) and
  recomputes one block at a time in backward (one block's activations become temporary).

The optimizer step is a second peak, with the activations gone but the synced G, the
step's scratch and the post-step all-gathers alive (``step_bytes``): see that function.
The estimate is the larger of the two phases.

Tensor parallelism (degree t, torchtitan's llama3 TP plan with sequence parallelism): the
states are those of the TP-local shapes (models.py). Activations, per micro-batch of T
tokens on one TP rank (``block_activation_bytes``): the sequence-parallel regions (the
norms, and the block's input under full checkpointing) hold T/t tokens; the tensors the
linears save hold whole sequences but only the rank's heads and FFN columns (q, k, v,
attention output, logsumexp, SwiGLU: divided by t); the inputs of wq/wk/wv, w1/w3 and the
output head are the all-gathered sequence, e*h per token on every TP rank, so they are
not divided. With loss_parallel (torchtitan's default) the fp32 log-softmax and the loss
gradient hold the rank's vocab shard. Checked against autograd's saved tensors on torch's
fake process group by tests/test_planner_tp.py. The embedding's gradient is computed
replicated, vocab x dim on every TP rank (DTensor has no Shard(0) rule for
embedding_dense_backward on this torch), before FSDP2 keeps its local rows: a moment of
its own at the end of the backward (``temp_bytes``).

Temporary buffers (D_tmp): gathered units (s_p > 1: the unit being computed plus the one
prefetched, both unsharded e*padded(U, s_p); the unit kept unsharded after forward, the
root or torchtitan's [norm, output], stays gathered from forward to backward), the
unsharded gradient of the unit in backward, FSDP2's reduce-scatter input, the engine's hook
input P_u (FSDP2's reduce-scatter output, or the flat copy of the grads when s_p = 1) plus,
with s_g > s_p, its packed copy and the output of the reduce-scatter over "g", the loss
gradient (fp32 and e-byte copies of the logits' gradient, 4V + eV per token). Not all of
them are alive at once: ``temp_bytes`` takes the largest of the backward's peak moments
(the Note after it), net of the activations freed by then.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..sharding_plan import ResolvedPlan
from .backward_peak import synced_grad_elements, unit_sizes
from .comm import dim_group, error_feedback_elements
from ..compression import Compression, codec_applies
from .models import ModelShape, tp_chunk
from .padding import dim0_cols, padded_numel, shard_numel

__all__ = [
    "StateBytes",
    "state_bytes",
    "state_bytes_of_rank",
    "mesh_coords",
    "activation_bytes",
    "block_activation_bytes_per_token",
    "root_activation_bytes_per_token",
    "block_activation_bytes",
    "root_activation_bytes",
    "temp_bytes",
    "StepBytes",
    "step_bytes",
    "MemoryEstimate",
    "estimate_memory",
    "CompressionBytes",
    "compression_bytes",
    "DTYPE_BYTES",
    "optim_bytes_per_param",
]

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
OPTIM_BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq (Adam/AdamW)
MOMENT_BYTES_PER_PARAM = 8  # exp_avg + exp_avg_sq: an fp32 P shard is its own master


def optim_bytes_per_param(dtype_bytes: int) -> int:
    """OS bytes per element: the two Adam moments, plus a separate fp32 master unless the
    P shard is fp32 itself (then the master is a view into it)."""
    return MOMENT_BYTES_PER_PARAM if dtype_bytes == 4 else OPTIM_BYTES_PER_PARAM


def _dtype_bytes(mixed_precision: str) -> int:
    try:
        return DTYPE_BYTES[mixed_precision]
    except KeyError:
        raise ValueError(
            f"mixed_precision={mixed_precision!r}; use one of {sorted(DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True)
class StateBytes:
    param: int
    grad: int
    optim: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim

    def as_dict(self) -> dict:
        return asdict(self)


def state_bytes(
    unit_param_shapes, s_p: int, s_g: int, s_os: int, dtype_bytes: int,
    optim_bytes: int | None = None, grad_dtype_bytes: int | None = None,
) -> StateBytes:
    """Bytes of P, G, OS on one rank: e*sum ceil(d0/s_p)*c, r*sum ceil(d0/s_g)*c,
    o*sum ceil(d0/s_os)*c (2/s_p + 2/s_g + 12/s_os per param in bf16, 4/4/8 in fp32,
    padded); r = grad_dtype_bytes (the reduce dtype; default e); o = optim_bytes (default
    optim_bytes_per_param(e))."""
    shapes = [shape for unit in unit_param_shapes for shape in unit]
    r = grad_dtype_bytes or dtype_bytes
    o = optim_bytes if optim_bytes is not None else optim_bytes_per_param(dtype_bytes)
    return StateBytes(
        param=dtype_bytes * shard_numel(shapes, s_p),
        grad=r * shard_numel(shapes, s_g),
        optim=o * shard_numel(shapes, s_os),
    )


def _chunk_len(n_rows: int, k: int, index: int) -> int:
    """Rows of chunk `index` when n rows are split over k ranks, torch.chunk / DTensor style
    (chunks of ceil(n/k) rows, the last ones shorter or empty)."""
    size = -(-n_rows // k) if n_rows else 0
    return max(0, min(size, n_rows - index * size))


def mesh_coords(plan: ResolvedPlan, rank: int) -> dict[str, int]:
    """Mesh coordinates of a rank: rank = rep*s_os + os*s_g + g*s_p + p (docs/layouts.md)."""
    return {
        "p": rank % plan.s_p,
        "g": (rank // plan.s_p) % (plan.s_g // plan.s_p),
        "os": (rank // plan.s_g) % (plan.s_os // plan.s_g),
        "rep": rank // plan.s_os,
    }


def state_bytes_of_rank(
    unit_param_shapes, plan: ResolvedPlan, rank: int, dtype_bytes: int,
    grads_synced: bool = False, optim_bytes: int | None = None,
) -> StateBytes:
    """What one given rank holds, as the engine lays it out (layouts.py):

    - P: FSDP2's padded shard, ceil(d0/s_p) rows on every rank (the full param if s_p = 1);
    - G: flat buffers with a slot of ceil(d0/s_g) rows per tensor while accumulating; after
      the last backward's sync they are in the OS layout, ceil(d0/s_os) rows per slot
      (differs from the former only when s_g = s_p < s_os);
    - OS: the real rows only (fp32 master unless P is fp32, exp_avg, exp_avg_sq are
      DTensors of the rank's chunk): the P chunk (torch.chunk of d0 over s_p) chunked
      again over the s_os/s_p ranks of the OS subgroup, so ranks at the end of a tensor
      may hold fewer rows.
    Rank 0 always holds full chunks, so state_bytes() (the padded formula) equals rank 0.
    """
    c = mesh_coords(plan, rank)
    k = plan.s_os // plan.s_p
    sub_index = c["g"] if plan.s_g > plan.s_p else c["os"]
    s_grad = plan.s_os if grads_synced else plan.s_g
    param = grad = optim = 0
    for unit in unit_param_shapes:
        for shape in unit:
            d0, cols = dim0_cols(shape)
            param += -(-d0 // plan.s_p) * cols
            grad += -(-d0 // s_grad) * cols
            p_rows = _chunk_len(d0, plan.s_p, c["p"])
            optim += _chunk_len(p_rows, k, sub_index) * cols
    o = optim_bytes if optim_bytes is not None else optim_bytes_per_param(dtype_bytes)
    return StateBytes(dtype_bytes * param, dtype_bytes * grad, o * optim)


def _norm_bytes(h: int, e: int, norm: str) -> int:
    return _norm_own_bytes(h, e, norm) + e * h


def _norm_own_bytes(h: int, e: int, norm: str) -> int:
    """What a norm saves itself, per token: composite fp32 input copy, fp32 normalised x
    and rstd; fused the input and rstd. (Its e-byte output is saved by the linears after
    it, counted with them: under TP that is the all-gathered sequence.)"""
    if norm == "composite":
        return 4 * h + 4 * h + 4
    if norm == "fused":
        return e * h + 4
    raise ValueError(f"norm={norm!r}; use 'composite' (eager) or 'fused'")


def block_activation_bytes_per_token(
    model: ModelShape, seq_len: int, e: int, attention: str = "flash", norm: str = "composite"
) -> int:
    """Bytes autograd saves in one transformer block, per token (see module docstring)."""
    h, a = model.dim, model.n_heads
    hq, hkv = model.q_width, model.kv_width
    attn = e * h + 2 * e * hkv + e * hq + 4 * a
    if attention == "math":
        attn += 2 * e * a * seq_len
    elif attention != "flash":
        raise ValueError(f"attention={attention!r}; use 'flash' (SDPA flash/efficient) or 'math'")
    return 2 * _norm_bytes(h, e, norm) + attn + _ffn_activation_bytes_per_token(model, e)


def _ffn_activation_bytes_per_token(model: ModelShape, e: int) -> int:
    """A SwiGLU FFN of hidden f saves 4*e*f per token (w1's and w3's outputs, the SiLU, the
    product w2 reads); an MoE block's routed experts do so for the top_k experts a token
    takes, on the token's top_k copies (the dispatched input and the output, 2*e*dim
    each), its shared experts as a FFN of n_shared*hidden, and the router its fp32
    scores (4*n_experts). Mean over the blocks."""
    x = model.experts
    if x is None:
        return 4 * e * model.ffn_hidden
    moe = (4 * e * (x.top_k + x.n_shared) * x.hidden + 2 * x.top_k * 2 * e * model.dim
           + 4 * x.n_experts)
    dense = 4 * e * model.ffn_hidden
    return (x.n_dense_layers * dense + model.moe_layers * moe) // model.n_layers


def root_activation_bytes_per_token(model: ModelShape, e: int, norm: str = "composite") -> int:
    """Token ids (with the embeddings), final norm, fp32 log-softmax output, labels (with
    the head), per token: a pipeline stage has the ends it holds."""
    ids = 8 if model.embeddings else 0
    return ids + (_norm_bytes(model.dim, e, norm) + 4 * model.vocab_size + 8 if model.head else 0)


def block_activation_bytes(
    model: ModelShape, seq_len: int, micro_batch: int, e: int, attention: str = "flash",
    norm: str = "composite", tp: int = 1, cp: int = 1,
) -> int:
    """Bytes autograd saves in one block for one micro-batch on one TP rank: with tp = 1,
    tokens x block_activation_bytes_per_token; with tp > 1 the norms' own tensors on T/t
    tokens, the gathered inputs of the attention and FFN linears (e*h each) on all T, the
    rest with the rank's heads and FFN columns (module docstring). cp > 1: the rank holds
    seq_len / cp tokens of each sequence, but its attention saves K and V gathered over
    the whole sequence (context parallelism's K/V all-gather, _cp_gathered_kv)."""
    local = _cp_local(seq_len, cp)
    if cp > 1:
        return (block_activation_bytes(model, local, micro_batch, e, attention, norm, tp)
                + _cp_gathered_kv(model, seq_len, micro_batch, e, attention, tp, cp))
    tokens = seq_len * micro_batch
    if tp == 1:
        return tokens * block_activation_bytes_per_token(model, seq_len, e, attention, norm)
    model.check_tensor_parallel(tp)
    h, a = model.dim, model.n_heads // tp
    hq, hkv = a * model.head_dim, model.kv_heads // tp * model.head_dim
    f = tp_chunk(model.ffn_hidden, tp)
    attn = e * hq + 2 * e * hkv + e * hq + 4 * a
    if attention == "math":
        attn += 2 * e * a * seq_len
    elif attention != "flash":
        raise ValueError(f"attention={attention!r}; use 'flash' (SDPA flash/efficient) or 'math'")
    sequence_shard = tokens // tp
    return (sequence_shard * 2 * _norm_own_bytes(h, e, norm)
            + tokens * (2 * e * h + attn + 4 * e * f))


def _cp_local(seq_len: int, cp: int) -> int:
    """The tokens of each sequence one cp rank holds."""
    if cp < 1 or seq_len % cp:
        raise ValueError(f"cp={cp} must divide seq_len={seq_len} (each cp rank holds "
                         "seq_len / cp tokens)")
    return seq_len // cp


def _cp_gathered_kv(model: ModelShape, seq_len: int, micro_batch: int, e: int,
                    attention: str, tp: int, cp: int) -> int:
    """What one block's attention saves beyond a seq_len / cp sequence under context
    parallelism: K and V of the rank's kv heads gathered over the whole sequence (2*e*h_kv
    per token of the other cp ranks) and, with math attention, its queries' scores and
    probabilities over the other ranks' keys (2*e*a per query and key)."""
    local = seq_len // cp
    heads, hkv = model.n_heads // tp, model.kv_heads // tp * model.head_dim
    extra = micro_batch * (seq_len - local) * 2 * e * hkv
    if attention == "math":
        extra += micro_batch * local * (seq_len - local) * 2 * e * heads
    return extra


def root_activation_bytes(
    model: ModelShape, seq_len: int, micro_batch: int, e: int, norm: str = "composite",
    tp: int = 1, loss_parallel: bool = True,
) -> int:
    """The root's saved activations for one micro-batch on one TP rank: token ids, the
    final norm (on T/t tokens under TP), its gathered output (saved by the output head),
    the fp32 log-softmax (the rank's vocab shard with loss_parallel), labels."""
    tokens = seq_len * micro_batch
    if tp == 1:
        return tokens * root_activation_bytes_per_token(model, e, norm)
    ids = tokens * 8 if model.embeddings else 0
    if not model.head:
        return ids
    vocab = tp_chunk(model.vocab_size, tp) if loss_parallel else model.vocab_size
    return (ids + tokens * (e * model.dim + 4 * vocab + 8)
            + tokens // tp * _norm_own_bytes(model.dim, e, norm))


def activation_bytes(
    model: ModelShape, seq_len: int, micro_batch: int, mixed_precision: str = "bf16",
    activation_checkpointing: str = "none", attention: str = "flash", norm: str = "composite",
    tp: int = 1, loss_parallel: bool = True, cp: int = 1,
) -> int:
    """Saved activations of one micro-batch at the start of its backward (one TP rank; cp:
    the context-parallel degree, each rank holding seq_len / cp tokens of a sequence)."""
    e = _dtype_bytes(mixed_precision)
    local = _cp_local(seq_len, cp)
    root = root_activation_bytes(model, local, micro_batch, e, norm, tp, loss_parallel)
    if activation_checkpointing == "none":
        block = block_activation_bytes(model, seq_len, micro_batch, e, attention, norm, tp, cp)
        return model.n_layers * block + root
    if activation_checkpointing == "full":
        # each block's input: a sequence shard under TP (the residual stream is Shard(1))
        return model.n_layers * _checkpointed_input(model, local, micro_batch, e, tp) + root
    raise ValueError(
        f"activation_checkpointing={activation_checkpointing!r}; use 'none' or 'full'"
    )


def _checkpointed_input(model: ModelShape, seq_len: int, micro_batch: int, e: int,
                        tp: int) -> int:
    return seq_len * micro_batch // tp * e * model.dim


def temp_bytes(
    model: ModelShape, plan: ResolvedPlan, seq_len: int, micro_batch: int,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", norm: str = "composite", reshard_after_forward=True,
    reduce_dtype: str | None = None, tp: int = 1, loss_parallel: bool = True, cp: int = 1,
) -> int:
    """Peak temporary buffers in backward, net of the activations already freed at that
    moment (so states + activations + temp is the backward's peak): the largest of the
    moments in the Note below. tp: the TP degree (plan is then the data-parallel plan and
    every unit holds its TP-local shapes); cp: the context-parallel degree (seq_len / cp
    tokens of each sequence on this rank)."""
    e = _dtype_bytes(mixed_precision)
    r = _dtype_bytes(reduce_dtype) if reduce_dtype else e
    units = model.unit_param_shapes(tp)
    # the unit kept unsharded after forward: the root ("blocks") or [norm, output]
    # ("titan"); every other unit is gathered for its compute and resharded after
    root = units[model.root_unit_index]
    others = [u for i, u in enumerate(units) if i != model.root_unit_index]
    block = max(others, key=lambda u: padded_numel(u, plan.s_p))
    local = _cp_local(seq_len, cp)
    tokens = local * micro_batch
    biggest = max(units, key=lambda u: padded_numel(u, plan.s_p))
    big_unit = padded_numel(biggest, plan.s_p)
    gathered = 0
    if plan.s_p > 1:
        # unit in compute + prefetched one; the root stays gathered through backward
        gathered = e * (2 * padded_numel(block, plan.s_p) + padded_numel(root, plan.s_p))
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            if 1 < reshard_after_forward < plan.s_p:  # hpZ secondary copy of every block
                gathered += e * model.n_layers * shard_numel(block, reshard_after_forward)

    def hook(unit) -> int:
        # the engine's hook input, P_u: FSDP2's reduce-scatter output (s_p > 1) or the
        # flat copy of the unit's grads (s_p = 1); with s_g > s_p the engine packs it for
        # the reduce-scatter over "g" and receives that one's output (backward_peak.py)
        sizes = unit_sizes(unit, plan)
        held = r * sizes.p
        if plan.s_g > plan.s_p:
            held += r * (sizes.g_packed + sizes.g)
        return held

    def os_sync(unit) -> int:
        # a syncing hook that shrinks the accumulated G to the OS shard (s_g = s_p < s_os)
        # holds the packed send buffer and the output of its reduce-scatter over "os"
        sizes = unit_sizes(unit, plan)
        return r * (sizes.os_packed + sizes.os) if plan.s_g == plan.s_p < plan.s_os else 0

    def block_acts() -> int:
        return block_activation_bytes(model, seq_len, micro_batch, e, attention, norm, tp, cp)

    recompute = block_acts() if activation_checkpointing == "full" else 0
    acts = activation_bytes(model, seq_len, micro_batch, mixed_precision,
                            activation_checkpointing, attention, norm, tp, loss_parallel, cp)
    # 5. (tp > 1) the embedding's backward, the last of all: its gradient is computed
    # replicated, vocab x dim on every TP rank, before FSDP2 or the engine keeps the
    # local rows; every activation is freed by then
    replicated_emb = 0
    if tp > 1 and model.embeddings:
        replicated_emb = e * model.vocab_size * model.dim
    # 1. the output head's backward (with s_p = 1, also the syncing hooks: moment 2)
    unit_grads = e * big_unit  # unsharded grads of the unit in backward
    if r != e:
        unit_grads += r * big_unit  # FSDP2 casts them to reduce_dtype for the reduce-scatter
    vocab = tp_chunk(model.vocab_size, tp) if loss_parallel else model.vocab_size
    loss_grad = tokens * (4 + e) * vocab if model.head else 0
    head = gathered + unit_grads + hook(biggest) + loss_grad + recompute
    if plan.s_p == 1:
        if tp == 1 or not model.embeddings:
            return head + os_sync(biggest)
        # with s_p = 1 the params are whole (counted in P): the embedding's hook holds its
        # replicated gradient beside its flat copy
        emb_unit = units[0] if model.layout == "titan" else root
        embedding = replicated_emb + hook(emb_unit) + os_sync(emb_unit) - acts
        return max(head + os_sync(biggest), embedding)
    # 3. FSDP2 (s_p > 1): a later unit's backward and its hook, then the root's own
    # post-backward at the very end (moments 3 and 4 of the Note)
    root_numel, block_numel = padded_numel(root, plan.s_p), padded_numel(block, plan.s_p)
    freed = root_activation_bytes(model, local, micro_batch, e, norm, tp, loss_parallel)
    if activation_checkpointing == "full":
        freed += _checkpointed_input(model, local, micro_batch, e, tp)  # last block's input
    else:
        freed += block_acts()
    later = gathered + e * root_numel + r * block_numel + hook(block) + recompute - freed
    compute = later + e * block_numel  # this unit's unsharded grads, as they are produced
    at_hook = later + os_sync(block)  # FSDP2 freed them once copied into its input
    final = e * root_numel + (e + r) * root_numel + hook(root) + os_sync(root) - acts
    moments = [head, compute, at_hook, final]
    if tp > 1 and model.embeddings:
        emb_unit = units[0] if model.layout == "titan" else root
        emb_local = padded_numel([emb_unit[0]], plan.s_p)
        if model.layout == "titan":
            # [norm, output] gathered and its grads kept to the end; the embeddings
            # gathered, its reduce-scatter input and hook beside the replicated gradient
            moments.append(2 * e * root_numel + e * emb_local + replicated_emb
                           + r * emb_local + hook(emb_unit) + os_sync(emb_unit) - acts)
        else:  # the root's post-backward (moment 4) with the replicated gradient alive
            moments.append(final + replicated_emb - e * emb_local)
    return max(moments)


# [Note: the backward's peak moments] The sum of every buffer's own maximum overstates the
# peak, and FSDP2 holds two buffers the engine never sees, so temp_bytes takes the largest
# of four moments, five under TP (on top of the states and all the saved activations):
# 1. The output head's backward: the loss gradient (fp32 and e-byte copies of the logits'
#    gradient), the gathered units, the largest unit's unsharded grads (and their
#    reduce-dtype copy), the engine's hook input and, with s_g > s_p, the packed copy and
#    output of the reduce-scatter over "g".
# 2. The syncing hook of a unit when s_g = s_p < s_os: the accumulated G is packed for the
#    reduce-scatter over "os" (k_os * OS_u) and its output (OS_u) is allocated while the
#    hook input is still alive (grad.py `_issue_sync`; backward_peak.py, item 2). With
#    s_p = 1 this is counted on top of moment 1 (an upper bound); with s_p > 1, at moment 3.
# 3. With s_p > 1, the backward of every unit after the first to fire: FSDP2 keeps the
#    root's unsharded grads until the end of backward (the root's forward input needs no
#    grad, so its post-backward runs in the final callback), and keeps the previous unit's
#    reduce-scatter input (its unsharded grads, padded, in the reduce dtype) alive while
#    this unit computes (``reduce_scatter_max_input_buffers``, 1 by default, reclaimed in
#    the next post-backward, just before that unit's own input is allocated). By then the
#    loss gradient, the root's saved activations and the last block's are freed.
# 4. With s_p > 1, the root's post-backward at the end: its gathered params, unsharded
#    grads and reduce-scatter input, with every activation freed (it matters only when
#    the root is large against the activations: a big vocabulary, full checkpointing).
# 5. With tensor parallelism, the embedding's backward, the last of all: DTensor computes
#    the gradient of the RowwiseParallel embedding replicated (vocab x dim on every TP
#    rank; embedding_dense_backward has no Shard(0) rule on this torch) and FSDP2, or the
#    engine's hook with s_p = 1, takes this rank's rows from it: so beside moment 4's
#    buffers (or the hook's, with s_p = 1) the whole vocab x dim gradient is alive once,
#    with every activation freed.
# Measured on the debug model (tools/bench_frontier.py, per-op samples of a steady-state
# step, 25 plans at 2x2 and 4x2): within -1.6..+1.0 MB of the measured peaks, where the
# upper-bound sum was -1.6..+3.5 MB. The peak-per-rank samples include gloo's buffers,
# whose number in flight depends on timing.


# [Note: gloo's staging buffer] On CPU, in-flight post-step all-gathers hold more than
# their send buffers and outputs: measured on the debug model at 4 ranks (p1-g4-os4),
# 6.9 MB beyond the 30.8 MB of those buffers, about two outputs of the largest unit: the
# flat buffer gloo gathers into before copying it to the output, on each of the two
# worker threads a gloo process group runs by default. NCCL gathers into the output.
# Each process group has its own two threads: with experts, the dense units' all-gathers
# over their "os" group and the experts' over theirs stage two outputs each. Counting two
# for both together left the pairs with experts p1 and os 2 or 4 up to 6.6 MB (one
# expert unit's output) under their measured peaks on the emulated MoE sweeps; per group,
# no estimate of the 2x2 sweep is more than 1.6 MB under (p1-g1-os2 + experts p1-g1-os2:
# 141.3 MB measured, its step estimated 134.7 MB before, 140.4 now). Where the two groups
# are the same ranks the engine may share one process group: then this counts up to two
# outputs too many.
GLOO_WORKER_THREADS = 2
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class StepBytes:
    """Bytes beyond P and OS at the optimizer step's peak, by kind (step_bytes)."""

    synced_grad: int  # every unit's synced G, freed by zero_grad
    gather: int  # every unit's post-step all-gather: send buffer + output
    scratch: int  # what one unit's update allocates beyond them (worst unit)
    staging: int  # the backend's copies of in-flight all-gather outputs (gloo)

    @property
    def total(self) -> int:
        return self.synced_grad + self.gather + self.scratch + self.staging


def step_bytes(
    model: ModelShape, plan: ResolvedPlan, mixed_precision: str = "bf16",
    reduce_dtype: str | None = None, clip: bool = False, backend: str = "nccl",
    tp: int = 1, expert_plan: ResolvedPlan | None = None, ep: int = 1,
    expert_shard_dim: int = 0, optimizer_scratch: int = 0,
) -> StepBytes:
    """What one rank holds beyond P and OS at the peak of the optimizer step.

    [Note: the step's peak] ``AMSPOptimizer.step()`` with AdamW-like optimizers steps the
    units in a few calls of the wrapped optimizer (optim.py's [Note: per-unit step]): for
    the units of one call it builds fp32 master grads from the synced G (4*OS_u each) and
    the optimizer's scratch (foreach AdamW: one fp32 temporary of the master's size,
    4*OS_u), updates, frees both, and, when s_os > s_p, issues each unit's post-step
    all-gather over the OS subgroup: a send buffer of OS_u and its output of k_os*OS_u
    elements in the param dtype, alive until the update lands (at the end of step(), or
    in the next forward with overlap_param_update). So at the step's end every unit's
    all-gather buffers are alive together, beside every unit's synced G (freed by
    zero_grad). Which units share a call depends on which collectives have completed
    (after clip_grad_norm_, or when all have, one call steps every unit; a batch takes in
    the units whose collectives completed meanwhile), so the bound takes the worst over
    every order and batching: each unit either is in the call at the peak (8*OS_u) or
    was stepped before it (its all-gather buffers, c_u*OS_u), and nothing decides which
    before the step runs, so a unit counts max(c_u, 8)*OS_u. With one plan (one c) that is
    max(c, 8)*sum(OS_u): the end of the step or one call over every unit. With a dense
    and an expert plan of different c it is more than either moment: the dense units'
    all-gathers issued while one call steps the experts (ready first when they have no
    replicas) was a peak of the emulated 4x2 MoE sweep 11 MB above the larger moment
    (p1-g1-os8 + experts p1-g1-os1, 149.0 MB measured). OS_u, G_u: slot elements as in
    backward_peak.unit_sizes. backend "gloo" adds its staging buffers (Note above).
    ``clip`` is kept for callers: the bound already covers it. With ``expert_plan`` the
    experts' units (EP-local, ``ep``) join, each unit with its own group's factors (one
    optimizer steps both groups). optimizer_scratch: what a whole-matrix optimizer's step
    allocates beyond that (Muon: cost/muon.py's [Note: Muon's step buffers]); it steps
    after every master grad is built, so it joins the one-call-over-every-unit moment."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; use one of {BACKENDS}")
    e = _dtype_bytes(mixed_precision)
    r = _dtype_bytes(reduce_dtype) if reduce_dtype else e
    # (unit sizes, its plan) of every unit: the dense ones, then the experts' on theirs
    units = [(unit_sizes(shapes, plan), plan) for shapes in model.unit_param_shapes(tp)]
    n_dense = len(units)
    if expert_plan is not None:
        units += [(unit_sizes(shapes, expert_plan), expert_plan)
                  for shapes in model.expert_units(ep, expert_shard_dim)]
    synced_g = r * sum(synced_grad_elements(s, p) for s, p in units)
    outputs = [e * (p.s_os // p.s_p) * s.os if p.s_os > p.s_p else 0 for s, p in units]
    sends = [e * s.os if p.s_os > p.s_p else 0 for s, p in units]
    gather = sum(sends) + sum(outputs)
    # Note above: each unit stepped before the peak or in its call, whichever holds more;
    # or one call over every unit with a whole-matrix optimizer's buffers
    held = max(sum(max(send + out, 8 * s.os) for (s, _), send, out in zip(units, sends, outputs)),
               8 * sum(s.os for s, _ in units) + optimizer_scratch)
    staging = 0
    if backend == "gloo":  # per process group: the dense units' "os" group, the experts'
        groups = [outputs[:n_dense], outputs[n_dense:]]
        staging = sum(sum(sorted(g, reverse=True)[:GLOO_WORKER_THREADS]) for g in groups)
    return StepBytes(synced_g, gather, held - gather, staging)


@dataclass(frozen=True)
class CompressionBytes:
    """What opt-in compression keeps on one rank across steps (compression_bytes)."""

    error_feedback: int  # residuals of the compressed gradient stages, grad dtype
    fp32_master: int  # separate fp32 master of the OS rows (fp32 P under weights codec)

    @property
    def total(self) -> int:
        return self.error_feedback + self.fp32_master


def compression_bytes(
    unit_param_shapes, plan: ResolvedPlan, compression: Compression | None,
    dtype_bytes: int, grad_dtype_bytes: int | None = None,
) -> CompressionBytes:
    """[Note: compression's memory] Persistent bytes compression adds on one rank:

    - error feedback: every compressed gradient stage (cross-node, codec applies to the
      grad dtype r; the same stages predicted_events compresses) keeps the residual of
      its input per unit across steps, r bytes per element: the reduce-scatter over "g",
      padded(U,s_g)/s_p elements; over "os", padded(U,s_os)/s_p; the all-reduce over
      "rep", rep*ceil(n/rep), n = padded(U,s_os)/s_os (comm.error_feedback_elements);
    - fp32 master: an fp32 P shard is its own master (optim_bytes_per_param), but when
      the post-step all-gather is compressed (weights codec, s_os > s_p, its group spans
      nodes) the P shard holds dequantised values, so the exact fp32 master of the OS
      rows is kept apart: 4 bytes per OS element. bf16 params have a separate master
      already (nothing added).
    The codec's transient buffers (compressed send and receive buffers) are not counted.
    """
    if compression is None or not compression.enabled:
        return CompressionBytes(0, 0)
    e = int(dtype_bytes)
    r = int(grad_dtype_bytes or dtype_bytes)
    ef = r * error_feedback_elements(plan, unit_param_shapes, compression, r)
    master = 0
    if e == 4 and plan.s_os > plan.s_p and codec_applies(compression.weights, e):
        dim = "g" if plan.s_g > plan.s_p else "os"
        if dim_group(plan, dim).inter_node:
            shapes = [shape for unit in unit_param_shapes for shape in unit]
            master = 4 * shard_numel(shapes, plan.s_os)
    return CompressionBytes(ef, master)


@dataclass(frozen=True)
class MemoryEstimate:
    """Two phases: forward/backward (states + activations + temp) and the optimizer step
    (P + OS + ``step``); the total is the larger, plus the reserve."""

    states: StateBytes
    activations: int
    temp: int
    reserve: int = 0  # CUDA context, NCCL buffers, allocator slack: outside the tensors
    step: int = 0  # beyond P and OS at the step's peak (step_bytes(...).total)
    # opt-in compression's persistent buffers (alive in both phases); None: off
    compression: CompressionBytes | None = None
    # with experts: their part of ``states`` (which holds both groups)
    expert_states: StateBytes | None = None

    @property
    def compression_total(self) -> int:
        return self.compression.total if self.compression is not None else 0

    @property
    def backward_total(self) -> int:
        return self.states.total + self.activations + self.temp + self.compression_total

    @property
    def step_total(self) -> int:
        return self.states.param + self.states.optim + self.step + self.compression_total

    @property
    def peak_phase(self) -> str:
        return "step" if self.step_total > self.backward_total else "backward"

    @property
    def total(self) -> int:
        return max(self.backward_total, self.step_total) + self.reserve

    def as_dict(self) -> dict:
        out = {
            "param": self.states.param,
            "grad": self.states.grad,
            "optim": self.states.optim,
            "activations": self.activations,
            "temp": self.temp,
            "step": self.step,
            "peak_phase": self.peak_phase,
            "reserve": self.reserve,
            "total": self.total,
        }
        if self.expert_states is not None:
            out["expert"] = self.expert_states.as_dict()
            out["dense"] = {k: out[k] - v for k, v in out["expert"].items()}
        if self.compression is not None:
            out["compression_error_feedback"] = self.compression.error_feedback
            out["compression_fp32_master"] = self.compression.fp32_master
        return out


def estimate_memory(
    model: ModelShape, plan: ResolvedPlan, seq_len: int, micro_batch: int,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", norm: str = "composite", reshard_after_forward=True,
    reduce_dtype: str | None = None, reserve_bytes: int = 0, clip: bool = False,
    backend: str = "nccl", tp: int = 1, loss_parallel: bool = True,
    compression: Compression | None = None, expert_plan: ResolvedPlan | None = None,
    ep: int = 1, expert_shard_dim: int = 0, cp: int = 1, muon=None,
) -> MemoryEstimate:
    """max(D_states + D_activation + D_tmp, the optimizer step's peak) (+ a fixed reserve)
    for one rank.

    expert_plan (a model with experts): the routed experts' plan over the expert world,
    their units EP-local (``ep``): their states join ``states`` (and ``expert_states``);
    the temporary buffers add one expert unit's (expert_temp_bytes), the step's bound
    covers both groups; expert_shard_dim: models.ModelShape.expert_units.

    reduce_dtype: "fp32" keeps G (and the gradient collectives) in fp32 under bf16 params
    (MixedPrecisionPolicy.reduce_dtype); None = the param dtype. reserve_bytes: memory the
    process holds outside tensors (CUDA context, NCCL buffers, allocator slack). clip:
    clip_grad_norm_ runs before the step (every master grad is built first). backend:
    the process group's ("gloo" stages all-gather outputs, see step_bytes). tp: the
    tensor-parallel degree (plan is then the data-parallel plan: states of the TP-local
    shapes, activations of one TP rank); loss_parallel: torchtitan's default with TP.
    compression: Compression or None; when it enables a codec, the estimate's
    ``compression`` field holds its persistent buffers (compression_bytes), counted in
    both phases. cp: the context-parallel degree: the plan is over the data-parallel world
    with the cp ranks in it (states as without cp), each rank holds seq_len / cp tokens of
    a sequence and K/V of the whole one (block_activation_bytes). muon: the plan's
    MuonStep (cost/muon.py, which imports this module) when Muon steps the block
    matrices (AdamW the rest): one fp32 momentum in place of two moments on its rows, and
    its step buffers beside the step's own."""
    e = _dtype_bytes(mixed_precision)
    r = _dtype_bytes(reduce_dtype) if reduce_dtype else e
    states = state_bytes(model.unit_param_shapes(tp), plan.s_p, plan.s_g, plan.s_os, e,
                         grad_dtype_bytes=r)
    act = activation_bytes(model, seq_len, micro_batch, mixed_precision,
                           activation_checkpointing, attention, norm, tp, loss_parallel, cp)
    tmp = temp_bytes(model, plan, seq_len, micro_batch, mixed_precision,
                     activation_checkpointing, attention, norm, reshard_after_forward,
                     reduce_dtype, tp, loss_parallel, cp)
    step = step_bytes(model, plan, mixed_precision, reduce_dtype, clip, backend, tp,
                      expert_plan, ep, expert_shard_dim,
                      muon.scratch_bytes if muon is not None else 0)
    if muon is not None:
        states = StateBytes(states.param, states.grad, states.optim - muon.os_bytes_saved)
    comp = None
    if compression is not None and compression.enabled:
        comp = compression_bytes(model.unit_param_shapes(tp), plan, compression, e, r)
        if expert_plan is not None:  # the experts' residuals (and masters) too
            more = compression_bytes(model.expert_units(ep, expert_shard_dim), expert_plan,
                                     compression, e, r)
            comp = CompressionBytes(comp.error_feedback + more.error_feedback,
                                    comp.fp32_master + more.fp32_master)
    experts = None
    if expert_plan is not None:
        p = expert_plan
        experts = state_bytes(model.expert_units(ep, expert_shard_dim), p.s_p, p.s_g,
                              p.s_os, e, grad_dtype_bytes=r)
        states = StateBytes(*(getattr(states, f) + getattr(experts, f)
                              for f in ("param", "grad", "optim")))
        tmp += expert_temp_bytes(model, expert_plan, ep, e, r, expert_shard_dim)
    return MemoryEstimate(states, act, tmp, int(reserve_bytes), step.total, comp, experts)


def expert_temp_bytes(model: ModelShape, plan: ResolvedPlan, ep: int, e: int, r: int,
                      shard_dim: int = 0) -> int:
    """What one MoE block's experts add to the backward's temporary buffers, beside the
    dense units' peak (temp_bytes), by [Note: the experts' backward buffers]."""
    units = model.expert_units(ep, shard_dim)
    if not units:
        return 0
    unit = units[0]
    sizes = unit_sizes(unit, plan)
    numel = padded_numel(unit, plan.s_p)
    gathered = e * numel if plan.s_p > 1 else 0
    held = r * sizes.p + (r * (sizes.g_packed + sizes.g) if plan.s_g > plan.s_p else 0)
    sync = r * (sizes.os_packed + sizes.os) if plan.s_g == plan.s_p < plan.s_os else 0
    return gathered + e * numel + held + sync


# [Note: the experts' backward buffers] A MoE block's routed experts are a unit of their
# own, inside the block's unit, so their backward runs while the block's dense unit is
# gathered: the dense units' peak (temp_bytes: two blocks gathered, the one in compute
# and the prefetched one) already holds what is gathered beside them, and the experts add
# their own gathered params once (s_p > 1), their unsharded grads as they are produced,
# the hook input (FSDP2's reduce-scatter output, or the flat copy with s_p = 1) with,
# when s_g > s_p, the packed copy and output of the reduce-scatter over "g", and, in the
# syncing backward with s_g = s_p < s_os, the packed send buffer and output of the
# reduce-scatter over "os" (moment 2 of [Note: the backward's peak moments]).
# Measured on the emulated MoE benchmark at 2x2 (tools/bench_frontier.py --flavor moe,
# 36 plan pairs, every expert plan against nine dense ones): counting the gathered
# experts twice overstated p2-g2-os2's peak by a median 5.4 MB (one expert unit, 6.3 MB),
# and leaving out the syncing buffers understated p1-g1-os2's by 6.0 MB.
