"""AMSPOptimizer: fp32 master weights and optimizer states in the OS layout.

Each param gets an fp32 master DTensor with OS placements (layouts.OS_PLACEMENTS): this
rank's 1/s_os of the rows, a sub-chunk of its own P shard, so building it needs no
communication. The wrapped optimizer steps the local shards as plain tensors, which is exact
when the update of each element depends on that element alone (torch's SGD, Adam, AdamW,
...: ELEMENTWISE_OPTIMIZERS). Adafactor, whose update reads whole rows, columns and norms,
runs a sharding-aware version that sums those over the shard group (SHARDED_OPTIMIZERS);
any other class is refused at construction with what it would need.
DTensor dispatch would see whole tensors, but torch 2.13 cannot run such updates on the
multi-dim OS placements in place, and made AdamW's step ~10x slower here. ``state_dict()``
hands out DTensors in the OS layout, sharing storage with what the optimizer updates.

[Note: fp32 P is its own master] When a unit's P shard is fp32 (an fp32 model, or FSDP2's
MixedPrecisionPolicy, whose sharded params stay fp32), the master is not a copy: it is a
view of this rank's OS rows inside the P shard, as FSDP2's sharded param is its own master.
The optimizer then updates those P rows in place, and the post-step all-gather fills the
rest of the P shard (s_os > s_p) or has nothing to do (s_os = s_p). This saves 4 bytes per
parameter per OS shard and keeps the weights one tensor: an in-place edit of a parameter
(a model ``load_state_dict``, a manual rescale) is what the next step starts from. The
view must keep pointing at the P storage: ``step()`` checks it (_check_masters_alias) and
refuses if a parameter was replaced (``load_state_dict(assign=True)``, ``module.to()``).
With a bf16 P shard, or with compressed weights (compression.py: the P shard then lands
dequantized values), the master is a separate fp32 copy.

After ``step()`` the new weights go back to the P shards (param_update.py): an all-gather
over the OS subgroup (s_os/s_p ranks holding the same P shard). As with any torch
optimizer, ``step()`` returns with every parameter updated. ``overlap_param_update=True``
is AMSP's overlap (the paper overlaps this all-gather with the next forward; Megatron-LM's
``overlap_param_gather`` is the same idea, also opt-in): ``step()`` returns with the
all-gathers in flight, and each unit's forward pre-hook lands its own; until then the
parameters read through ``model.parameters()`` are not all current (the previous step's,
except, with fp32 params, the rows this rank updated itself). ``state_dict()`` and
``load_state_dict()`` (the model's, a submodule's, the optimizer's) and
``wait_param_update()`` land them first. An in-place write to a parameter before they
have landed would be overwritten by the landing: it raises ParamWrittenWhilePending
(param_update.py).
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import math
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from torch.profiler import record_function

from .. import compat
from . import optim_state, param_update
from . import grad as grad_path
from .fqn import clean_fqn
from .handle import root_state
from .layouts import OS_PLACEMENTS, chunk_rows, os_member_rows
from .lifecycle import StepState
from .sharded_adafactor import ShardedAdafactor
from .sharded_muon import GROUP_OPTIMIZER_KEY, OSShards, ShardedMuon
from .root import RootState
from .unit import AMSPUnit

__all__ = ["AMSPOptimizer", "ELEMENTWISE_OPTIMIZERS", "SHARDED_OPTIMIZERS", "STEP_BATCHES",
           "step_batches"]

# Exact classes whose step touches each element on its own (no norms or reductions):
# safe to run on local shards. Subclasses may not be, so they take the DTensor path.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


# Optimizers whose update reads whole tensors, run by a sharding-aware implementation
# over the shard group, exact: Adafactor sums its partial reductions
# (sharded_adafactor.py), Muon orthogonalizes each matrix on one owner (sharded_muon.py).
SHARDED_OPTIMIZERS = {torch.optim.Adafactor: ShardedAdafactor, torch.optim.Muon: ShardedMuon}
# what each of them would also need under tensor parallelism or on an expert mesh
_SHARDED_NEEDS = {
    torch.optim.Adafactor: "its factored moments would also need sums over the "
                           "tensor-parallel ranks or the expert mesh's groups",
    torch.optim.Muon: "its Newton-Schulz update needs each matrix whole, which tensor "
                      "parallelism splits over the tp ranks and the expert mesh holds as "
                      "3-D grouped experts",
}
# the sharded optimizers whose param groups may name their own elementwise optimizer
_GROUP_OPTIMIZERS = (torch.optim.Muon,)

# what a refused optimizer's update reads beyond the element it updates
_NEEDS = {
    "LBFGS": "a closure and the whole flattened parameter and gradient vectors",
    "SparseAdam": "sparse gradients, which the engine's flat buffers do not carry",
}


# the most calls of the wrapped optimizer one step() makes ([Note: per-unit step])
STEP_BATCHES = 4


def step_batches(sizes: list[int], batches: int) -> list[int]:
    """How many units each of at most ``batches`` contiguous batches takes, for units of
    ``sizes`` (elements) in order: each batch takes units until it holds at least half of
    what is left (at least one unit); the last allowed batch takes all that is left.
    Ten units of one element in four batches: [5, 3, 1, 1]."""
    if batches < 1:
        raise ValueError(f"batches must be at least 1, got {batches}")
    lengths, start, left = [], 0, sum(sizes)
    while start < len(sizes):
        if len(lengths) == batches - 1:
            lengths.append(len(sizes) - start)
            break
        end, held = start, 0
        while end < len(sizes) and (end == start or 2 * held < left):
            held += sizes[end]
            end += 1
        lengths.append(end - start)
        left -= held
        start = end
    return lengths


def _not_elementwise_message(cls: type) -> str:
    needs = _NEEDS.get(cls.__name__, "values outside the element it updates (or is a subclass "
                                      "the engine cannot vouch for)")
    supported = ", ".join(c.__name__ for c in (*ELEMENTWISE_OPTIMIZERS, *SHARDED_OPTIMIZERS))
    return (
        f"{cls.__name__} is not an elementwise optimizer: each rank steps only its OS shard (a "
        f"block of rows of every tensor), and {cls.__name__} needs {needs}; use one of "
        f"{supported} (exact classes)"
    )


def param_groups_by_regex(named, patterns) -> tuple[list[dict], list[str]]:
    """Torch param groups ``[{"params": [...], **options}]`` for ``patterns`` ([(regex,
    options)]), each of ``named``'s (name, param) pairs in the group of the first regex
    found in its name (``re.search``; torchtitan 0.3's ParamGroupConfig rule), and the
    names no regex finds. Callers decide what an unmatched name or an empty group means."""
    compiled = [re.compile(pattern) for pattern, _ in patterns]
    groups = [{"params": [], **options} for _, options in patterns]
    unmatched = []
    for name, param in named:
        first = next((i for i, c in enumerate(compiled) if c.search(name)), None)
        if first is None:
            unmatched.append(name)
        else:
            groups[first]["params"].append(param)
    return groups, unmatched


def _resolve_groups(model: nn.Module, fqns: list[str], param_groups, optimizer_class
                    ) -> list[tuple[list[int], dict]]:
    """``param_groups`` (AMSPOptimizer's argument) as [(indices into ``fqns``, the group's
    hyperparameters)]; None is one group of every parameter. Raises, naming the group and
    the fix, for anything torch would refuse or silently mis-train: a parameter in two
    groups or in none, one the model lacks or has frozen, a key the optimizer does not
    take."""
    if param_groups is None:
        return [(list(range(len(fqns))), {})]
    if not isinstance(param_groups, (list, tuple)) or not param_groups or not all(
            isinstance(g, dict) and "params" in g for g in param_groups):
        raise TypeError("param_groups must be a non-empty list of dicts, each with 'params' "
                        "(the model's parameters or their FQNs) and the group's options")
    index_of = {fqn: i for i, fqn in enumerate(fqns)}
    names = {id(p): clean_fqn(n) for n, p in model.named_parameters(remove_duplicate=False)}
    owner: dict[int, int] = {}
    groups = []
    for g, group in enumerate(param_groups):
        group_class = _group_optimizer(g, group, optimizer_class)
        accepted = set(inspect.signature(group_class.__init__).parameters) - {"self", "params"}
        unknown = sorted(set(group) - accepted - {"params", GROUP_OPTIMIZER_KEY})
        if unknown:
            raise ValueError(f"param_groups[{g}] has {', '.join(map(repr, unknown))}, which "
                             f"{group_class.__name__} does not take: use "
                             f"{', '.join(sorted(accepted))}")
        params = group["params"]
        params = [params] if isinstance(params, (str, torch.Tensor)) else list(params)
        indices = []
        for p in params:
            fqn = p if isinstance(p, str) else names.get(id(p))
            if fqn not in index_of:
                what = (f"{fqn!r} is frozen (requires_grad=False) or not sharded by "
                        "amsp.fully_shard" if fqn in names.values() else
                        f"{p!r} is not a parameter of this model" if isinstance(p, str) else
                        "a tensor that is not a parameter of this model (pass the "
                        "parameters model.parameters() gives after amsp.fully_shard)")
                raise ValueError(f"param_groups[{g}]: {what}; a group holds trainable "
                                 "parameters only")
            i = index_of[fqn]
            if i in owner:
                raise ValueError(f"{fqn!r} is in param_groups[{owner[i]}] and "
                                 f"param_groups[{g}]: each parameter belongs to one group")
            owner[i] = g
            indices.append(i)
        if not indices:
            raise ValueError(f"param_groups[{g}] holds no parameters: drop it")
        hyper = {k: v for k, v in group.items() if k != "params"}
        if GROUP_OPTIMIZER_KEY in hyper:  # by name: checkpoints hold strings, not classes
            hyper[GROUP_OPTIMIZER_KEY] = group_class.__name__
        groups.append((indices, hyper))
    missing = [f for i, f in enumerate(fqns) if i not in owner]
    if missing:
        raise ValueError(f"{len(missing)} trainable parameters are in no group "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                         "add them to a group (a group of only 'params' takes the defaults)")
    return groups


def _group_optimizer(g: int, group: dict, optimizer_class: type) -> type:
    """The optimizer class stepping ``param_groups[g]``: its own ``"optimizer"`` (an
    elementwise class, beside a whole-matrix optimizer only), else ``optimizer_class``."""
    if GROUP_OPTIMIZER_KEY not in group:
        return optimizer_class
    cls = group[GROUP_OPTIMIZER_KEY]
    if optimizer_class not in _GROUP_OPTIMIZERS:
        raise ValueError(
            f"param_groups[{g}] names its own optimizer, which only "
            f"{', '.join(c.__name__ for c in _GROUP_OPTIMIZERS)} groups take (for the "
            f"parameters it does not step); with {optimizer_class.__name__}, drop "
            f"{GROUP_OPTIMIZER_KEY!r} and set the group's options")
    if cls not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(
            f"param_groups[{g}]: {GROUP_OPTIMIZER_KEY!r} must be an elementwise optimizer "
            f"class ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}), got {cls!r}")
    return cls


class InnerState(enum.Enum):
    """Where the wrapped optimizer's per-parameter state came from."""

    FRESH = "fresh"  # nothing yet: torch creates it in the first step
    # zeros made for a checkpoint load before the first step (_materialize_state); the
    # first step drops it unless a checkpoint was loaded into it
    PLACEHOLDER = "placeholder"
    REAL = "real"  # made by a step, or loaded from a checkpoint that had one


class AMSPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` (any torch.optim.Optimizer) around OS-sharded masters.

    Usage: ``AMSPOptimizer(model, torch.optim.AdamW, lr=3e-4)`` where ``model`` is the
    root passed last to ``amsp.fully_shard``. ``param_groups`` and ``state`` are the
    wrapped optimizer's, so LR schedulers work unchanged. ``overlap_param_update``: see
    the module docstring (default False: parameters are current when ``step()`` returns).

    ``param_groups``: torch's parameter groups, ``[{"params": [...], "lr": 1e-4, ...},
    ...]``, ``params`` the model's parameters or their FQNs (as ``model.named_parameters()``
    names them); the other keys override ``optimizer_kwargs`` for the group. Every
    trainable parameter belongs to exactly one group. Each OS shard is stepped with its
    parameter's group (grouping is per parameter, so it never depends on the plan).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        overlap_param_update: bool = False,
        param_groups: list[dict] | None = None,
        **optimizer_kwargs,
    ):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(
                "optimizer_class must be a torch.optim.Optimizer subclass such as "
                f"torch.optim.AdamW, got {optimizer_class!r}"
            )
        if optimizer_class not in ELEMENTWISE_OPTIMIZERS and optimizer_class not in SHARDED_OPTIMIZERS:
            raise ValueError(_not_elementwise_message(optimizer_class))
        info = root_state(model).info
        if optimizer_class in SHARDED_OPTIMIZERS and (info.tp > 1 or info.expert):
            what = "tensor parallelism" if info.tp > 1 else "an expert mesh"
            raise ValueError(
                f"{optimizer_class.__name__} with {what} is not supported: "
                f"{_SHARDED_NEEDS[optimizer_class]}; use one of "
                f"{', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}"
            )
        if not isinstance(overlap_param_update, bool):
            raise TypeError(f"overlap_param_update must be a bool, got {overlap_param_update!r}")
        self._root: RootState = root_state(model)
        if self._root.optimizer_bound:
            raise ValueError(
                "this model already has an AMSPOptimizer (it owns the fp32 master weights): "
                "build one AMSPOptimizer per model, with several param_groups if needed"
            )
        self._fqns: list[str] = [f for unit in self._root.units for f in unit.param_fqns]
        # the groups as indices into self._fqns (the masters' order), checked before
        # anything is built or registered
        groups = _resolve_groups(model, self._fqns, param_groups, optimizer_class)
        shapes = [s for unit in self._root.units for s in unit.global_shapes]
        if hasattr(SHARDED_OPTIMIZERS.get(optimizer_class), "check_params"):
            SHARDED_OPTIMIZERS[optimizer_class].check_params(self._fqns, shapes, groups)
        for unit in self._root.units:
            if unit.refresh_params():
                grad_path.register_param_hooks(unit)
            if any(p.device.type == "meta" for p in unit.local_params()):
                raise ValueError(
                    f"parameters of {unit.fqn or 'the root'} are still on the meta device: "
                    "materialise the model (to_empty + init_weights) before building "
                    "AMSPOptimizer, which builds its fp32 master weights from them"
                )
        # per unit whose masters are views into its fp32 P shards: {param index: storage}
        self._aliases: list[tuple[AMSPUnit, dict[int, int]]] = []
        self._masters_are_p: dict[int, bool] = {}  # id(unit) -> every master is a P view
        self._masters: list[DTensor] = []
        self._unit_masters: list[tuple[AMSPUnit, list[DTensor]]] = []
        self._unit_slices: dict[int, tuple[int, list[DTensor]]] = {}  # id(unit) -> (start, masters)
        self._unit_numel: dict[int, int] = {}  # id(unit) -> elements of its OS shard (step_batches)
        for unit in self._root.units:
            masters = self._build_masters(unit)
            self._unit_masters.append((unit, masters))
            self._unit_slices[id(unit)] = (len(self._masters), masters)
            self._unit_numel[id(unit)] = sum(m.to_local().numel() for m in masters)
            self._masters.extend(masters)
        # Plain Parameters sharing storage with the master DTensors' local shards.
        self._opt_params = [nn.Parameter(m.to_local()) for m in self._masters]
        # under TP, the params every tp rank holds whole (SequenceParallel norms): their
        # share of the global grad norm is counted on one tp rank only
        # [(MeshInfo, its units)]: the dense mesh's first, then the expert mesh's (the
        # global norm sums each over its own copy)
        by_mesh: dict[int, tuple] = {}
        for unit in self._root.units:
            by_mesh.setdefault(id(unit.info), (unit.info, []))[1].append(unit)
        self._units_by_mesh = sorted(by_mesh.values(), key=lambda pair: pair[0].is_expert)
        self._tp_replicated = [isinstance(p, Replicate) for u in self._root.units
                               for p in (u.tp_placements or [None] * len(u.params))]
        self.optimizer_class = optimizer_class  # what the user asked for (checkpoints name it)
        # the wrapped optimizer holds the params group by group: its index k is master
        # self._order[k], and master j is its index self._inner_index[j]
        self._order = [j for indices, _ in groups for j in indices]
        self._inner_index = {j: k for k, j in enumerate(self._order)}
        inner_groups = [{"params": [self._opt_params[j] for j in indices], **hyper}
                        for indices, hyper in groups]
        if optimizer_class in SHARDED_OPTIMIZERS:
            if optimizer_class in _GROUP_OPTIMIZERS:
                optimizer_kwargs["group_classes"] = {c.__name__: c for c in ELEMENTWISE_OPTIMIZERS}
            self.inner = SHARDED_OPTIMIZERS[optimizer_class](
                inner_groups, shards=self._os_shards(), **optimizer_kwargs)
        else:
            self.inner = optimizer_class(inner_groups, **optimizer_kwargs)
        super().__init__(self._opt_params, self.inner.defaults)
        self._groups_fixed = True  # add_param_group refuses from here on
        # One source of truth: schedulers and users edit the wrapped optimizer's groups.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._inner_state = InnerState.FRESH
        self._limited_groups: dict = {}  # _groups_limited_to's lists, by (units, groups)
        self._root.bind_optimizer(overlap_param_update)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, while ``__init__`` builds; afterwards refused: each parameter's fp32
        master and OS shard are built for its group (and the checkpoint keys on that)."""
        if getattr(self, "_groups_fixed", False):
            raise ValueError("AMSPOptimizer.add_param_group: the groups are fixed when the "
                             "optimizer is built; pass every group in param_groups=[...]")
        super().add_param_group(param_group)

    @property
    def overlap_param_update(self) -> bool:
        """Whether ``step()`` returns with the post-step all-gathers in flight."""
        return self._root.overlap.param_update

    @overlap_param_update.setter
    def overlap_param_update(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"overlap_param_update must be a bool, got {value!r}")
        self._root.set_overlap(param_update=value)

    # ---- construction -------------------------------------------------------------
    def _build_masters(self, unit: AMSPUnit) -> list[DTensor]:
        """This rank's OS rows of each param as fp32 master DTensors: views into the P
        shard when it is fp32, copies otherwise (Note at the top)."""
        k, index = unit.info.os_split
        masters = []
        views: dict[int, int] = {}
        # compressed weights land dequantized in the P shard: the master is then a copy
        compressed_weights = unit.weight_codec() is not None
        placements, full_shapes = OS_PLACEMENTS, unit.global_shapes
        if unit.tp_placements:  # (mesh.py's Note: "tp" comes first)
            full_shapes = unit.full_shapes
        for i, (local, shape, rows) in enumerate(
                zip(unit.local_params(), unit.global_shapes, unit.p_layout.params)):
            if unit.tp_placements:
                placements = (unit.tp_placements[i], *OS_PLACEMENTS)
            start, length = chunk_rows(rows.rows, k)[index]
            with torch.no_grad():
                chunk = local.reshape(rows.rows, rows.cols)[start : start + length]
                if local.dtype == torch.float32 and not compressed_weights:
                    master_local = chunk.view(length, *shape[1:])
                    views[i] = local.untyped_storage().data_ptr()
                else:
                    master_local = chunk.to(torch.float32, copy=True).reshape(length, *shape[1:])
            full = full_shapes[i]
            master = DTensor.from_local(
                master_local,
                unit.info.mesh,
                placements,
                run_check=False,
                shape=full,
                stride=optim_state.contiguous_stride(full),
            )
            masters.append(nn.Parameter(master))
        if views:
            self._aliases.append((unit, views))
        # every master is a view of its P shard: after the step there is nothing to copy
        # when s_os = s_p (step() has checked the views still alias the P storage)
        self._masters_are_p[id(unit)] = len(views) == len(masters)
        return masters

    def _os_shards(self) -> OSShards:
        """The OS layout as a sharding-aware optimizer sees it, in the wrapped optimizer's
        parameter order."""
        info = self._root.info
        (k, _), members = info.os_split, info.shard_members
        shapes = [self._masters[j].shape for j in self._order]
        return OSShards(
            global_shapes=shapes,
            member_rows=[os_member_rows(s[0] if len(s) else 1, info.plan.s_p, k, members)
                         for s in shapes],
            member=dist.get_rank(info.group("shard")) if info.plan.s_os > 1 else 0,
            row_order=sorted(range(len(members)), key=members.__getitem__),
            collectives=self._root.collectives)

    # ---- gradients ----------------------------------------------------------------
    def _prepare_master_grads(self) -> None:
        """fp32 master grads from the synced G (divided by the gradient divide factor),
        for every unit: waits for the gradient collectives still in flight."""
        if self._master_grads_ready():
            return
        self._check_ready_to_step()
        self._root.finish_sync()
        for unit, _ in self._unit_masters:
            self._prepare_unit_grads(unit)

    def _master_grads_ready(self) -> bool:
        """clip_grad_norm_ prepared this step's master grads (step() and zero_grad()
        drop them)."""
        return any(p.grad is not None for p in self._opt_params)

    def _prepare_unit_grads(self, unit: AMSPUnit) -> None:
        start, masters = self._unit_slices[id(unit)]
        mine = self._opt_params[start:start + len(masters)]  # the masters' local rows
        synced = unit.synced_grad
        if synced is None:
            for opt_param in mine:
                opt_param.grad = None
            return
        # one cast and one division for the whole unit, not one per tensor
        flat = synced.to(torch.float32) / self._root.divide_factor
        if unit.os_layout.dense:  # the grads are the buffer cut end to end, in their shapes
            grads = compat.unflatten_dense(flat, mine)
        else:
            grads = [view.view(p.shape) for view, p in zip(unit.os_layout.views(flat), mine)]
        for opt_param, grad in zip(mine, grads):
            opt_param.grad = grad

    def _check_ready_to_step(self) -> None:
        """Every unit must be SYNCED, or REDUCING with its last stage in flight after the
        backward (lifecycle.py); say what the user did otherwise."""
        state = self._root
        if state.iteration_aborted():
            raise RuntimeError(
                "the last forward or backward raised before it finished: call zero_grad() "
                "to reset the iteration, then run the step again"
            )
        if state.unsynced_micro_batches:
            raise RuntimeError(
                f"{state.unsynced_micro_batches} backward(s) ran under amsp.no_sync since the "
                "last gradient sync: run the last micro-batch's backward outside no_sync "
                "before optimizer.step() / clip_grad_norm_()"
            )
        self._check_masters_alias()
        for unit in state.units:
            unit.check_device()
            if unit.ready_to_step():
                continue
            current = unit.step_state
            if current in (StepState.SENDING, StepState.UPDATED):
                raise RuntimeError(
                    "step() was called twice without a backward in between: run "
                    "zero_grad() and a backward before the next step()"
                )
            raise RuntimeError(
                f"step() found no synced gradients for {unit.name} ({current.value}): run "
                "backward (the last micro-batch outside amsp.no_sync) before step()"
            )

    def _check_masters_alias(self) -> None:
        """The fp32 masters that are views into the P shards must still be: a parameter
        replaced since this optimizer was built would silently stop training."""
        for unit, views in self._aliases:
            local = unit.local_params()
            if any(local[i].untyped_storage().data_ptr() != storage
                   for i, storage in views.items()):
                raise RuntimeError(
                    "a parameter's storage was replaced after AMSPOptimizer was built (e.g. "
                    "load_state_dict(assign=True) or module.to()), so the optimizer no longer "
                    "updates it: load weights in place (assign=False, or amsp.load), or build "
                    "the optimizer after replacing them")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over ALL params of the model (every rank gets the same value).

        Each rank holds a disjoint OS piece of the grads, and one full copy is spread over
        the s_os ranks of a "shard" group: a single all-reduce of one scalar over that
        group gives the global norm. Under tensor parallelism a second one over "tp" adds
        the other TP pieces; a param every tp rank holds whole (a SequenceParallel norm)
        is counted on tp rank 0 only. Under pipeline parallelism a third one over "pp"
        adds the other stages' (this optimizer must then be the rank's only one: with
        several stages on a rank, use ``amsp.clip_grad_norm_`` over all their
        optimizers). Same clip rule as torch.nn.utils.clip_grad_norm_.
        """
        return clip_grad_norm_([self], max_norm, norm_type)

    def _norm_total(self, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(this model's sum of |g|^norm_type (max for inf) over every rank of its stage,
        this rank's master grads). Each mesh's units (the dense mesh's, the expert
        mesh's) are summed over the ranks holding one copy of them, then added."""
        self._prepare_master_grads()
        device = self._masters[0].device if self._masters else torch.device("cpu")
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        totals, grads = [], []
        for info, units in self._units_by_mesh:
            total, own = self._mesh_norm_total(info, units, norm_type, device)
            if info.size("shard") > 1:
                units[0].collectives.all_reduce(total, "shard", phase="step", op=op).wait()
            if info.tp > 1:  # TP (EP) pieces: each tp (ep) rank holds another one
                units[0].collectives.all_reduce(total, info.mp_dim, phase="step",
                                                op=op).wait()
            totals.append(total)
            grads.extend(own)
        if not totals:
            return torch.zeros(1, device=device), grads
        if len(totals) == 1:
            return totals[0], grads
        stacked = torch.stack(totals)
        return (stacked.amax(0) if math.isinf(norm_type) else stacked.sum(0)), grads

    def _mesh_norm_total(self, info, units, norm_type: float, device):
        """(this rank's sum of |g|^norm_type (max) over ``units``' master grads, those
        grads); under TP, a param every tp rank holds whole counts on tp rank 0 only."""
        own, counted = [], []
        skip_replicated = info.tp > 1 and info.coordinate[info.mp_dim] != 0
        for unit in units:
            start, masters = self._unit_slices[id(unit)]
            for j in range(start, start + len(masters)):
                grad = self._opt_params[j].grad
                if grad is None:
                    continue
                own.append(grad)
                if not (skip_replicated and self._tp_replicated[j]):
                    counted.append(grad)
        if math.isinf(norm_type):
            local = max((g.abs().max() for g in own if g.numel()),
                        default=torch.zeros((), device=device))
            return torch.as_tensor(local, dtype=torch.float32, device=device).reshape(1), own
        local = sum((g.abs().pow(norm_type).sum() for g in counted),
                    torch.zeros((), device=device))
        return local.to(torch.float32).reshape(1), own

    # ---- step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AMSPOptimizer.step does not take a closure (run backward first)")
        if self._steps_per_unit():
            self._check_ready_to_step()
        else:
            self._prepare_master_grads()
        if self._inner_state is InnerState.PLACEHOLDER:
            # state_dict() ran before the first step and no checkpoint was loaded: let
            # the optimizer create its state as it would have (exactly, for any class).
            self.inner.state.clear()
        if self._steps_per_unit():
            self._step_per_unit()
        else:
            with record_function("AMSP::optimizer_step"):
                self.inner.step()
            for opt_param in self._opt_params:
                opt_param.grad = None  # step-time scratch; G stays until zero_grad
            for unit, masters in self._unit_masters:
                unit.send(masters, self._masters_are_p[id(unit)])
        self._inner_state = InnerState.REAL
        if not self.overlap_param_update:
            self.wait_param_update()

    def _steps_per_unit(self) -> bool:
        """[Note: per-unit step] An elementwise optimizer's update of one parameter reads
        nothing of the others, so stepping the units in groups (the wrapped optimizer
        skips parameters whose grad is None) is bit-identical to one step over all of
        them. ``step()`` therefore starts updating before every gradient has landed: the
        units are stepped in the order their gradient collectives were issued, each group
        as soon as its own collectives have landed, and each unit's post-step all-gather
        is issued right after its group's update, so it overlaps the later units' waits
        and updates. One call of the wrapped optimizer costs host time whatever its size
        (its walk over the params, one launch of each foreach kernel), so ``step()``
        makes at most STEP_BATCHES calls:

        - the units with nothing in flight when ``step()`` starts (all of them after
          clip_grad_norm_, whose norm needs every gradient; without replicas all but the
          last unit) are stepped together first;
        - the others (with replicas, every unit's all-reduce is still in flight) are cut,
          in issue order, into contiguous batches whose sizes halve: each batch takes
          units until it holds at least half of the elements still to step (at least one
          unit), and the last allowed batch takes all that is left (``step_batches``).
          Before its call a batch waits for its own collectives (those of its last unit
          and everything issued before), and takes in the next units whose collectives
          have completed meanwhile (``RootState.unit_sync_done``), which never blocks.

        With halving batches the update left after the last collective lands is a small
        tail (what is not overlapped: for equal units one unit up to 15 of them, as with a
        call per unit, and about an eighth of the elements beyond), while earlier batches
        overlap the later collectives; when those are slow (the replica all-reduce crosses
        nodes) that is most of the per-unit overlap, at a constant number of calls instead
        of one per unit. ``set_overlap(step=False)`` steps once after every collective
        has landed."""
        return (self._root.overlap.step
                and self.optimizer_class in ELEMENTWISE_OPTIMIZERS)

    def _step_per_unit(self) -> None:
        root = self._root
        prepared = [p.grad for p in self._opt_params] if self._master_grads_ready() else None
        for opt_param in self._opt_params:
            opt_param.grad = None
        order = root.sync_order()
        waiting = {id(e.unit) for e in root.in_flight}
        ready = [u for u in order if prepared is not None or id(u) not in waiting]
        rest = order[len(ready):]
        calls_left = STEP_BATCHES
        if ready:
            self._step_units(ready, prepared)
            calls_left -= 1
        while rest:
            take = step_batches([self._unit_numel[id(u)] for u in rest], calls_left)[0]
            batch, rest = rest[:take], rest[take:]
            root.finish_unit_sync(batch[-1])  # may block: this batch's collectives
            while rest and root.unit_sync_done(rest[0]):
                root.finish_unit_sync(rest[0])  # completed meanwhile: does not block
                batch.append(rest.pop(0))
            self._step_units(batch, None)
            calls_left -= 1

    def _step_units(self, units: list[AMSPUnit], prepared: list | None) -> None:
        """One step of the wrapped optimizer over ``units`` (their gradients landed),
        then each unit's post-step update issued, in order."""
        stepped = []
        for unit in units:
            start, masters = self._unit_slices[id(unit)]
            mine = self._opt_params[start:start + len(masters)]
            if prepared is not None:
                for j, opt_param in enumerate(mine):
                    opt_param.grad = prepared[start + j]
            else:
                self._prepare_unit_grads(unit)
            stepped.extend(mine)
        # one range per call, naming its units: "AMSP::optimizer_step (layers.0 + layers.1)"
        label = (f"AMSP::optimizer_step ({' + '.join(u.name for u in units)})"
                 if compat.profiler_enabled() else None)
        with record_function(label) if label else contextlib.nullcontext():
            if len(stepped) == len(self._opt_params):
                self.inner.step()
            else:
                with self._groups_limited_to(units, stepped):
                    self.inner.step()
        for opt_param in stepped:
            opt_param.grad = None
        for unit in units:
            unit.send(self._unit_slices[id(unit)][1], self._masters_are_p[id(unit)])

    @contextlib.contextmanager
    def _groups_limited_to(self, units: list, params: list):
        """The wrapped optimizer's param groups hold only ``params``, those of ``units``
        (the others have no grad and would be skipped): a step over a few units then
        walks their params alone, not every param of the model. The groups are restored
        afterwards; the limited lists are computed once per units and groups."""
        groups = self.inner.param_groups
        saved = [group["params"] for group in groups]
        key = (tuple(id(u) for u in units), tuple(id(ps) for ps in saved))
        limited = self._limited_groups.get(key)
        if limited is None:
            wanted = {id(p) for p in params}
            limited = [[p for p in ps if id(p) in wanted] for ps in saved]
            self._limited_groups = {**self._limited_groups, key: limited}
        try:
            for group, mine in zip(groups, limited):
                group["params"] = mine
            yield
        finally:
            for group, all_params in zip(groups, saved):
                group["params"] = all_params

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the step's gradients. After a forward or backward that raised, also reset
        the iteration (complete what was issued, reset FSDP2's state) so it can be retried."""
        if not set_to_none:
            raise ValueError(
                "AMSPOptimizer.zero_grad(set_to_none=False) is not supported: gradients live "
                "in the engine's buffers, which are freed (set_to_none=True)"
            )
        if self._root.iteration_aborted():
            self._root.reset_iteration()
        self._root.zero_grad()
        for opt_param in self._opt_params:
            opt_param.grad = None

    def wait_param_update(self) -> None:
        """Land every in-flight post-step all-gather: afterwards every parameter holds the
        weights of the last step (a no-op unless ``overlap_param_update=True``)."""
        param_update.land_all(self._root.units)

    @property
    def param_update_pending(self) -> bool:
        """True while some parameters still hold the previous step's weights."""
        return param_update.pending(self._root.units)

    # ---- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"state": {fqn: {"master": DTensor, <optimizer states>}}, "param_groups": [...]}.

        Keys are parameter FQNs (as torch.distributed.checkpoint.state_dict does), values
        DTensors in the OS layout, so DCP can save and reshard them.
        """
        self.wait_param_update()
        self._materialize_state()
        inner = self.inner.state_dict()
        state = {}
        for index, (fqn, master) in enumerate(zip(self._fqns, self._masters)):
            entry = {"master": master.detach()}
            for key, value in inner["state"].get(self._inner_index[index], {}).items():
                if optim_state.row_sharded(key, value, master.to_local()):
                    value = optim_state.as_dtensor(value, master)
                entry[key] = value
            state[fqn] = entry
        groups = []
        for group in inner["param_groups"]:
            g = dict(group)
            g["params"] = [self._fqns[self._order[k]] for k in group["params"]]
            groups.append(g)
        return {"state": state, "param_groups": groups,
                "state_is_placeholder": self._inner_state is InnerState.PLACEHOLDER}

    def _materialize_state(self) -> None:
        """The wrapped optimizer's state before its first step, so a checkpoint saved or
        loaded then carries it (optim_state.materialize_placeholder). Unless a checkpoint
        is loaded into it, this placeholder is dropped at the first step; state_dict()
        says "state_is_placeholder", and a checkpoint saved before the first step loads
        as a placeholder again."""
        if self._inner_state is not InnerState.FRESH or self.inner.state:
            return
        optim_state.materialize_placeholder(self.inner, self._opt_params)
        self._inner_state = InnerState.PLACEHOLDER

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict from ``state_dict()``, possibly saved under another plan
        (values are resharded to this plan's OS layout)."""
        # an update still in flight would land after the load and overwrite it
        self.wait_param_update()
        if not isinstance(state_dict, dict) or not (
            {"state", "param_groups"} <= set(state_dict)
            <= {"state", "param_groups", "state_is_placeholder"}
        ):
            raise ValueError("expected a dict with keys 'state' and 'param_groups' (and "
                             "optionally 'state_is_placeholder') from AMSPOptimizer.state_dict()")
        index_of = {fqn: i for i, fqn in enumerate(self._fqns)}
        unknown = [fqn for fqn in state_dict["state"] if fqn not in index_of]
        if unknown:
            raise ValueError(f"optimizer state has parameters this model lacks: {unknown[:3]}")
        inner_state = {}
        for fqn, entry in state_dict["state"].items():
            i = index_of[fqn]
            master = self._masters[i]
            converted = {}
            for key, value in entry.items():
                # row-sharded states come as DTensors (or, from a full-tensor dict, shaped
                # like the param); others (Adafactor's column factor, step) are replicated
                if isinstance(value, DTensor) or (
                    isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.shape
                ):
                    value = optim_state.to_os_layout(value, master)
                if key == "master":
                    master.to_local().copy_(value.to_local())
                elif isinstance(value, DTensor):
                    converted[key] = value.to_local()
                else:
                    converted[key] = value
            inner_state[self._inner_index[i]] = converted
        self.inner.load_state_dict({"state": inner_state,
                                    "param_groups": optim_state.saved_groups(
                                        state_dict["param_groups"], self.inner.param_groups,
                                        lambda k: self._fqns[self._order[k]])})
        placeholder = bool(state_dict.get("state_is_placeholder", False))
        self._inner_state = InnerState.PLACEHOLDER if placeholder else InnerState.REAL
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        for unit, masters in self._unit_masters:
            unit.overwrite(masters)

    def memory_bytes(self, units: list | None = None) -> int:
        """Bytes of per-element OS tensors on this rank: masters + states shaped like them
        (a master that is a view into an fp32 P shard is counted as P, not here); of
        ``units`` only when given."""
        p_storages = {storage for _, views in self._aliases for storage in views.values()}
        total = 0
        indices = range(len(self._masters)) if units is None else [
            j for u in units for j in range(self._unit_slices[id(u)][0],
                                            self._unit_slices[id(u)][0]
                                            + len(self._unit_slices[id(u)][1]))]
        for j in indices:
            master, opt_param = self._masters[j], self._opt_params[j]
            local = master.to_local()
            if local.untyped_storage().data_ptr() not in p_storages:
                total += local.numel() * local.element_size()
            for value in self.inner.state.get(opt_param, {}).values():
                if isinstance(value, DTensor):
                    value = value.to_local()
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
                    total += value.numel() * value.element_size()
        return total


@torch.no_grad()
def clip_grad_norm_(optimizers, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of every model of ``optimizers`` (AMSPOptimizers, one per model
    part on this rank: pipeline stages) by their one global norm, over every stage of the
    pipeline; returns the norm (the same on every rank). ``AMSPOptimizer.clip_grad_norm_``
    is this over the one optimizer."""
    if isinstance(optimizers, AMSPOptimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)
    if not optimizers or not all(isinstance(o, AMSPOptimizer) for o in optimizers):
        raise TypeError("clip_grad_norm_ expects a non-empty list of AMSPOptimizers")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    infos = [o._root.info for o in optimizers]
    if len({(i.pp, id(i.pp_mesh)) for i in infos}) > 1:
        raise ValueError("clip_grad_norm_ over optimizers of models on different amsp meshes: "
                         "every model part of one pipeline must be sharded on one mesh")
    with record_function("AMSP::clip_grad_norm"):
        inf = math.isinf(norm_type)
        totals, grads = [], []
        for optim in optimizers:
            total, own = optim._norm_total(norm_type)
            totals.append(total)
            grads.extend(own)
        total = torch.stack(totals).amax(0) if inf else torch.stack(totals).sum(0)
        info = infos[0]
        if info.pp > 1:  # the other stages of the pipeline
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            optimizers[0]._root.collectives.all_reduce(total, "pp", phase="step", op=op).wait()
        total_norm = total[0] if inf else total[0].pow(1.0 / norm_type)
        clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(clip_coef)
        return total_norm
