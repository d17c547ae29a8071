"""A small Llama-style decoder (RMSNorm, RoPE attention, SwiGLU MLP) for tests.

Shapes are chosen so that some dim-0 sizes do not divide the world size (vocab=100), which
exercises the padded-row layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 100
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 64
    max_seq_len: int = 32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def _rope(x: torch.Tensor, start: int = 0) -> torch.Tensor:
    # x: [b, h, t, d] at positions start .. start + t - 1; rotary embedding computed on the
    # fly (no buffers to shard)
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    positions = torch.arange(start, start + t, dtype=torch.float32, device=x.device)
    freqs = torch.outer(positions, inv)
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.cp_mesh = None  # context_parallelize

    def forward(self, x):
        b, t, _ = x.shape
        head_dim = self.wq.in_features // self.n_heads
        # -1 heads: under tensor parallelism wq/wk/wv give this rank's heads only
        q, k, v = (w(x).view(b, t, -1, head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        if self.cp_mesh is None:
            out = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        else:
            out = self._context_parallel(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def _context_parallel(self, q, k, v):
        """This rank holds positions [c t, (c + 1) t) of each sequence (chunk c of cp):
        K and V of the whole sequence are gathered over the cp group, as torchtitan's
        apply_cp_to_forward does for FlexAttention, and each query sees the keys at or
        before its position."""
        from amsp_dtensor import compat

        t, c = q.shape[2], self.cp_mesh.get_local_rank()
        start = c * t
        keys, values = compat.flex_cp_allgather(_rope(k, start), v, 2, self.cp_mesh.get_group())
        causal = (torch.arange(start, start + t, device=q.device)[:, None]
                  >= torch.arange(keys.shape[2], device=q.device)[None, :])
        return F.scaled_dot_product_attention(_rope(q, start), keys, values, attn_mask=causal)


class FeedForward(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig | None = None):
        super().__init__()
        cfg = cfg or TinyLlamaConfig()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def context_parallelize(model: TinyLlama, cp_mesh) -> TinyLlama:
    """Context parallelism over the 1-D ``cp_mesh``: each rank is then fed chunk
    ``cp_mesh.get_local_rank()`` of every sequence (cp equal, contiguous chunks), and the
    attention exchanges keys and values over it (Attention._context_parallel)."""
    for block in model.layers:
        block.attention.cp_mesh = cp_mesh
    return model


def tensor_parallelize(model: TinyLlama, tp_mesh) -> TinyLlama:
    """torchtitan's llama3 tensor-parallel plan (sequence parallel, no loss parallel) on
    the tiny llama: embeddings rowwise, q/k/v and w1/w3 colwise, wo and w2 rowwise with
    sequence-sharded outputs, the norms SequenceParallel, the output head colwise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model
