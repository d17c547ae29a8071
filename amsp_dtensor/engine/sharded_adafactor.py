"""torch.optim.Adafactor on OS shards, exactly: the same update as one process holding whole
tensors.

Each rank of a shard group (the s_os ranks that together hold one copy of the optimizer
state) steps a disjoint block of rows of every tensor (its OS chunk). Adafactor's update
of an element reads more than that element: for a 2-D tensor of R x C,

- the column factor averages the squared gradient over all R rows;
- the variance estimate divides by the mean of the row factor over all R rows;
- the step size scales with the RMS of the whole parameter and is divided by the RMS of
  the whole update (its clipping).

The row factor (one value per row) stays local. So each step sums, per tensor, the
rank's partial squared-column sums, row-factor sums, parameter and update squared norms
over the shard group: three all-reduces per step for all tensors together (the first two
and the squared parameter norm share one), recorded like every engine collective ("shard",
phase "step"). Tensors of three or more dims are factored over their last two dims,
which a rank holds whole, so only their norms are summed; 1-D tensors keep an
elementwise variance. Ranks whose chunk of a small tensor is empty add zeros.

The formulas follow torch 2.13's single-tensor Adafactor (torch/optim/_adafactor.py),
term for term, with the global sums in place of the local reductions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardedAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor(params, ...)`` where each param is this rank's row block of a
    tensor of ``shards.global_shapes[i]`` (sharded_muon.OSShards); its sums run over the
    shard group in place, through the engine's recorded collectives."""

    def __init__(self, params, *, shards, **kwargs):
        kwargs.pop("foreach", None)  # one loop with batched all-reduces, foreach or not
        super().__init__(params, foreach=False, **kwargs)
        self._global_shapes = {id(p): torch.Size(s)
                               for p, s in zip(self._all_params(), shards.global_shapes)}
        self._all_reduce = shard_group_all_reduce(shards.collectives)

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedAdafactor.step does not take a closure")
        work = []  # (group, param, grad, state, global shape)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                work.append((group, p, grad, self._state_of(p), self._global_shapes[id(p)]))
        if not work:
            return None
        # 1: squared parameter norms and squared column sums of the gradient (2-D)
        firsts = []
        for _, p, grad, _, shape in work:
            firsts.append(p.float().pow(2).sum().reshape(1))
            if len(shape) == 2:
                firsts.append(grad.float().pow(2).sum(dim=0))
        first = torch.cat(firsts)
        self._all_reduce(first)
        # update the factors; 2: the row factors' sums (2-D)
        offset, param_sq, seconds = 0, [], []
        for group, p, grad, state, shape in work:
            param_sq.append(first[offset])
            offset += 1
            state["step"] += 1
            step = state["step"].item()
            one_minus_beta2 = step ** group["beta2_decay"]
            if len(shape) == 2:
                columns = first[offset: offset + shape[1]]
                offset += shape[1]
                state["row_var"].lerp_(grad.pow(2).sum(dim=-1, keepdim=True) / shape[1], one_minus_beta2)
                state["col_var"].lerp_((columns / shape[0]).reshape(1, -1), one_minus_beta2)
                seconds.append(state["row_var"].sum().reshape(1))
            elif len(shape) > 2:
                state["row_var"].lerp_(grad.pow(2).mean(dim=-1, keepdim=True), one_minus_beta2)
                state["col_var"].lerp_(grad.pow(2).mean(dim=-2, keepdim=True), one_minus_beta2)
            else:
                state["variance"].lerp_(grad * grad, one_minus_beta2)
        row_sums = torch.cat(seconds) if seconds else None
        if row_sums is not None:
            self._all_reduce(row_sums)
        # updates; 3: their squared norms
        updates, index = [], 0
        for group, p, grad, state, shape in work:
            eps1 = group["eps"][0] if group["eps"][0] is not None else torch.finfo(p.dtype).eps
            if len(shape) >= 2:
                var = state["row_var"] @ state["col_var"]
                if len(shape) == 2:
                    row_mean = row_sums[index] / shape[0]
                    index += 1
                else:
                    row_mean = state["row_var"].mean(dim=-2, keepdim=True)
                var.div_(row_mean.clamp(min=eps1))
            else:
                var = state["variance"].clone()
            update = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad)
            updates.append(update)
        update_sq = torch.stack([u.float().pow(2).sum() for u in updates])
        self._all_reduce(update_sq)
        for (group, p, _, state, shape), update, p_sq, u_sq in zip(work, updates, param_sq, update_sq):
            numel = shape.numel()
            lr = float(group["lr"])
            step = state["step"].item()
            rho = min(lr, 1 / step ** 0.5)
            alpha = max(group["eps"][1], p_sq.sqrt().item() / numel ** 0.5) * rho
            if group["weight_decay"] != 0:
                p.mul_(1 - lr * group["weight_decay"])
            denom = max(1.0, u_sq.sqrt().item() / (numel ** 0.5 * group["d"]))
            p.add_(update, alpha=-alpha / denom)
        return None

    def _state_of(self, p) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            if p.dim() > 1:
                state["row_var"] = p.new_zeros((*p.shape[:-1], 1))
                state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(p)
        return state


def shard_group_all_reduce(collectives):
    """The engine's recorded SUM all-reduce over the shard group (s_os ranks), waited."""
    if collectives.info.size("shard") == 1:
        return lambda tensor: None

    def all_reduce(tensor: torch.Tensor) -> None:
        collectives.all_reduce(tensor, "shard", phase="step", op=dist.ReduceOp.SUM).wait()

    return all_reduce
