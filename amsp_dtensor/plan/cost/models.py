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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "ModelShape",
    "ParamShape",
    "MODELS",
    "get_model",
    "llama3_ffn_hidden",
    "from_torchtitan_args",
]


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


def llama3_ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan llama3 FeedForward hidden size (model.py, FeedForward.__init__):
    hidden = int(2 * 4*dim / 3); hidden = int(mult * hidden); round up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


LAYOUTS = ("blocks", "titan")


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

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name}: {key} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"model {self.name}: dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"model {self.name}: n_heads={self.n_heads} not divisible by n_kv_heads={self.kv_heads}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"model {self.name}: layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def block_params(self) -> list[ParamShape]:
        """One transformer block, in named_parameters() order."""
        d, hd, f = self.dim, self.head_dim, self.ffn_hidden
        return [
            ParamShape("attention.wq.weight", (self.n_heads * hd, d)),
            ParamShape("attention.wk.weight", (self.kv_heads * hd, d)),
            ParamShape("attention.wv.weight", (self.kv_heads * hd, d)),
            ParamShape("attention.wo.weight", (d, self.n_heads * hd)),
            ParamShape("feed_forward.w1.weight", (f, d)),
            ParamShape("feed_forward.w2.weight", (d, f)),
            ParamShape("feed_forward.w3.weight", (f, d)),
            ParamShape("attention_norm.weight", (d,)),
            ParamShape("ffn_norm.weight", (d,)),
        ]

    def root_params(self) -> list[ParamShape]:
        """Parameters left to the root unit (not inside any block)."""
        return [
            ParamShape("tok_embeddings.weight", (self.vocab_size, self.dim)),
            ParamShape("norm.weight", (self.dim,)),
            ParamShape("output.weight", (self.vocab_size, self.dim)),
        ]

    def units(self) -> list[list[ParamShape]]:
        """FSDP units in wrap order. "blocks": block 0 .. block L-1, then the root (index
        L); "titan": the embeddings, block 0 .. L-1, then [norm, output] (index L + 1)."""
        block = self.block_params()
        blocks = [list(block) for _ in range(self.n_layers)]
        if self.layout == "titan":
            embeddings, norm, output = self.root_params()
            return [[embeddings], *blocks, [norm, output]]
        return blocks + [self.root_params()]

    def unit_param_shapes(self) -> list[list[tuple[int, ...]]]:
        """Same as units() but bare shapes: the format predicted_events() takes."""
        return [[p.shape for p in unit] for unit in self.units()]

    @property
    def root_unit_index(self) -> int:
        """The unit kept unsharded after forward (no backward all-gather): the root, or
        [norm, output] in the "titan" layout."""
        return self.n_layers + (1 if self.layout == "titan" else 0)

    @property
    def block_numel(self) -> int:
        return sum(p.numel for p in self.block_params())

    @property
    def root_numel(self) -> int:
        return sum(p.numel for p in self.root_params())

    @property
    def num_params(self) -> int:
        return self.n_layers * self.block_numel + self.root_numel


def from_torchtitan_args(name: str, args) -> ModelShape:
    """Build from a torchtitan llama3 TransformerModelArgs (duck-typed: dim, n_layers, ...)."""
    return ModelShape(
        name=name,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab_size,
        ffn_hidden=llama3_ffn_hidden(args.dim, args.multiple_of, args.ffn_dim_multiplier),
    )


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

MODELS: dict[str, ModelShape] = {
    "llama3_debugmodel": _TITAN["debugmodel"],
    "llama3_8b": _TITAN["8B"],
    "llama3_70b": _TITAN["70B"],
    "llama3_405b": _TITAN["405B"],
    **_PAPER,
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
