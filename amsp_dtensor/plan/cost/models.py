"""Model shapes for the cost model: every parameter tensor's shape, grouped by FSDP unit.

The engine wraps every transformer block as one unit and the root (tok_embeddings, norm,
output) as the last unit, and pads each tensor's dim0 to a multiple of the sharding factor
(FSDP2's Shard(0) layout), so the cost model needs each tensor's (dim0, cols), not just a
parameter count.

Shapes follow torchtitan 0.2.2's llama3 ``Transformer`` (torchtitan/models/llama3/model/
model.py): per block wq [n_heads*hd, dim], wk/wv [n_kv_heads*hd, dim], wo [dim, n_heads*hd],
w1/w3 [ffn, dim], w2 [dim, ffn], attention_norm/ffn_norm [dim]; root tok_embeddings
[vocab, dim], norm [dim], output [vocab, dim] (untied). The flavors below are copied from
``torchtitan.models.llama3.llama3_args`` (tests/test_cost_models.py checks them against the
installed torchtitan source); the paper's LLaMA-7B/13B/30B are LLaMA-1 shapes in the same
architecture (ffn given explicitly, vocab 32000).

Tensor parallelism: with TP degree t every rank holds the TP-local part of each parameter,
and the AMSP factors shard that part (FSDP2 chunks a TP DTensor's local tensor on dim 0).
``TP_SHARD_DIM`` states torchtitan 0.2.2's llama3 TP plan (``apply_tp`` in
torchtitan/models/llama3/infra/parallelize.py) per parameter; ``units(tp)`` and
``unit_param_shapes(tp)`` give the local shapes. tests/test_planner_tp.py checks them
against the shapes DTensor gives after torchtitan's own ``apply_tp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

__all__ = [
    "Experts",
    "MLA",
    "ModelShape",
    "ParamShape",
    "MODELS",
    "get_model",
    "llama3_ffn_hidden",
    "from_torchtitan_args",
    "from_named_shapes",
    "TP_SHARD_DIM",
    "tp_chunk",
]

# torchtitan 0.2.2 apply_tp, per parameter: the tensor dim TP shards (None: replicated).
#   tok_embeddings  RowwiseParallel on nn.Embedding: the weight [vocab, dim] is Shard(0)
#                   (torch's RowwiseParallel._partition_embedding_fn), vocab rows split
#   wq, wk, wv      ColwiseParallel: Shard(0) of [out, in], i.e. whole heads per rank
#   wo              RowwiseParallel on nn.Linear: Shard(1) of [dim, n_heads*hd]
#   w1, w3 / w2     ColwiseParallel Shard(0) / RowwiseParallel Shard(1)
#   attention_norm, ffn_norm, norm
#                   SequenceParallel: the weight is Replicate (whole on every TP rank);
#                   the norm runs on a sequence shard, so its gradient comes out
#                   Partial(sum) and is all-reduced over TP (tensor_parallel.py)
#   output          ColwiseParallel: Shard(0) of [vocab, dim] (logits sharded on vocab,
#                   for loss_parallel)
TP_SHARD_DIM: dict[str, int | None] = {
    "tok_embeddings.weight": 0,
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w2.weight": 1,
    "feed_forward.w3.weight": 0,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "norm.weight": None,
    "output.weight": 0,
}


def tp_chunk(n: int, tp: int) -> int:
    """Length of TP rank 0's chunk of a dim of n over tp ranks (DTensor's Shard splits
    torch.chunk style: ceil(n/tp), the last ranks shorter): the largest, so the worst
    rank's bytes."""
    return -(-n // tp)


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor: its name inside the unit and its shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def dim0(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        """numel / dim0: the row length a Shard(0) layout moves together."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def tp_local(self, tp: int) -> "ParamShape":
        """The shape TP rank 0 holds under torchtitan's TP plan (TP_SHARD_DIM)."""
        if tp == 1:
            return self
        if self.name not in TP_SHARD_DIM:
            raise ValueError(f"no tensor-parallel style known for parameter {self.name!r}")
        dim = TP_SHARD_DIM[self.name]
        if dim is None:
            return self
        shape = list(self.shape)
        shape[dim] = tp_chunk(shape[dim], tp)
        return ParamShape(self.name, tuple(shape))


def llama3_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan llama3 FeedForward hidden size (model.py, FeedForward.__init__):
    hidden = int(2 * 4*dim / 3); hidden = int(mult * hidden); round up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


LAYOUTS = ("blocks", "titan")


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts part of a model, as torchtitan's MoEArgs and model args give
    it: after the first ``n_dense_layers`` blocks (which keep the dense FFN of
    ``ffn_hidden``), every block's FFN is a router (``moe.router.gate`` [n_experts, dim]),
    ``n_experts`` routed SwiGLU experts of ``hidden`` each in three grouped weights
    (``moe.experts.w1``/``w3`` [n_experts, hidden, dim], ``w2`` [n_experts, dim, hidden]),
    of which each token takes ``top_k``, and ``n_shared`` shared experts that every token
    takes, one FeedForward of n_shared * hidden (``moe.shared_experts``)."""

    n_experts: int
    top_k: int
    hidden: int
    n_shared: int = 0
    n_dense_layers: int = 0

    def __post_init__(self) -> None:
        for key in ("n_experts", "top_k", "hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"experts: {key} must be a positive int, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"experts: top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.n_shared < 0 or self.n_dense_layers < 0:
            raise ValueError("experts: n_shared and n_dense_layers must be >= 0")


@dataclass(frozen=True)
class MLA:
    """DeepSeek-V3's multi-head latent attention (torchtitan's deepseek_v3 Attention):
    q_lora_rank 0 means a plain wq."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder: enough to list every parameter and size the activations."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_hidden: int
    n_kv_heads: int | None = None
    notes: str = field(default="", compare=False)
    # how the model is cut into units: "blocks" = every block, then the root (embeddings,
    # final norm, output head: kept unsharded after forward); "titan" = as torchtitan
    # shards: the embeddings, every block, then [final norm, output head] (kept
    # unsharded after forward), the root holding nothing
    layout: str = "blocks"
    # a pipeline stage holds some blocks and, on the first stage, the embeddings, on the
    # last, [final norm, output head] (plan/cost/pipeline.py); the whole model has both.
    # A stage's root unit ("blocks" layout) holds the ends it has, or nothing.
    embeddings: bool = True
    head: bool = True
    # attention other than llama3's: an explicit head dim (qwen3: not dim / n_heads), the
    # per-head RMSNorms of q and k (qwen3's qk_norm), or DeepSeek's latent attention
    explicit_head_dim: int | None = None
    qk_norm: bool = False
    mla: MLA | None = None
    experts: Experts | None = None

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name}: {key} must be a positive int, got {value!r}")
        if self.dim % self.n_heads and self.explicit_head_dim is None and self.mla is None:
            raise ValueError(f"model {self.name}: dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.experts is not None and self.experts.n_dense_layers > self.n_layers:
            raise ValueError(f"model {self.name}: n_dense_layers={self.experts.n_dense_layers} "
                             f"exceeds n_layers={self.n_layers}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"model {self.name}: n_heads={self.n_heads} not divisible by n_kv_heads={self.kv_heads}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"model {self.name}: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not (self.embeddings and self.head) and self.layout != "blocks":
            raise ValueError(f"model {self.name}: a pipeline stage (embeddings={self.embeddings}, "
                             f"head={self.head}) is costed in the \"blocks\" layout only")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.experts is not None and layer >= self.experts.n_dense_layers

    @property
    def moe_layers(self) -> int:
        """Blocks whose FFN is a mixture of experts."""
        return 0 if self.experts is None else self.n_layers - self.experts.n_dense_layers

    def _attention_params(self) -> list[ParamShape]:
        d, hd, mla = self.dim, self.head_dim, self.mla
        if mla is None:
            out = [ParamShape("attention.wq.weight", (self.n_heads * hd, d)),
                   ParamShape("attention.wk.weight", (self.kv_heads * hd, d)),
                   ParamShape("attention.wv.weight", (self.kv_heads * hd, d)),
                   ParamShape("attention.wo.weight", (d, self.n_heads * hd))]
            if self.qk_norm:
                out += [ParamShape("attention.q_norm.weight", (hd,)),
                        ParamShape("attention.k_norm.weight", (hd,))]
            return out
        q = self.n_heads * mla.qk_head_dim
        out = ([ParamShape("attention.wq.weight", (q, d))] if mla.q_lora_rank == 0 else
               [ParamShape("attention.wq_a.weight", (mla.q_lora_rank, d)),
                ParamShape("attention.q_norm.weight", (mla.q_lora_rank,)),
                ParamShape("attention.wq_b.weight", (q, mla.q_lora_rank))])
        return out + [
            ParamShape("attention.wkv_a.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, d)),
            ParamShape("attention.kv_norm.weight", (mla.kv_lora_rank,)),
            ParamShape("attention.wkv_b.weight",
                       (self.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                        mla.kv_lora_rank)),
            ParamShape("attention.wo.weight", (d, self.n_heads * mla.v_head_dim))]

    @staticmethod
    def _ffn(prefix: str, f: int, d: int) -> list[ParamShape]:
        return [ParamShape(f"{prefix}.w1.weight", (f, d)),
                ParamShape(f"{prefix}.w2.weight", (d, f)),
                ParamShape(f"{prefix}.w3.weight", (f, d))]

    def block_params(self, tp: int = 1, layer: int = 0) -> list[ParamShape]:
        """Block ``layer``'s parameters in the dense group (TP-local with tp > 1): the
        attention, the norms, and the dense FFN, or in an MoE block the router and the
        shared experts (the routed experts are expert_params: a group of their own)."""
        d = self.dim
        if self.is_moe_layer(layer):
            x = self.experts
            ffn = [ParamShape("moe.router.gate.weight", (x.n_experts, d))]
            if x.n_shared:
                ffn += self._ffn("moe.shared_experts", x.n_shared * x.hidden, d)
        else:
            ffn = self._ffn("feed_forward", self.ffn_hidden, d)
        norms = [ParamShape("attention_norm.weight", (d,)), ParamShape("ffn_norm.weight", (d,))]
        return [p.tp_local(tp) for p in (*self._attention_params(), *ffn, *norms)]

    def expert_params(self, ep: int = 1) -> list[ParamShape]:
        """One MoE block's routed experts, the rows one of ``ep`` expert-parallel ranks
        holds (torchtitan's ExpertParallel: Shard(0) over the experts)."""
        if self.experts is None:
            return []
        x, d = self.experts, self.dim
        if ep < 1 or x.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide model {self.name}'s {x.n_experts} "
                             f"experts; use a divisor of {x.n_experts}")
        e = x.n_experts // ep
        return [ParamShape("moe.experts.w1", (e, x.hidden, d)),
                ParamShape("moe.experts.w2", (e, d, x.hidden)),
                ParamShape("moe.experts.w3", (e, x.hidden, d))]

    def expert_units(self, ep: int = 1, shard_dim: int = 0) -> list[list[tuple[int, ...]]]:
        """The expert units' EP-local shapes, one unit per MoE block (the format
        predicted_expert_events takes). The cost model shards a tensor's dim 0 (padded to
        the factor): the engine's layout. ``shard_dim=1`` gives each grouped weight with its
        dim 1 first: the bytes of torchtitan's Shard(1) for experts, which it uses when
        the expert data-parallel size x ep exceeds the experts (no padding)."""
        shapes = [p.shape for p in self.expert_params(ep)]
        if shard_dim == 1:
            shapes = [(s[1], s[0], *s[2:]) for s in shapes]
        elif shard_dim != 0:
            raise ValueError(f"shard_dim={shard_dim!r}; use 0 or 1")
        return [list(shapes) for _ in range(self.moe_layers)]

    def titan_expert_shard_dim(self, plan, ep: int) -> int:
        """The dim torchtitan shards the experts on under ``plan`` (over the expert world):
        1 when its largest factor x ep exceeds the experts, else 0."""
        return 1 if max(plan.s_p, plan.s_g, plan.s_os) * ep > self.experts.n_experts else 0

    def block_unit(self, layer: int) -> int:
        """The index among units() of block ``layer``'s unit."""
        return layer + (1 if self.layout == "titan" else 0)

    def expert_unit_block(self, index: int) -> int:
        """The index among units() of the block that expert unit ``index`` belongs to."""
        return self.block_unit(self.experts.n_dense_layers + index)

    def root_params(self, tp: int = 1) -> list[ParamShape]:
        """Parameters left to the root unit (not inside any block; TP-local with tp > 1):
        those of the ends this model (or pipeline stage) holds."""
        ends = []
        if self.embeddings:
            ends.append(ParamShape("tok_embeddings.weight", (self.vocab_size, self.dim)))
        if self.head:
            ends += [ParamShape("norm.weight", (self.dim,)),
                     ParamShape("output.weight", (self.vocab_size, self.dim))]
        return [p.tp_local(tp) for p in ends]

    def units(self, tp: int = 1) -> list[list[ParamShape]]:
        """FSDP units in wrap order. "blocks": block 0 .. block L-1, then the root (index
        L); "titan": the embeddings, block 0 .. L-1, then [norm, output] (index L + 1).
        With tp > 1 every shape is what TP rank 0 holds (TP_SHARD_DIM)."""
        self.check_tensor_parallel(tp)
        blocks = [self.block_params(tp, layer) for layer in range(self.n_layers)]
        if self.layout == "titan":
            embeddings, norm, output = self.root_params(tp)
            return [[embeddings], *blocks, [norm, output]]
        return blocks + [self.root_params(tp)]

    def unit_param_shapes(self, tp: int = 1) -> list[list[tuple[int, ...]]]:
        """Same as units() but bare shapes: the format predicted_events() takes."""
        return [[p.shape for p in unit] for unit in self.units(tp)]

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a TP degree torchtitan's plan cannot split this model by: each TP rank
        must hold whole attention heads (torchtitan views q, k, v as (-1, head_dim))."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_degree must be a positive int, got {tp!r}")
        if tp > 1 and (self.experts is not None or self.mla is not None or self.qk_norm):
            raise ValueError(
                f"tensor_parallel_degree={tp} with model {self.name}: the cost model has "
                "llama3's tensor-parallel plan only (and AMSP refuses expert parallelism "
                "with TP); use tp 1")
        if self.kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_degree={tp} does not divide model {self.name}'s "
                f"n_kv_heads={self.kv_heads}: every TP rank needs whole KV heads; use a "
                f"divisor of {self.kv_heads}")

    @property
    def root_unit_index(self) -> int:
        """The unit kept unsharded after forward (no backward all-gather): the root, or
        [norm, output] in the "titan" layout."""
        return self.n_layers + (1 if self.layout == "titan" else 0)

    @cached_property
    def block_numel(self) -> int:
        """A block's parameters that one token's forward multiplies by, the mean over the
        blocks: with experts, the dense group's and top_k routed experts' (the active
        parameters; the FLOP count of cost/step.py)."""
        total = sum(p.numel for layer in range(self.n_layers)
                    for p in self.block_params(layer=layer))
        if self.experts is not None:
            one = sum(p.numel for p in self.expert_params()) // self.experts.n_experts
            total += self.moe_layers * self.experts.top_k * one
        return total // self.n_layers

    @property
    def root_numel(self) -> int:
        return sum(p.numel for p in self.root_params())

    @cached_property
    def expert_numel(self) -> int:
        """Every routed expert's parameters (all MoE blocks)."""
        return self.moe_layers * sum(p.numel for p in self.expert_params())

    @cached_property
    def dense_numel(self) -> int:
        return sum(p.numel for layer in range(self.n_layers)
                   for p in self.block_params(layer=layer)) + self.root_numel

    @property
    def num_params(self) -> int:
        return self.dense_numel + self.expert_numel

    @property
    def active_params(self) -> int:
        """Parameters one token's forward uses (= num_params without experts)."""
        if self.experts is None:
            return self.num_params
        return self.n_layers * self.block_numel + self.root_numel

    @property
    def q_width(self) -> int:
        """Per token, the queries' width (the attention output's too)."""
        if self.mla is not None:
            return self.n_heads * self.mla.qk_head_dim
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Per token, the width of the keys (and of the values): latent attention
        expands the latent to per-head keys and values (their mean width here)."""
        if self.mla is not None:
            return self.attention_width
        return self.kv_heads * self.head_dim

    @property
    def attention_width(self) -> int:
        """Per token, the width of the attention products (QK^T and AV, averaged): dim for
        llama3, n_heads x head_dim with an explicit head dim, the mean of the q/k and v
        head widths under latent attention."""
        if self.mla is not None:
            return self.n_heads * (self.mla.qk_head_dim + self.mla.v_head_dim) // 2
        return self.n_heads * self.head_dim


def from_torchtitan_args(name: str, args) -> ModelShape:
    """Build from torchtitan model args (duck-typed): llama3's TransformerModelArgs,
    qwen3's Qwen3ModelArgs (head_dim, qk_norm, MoE with moe_enabled), deepseek_v3's
    DeepSeekV3ModelArgs (latent attention, dense first layers, MoE)."""
    moe = getattr(args, "moe_args", None)
    if hasattr(args, "kv_lora_rank"):  # deepseek_v3
        return _deepseek(name, args.dim, args.n_layers, args.n_heads, args.vocab_size,
                         args.inter_dim, args.moe_inter_dim, moe.num_experts, moe.top_k,
                         moe.num_shared_experts, args.n_dense_layers,
                         MLA(args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim,
                             args.qk_rope_head_dim, args.v_head_dim))
    if hasattr(args, "qk_norm"):  # qwen3
        if getattr(args, "enable_weight_tying", False):
            raise ValueError(f"model {name}: tied embeddings are not in the cost model")
        experts = (Experts(moe.num_experts, moe.top_k, args.moe_inter_dim,
                           moe.num_shared_experts) if args.moe_enabled else None)
        return ModelShape(name, args.dim, args.n_layers, args.n_heads, args.vocab_size,
                          args.hidden_dim, args.n_kv_heads, explicit_head_dim=args.head_dim,
                          qk_norm=args.qk_norm, experts=experts)
    return ModelShape(
        name=name,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        ffn_hidden=llama3_ffn_hidden(args.dim, args.multiple_of, args.ffn_dim_multiplier),
    )


def from_named_shapes(name: str, *, dim: int, n_heads: int, top_k: int | None,
                      blocks: list[dict[str, tuple]], root: dict[str, tuple]) -> ModelShape:
    """A ModelShape read off a built model's parameters, for models whose config the cost
    model cannot read (torchtitan 0.3's): ``blocks`` maps each block's parameter names
    (relative to the block) to shapes, ``root`` the rest. Recognised by name: latent
    attention (``wkv_a``), q/k norms with plain ``wq``, the dense FFN (``feed_forward.w1``),
    the router, routed experts (3-D, ``experts`` in the name), shared experts
    (``shared_experts.w1``); ``top_k`` is the router's (None for a dense model). The
    result's parameters are compared with the given ones, shape by shape per block; a
    model that does not match is refused (ValueError) rather than costed wrong."""
    first, last = blocks[0], blocks[-1]

    def find(block, *parts, ndim=None):
        for key, shape in block.items():
            if all(p in key for p in parts) and (ndim is None or len(shape) == ndim):
                return key, shape
        return None, None

    def first_with(*parts, ndim=None):
        for block in blocks:
            key, shape = find(block, *parts, ndim=ndim)
            if key is not None:
                return shape
        return None

    mla = None
    _, wkv_a = find(first, "wkv_a")
    if wkv_a is not None:
        _, kv_norm = find(first, "kv_norm")
        _, wkv_b = find(first, "wkv_b")
        _, wo = find(first, "attention.wo")
        _, wq_a = find(first, "wq_a")
        v = wo[1] // n_heads
        nope = wkv_b[0] // n_heads - v
        mla = MLA(wq_a[0] if wq_a is not None else 0, kv_norm[0], nope,
                  wkv_a[0] - kv_norm[0], v)
        head_dim, kv_heads, qk_norm = None, None, False
    else:
        _, wq = find(first, "attention.wq")
        _, wk = find(first, "attention.wk")
        head_dim = wq[0] // n_heads
        kv_heads = wk[0] // head_dim
        qk_norm = find(first, "q_norm")[0] is not None
        head_dim = head_dim if head_dim * n_heads != dim else None
    dense_w1 = first_with("feed_forward", "w1")
    routed = first_with("experts", "w1", ndim=3)
    experts = None
    if routed is not None:
        if top_k is None:
            raise ValueError(f"model {name}: routed experts but no router top_k given")
        shared = first_with("shared_experts", "w1")
        n_dense = next(i for i, b in enumerate(blocks) if find(b, "experts", ndim=3)[0])
        experts = Experts(routed[0], top_k, routed[1],
                          shared[0] // routed[1] if shared is not None else 0, n_dense)
    vocab = max(shape[0] for shape in root.values())
    shape = ModelShape(name, dim, len(blocks), n_heads, vocab,
                       dense_w1[0] if dense_w1 is not None else routed[1], kv_heads,
                       explicit_head_dim=head_dim, qk_norm=qk_norm, mla=mla,
                       experts=experts, notes="read off the model's parameters")
    for layer, block in enumerate(blocks):
        want = sorted(p.shape for p in shape.block_params(layer=layer))
        if shape.is_moe_layer(layer):
            want = sorted(want + [p.shape for p in shape.expert_params()])
        if sorted(block.values()) != want:
            raise ValueError(f"model {name}: block {layer}'s parameters {sorted(block.values())} "
                             f"are not the cost model's {want}; it cannot plan this model")
    if sorted(root.values()) != sorted(p.shape for p in shape.root_params()):
        raise ValueError(f"model {name}: the parameters outside the blocks "
                         f"{sorted(root.values())} are not embeddings, norm and output head")
    return shape


def _llama3(name, dim, n_layers, n_heads, n_kv_heads=None, vocab=128256, multiple_of=256, mult=None):
    return ModelShape(
        name=name,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=vocab,
        ffn_hidden=llama3_ffn_hidden(dim, multiple_of, mult),
        notes="torchtitan 0.2.2 llama3_args",
    )


# torchtitan 0.2.2 llama3_args (TransformerModelArgs defaults: vocab 128256, multiple_of 256)
_TITAN = {
    "debugmodel": _llama3("llama3_debugmodel", 256, 6, 16, vocab=2048),
    "8B": _llama3("llama3_8b", 4096, 32, 32, 8, multiple_of=1024, mult=1.3),
    "70B": _llama3("llama3_70b", 8192, 80, 64, 8, multiple_of=4096, mult=1.3),
    "405B": _llama3("llama3_405b", 16384, 126, 128, 8, multiple_of=4096, mult=1.2),
}

# The paper's models (LLaMA-1 shapes: MHA, ffn as published, vocab 32000).
_PAPER = {
    "llama_7b": ModelShape("llama_7b", 4096, 32, 32, 32000, 11008, notes="LLaMA-1 7B"),
    "llama_13b": ModelShape("llama_13b", 5120, 40, 40, 32000, 13824, notes="LLaMA-1 13B"),
    "llama_30b": ModelShape("llama_30b", 6656, 60, 52, 32000, 17920, notes="LLaMA-1 30B (33B)"),
}

def _deepseek(name, dim, n_layers, n_heads, vocab, inter_dim, moe_inter_dim, n_experts,
              top_k, n_shared, n_dense, mla, notes=""):
    return ModelShape(name, dim, n_layers, n_heads, vocab, inter_dim, mla=mla,
                      experts=Experts(n_experts, top_k, moe_inter_dim, n_shared, n_dense),
                      notes=notes)


# torchtitan 0.2.2's deepseekv3_args and qwen3_args (tests/test_cost_models.py checks the
# parameter shapes against the models torchtitan builds from them)
_MOE = {
    "deepseek_v3_debugmodel": _deepseek(
        "deepseek_v3_debugmodel", 256, 6, 16, 2048, 1024, 256, 8, 3, 2, 1,
        MLA(0, 512, 128, 64, 128), "torchtitan 0.2.2 deepseekv3_args debugmodel"),
    "deepseek_v3_16b": _deepseek(
        "deepseek_v3_16b", 2048, 27, 16, 102400, 10944, 1408, 64, 6, 2, 1,
        MLA(0, 512, 128, 64, 128), "torchtitan 0.2.2 deepseekv3_args 16B"),
    "deepseek_v3_671b": _deepseek(
        "deepseek_v3_671b", 7168, 61, 128, 129280, 18432, 2048, 256, 8, 1, 3,
        MLA(1536, 512, 128, 64, 128), "torchtitan 0.2.2 deepseekv3_args 671B"),
    "qwen3_debugmodel_moe": ModelShape(
        "qwen3_debugmodel_moe", 256, 8, 16, 2048, 3072, 8, explicit_head_dim=128,
        qk_norm=True, experts=Experts(64, 8, 768), notes="torchtitan 0.2.2 qwen3_args"),
    "qwen3_30b_a3b": ModelShape(
        "qwen3_30b_a3b", 2048, 48, 32, 151936, 6144, 4, explicit_head_dim=128,
        qk_norm=True, experts=Experts(128, 8, 768), notes="torchtitan 0.2.2 qwen3_args 30B-A3B"),
}

MODELS: dict[str, ModelShape] = {
    "llama3_debugmodel": _TITAN["debugmodel"],
    "llama3_8b": _TITAN["8B"],
    "llama3_70b": _TITAN["70B"],
    "llama3_405b": _TITAN["405B"],
    **_PAPER,
    **_MOE,
}

# torchtitan flavor names as they appear in [model] flavor, for the titan integration.
_ALIASES = {
    "debugmodel": "llama3_debugmodel",
    "llama3_debug": "llama3_debugmodel",
    "8b": "llama3_8b",
    "70b": "llama3_70b",
    "405b": "llama3_405b",
    "llama3_8B": "llama3_8b",
    "llama3_70B": "llama3_70b",
    "llama3_405B": "llama3_405b",
    "llama7b": "llama_7b",
    "llama13b": "llama_13b",
    "llama30b": "llama_30b",
}


def get_model(name) -> ModelShape:
    """A ModelShape by name (case-insensitive; torchtitan flavor names accepted), or pass through."""
    if isinstance(name, ModelShape):
        return name
    key = str(name).strip()
    if key in MODELS:
        return MODELS[key]
    low = key.lower()
    if low in MODELS:
        return MODELS[low]
    for alias, target in _ALIASES.items():
        if alias.lower() == low:
            return MODELS[target]
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(sorted(MODELS))} "
        "(or give explicit --layers/--dim/--heads/--ffn/--vocab)"
    )
