"""Every private torch / torchtitan name the project uses still exists in the installed
torch (any of the supported range): module- and class-level names statically, instance
attributes through the accessors on a real one-rank FSDP2 model. A failure names the
internal that moved. The version-dependent choices compat.py makes are tested both on the
installed torch and, for the branches another torch would take, on stand-ins."""

from __future__ import annotations

import ast
import copy
import functools
import importlib.util
import pathlib
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "amsp_dtensor"


def _compat_on_its_own() -> types.ModuleType:
    """compat.py loaded from its file, not through the package: ``import amsp_dtensor``
    imports the engine, which subclasses FSDP2 internals at import time, so a torch that
    removed one of them would stop this module from being collected at all, instead of
    failing the one test that names the missing internal. compat.py imports only torch."""
    spec = importlib.util.spec_from_file_location("amsp_dtensor_compat", PACKAGE / "compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


compat = _compat_on_its_own()


@pytest.mark.parametrize("module,path", compat.PRIVATE_NAMES,
                         ids=[f"{m}.{p}" for m, p in compat.PRIVATE_NAMES])
def test_private_name_exists(module, path):
    if module.startswith("torchtitan"):
        try:  # the CPU shims torchtitan needs to import here live in the package
            from amsp_dtensor.titan import cpu_compat
        except ImportError as e:
            pytest.fail(f"cannot check {module}.{path}: amsp_dtensor itself does not import "
                        f"({e}); see the failing torch name")
        cpu_compat.apply()
    compat.resolve(module, path)


def test_private_names_list_what_this_torch_needs():
    """PRIVATE_NAMES is private_names() of the installed torch: the private timeout setter
    is listed exactly where torch has no public one."""
    assert compat.PRIVATE_NAMES == compat.private_names()
    listed = ("torch.distributed.distributed_c10d", "_set_pg_timeout") in compat.PRIVATE_NAMES
    assert listed == (not hasattr(dist, "set_timeout"))


# ---- the branches another torch takes, on stand-ins ---------------------------------------
_TORCH_2_13_DIST = types.SimpleNamespace()  # torch.distributed without set_timeout


def _torch_2_14_dist(calls):
    return types.SimpleNamespace(set_timeout=lambda timeout, group=None: calls.append(
        (timeout, group)))


def test_private_timeout_setter_is_listed_only_without_the_public_one():
    private = ("torch.distributed.distributed_c10d", "_set_pg_timeout")
    old, new = compat.private_names(_TORCH_2_13_DIST), compat.private_names(_torch_2_14_dist([]))
    assert private in old and private not in new
    assert set(old) - {private} == set(new)
    assert ("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam") in new


def test_set_pg_timeout_takes_the_public_setter_where_it_exists(monkeypatch):
    calls, group, timeout = [], object(), timedelta(seconds=7)
    stand_in = _torch_2_14_dist(calls)
    assert compat.public_set_timeout(stand_in) is stand_in.set_timeout
    assert compat.public_set_timeout(_TORCH_2_13_DIST) is None
    monkeypatch.setattr(compat, "_SET_TIMEOUT", stand_in.set_timeout)
    compat.set_pg_timeout(timeout, group)
    assert calls == [(timeout, group)]


def test_set_pg_timeout_falls_back_to_the_private_setter(monkeypatch):
    calls, group, timeout = [], object(), timedelta(seconds=9)
    monkeypatch.setattr(compat, "_SET_TIMEOUT", None)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda t, g: calls.append((t, g)), raising=False)
    compat.set_pg_timeout(timeout, group)
    assert calls == [(timeout, group)]


def test_the_installed_torch_picks_its_own_timeout_setter():
    assert compat.public_set_timeout() is getattr(dist, "set_timeout", None)


_TORCH_2_11_DIST = types.SimpleNamespace(  # no *_single forms (torch 2.11, 2.12)
    all_gather_into_tensor=None, reduce_scatter_tensor=None)
_TORCH_2_13_TENSOR_DIST = types.SimpleNamespace(
    all_gather_single=None, reduce_scatter_single=None, all_gather_into_tensor=None,
    reduce_scatter_tensor=None)


def test_reset_by_hand_is_chosen_where_fsdp_has_no_reset():
    assert compat.fsdp_has_reset_iter_state(types.SimpleNamespace(reset_iter_state=None))
    assert not compat.fsdp_has_reset_iter_state(types.SimpleNamespace())
    by_hand = ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
               "FSDPParamGroup._to_sharded")
    assert by_hand in compat.private_names(fsdp_module_cls=types.SimpleNamespace())
    assert by_hand not in compat.private_names(
        fsdp_module_cls=types.SimpleNamespace(reset_iter_state=None))


def test_tensor_collectives_take_the_names_each_torch_has():
    assert compat.tensor_collective_names(_TORCH_2_11_DIST) == {
        "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    assert compat.tensor_collective_names(_TORCH_2_13_TENSOR_DIST) == {
        "all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    have_single = hasattr(dist, "all_gather_single")
    assert compat.TENSOR_COLLECTIVES["all_gather"] == (
        "all_gather_single" if have_single else "all_gather_into_tensor")


@pytest.mark.parametrize("names", ["2.11", "2.13"])
def test_tensor_collectives_call_the_chosen_name_at_call_time(monkeypatch, names):
    """The call goes to the name chosen for this torch, looked up on torch.distributed
    when called (a wrapper installed there later sees it), with the same arguments."""
    calls = []
    chosen = compat.tensor_collective_names(
        _TORCH_2_11_DIST if names == "2.11" else _TORCH_2_13_TENSOR_DIST)
    monkeypatch.setattr(compat, "TENSOR_COLLECTIVES", chosen)
    for op, name in chosen.items():
        monkeypatch.setattr(dist, name, lambda *a, _op=op, **kw: calls.append((_op, a, kw)) or "w",
                            raising=False)
    out, inp, group = torch.zeros(1), torch.zeros(2), object()
    assert compat.all_gather_single(out, inp, group=group, async_op=True) == "w"
    assert compat.reduce_scatter_single(out, inp, group=group) == "w"
    assert calls == [
        ("all_gather", (out, inp), dict(group=group, async_op=True)),
        ("reduce_scatter", (out, inp), dict(op=dist.ReduceOp.SUM, group=group, async_op=False)),
    ]


class _FSDPParam_2_13:  # plain per-instance state (torch 2.13, 2.14)
    unsharded_accumulated_grad: torch.Tensor | None

    def __init__(self):
        self.unsharded_accumulated_grad = None


class _FSDPParam_2_15:  # a read-only view of the unsharded param's grad (torch 2.15)
    @property
    def unsharded_accumulated_grad(self):
        return None


class _FSDPParam_settable_property:
    @property
    def unsharded_accumulated_grad(self):
        return self._grad

    @unsharded_accumulated_grad.setter
    def unsharded_accumulated_grad(self, value):
        self._grad = value


def test_reset_workaround_is_detected_per_fsdp_param_class():
    assert compat.fsdp_reset_keeps_accumulated_grads(_FSDPParam_2_13) is True
    assert compat.fsdp_reset_keeps_accumulated_grads(_FSDPParam_settable_property) is True
    assert compat.fsdp_reset_keeps_accumulated_grads(_FSDPParam_2_15) is False
    with pytest.raises(AttributeError, match="no setter"):  # what the workaround hit on 2.15
        _FSDPParam_2_15().unsharded_accumulated_grad = None


def test_reduce_dtype_none_is_resolved_to_the_compute_dtype():
    from torch.distributed.fsdp import MixedPrecisionPolicy as MP

    bf16, fp32 = torch.bfloat16, torch.float32
    resolved = compat.fsdp_mixed_precision(MP(param_dtype=bf16, output_dtype=fp32,
                                              cast_forward_inputs=False))
    assert resolved == MP(param_dtype=bf16, reduce_dtype=bf16, output_dtype=fp32,
                          cast_forward_inputs=False)
    explicit = MP(param_dtype=bf16, reduce_dtype=fp32)
    assert compat.fsdp_mixed_precision(explicit) is explicit
    plain = MP()  # no cast: the grads are in the params' dtype on every version
    assert compat.fsdp_mixed_precision(plain) is plain
    assert compat.fsdp_mixed_precision(None) is None


# ---- on the installed torch --------------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path):
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        yield torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        if owned:
            dist.destroy_process_group()


class _FailOnce(nn.Module):
    """Identity whose output's gradient raises once: backward stops between the two
    linears, after the second one's weight and bias grads were accumulated."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        y = x * 1.0
        if self.armed:
            self.armed = False
            y.register_hook(self._raise)
        return y

    @staticmethod
    def _raise(grad):
        raise RuntimeError("backward interrupted")


def _interrupted_unit(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), _FailOnce(), nn.Linear(3, 2))
    reference = copy.deepcopy(model)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    x = torch.randn(5, 4)
    model[1].armed = True
    with pytest.raises(RuntimeError, match="backward interrupted"):
        model(x).square().sum().backward()
    return model, reference, x


@pytest.mark.parametrize("reset", ["installed", "by_hand"])
def test_reset_after_an_interrupted_backward_drops_its_grads(one_rank, monkeypatch, reset):
    """On the installed torch, fsdp_reset_iteration leaves no gradient of the failed
    backward behind (by the workaround or by FSDP2's own reset), and the retried backward
    gives the plain model's gradients. "by_hand": FSDPModule without ``reset_iter_state``
    (torch 2.11, 2.12), so compat's own reset runs, here on the installed FSDP2's state."""
    from torch.distributed.fsdp import FSDPModule

    if reset == "by_hand" and not compat.fsdp_reset_keeps_accumulated_grads():
        pytest.skip("the hand-made reset stands in for 2.11/2.12's missing one; this FSDP2 "
                    "(2.15+) clears the interrupted grads in its own reset only")
    if reset == "by_hand" and compat.fsdp_has_reset_iter_state():
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    if reset == "by_hand":
        assert not compat.fsdp_has_reset_iter_state()
    model, reference, x = _interrupted_unit(one_rank)
    stale = compat.fsdp_unsharded_grads(model)
    assert [g is not None for g in stale] == [False, False, True, True]  # the 2nd linear's
    compat.fsdp_reset_iteration(model)
    assert compat.fsdp_unsharded_grads(model) == [None] * 4
    state = model._get_fsdp_state()
    assert state._state_ctx.iter_forward_root is None
    assert state._training_state.name == "IDLE"
    assert all(p.sharded_state.name == "SHARDED" for p in compat.fsdp_params(model))
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, ref), param in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), ref.grad, rtol=0, atol=0,
                                   msg=name)


def test_reset_workaround_is_needed_exactly_where_it_is_detected(one_rank, monkeypatch):
    """The detection against the installed FSDP2: where it says the reset keeps the
    grads, the reset alone does keep them; where it says not, the workaround could not
    even run (the property has no setter)."""
    model, _, _ = _interrupted_unit(one_rank)
    if compat.fsdp_reset_keeps_accumulated_grads():
        monkeypatch.setattr(compat, "_RESET_KEEPS_ACCUMULATED_GRADS", False)
        compat.fsdp_reset_iteration(model)  # FSDP2's reset alone
        assert [g is not None for g in compat.fsdp_unsharded_grads(model)] == [
            False, False, True, True]
    else:
        with pytest.raises(AttributeError, match="no setter"):
            compat.fsdp_params(model)[0].unsharded_accumulated_grad = None
        compat.fsdp_reset_iteration(model)
        assert compat.fsdp_unsharded_grads(model) == [None] * 4


def test_fsdp_instance_internals_on_a_real_unit(tmp_path):
    from torch.distributed.fsdp import fully_shard

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        fully_shard(model, mesh=mesh)
        params = compat.fsdp_params(model)
        assert len(params) == 4
        shape, rows, padded = compat.fsdp_param_layout(params[0])
        assert (tuple(shape), rows, padded) == ((3, 4), 3, 3)
        assert compat.fsdp_sharded_storage(params[0]).numel() == 12
        assert compat.fsdp_forward_prefetch_modules(model) == []
        model(torch.ones(2, 4)).sum().backward()
        compat.fsdp_reset_iteration(model)
        assert compat.fsdp_copy_in_stream(model) is not None
        assert compat.fsdp_reduce_scatter_stream(model) is not None
        assert compat.global_offset(params[0].sharded_param) == (0, 0)
        # the tensor collectives under this torch's names, on a real one-rank group
        out = torch.zeros(3)
        assert compat.all_gather_single(out, torch.arange(3.0)) is None
        assert out.tolist() == [0.0, 1.0, 2.0]
        work = compat.reduce_scatter_single(out, torch.full((3,), 2.0), async_op=True)
        work.wait()
        assert out.tolist() == [2.0, 2.0, 2.0]
    finally:
        if owned:
            dist.destroy_process_group()


def test_no_private_torch_names_outside_compat():
    """Only compat.py may name private torch / torchtitan internals: an import from a
    private module or of a private name, or any ``obj._name`` attribute the project does
    not define itself (the project's own private attributes, methods and classes are
    collected from its source: whatever ``_name`` is left must be someone else's)."""
    own = _names_defined_in_the_package()
    offenders = [f"{path.name}:{line}" for path, tree in _package_trees().items()
                 if path.name != "compat.py" for line in _private_names_used(tree, own)]
    assert offenders == []


def test_the_scan_for_private_names_finds_one():
    """The scan above, on lines that reach into FSDP2, flags them (it can fail)."""
    tree = ast.parse("from torch.distributed.fsdp._fully_shard import _fsdp_state\n"
                     "group = module._get_fsdp_state()._fsdp_param_group\n")
    found = _private_names_used(tree, _names_defined_in_the_package())
    assert found == ["1 from torch.distributed.fsdp._fully_shard", "1 import _fsdp_state",
                     "2 ._fsdp_param_group", "2 ._get_fsdp_state"]


def _private_names_used(tree: ast.AST, own: set[str]) -> list[str]:
    """"<line> <what>" for each private torch / torchtitan name the tree uses."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                ("torch", "torchtitan")):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{node.lineno} from {node.module}")
            found += [f"{node.lineno} import {a.name}"
                      for a in node.names if a.name.startswith("_")]
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in own):
            found.append(f"{node.lineno} .{node.attr}")
    return found


@functools.cache
def _package_trees() -> dict[pathlib.Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def _names_defined_in_the_package() -> frozenset[str]:
    """Every name amsp_dtensor binds: functions, classes, assigned names and attributes,
    arguments, dataclass fields, import aliases."""
    names = set()
    for tree in _package_trees().values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return frozenset(names)


def _hooked_owner(register) -> "weakref.ref":
    """A param whose post-accumulate-grad hook reaches an owner that holds the param (the
    cycle an s_p = 1 unit makes), registered by ``register``; a weak reference to the owner."""
    import weakref

    class Owner:
        pass

    owner = Owner()
    owner.param = nn.Parameter(torch.ones(3))
    owner.calls = []
    register(owner)
    owner.param.square().sum().backward()
    assert owner.calls == [6.0]  # the hook ran, with the param's grad
    return weakref.ref(owner)


def test_post_accumulate_grad_hooks_held_weakly_free_their_owner():
    """[Note: post-accumulate-grad hooks and the garbage collector]: a hook closing over its
    owner keeps the cycle alive through gc.collect() on this torch; compat's hook, holding
    the owner weakly, lets it go."""
    import gc

    def plain(owner):
        owner.param.register_post_accumulate_grad_hook(
            lambda p: owner.calls.append(p.grad.sum().item()))

    def weak(owner):
        compat.register_post_accumulate_grad_hook(
            owner.param, owner, lambda o, p: o.calls.append(p.grad.sum().item()))

    leaked, freed = _hooked_owner(plain), _hooked_owner(weak)
    gc.collect()
    assert leaked() is not None, "torch now collects these cycles: the Note can go"
    assert freed() is None


def test_a_dropped_amsp_model_is_collected(one_rank):
    """A model sharded with s_p = 1 (its units' grads come through param hooks, the Note
    above): after a step, dropping the model and its optimizer frees them and every unit."""
    import gc
    import weakref

    import amsp_dtensor as amsp
    from amsp_dtensor.engine.handle import root_state

    def train_and_drop() -> tuple[weakref.ref, weakref.ref, list[weakref.ref]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        mesh = amsp.init_mesh(amsp.ShardingPlan.from_name("p1-g1-os1"), device_type="cpu")
        amsp.fully_shard(model[0], mesh=mesh)
        amsp.fully_shard(model, mesh=mesh)
        optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-2)
        model(torch.randn(5, 4)).square().sum().backward()
        optim.step()
        optim.wait_param_update()
        units = list(root_state(model).units)
        assert len(units) == 2
        return weakref.ref(model), weakref.ref(optim), [weakref.ref(u) for u in units]

    model, optim, units = train_and_drop()
    gc.collect()
    assert model() is None and optim() is None
    assert all(u() is None for u in units)
