"""torch.optim.Muon on OS shards, exactly: the same update as one process holding whole
matrices, with an elementwise optimizer (AdamW) for the parameters Muon does not take.

Muon's update of a matrix is elementwise except for one step: the momentum
(``buf.lerp_(grad, 1 - momentum)``), its Nesterov mix, the decoupled weight decay and the
final ``param.add_(update, alpha=-lr')`` touch each element alone, so they run on this
rank's OS rows like AdamW's moments, and the momentum buffer is an OS-sharded state like
exp_avg (checkpointed, resharded and counted as one). The Newton-Schulz orthogonalisation
in between reads the whole matrix.

[Note: one owner per matrix] Each matrix has one owner among the s_os ranks of the shard
group (the ranks that together hold one copy of the optimizer state), chosen once when the
optimizer is built: largest Newton-Schulz cost first, each to the least loaded member
(plan/muon_owners.py's ``assign_owners``). A step sends every rank's rows of each matrix to its owner in one
all-to-all over the shard group, the owners orthogonalise their matrices, and a second
all-to-all sends each rank its rows of the results. Both carry bfloat16: torch's
Newton-Schulz casts its input to bfloat16 first and returns bfloat16, so casting before
the send and adding the bfloat16 rows to the fp32 master afterwards is what one process
does, bit for bit. The traffic is (s_os - 1)/s_os of the Muon matrices' bytes at 2 bytes
an element, each way, inside the shard group; replicas of the shard group (other OS
copies) do the same work on their own copy and send nothing across.

[Note: a group's own optimizer] A parameter group may name an elementwise optimizer class,
``{"params": [...], "optimizer": torch.optim.AdamW, "lr": 3e-4, ...}``: its parameters are
stepped by that class, with that class's defaults and the group's own keys (nothing of
Muon's keyword arguments), as torchtitan's per-group optimizer configs do and as
Moonlight's recipe trains embeddings, the output head, norms and biases. The groups keep
the caller's order in ``param_groups``, and one ``state`` holds every parameter's state,
so LR schedulers, ``state_dict()`` and the engine's checkpoint see one optimizer.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import compat
from ..plan.muon_owners import assign_owners, newton_schulz_flops

GROUP_OPTIMIZER_KEY = "optimizer"


@dataclasses.dataclass(frozen=True)
class OSShards:
    """What a sharding-aware optimizer needs of the OS layout, per parameter in the
    wrapped optimizer's order: the whole tensor's shape and the rows each member of the
    shard group holds (in group-rank order); this rank's member index; the members in
    the order of their rows (``row_order``: they tile each tensor's rows in that order,
    which need not be group-rank order); the engine's collectives (recorded, phase
    "step")."""

    global_shapes: list[torch.Size]
    member_rows: list[list[int]]
    member: int
    row_order: list[int]
    collectives: object


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon(params, ...)`` where each param is this rank's rows of a matrix
    (``shards``: see OSShards); groups naming an ``"optimizer"`` (a name of
    ``group_classes``) are stepped by that elementwise class ([Note: a group's own
    optimizer])."""

    @staticmethod
    def check_params(fqns: list[str], shapes: list, groups: list[tuple[list[int], dict]]) -> None:
        """Before anything is built: every parameter Muon steps is a matrix, and some are."""
        muon = [i for indices, hyper in groups if GROUP_OPTIMIZER_KEY not in hyper
                for i in indices]
        if not muon:
            raise ValueError("Muon: every parameter group names its own optimizer, so Muon "
                             "steps nothing; use that optimizer class itself")
        for i in muon:
            if len(shapes[i]) != 2:
                raise ValueError(
                    f"Muon: {fqns[i]!r} has shape {tuple(shapes[i])}, not a matrix: Muon "
                    "orthogonalizes 2-D weights only; put it in a parameter group with its "
                    "own optimizer, e.g. {'params': [...], 'optimizer': torch.optim.AdamW, "
                    "'lr': 3e-4}")

    def __init__(self, params, *, shards: OSShards, group_classes: dict[str, type], **kwargs):
        groups = list(params)
        own = [g for g in groups if GROUP_OPTIMIZER_KEY not in g]
        super().__init__(own, **kwargs)
        self._fallbacks = []
        by_class: dict[str, list[dict]] = {}
        for group in groups:
            if GROUP_OPTIMIZER_KEY in group:
                by_class.setdefault(group[GROUP_OPTIMIZER_KEY], []).append(group)
        for name, class_groups in by_class.items():
            self._fallbacks.append(group_classes[name](class_groups))
        self.param_groups = groups  # the caller's order: the engine indexes params by it
        self._link()
        flat = [p for g in groups for p in g["params"]]
        self._shape = {id(p): torch.Size(s) for p, s in zip(flat, shards.global_shapes)}
        self._rows = {id(p): rows for p, rows in zip(flat, shards.member_rows)}
        self._member, self._collectives = shards.member, shards.collectives
        self._row_order = shards.row_order
        self._members = len(shards.row_order)
        matrices = [p for g in own for p in g["params"]]
        for p in matrices:
            if self._rows[id(p)][self._member] != p.shape[0]:
                raise AssertionError(f"OS rows of a {tuple(self._shape[id(p)])} matrix: "
                                     f"{p.shape[0]} held, {self._rows[id(p)]} computed")
        owners = assign_owners(
            [newton_schulz_flops(self._shape[id(p)], g["ns_steps"])
             for g in own for p in g["params"]], self._members)
        self._owner = {id(p): o for p, o in zip(matrices, owners)}

    def _link(self) -> None:
        """One state and the caller's group dicts shared with the groups' own optimizers."""
        for fallback in self._fallbacks:
            wanted = {id(g) for g in fallback.param_groups}
            fallback.param_groups = [g for g in self.param_groups if id(g) in wanted]
            fallback.state = self.state

    def load_state_dict(self, state_dict) -> None:
        # torch's load makes new group dicts and a new state: the groups' own optimizers
        # must see those (the groups keep their order, and so their optimizer names)
        kept = [[i for i, g in enumerate(self.param_groups) if id(g) in
                 {id(h) for h in f.param_groups}] for f in self._fallbacks]
        super().load_state_dict(state_dict)
        for fallback, indices in zip(self._fallbacks, kept):
            fallback.param_groups = [self.param_groups[i] for i in indices]
            fallback.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedMuon.step does not take a closure")
        for fallback in self._fallbacks:
            fallback.step()
        work = []  # (group, param, update rows): momentum and Nesterov, on this rank's rows
        for group in self.param_groups:
            if GROUP_OPTIMIZER_KEY in group:
                continue
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                work.append((group, p, update))
        if not work:
            return None
        for (group, p, _), rows in zip(work, self._orthogonalized(work)):
            lr = compat.optimizer_scalar(group["lr"])
            adjusted = compat.muon_adjusted_lr(lr, group["adjust_lr_fn"], self._shape[id(p)])
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(rows, alpha=-adjusted)
        return None

    def _orthogonalized(self, work) -> list[torch.Tensor]:
        """Each update's rows of its whole matrix's Newton-Schulz orthogonalisation, in
        bfloat16 ([Note: one owner per matrix])."""
        me, members = self._member, self._members
        owner = [self._owner[id(p)] for _, p, _ in work]
        # 1: every rank's rows to the owners
        send = [[] for _ in range(members)]
        for (_, _, update), o in zip(work, owner):
            send[o].append(update.reshape(-1).to(torch.bfloat16))
        mine = [j for j, o in enumerate(owner) if o == me]
        cols = [self._shape[id(p)][1] for _, p, _ in work]
        rows = [self._rows[id(p)] for _, p, _ in work]
        device = work[0][2].device
        received = self._exchange(
            send, [[rows[j][s] * cols[j] for j in mine] for s in range(members)], device)
        # 2: orthogonalise the matrices this rank owns
        done = []
        for k, j in enumerate(mine):
            group = work[j][0]
            whole = torch.cat([received[s][k].view(rows[j][s], cols[j]) for s in self._row_order])
            done.append(compat.muon_orthogonalize(whole, group["ns_coefficients"],
                                                  group["ns_steps"], group["eps"]))
        # 3: each rank's rows of the results back
        back = [[] for _ in range(members)]
        for k, j in enumerate(mine):
            start = 0
            for s in self._row_order:
                back[s].append(done[k][start:start + rows[j][s]].reshape(-1))
                start += rows[j][s]
        order = {o: [j for j in range(len(work)) if owner[j] == o] for o in range(members)}
        returned = self._exchange(
            back, [[rows[j][me] * cols[j] for j in order[o]] for o in range(members)], device)
        out = [None] * len(work)
        for o in range(members):
            for piece, j in zip(returned[o], order[o]):
                out[j] = piece.view(rows[j][me], cols[j])
        return out

    def _exchange(self, send: list[list[torch.Tensor]], sizes: list[list[int]], device
                  ) -> list[list[torch.Tensor]]:
        """``send[m]``'s tensors (flat, bfloat16) to member m, in one all-to-all over the
        shard group; member m's tensors arrive in pieces of ``sizes[m]``."""
        pieces = [t for to_member in send for t in to_member]
        flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.bfloat16,
                                                            device=device)
        out_splits = [sum(s) for s in sizes]
        out = torch.empty(sum(out_splits), dtype=torch.bfloat16, device=device)
        if self._members == 1:
            out.copy_(flat)
        else:
            in_splits = [sum(t.numel() for t in pieces) for pieces in send]
            self._collectives.all_to_all(out, flat, "shard", phase="step",
                                         splits=(out_splits, in_splits)).wait()
        return [list(torch.split(chunk, s)) for chunk, s in zip(torch.split(out, out_splits),
                                                                 sizes)]


__all__ = ["GROUP_OPTIMIZER_KEY", "OSShards", "ShardedMuon"]
