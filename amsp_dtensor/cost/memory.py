"""Memory model: bytes one rank holds for P, G, OS, activations and temporary buffers.

Model states (the paper's memory model, section 3): D_states = 2*Phi/s_p + 2*Phi/s_g + 12*Phi/s_os in
bf16 mode (bf16 params and grads, fp32 master + Adam exp_avg + exp_avg_sq in the OS layout);
fp32 mode keeps 4/s_p + 4/s_g + 12/s_os (master is a separate fp32 copy). Computed per
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

Temporary buffers (D_tmp): gathered units (s_p > 1: the unit being computed plus the one
prefetched, both unsharded e*padded(U, s_p); the root stays gathered from forward to
backward), the unsharded gradient of the unit in backward (its reduce-scatter input), and
the loss gradient (fp32 and e-byte copies of the logits' gradient, 4V + eV per token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..plan import ResolvedPlan
from .models import ModelShape
from .padding import dim0_cols, padded_numel, shard_numel

__all__ = [
    "StateBytes",
    "state_bytes",
    "state_bytes_of_rank",
    "mesh_coords",
    "activation_bytes",
    "block_activation_bytes_per_token",
    "root_activation_bytes_per_token",
    "temp_bytes",
    "MemoryEstimate",
    "estimate_memory",
    "DTYPE_BYTES",
]

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
OPTIM_BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq (Adam/AdamW)


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
    optim_bytes_per_param: int = OPTIM_BYTES_PER_PARAM, grad_dtype_bytes: int | None = None,
) -> StateBytes:
    """Bytes of P, G, OS on one rank: e*sum ceil(d0/s_p)*c, r*sum ceil(d0/s_g)*c,
    12*sum ceil(d0/s_os)*c (2/s_p + 2/s_g + 12/s_os per param in bf16, padded);
    r = grad_dtype_bytes (the reduce dtype; default e)."""
    shapes = [shape for unit in unit_param_shapes for shape in unit]
    r = grad_dtype_bytes or dtype_bytes
    return StateBytes(
        param=dtype_bytes * shard_numel(shapes, s_p),
        grad=r * shard_numel(shapes, s_g),
        optim=optim_bytes_per_param * shard_numel(shapes, s_os),
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
    grads_synced: bool = False, optim_bytes_per_param: int = OPTIM_BYTES_PER_PARAM,
) -> StateBytes:
    """What one given rank holds, as the engine lays it out (layouts.py):

    - P: FSDP2's padded shard, ceil(d0/s_p) rows on every rank (the full param if s_p = 1);
    - G: flat buffers with a slot of ceil(d0/s_g) rows per tensor while accumulating; after
      the last backward's sync they are in the OS layout, ceil(d0/s_os) rows per slot
      (differs from the former only when s_g = s_p < s_os);
    - OS: the real rows only (fp32 master, exp_avg, exp_avg_sq are DTensors of the rank's
      chunk): the P chunk (torch.chunk of d0 over s_p) chunked again over the s_os/s_p
      ranks of the OS subgroup, so ranks at the end of a tensor may hold fewer rows.
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
    return StateBytes(dtype_bytes * param, dtype_bytes * grad, optim_bytes_per_param * optim)


def _norm_bytes(h: int, e: int, norm: str) -> int:
    if norm == "composite":
        return 4 * h + 4 * h + 4 + e * h
    if norm == "fused":
        return e * h + 4 + e * h
    raise ValueError(f"norm={norm!r}; use 'composite' (eager) or 'fused'")


def block_activation_bytes_per_token(
    model: ModelShape, seq_len: int, e: int, attention: str = "flash", norm: str = "composite"
) -> int:
    """Bytes autograd saves in one transformer block, per token (see module docstring)."""
    h, f, a = model.dim, model.ffn_hidden, model.n_heads
    hkv = model.kv_heads * model.head_dim
    attn = e * h + 2 * e * hkv + e * h + 4 * a
    if attention == "math":
        attn += 2 * e * a * seq_len
    elif attention != "flash":
        raise ValueError(f"attention={attention!r}; use 'flash' (SDPA flash/efficient) or 'math'")
    return 2 * _norm_bytes(h, e, norm) + attn + 4 * e * f


def root_activation_bytes_per_token(model: ModelShape, e: int, norm: str = "composite") -> int:
    """Token ids, final norm, fp32 log-softmax output, labels (per token)."""
    return 8 + _norm_bytes(model.dim, e, norm) + 4 * model.vocab_size + 8


def activation_bytes(
    model: ModelShape, seq_len: int, micro_batch: int, mixed_precision: str = "bf16",
    activation_checkpointing: str = "none", attention: str = "flash", norm: str = "composite",
) -> int:
    """Saved activations of one micro-batch at the start of its backward."""
    e = _dtype_bytes(mixed_precision)
    tokens = seq_len * micro_batch
    root = root_activation_bytes_per_token(model, e, norm)
    if activation_checkpointing == "none":
        block = block_activation_bytes_per_token(model, seq_len, e, attention, norm)
        return tokens * (model.n_layers * block + root)
    if activation_checkpointing == "full":
        return tokens * (model.n_layers * e * model.dim + root)
    raise ValueError(
        f"activation_checkpointing={activation_checkpointing!r}; use 'none' or 'full'"
    )


def temp_bytes(
    model: ModelShape, plan: ResolvedPlan, seq_len: int, micro_batch: int,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", norm: str = "composite", reshard_after_forward=True,
    reduce_dtype: str | None = None,
) -> int:
    """Peak temporary buffers in backward (module docstring): gathered units, the unit's
    unsharded grads, the loss gradient, a recomputed block under full checkpointing, and
    hpZ's secondary param copies."""
    e = _dtype_bytes(mixed_precision)
    units = model.unit_param_shapes()
    block, root = units[0], units[-1]
    tokens = seq_len * micro_batch
    big_unit = max(padded_numel(u, plan.s_p) for u in units)
    gathered = 0
    if plan.s_p > 1:
        # unit in compute + prefetched one; the root stays gathered through backward
        gathered = e * (2 * padded_numel(block, plan.s_p) + padded_numel(root, plan.s_p))
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            if 1 < reshard_after_forward < plan.s_p:  # hpZ secondary copy of every block
                gathered += e * model.n_layers * shard_numel(block, reshard_after_forward)
    r = _dtype_bytes(reduce_dtype) if reduce_dtype else e
    unit_grads = e * big_unit  # unsharded grads of the unit in backward
    if r != e:
        unit_grads += r * big_unit  # FSDP2 casts them to reduce_dtype for the reduce-scatter
    loss_grad = tokens * (4 + e) * model.vocab_size
    recompute = 0
    if activation_checkpointing == "full":
        recompute = tokens * block_activation_bytes_per_token(model, seq_len, e, attention, norm)
    return gathered + unit_grads + loss_grad + recompute


@dataclass(frozen=True)
class MemoryEstimate:
    states: StateBytes
    activations: int
    temp: int
    reserve: int = 0  # CUDA context, NCCL buffers, allocator slack: outside the tensors

    @property
    def total(self) -> int:
        return self.states.total + self.activations + self.temp + self.reserve

    def as_dict(self) -> dict:
        return {
            "param": self.states.param,
            "grad": self.states.grad,
            "optim": self.states.optim,
            "activations": self.activations,
            "temp": self.temp,
            "reserve": self.reserve,
            "total": self.total,
        }


def estimate_memory(
    model: ModelShape, plan: ResolvedPlan, seq_len: int, micro_batch: int,
    mixed_precision: str = "bf16", activation_checkpointing: str = "none",
    attention: str = "flash", norm: str = "composite", reshard_after_forward=True,
    reduce_dtype: str | None = None, reserve_bytes: int = 0,
) -> MemoryEstimate:
    """D_total = D_states + D_activation + D_tmp (+ a fixed reserve) for one rank.

    reduce_dtype: "fp32" keeps G (and the gradient collectives) in fp32 under bf16 params
    (MixedPrecisionPolicy.reduce_dtype); None = the param dtype. reserve_bytes: memory the
    process holds outside tensors (CUDA context, NCCL buffers, allocator slack)."""
    e = _dtype_bytes(mixed_precision)
    r = _dtype_bytes(reduce_dtype) if reduce_dtype else e
    states = state_bytes(model.unit_param_shapes(), plan.s_p, plan.s_g, plan.s_os, e,
                         grad_dtype_bytes=r)
    act = activation_bytes(model, seq_len, micro_batch, mixed_precision,
                           activation_checkpointing, attention, norm)
    tmp = temp_bytes(model, plan, seq_len, micro_batch, mixed_precision,
                     activation_checkpointing, attention, norm, reshard_after_forward,
                     reduce_dtype)
    return MemoryEstimate(states, act, tmp, int(reserve_bytes))
