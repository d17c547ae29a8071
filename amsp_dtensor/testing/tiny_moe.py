"""A small mixture-of-experts decoder for tests: the tiny llama's attention, a dense first
layer (as DeepSeek's dense-first layers), then MoE layers with a softmax top-k router,
grouped experts ([experts, ...] weights, as torchtitan's GroupedExperts) and a shared
expert; and expert parallelism over a mesh dim, as torchtitan's ExpertParallel does it:
each rank keeps experts/ep of every grouped weight (Shard(0)), and the routed tokens go
to the rank of their expert and back by two all-to-alls.

With or without EP the model computes the same function of its weights, so a model
trained on N ranks with EP is compared with the same model trained in one process on
the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from .. import compat
from .tiny_llama import Attention, FeedForward, RMSNorm, TinyLlama, TinyLlamaConfig


@dataclass
class TinyMoEConfig(TinyLlamaConfig):
    n_dense_layers: int = 1  # the first layers have a dense FFN, the others MoE
    n_experts: int = 4
    top_k: int = 2
    expert_dim: int = 24
    shared_dim: int = 16  # the shared expert's hidden size (0: none)
    # route token t's j-th choice to expert (t * top_k + j) % n_experts, weighted by its
    # renormalised scores there (torchtitan's _debug_force_load_balance): every rank
    # routes alike, every expert gets the same tokens when tokens x top_k divides evenly
    balanced: bool = False


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts in three grouped weights, torchtitan's layout:
    w1, w3 [experts, hidden, dim], w2 [experts, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, dim) * dim ** -0.5)
        self.ep_group = None  # set by expert_parallelize
        # the token counts this rank receives are its own (every rank routes alike): for a
        # process group that moves no data (torch's fake backend); the exchange still runs
        self.counts_from_self = False

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens`` sorted by expert, ``counts[e]`` of them for expert e (every expert
        of the model): each token through its expert, in the same order."""
        if self.ep_group is None:
            return self._compute(tokens, counts.tolist())
        return self._dispatch(tokens, counts)

    def _local(self):
        return [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)]

    def _compute(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = self._local()
        outs = []
        for e, chunk in enumerate(torch.split(tokens, counts)):
            hidden = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())
            outs.append(hidden @ w2[e].t())
        return torch.cat(outs)

    def _dispatch(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """EP: rank r holds experts [r * E/ep, (r + 1) * E/ep). Send each expert's tokens
        to its rank, run the local experts on what arrives (grouped by expert), and send
        the outputs back."""
        group = self.ep_group
        ep = dist.get_world_size(group)
        local = self.n_experts // ep
        received = compat.all_to_all_counts(counts, group)  # [source, local expert]
        if self.counts_from_self:
            mine = counts.view(ep, local)[dist.get_rank(group)]
            received = mine.repeat(ep)
        send = counts.view(ep, local).sum(1).tolist()
        recv_by_source = received.view(ep, local)
        recv = recv_by_source.sum(1).tolist()
        arrived = compat.all_to_all_autograd(tokens, recv, send, group)
        # arrived is by source rank, then expert; the experts want expert, then source
        segments = torch.split(arrived, recv_by_source.flatten().tolist())
        by_expert = [segments[s * local + e] for e in range(local) for s in range(ep)]
        out = self._compute(torch.cat(by_expert), recv_by_source.sum(0).tolist())
        done = torch.split(out, recv_by_source.t().flatten().tolist())
        by_source = [done[e * ep + s] for s in range(ep) for e in range(local)]
        return compat.all_to_all_autograd(torch.cat(by_source), send, recv, group)


class MoE(nn.Module):
    """Router (softmax over experts, top-k, weights renormalised), routed experts, and a
    shared expert every token goes through."""

    def __init__(self, cfg: TinyMoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.balanced = cfg.balanced
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, cfg.expert_dim, cfg.n_experts)
        self.shared_expert = (FeedForward(TinyLlamaConfig(dim=cfg.dim, ffn_dim=cfg.shared_dim))
                              if cfg.shared_dim else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = F.softmax(self.gate(x).float(), dim=-1)
        if self.balanced:
            n = self.experts.n_experts
            experts = (torch.arange(x.shape[0] * self.top_k) % n).view(-1, self.top_k)
            weights = scores.gather(1, experts)
        else:
            weights, experts = scores.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat, minlength=self.experts.n_experts)
        out = self.experts(x[token_of], counts)
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        routed = torch.zeros_like(x).index_add(0, token_of, out)
        if self.shared_expert is not None:
            routed = routed + self.shared_expert(x)
        return routed.view(shape)


class MoEBlock(nn.Module):
    def __init__(self, cfg: TinyMoEConfig, moe: bool):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.moe = MoE(cfg) if moe else None
        self.feed_forward = None if moe else FeedForward(cfg)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        ffn = self.moe if self.moe is not None else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class TinyMoE(TinyLlama):
    """The tiny llama (its forward) with MoE blocks after the first ``n_dense_layers``."""

    def __init__(self, cfg: TinyMoEConfig | None = None):
        nn.Module.__init__(self)  # TinyLlama's own blocks are not made (nor drawn from the RNG)
        cfg = cfg or TinyMoEConfig()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg, moe=i >= cfg.n_dense_layers)
                                    for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def experts(self) -> list[GroupedExperts]:
        return [block.moe.experts for block in self.layers if block.moe is not None]


def expert_parallelize(model: TinyMoE, ep_mesh) -> TinyMoE:
    """Split every GroupedExperts over the 1-D ``ep_mesh``: each rank keeps its experts'
    rows of w1, w2, w3 as DTensors placed Shard(0) (what torchtitan's ExpertParallel
    leaves), and tokens are dispatched to them by all-to-all."""
    ep = ep_mesh.size()
    rank = ep_mesh.get_local_rank()
    for experts in model.experts():
        if experts.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide the {experts.n_experts} experts")
        for name in ("w1", "w2", "w3"):
            whole = getattr(experts, name).detach()
            mine = whole.chunk(ep)[rank].clone()
            setattr(experts, name, nn.Parameter(DTensor.from_local(
                mine, ep_mesh, [Shard(0)], run_check=False, shape=whole.shape,
                stride=whole.stride())))
        experts.ep_group = ep_mesh.get_group()
    return model
