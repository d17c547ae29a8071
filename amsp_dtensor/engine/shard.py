"""``amsp.fully_shard``: the parameter path, by FSDP2, plus AMSP's hooks.

Called bottom-up like FSDP2's ``fully_shard``: every block, then the root. With s_p > 1
the module is handed to FSDP2's ``fully_shard`` on the 1-D "p" sub-mesh, which does the
all-gathers, prefetching, resharding and mixed precision; we only take its reduce-scatter
output (``set_all_reduce_hook``) into our gradient path. With s_p = 1 there is nothing to
gather, so FSDP is not applied at all (it would keep a second, flat copy of every param);
the params stay plain tensors and per-param post-accumulate-grad hooks feed the same path.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import fully_shard as fsdp_fully_shard

from .. import compat
from . import handle, param_update, streams
from . import grad as grad_path
from .collectives import Collectives, RecordingAllGather, RecordingReduceScatter
from .mesh import mesh_info
from ..plan import ResolvedPlan, ShardingPlan
from .fqn import clean_fqn
from .layouts import FlatLayout
from .mesh import EP_DIM, MeshInfo
from .root import RootState
from .unit import AMSPUnit

__all__ = ["fully_shard"]


def _owned_params(module: nn.Module, first_name: dict | None = None) -> list[tuple[str, nn.Parameter]]:
    """Params of ``module`` not owned by an AMSP unit further down (may be on meta:
    torchtitan shards the meta model and materialises it afterwards, as with FSDP2).

    Every name a parameter is reachable by is looked at (``remove_duplicate=False``), so
    a tensor shared by two modules (tied embedding and output head) is caught when the
    two names fall in different units: one unit would update it while the other reads a
    copy. Tied modules may share one unit; they may not be split over two."""
    # names without wrappers on both sides: activation checkpointing's wrapper names its
    # parameters without "_checkpoint_wrapped_module." but its modules with it
    unit_at = {clean_fqn(name): handle.unit_of(sub) for name, sub in module.named_modules()
               if sub is not module and handle.unit_of(sub) is not None}
    owner_of = {id(p): unit for unit in unit_at.values() for p in unit.params}
    # shared by the modules of one unit (a list): a weight tied between them is one param
    first_name = {} if first_name is None else first_name
    owned = []
    for name, param in module.named_parameters(remove_duplicate=False):
        location = _unit_containing(clean_fqn(name), unit_at)  # None: this module's own
        owner = owner_of.get(id(param)) or handle.param_owner(param)
        if owner is not None and owner is location:
            continue  # a param of a unit below, reached through that unit
        if owner is not None:
            other = next((n for n, u in unit_at.items() if u is owner), None)
            if other is not None or location is not None:
                raise ValueError(_tied_message(name, other or first_name.get(id(param), "?")))
            raise ValueError(_already_sharded_message(module, name, owner))
        if location is not None:
            # reached through a unit below that does not own it: tied with a param that
            # this module owns (its own name came first) or will own (it comes later)
            raise ValueError(_tied_message(name, first_name.get(id(param), "this module")))
        if id(param) in first_name:
            continue  # tied inside this unit: one parameter, sharded once
        first_name[id(param)] = name
        owned.append((name, param))
    return owned


def _unit_containing(name: str, unit_at: dict) -> "AMSPUnit | None":
    best = None
    for prefix, unit in unit_at.items():
        if name.startswith(prefix + ".") and (best is None or len(prefix) > len(best[0])):
            best = (prefix, unit)
    return best[1] if best else None


def _tied_message(name: str, other: str) -> str:
    return (
        f"tied parameters: {name!r} is the same tensor as a parameter of {other!r}, which is "
        "in another AMSP unit; modules that share a weight must be in one unit: do not call "
        f"amsp.fully_shard on {other!r} on its own (let the unit containing both own it)"
    )


def _already_sharded_message(module: nn.Module, name: str, owner: AMSPUnit) -> str:
    if owner.root is not None and owner.root.optimizer_bound:
        return (
            f"amsp.fully_shard({type(module).__name__}) after AMSPOptimizer was built: "
            f"parameter {name!r} already belongs to unit {owner.name!r}, whose fp32 masters the "
            "optimizer holds; shard every module first (bottom-up), then build AMSPOptimizer"
        )
    return (
        f"parameter {name!r} of {type(module).__name__} already belongs to AMSP unit "
        f"{owner.name!r}: call amsp.fully_shard bottom-up (blocks before the model that "
        "contains them), once per module"
    )


def _as_module_list(module) -> list[nn.Module]:
    """``module`` or a list of modules (one unit, as FSDP2's ``fully_shard`` takes)."""
    if isinstance(module, nn.Module):
        return [module]
    if isinstance(module, (list, tuple)) and module:
        modules = list(module)
        bad = [type(m).__name__ for m in modules if not isinstance(m, nn.Module)]
        if bad:
            raise TypeError(f"fully_shard expects nn.Modules, got {', '.join(bad)} in the list")
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("fully_shard got the same module twice in one list")
        for m in modules:
            inside = [o for o in modules if o is not m and any(s is m for s in o.modules())]
            if inside:
                raise ValueError(
                    f"fully_shard list: {type(m).__name__} is inside "
                    f"{type(inside[0]).__name__}; list sibling modules only"
                )
        return modules
    raise TypeError(
        f"fully_shard expects an nn.Module or a non-empty list of them, got "
        f"{type(module).__name__}"
    )


def _check_module(module: nn.Module) -> None:
    if handle.is_sharded(module):
        raise ValueError(f"{type(module).__name__} is already sharded by amsp.fully_shard")
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"{type(module).__name__} was already wrapped by torch's fully_shard: use "
            "amsp.fully_shard instead of (not on top of) FSDP2's"
        )


def _check_args(modules, mesh, plan, mp_policy, reshard_after_forward):
    for module in modules:
        _check_module(module)
    if plan is not None and not isinstance(plan, (ShardingPlan, ResolvedPlan)):
        raise TypeError(f"plan must be amsp.ShardingPlan, got {type(plan).__name__}")

    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            f"reshard_after_forward must be None, a bool or an int, got "
            f"{type(reshard_after_forward).__name__}"
        )
    info = mesh_info(mesh, plan)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        s_p = info.plan.s_p
        if reshard_after_forward < 1 or s_p % reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward} must be a bool or a factor "
                f"of param_shard={s_p} (the size of the hpZ secondary group)"
            )
    return info


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh,
    plan: ShardingPlan | ResolvedPlan | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s own params by the mesh's plan (P over "p"; G and OS by the engine).

    ``module`` may be a list of sibling modules that form one unit, as with FSDP2
    (torchtitan shards ``[model.norm, model.output]`` together); a list is never the
    root, so shard the model containing it afterwards. ``mesh`` comes from
    ``amsp.init_mesh(plan)`` and carries the plan resolved there, which every unit reads;
    ``plan``, if given, must ask for the same factors (a ValueError names both when it
    does not). ``mp_policy`` and ``reshard_after_forward`` are FSDP2's and are passed to
    it (they have no effect when param_shard is 1, where there is no all-gather). For the
    paper's bf16 setting cast the model to bf16 first: the engine keeps fp32 master
    weights in the OS layout.
    """
    modules = _as_module_list(module)
    info = _check_args(modules, mesh, plan, mp_policy, reshard_after_forward)
    if info.is_expert:
        _check_expert_unit(modules)
    mp_policy = compat.fsdp_mixed_precision(mp_policy)  # reduce_dtype=None: same on every torch
    first_name: dict = {}
    located = [(i, name, param) for i, m in enumerate(modules)
               for name, param in _owned_params(m, first_name)]
    dtypes = {p.dtype for _, _, p in located}
    if len(dtypes) > 1:
        raise ValueError(
            f"{_describe(modules)} mixes parameter dtypes {sorted(map(str, dtypes))}: "
            "cast the model to one dtype (bf16 for the paper's setting) first"
        )
    collectives = Collectives(info)
    unit = None
    if located:
        unit = _make_unit(modules, located, info, collectives, mp_policy,
                          reshard_after_forward)
        for m in modules:
            handle.set_unit(m, unit)
    elif len(modules) > 1:
        raise ValueError(f"{_describe(modules)} has no parameters of its own to shard")
    if len(modules) == 1 and (unit is None or not unit.uses_fsdp) and not info.is_expert:
        below = _first_fsdp_unit(module)
        if below is not None:
            # [Note: parameter-less root] FSDP2 needs one root state over all its units;
            # without it each unit below would be a root of its own (a list unit cannot),
            # and FSDP2 keeps a root's parameters unsharded from forward to backward. As
            # torchtitan does, the root is handed to FSDP2 even with no params of its own
            # for FSDP2 to shard: none at all, or only s_p = 1 ones (the dense plan's,
            # beside experts with s_p > 1 on theirs), which FSDP2 then ignores.
            mesh_p = info.mesh["p"] if info.plan.s_p > 1 else below.info.mesh["p"]
            kwargs = {"mesh": mesh_p, **_fsdp_ignored([module])}
            if mp_policy is not None:
                kwargs["mp_policy"] = mp_policy
            fsdp_fully_shard(module, **kwargs)
    if isinstance(module, nn.Module) and not info.is_expert:
        _become_root(module, info, collectives)
    return module


def _check_expert_unit(modules: list[nn.Module]) -> None:
    """A unit on the expert mesh holds experts only: the model containing them (the root,
    a block) is sharded on the dense mesh, and its root owns the expert units."""
    for m in modules:
        if any(sub is not m and handle.unit_of(sub) is not None for sub in m.modules()):
            raise ValueError(
                f"amsp.fully_shard({type(m).__name__}) on the expert mesh contains sharded "
                "modules: shard only the experts on amsp.expert_mesh(mesh), and the blocks "
                "and model containing them on the mesh amsp.init_mesh returned")


def build_layouts(
    info: MeshInfo, global_shapes: list, p_rows: list[int], p_caps: list[int]
) -> tuple[FlatLayout, FlatLayout, FlatLayout]:
    """P, G and OS flat layouts of one unit on this rank (see layouts.py for the rule)."""
    p_layout = FlatLayout.for_shapes(global_shapes, rows=p_rows, caps=p_caps)
    k_g = info.size("g")
    g_layout = p_layout.split(k_g, info.coordinate["g"]) if k_g > 1 else p_layout
    k_os, os_index = info.os_split
    os_layout = p_layout.split(k_os, os_index) if k_os > 1 else p_layout
    return p_layout, g_layout, os_layout


def _fsdp_ignored(modules: list[nn.Module]) -> dict:
    """FSDP2's ``ignored_params`` for a unit over ``modules``: the params of units below
    that FSDP2 does not shard (s_p = 1 on their mesh: experts on their own plan under a
    dense block with s_p > 1), which FSDP2 would otherwise take as the block's."""
    ignored = {p for m in modules for sub in m.modules()
               if (u := handle.unit_of(sub)) is not None and not u.uses_fsdp
               for p in [*u.params, *u.frozen_params]}
    return {"ignored_params": ignored} if ignored else {}


def _first_fsdp_unit(module: nn.Module) -> AMSPUnit | None:
    """The first unit below ``module`` that FSDP2 shards (s_p > 1 on its mesh), if any."""
    return next((unit for m in module.modules() if m is not module
                 and (unit := handle.unit_of(m)) is not None and unit.uses_fsdp), None)


def _describe(modules: list[nn.Module]) -> str:
    names = [type(m).__name__ for m in modules]
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def _make_unit(modules, located, info, collectives, mp_policy, reshard_after_forward) -> AMSPUnit:
    """One unit over ``modules`` (usually one); ``located``: (module index, name, param)."""
    named = [(name, param) for _, name, param in located]
    module_of = {id(param): i for i, _, param in located}
    module = modules[0]  # FSDP2 keeps a list's state on its first module
    s_p = info.plan.s_p
    uses_fsdp = s_p > 1
    if not uses_fsdp and mp_policy is not None and mp_policy.param_dtype not in (
        None,
        named[0][1].dtype,
    ):
        raise ValueError(
            f"mp_policy.param_dtype={mp_policy.param_dtype} needs a parameter all-gather to "
            "cast in, and param_shard=1 has none: cast the model to that dtype instead "
            "(master weights stay fp32 in the optimizer)"
        )
    device = named[0][1].device
    # [Note: frozen parameters] A parameter with requires_grad=False is P only: FSDP2
    # shards and all-gathers it like any other, but it gets no gradient (FSDP2's
    # reduce-scatter leaves it out), so the unit's G and OS layouts, hooks and masters
    # cover the trainable parameters alone. A unit of frozen parameters only has no
    # gradient path at all (AMSPState.frozen_units).
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [p for _, p in named if not p.requires_grad]
    tp_of = _tp_layout_of(info, modules, located)  # (module index, name) -> (placement, shape)
    tp_refusals = _tp_after_shard_refusals(modules, located)  # named before FSDP2's class swap
    global_shapes = [_local_shape(p) for _, p in trainable]
    grad_stream = streams.grad_stream(info.mesh.device_type)
    if uses_fsdp:
        kwargs = {"mesh": info.mesh["p"], "reshard_after_forward": reshard_after_forward,
                  **_fsdp_ignored(modules)}
        if mp_policy is not None:
            kwargs["mp_policy"] = mp_policy
        fsdp_fully_shard(modules if len(modules) > 1 else module, **kwargs)
        layouts = [compat.fsdp_param_layout(fp) for fp in compat.fsdp_params(module)
                   if fp.sharded_param.requires_grad]
        global_shapes = [shape for shape, _, _ in layouts]
        p_rows = [rows for _, rows, _ in layouts]
        p_caps = [caps for _, _, caps in layouts]
        params = None  # read from FSDP each time (see AMSPUnit.params)
    else:
        params = [p for _, p in trainable]
        p_rows = [s[0] if len(s) else 1 for s in global_shapes]
        p_caps = list(p_rows)
    p_layout, g_layout, os_layout = build_layouts(info, global_shapes, p_rows, p_caps)
    if uses_fsdp:  # FSDP's params, in the order of its flat buffers
        param_module, param_names = _fsdp_names(
            modules, [fp.sharded_param for fp in compat.fsdp_params(module)
                      if fp.sharded_param.requires_grad])
    else:
        param_module = [module_of[id(p)] for _, p in trainable]
        param_names = [n for n, _ in trainable]
    tp = [tp_of[k] for k in zip(param_module, param_names)] if tp_of else []
    unit = AMSPUnit(
        module=module,
        fqn="",
        info=info,
        own_params=params,
        param_names=param_names,
        frozen_params=frozen if not uses_fsdp else [],
        uses_fsdp=uses_fsdp,
        global_shapes=list(global_shapes),
        p_layout=p_layout,
        g_layout=g_layout,
        os_layout=os_layout,
        reduce_dtype=mp_policy.reduce_dtype if mp_policy is not None else None,
        device=device,
        modules=list(modules),
        param_module=param_module,
        tp_placements=[placement for placement, _ in tp],
        full_shapes=[shape for _, shape in tp],
        collectives=collectives,
    )
    if uses_fsdp:
        # Sum-only reductions (gloo has no PREMUL_SUM) and no FSDP-side division: the
        # engine divides once, on the fp32 master grads.
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(1.0)
        module.set_all_reduce_hook(grad_path.fsdp_grad_hook(unit), stream=grad_stream)
        grad_path.drop_fsdp_grad_views(unit)
        module.set_custom_all_gather(RecordingAllGather(collectives))
        module.set_custom_reduce_scatter(RecordingReduceScatter(collectives))
    else:
        grad_path.register_param_hooks(unit)
    # mark the params, and for FSDP units also the originals FSDP replaced on the module:
    # another module may still hold an original (a tied weight), see _owned_params
    sharded = [fp.sharded_param for fp in compat.fsdp_params(module)] if uses_fsdp else []
    for param in [*unit.params, *sharded, *(p for _, p in named)]:
        handle.set_param_owner(param, unit)
    for owner, message in tp_refusals:
        compat.refuse_tensor_parallel_after_shard(owner, message)
    # Runs before FSDP's own pre-forward (prepend): the new P shard of this unit, sent
    # by the last optimizer step, must have landed before it is all-gathered or used.
    for m in modules:
        m.register_forward_pre_hook(_unit_pre_forward(unit), prepend=True)
    if not uses_fsdp:
        _land_before_submodule_forward(unit)
    _land_before_state_dicts(unit)
    return unit


def _tp_after_shard_refusals(modules, located) -> list[tuple[nn.Module, str]]:
    """(module, message) for each module owning a param of the unit: see [Note: tensor
    parallelism applied after amsp.fully_shard] in compat.py."""
    unit, out = _describe(modules), {}
    for i, name, _ in located:
        path = name.rpartition(".")[0]
        owner = modules[i].get_submodule(path)
        where = f"{type(owner).__name__} {path!r} of {unit}" if path else unit
        out[id(owner)] = owner, (
            f"{where} was sharded by amsp.fully_shard, and tensor parallelism cannot split it "
            "afterwards: apply it first (parallelize_module(model, mesh['tp'], tp_plan), "
            "mesh from amsp.init_mesh(plan, tp=N)), then amsp.fully_shard")
    return list(out.values())


def _local_shape(param):
    return param.to_local().shape if isinstance(param, DTensor) else param.shape


def _tp_layout_of(info: MeshInfo, modules, located) -> dict:
    """Under tensor (or, on an expert mesh, expert) parallelism, {(module index, name):
    (placement, whole shape)} of every param (empty without it). Each must be a DTensor on
    the AMSP mesh's "tp" ("ep") dim, as ``parallelize_module(model, mesh["tp"], ...)``
    leaves them."""
    tp_mesh, dim = info.tp_mesh(), info.mp_dim
    how = (f"split the experts over amsp.expert_mesh(mesh)['{dim}'] (expert parallelism)"
           if info.is_expert else
           f"apply tensor parallelism to every parameter of the model "
           f"(parallelize_module(model, mesh['{dim}'], plan))")
    out = {}
    for i, name, param in located:
        where = f"{type(modules[i]).__name__}.{name}"
        if not isinstance(param, DTensor):
            if tp_mesh is None:
                continue
            raise ValueError(
                f"parameter {where} is a plain tensor, but the AMSP mesh has {dim}={info.tp}: "
                f"{how} before amsp.fully_shard"
            )
        if tp_mesh is None:
            fix = ("shard the experts on amsp.expert_mesh(mesh), built with "
                   "amsp.init_mesh(plan, ep=N), and split them over its 'ep' dim"
                   if info.is_expert or EP_DIM in (param.device_mesh.mesh_dim_names or ()) else
                   "build it with amsp.init_mesh(plan, tp=N) and parallelize with its mesh['tp']")
            raise ValueError(
                f"parameter {where} is a DTensor on mesh {param.device_mesh.mesh_dim_names} "
                f"{param.placements} but the AMSP mesh has no {dim} dim: {fix}"
            )
        if param.device_mesh != tp_mesh or param.device_mesh.mesh_dim_names != (dim,):
            raise ValueError(
                f"parameter {where} is a DTensor on mesh {param.device_mesh}, not on the AMSP "
                f"mesh's '{dim}' dim: parallelize the model with amsp_mesh['{dim}'] (the mesh "
                f"amsp.init_mesh returned{', through amsp.expert_mesh' if info.is_expert else ''}), "
                "not a mesh of its own"
            )
        out[(i, name)] = (param.placements[0], param.shape)
    return out


def _land_before_state_dicts(unit: AMSPUnit) -> None:
    """``state_dict()`` and ``load_state_dict()`` of any module inside the unit (not only
    of the root: ``model.layers[0].state_dict()``) land the model's in-flight updates
    first, so a read sees the last step's weights and a load is not overwritten by an
    update landing after it."""

    def land_model(*_):
        param_update.land_all(unit.root.units if unit.root is not None else [unit])

    for top in unit.modules:
        for sub in top.modules():
            if handle.mark_lands_on_state_dict(sub):
                sub.register_state_dict_pre_hook(land_model)
                sub.register_load_state_dict_pre_hook(land_model)


def _land_before_submodule_forward(unit: AMSPUnit) -> None:
    """s_p = 1 params are plain tensors, so a submodule of the unit can be run on its own
    (``model.layers[0].attention(x)``); with an overlapped update in flight it must see
    the new weights too. (FSDP units' params are sharded DTensors outside the unit's
    forward, so their submodules cannot be run alone.)"""
    owned = {id(p) for p in unit.params}

    def hook(module, args):
        # Inside a compiled forward of the unit's module (per-block torch.compile) the
        # unit's own pre-forward hook, outside the compiled region, has landed it already;
        # traced, this hook would make the compiled code guard on the unit's step state
        # and recompile whenever an update is in flight.
        if torch.compiler.is_compiling():
            return
        param_update.land(unit)

    for top in unit.modules:
        for sub in top.modules():
            if sub is not top and any(id(p) in owned for p in sub.parameters(recurse=False)):
                sub.register_forward_pre_hook(hook)


def _fsdp_names(modules: list[nn.Module], params: list[nn.Parameter]) -> tuple[list[int], list[str]]:
    """(module index, name in that module) of each of FSDP's params."""
    by_id = {}
    for index, module in reversed(list(enumerate(modules))):
        by_id.update({id(p): (index, n) for n, p in module.named_parameters()})
    located = [by_id[id(p)] for p in params]
    return [i for i, _ in located], [n for _, n in located]


def _unit_pre_forward(unit: AMSPUnit):
    def hook(module, args):
        unit.check_device()
        if unit.root is not None:
            unit.root.record_forward(unit)
        param_update.land(unit)
        if unit.uses_fsdp:
            # Units FSDP will prefetch from here need their new shards too.
            for other in compat.fsdp_forward_prefetch_modules(module):
                other_unit = handle.unit_of(other)
                if other_unit is not None:
                    param_update.land(other_unit)

    return hook


def _become_root(module: nn.Module, info, collectives: Collectives) -> None:
    """Make ``module`` the root of every unit below it (the last call is the root)."""
    # a unit may be reached twice: torch.compile's wrapper passes attribute reads through
    # to the module it wraps (``layers.0`` and ``layers.0._orig_mod``)
    units = list({id(u): u for m in module.modules()
                  if (u := handle.unit_of(m)) is not None}.values())
    if not units:
        raise ValueError(
            f"{type(module).__name__} has no parameters to shard (and no sharded submodules)"
        )
    if any(u.info is not info and u.info is not info.expert for u in units):
        raise ValueError(
            "all units of one model must use the same amsp mesh and plan (the experts: its "
            "expert mesh, amsp.expert_mesh(mesh))")
    bound = next((u for u in units if u.root is not None and u.root.optimizer_bound), None)
    if bound is not None:
        raise ValueError(
            f"amsp.fully_shard({type(module).__name__}) after AMSPOptimizer was built over "
            f"unit {bound.name!r}: shard every module first (bottom-up), then build AMSPOptimizer"
        )
    root = RootState(info=info, collectives=collectives,
                     units=[u for u in units if u.p_layout.params],
                     frozen_units=[u for u in units if not u.p_layout.params],
                     grad_stream=streams.grad_stream(info.mesh.device_type))
    prefix_of = {m: clean_fqn(name) for name, m in module.named_modules()}
    for unit in units:
        unit.attach(root, [prefix_of[m] for m in unit.modules])
    for sub in module.modules():
        if sub is not module:
            handle.clear_root(sub)  # a block sharded before its parent is a root no more
    handle.set_root(module, root, [
        module.register_state_dict_pre_hook(_land_updates_before_state_dict),
        module.register_load_state_dict_pre_hook(_land_updates_before_load),
        module.register_forward_pre_hook(_root_pre_forward, prepend=True),
        module.register_forward_hook(_root_post_forward, always_call=False),
    ])


def _root_pre_forward(module, args):
    handle.root_state(module).pre_forward()


def _root_post_forward(module, args, output):
    handle.root_state(module).post_forward()


def _land_updates_before_state_dict(module, prefix, keep_vars):
    # model.state_dict() must see the weights of the last step, whose all-gather may
    # still be in flight (it is otherwise landed by the next forward).
    param_update.land_all(handle.root_state(module).units)


def _land_updates_before_load(module, *_):
    # and model.load_state_dict() must not be overwritten by such an update landing later
    param_update.land_all(handle.root_state(module).units)
