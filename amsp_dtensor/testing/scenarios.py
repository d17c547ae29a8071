"""Training scenarios shared by the engine tests: AMSP on N ranks and its single-process
reference on the same global batch."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..engine.optim import param_groups_by_regex
from .tiny_llama import TinyLlama, TinyLlamaConfig, loss_fn

SEQ_LEN = 16
MICRO_BATCH = 2  # samples per rank per micro-batch
LR = 1e-3
MAX_NORM = 0.5
# optimizer name -> (class, kwargs) for both the reference and AMSP
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_groups": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}),
    "adafactor_groups": (torch.optim.Adafactor, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_norms": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}),
    # Muon on the blocks' matrices; AdamW (its own group) on embeddings, head and norms
    "muon": (torch.optim.Muon, {"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.95}),
    "muon_rms": (torch.optim.Muon, {"lr": 1e-2, "weight_decay": 0.05,
                                    "adjust_lr_fn": "match_rms_adamw", "nesterov": False}),
}
# optimizer name -> its param groups: [(regex searched in the parameter's FQN, the group's
# options)], first match wins (torchtitan's ParamGroupConfig rule). The embeddings and
# head, the norms (inside every block: a group that is not contiguous in the model's
# order) and the rest each with their own lr and weight decay.
PARAM_GROUPS = {
    "adamw_groups": [(r"^(tok_embeddings|output)\.", {"lr": 3e-3, "weight_decay": 0.0}),
                     (r"norm\.", {"lr": 5e-4, "weight_decay": 0.0}),
                     (r"", {"weight_decay": 0.3})],
    "adafactor_groups": [(r"norm\.", {"lr": 3e-2, "weight_decay": 0.0}),
                         (r"", {})],
    "adamw_norms": [(r"norm\.", {"lr": 5e-4}), (r"", {})],
    "muon": [(r"^(tok_embeddings|output)\.|norm\.",
              {"optimizer": torch.optim.AdamW, "lr": 3e-3, "weight_decay": 0.1}),
             (r"", {})],
    "muon_rms": [(r"norm\.", {"optimizer": torch.optim.AdamW, "lr": 3e-3}),
                 (r"^(tok_embeddings|output)\.", {"optimizer": torch.optim.SGD, "lr": 0.1,
                                                    "momentum": 0.9}),
                 (r"", {})],
}


def param_groups(named, optimizer: str) -> list[dict] | None:
    """torch param groups of ``named`` ((FQN, param) pairs) for PARAM_GROUPS[optimizer]
    (None for an optimizer without groups)."""
    spec = PARAM_GROUPS.get(optimizer)
    if spec is None:
        return None
    groups, unmatched = param_groups_by_regex(named, spec)
    assert not unmatched, unmatched  # every spec ends with a catch-all
    return groups


def global_batches(step: int, world_size: int, micro_batches: int, cfg: TinyLlamaConfig):
    """[world * micro_batches * MICRO_BATCH, SEQ_LEN + 1] tokens for one step."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world_size * micro_batches * MICRO_BATCH
    return torch.randint(0, cfg.vocab_size, (n, SEQ_LEN + 1), generator=g)


def local_micro_batch(batch, rank, world_size, micro):
    start = (micro * world_size + rank) * MICRO_BATCH
    return batch[start : start + MICRO_BATCH]


def make_model(dtype: torch.dtype, cfg: TinyLlamaConfig | None = None, variant: str = "") -> TinyLlama:
    """The test model; ``variant`` one of MODEL_VARIANTS ("" = as built)."""
    torch.manual_seed(0)
    model = TinyLlama(cfg or TinyLlamaConfig()).to(dtype)
    MODEL_VARIANTS[variant](model)
    return model


def _freeze_embeddings_and_attention(model: TinyLlama) -> None:
    """LoRA-style: frozen token embeddings and the attention half of every block."""
    model.tok_embeddings.weight.requires_grad_(False)
    for block in model.layers:
        block.attention.requires_grad_(False)


def _tie_output_to_embeddings(model: TinyLlama) -> None:
    model.output.weight = model.tok_embeddings.weight


MODEL_VARIANTS = {
    "": lambda model: None,
    "frozen": _freeze_embeddings_and_attention,
    "tied": _tie_output_to_embeddings,
}


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter as a whole fp32 tensor, read through ``model.named_parameters()``
    (FSDP's P shards are gathered over "p": a collective, every rank must call it)."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        out[name] = full.detach().float().clone()
    return out


def async_all_gathers(*roots) -> list[bool]:
    """The distinct settings of FSDP2's async all-gather over the FSDP units of ``roots``
    (engine/overlap.py, Note: async all-gathers on CPU), sorted."""
    from amsp_dtensor import compat
    from amsp_dtensor.engine.handle import root_state

    return sorted({compat.fsdp_unshard_async_op(unit.module) for root in roots
                   for unit in root_state(root).units if unit.uses_fsdp})


def full_state(model, optim) -> dict:
    """{"weights": every parameter whole, "optim": every optimizer state whole, keyed
    "<fqn>.<state>"} (a collective: every rank calls it, every rank gets them)."""
    from ..engine.layouts import gather_full

    states = {}
    for fqn, entry in optim.state_dict()["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                full = gather_full(value) if hasattr(value, "full_tensor") else value
                states[f"{fqn}.{key}"] = full.detach().clone()
    return {"weights": full_weights(model), "optim": states}


class _Optimizers:
    """Several torch optimizers stepped as one (the reference of groups with their own)."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self):
        for optim in self.optimizers:
            optim.step()

    def zero_grad(self):
        for optim in self.optimizers:
            optim.zero_grad()


def reference_optimizer(cls, groups: list[dict], kwargs: dict):
    """torch's own optimizers for ``groups``, as a user writes them without AMSP: ``cls``
    (with ``kwargs``) for the groups that name no ``"optimizer"``, and each named class,
    with its own defaults and the group's options only, for those that do (Muon's
    matrices and AdamW's rest, as torch.optim.Muon's documentation pairs them)."""
    own = [g for g in groups if "optimizer" not in g]
    named: dict[type, list[dict]] = {}
    for g in groups:
        if "optimizer" in g:
            named.setdefault(g["optimizer"], []).append(
                {k: v for k, v in g.items() if k != "optimizer"})
    optimizers = [cls(own, **kwargs)] if own else []
    optimizers += [named_cls(named_groups) for named_cls, named_groups in named.items()]
    return optimizers[0] if len(optimizers) == 1 else _Optimizers(optimizers)


def reference_training(world_size, micro_batches, steps, dtype, read_steps=0, variant="",
                       optimizer="adamw"):
    """One process, whole global batch, fp32 master weights + AdamW, same clipping; the
    weights after each of the first ``read_steps`` steps in "step_weights"."""
    model = make_model(dtype, variant=variant)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    cls, kwargs = OPTIMIZERS[optimizer]
    groups = param_groups([(n, m) for (n, _), m in zip(named, masters)], optimizer)
    optim = reference_optimizer(cls, groups or [{"params": masters}], kwargs)
    losses, norms, step_weights = [], [], []
    for step in range(steps):
        batch = global_batches(step, world_size, micro_batches, model.cfg)
        loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        norms.append(torch.nn.utils.clip_grad_norm_(masters, MAX_NORM).item())
        optim.step()
        optim.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
        losses.append(loss.item())
        if step < read_steps:
            step_weights.append(full_weights(model))
    return {
        "losses": losses,
        "norms": norms,
        "weights": full_weights(model),
        "step_weights": step_weights,
    }


def shard_model(model, mesh, sharding, policy=None, layout="blocks"):
    """``layout``: "blocks" = every block, then the root (embeddings, final norm and
    output head in one unit); "titan" = as torchtitan shards: the embeddings, every
    block, [final norm, output head] (kept unsharded after forward), then the root."""
    import amsp_dtensor as amsp

    if layout == "titan":
        amsp.fully_shard(model.tok_embeddings, mesh=mesh, plan=sharding, mp_policy=policy)
    for block in model.layers:
        amsp.fully_shard(block, mesh=mesh, plan=sharding, mp_policy=policy)
    if layout == "titan":
        amsp.fully_shard([model.norm, model.output], mesh=mesh, plan=sharding,
                         mp_policy=policy, reshard_after_forward=False)
    amsp.fully_shard(model, mesh=mesh, plan=sharding, mp_policy=policy)


# [Note: one mesh per plan] Every gloo group keeps transport threads that poll while
# idle (on this 2-core machine, 200 idle groups cost each rank about 0.16 s of CPU per
# second), and each init_mesh makes four. A module that trains every plan in several
# variants on one process group used to end with ~600 threads per rank, whose polling
# took as much CPU as the training it tested. Cases of one plan therefore share its
# mesh (a mesh holds groups only; every case builds its own model and optimizer).
# Destroying a case's groups instead is not safe: DeviceMesh caches submeshes by value,
# so a later equal mesh can be handed the destroyed groups.
_MESHES: dict = {}


def plan_mesh(sharding, ranks_per_node: int):
    """The mesh of ``sharding`` for this process group, made on first use."""
    import amsp_dtensor as amsp

    key = (sharding.param, sharding.grad, sharding.optim, ranks_per_node,
           dist.get_world_size(), id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = amsp.init_mesh(sharding, ranks_per_node=ranks_per_node,
                                      device_type="cpu")
    return _MESHES[key]


def amsp_training(rank, world_size, plan, dtype, micro_batches, steps, record_step=1,
                  overlap=False, reduce_dtype=None, read_steps=0, variant="", optimizer="adamw",
                  layout="blocks", overlaps=None, clip=True, compression=None):
    """Train under ``plan`` (a (s_p, s_g, s_os) tuple); returns losses, norms, the final
    full weights (rank 0), this rank's memory per state, and one step's CommEvents.

    ``read_steps``: after each of the first steps, read the weights through
    ``model.parameters()`` ("step_weights", rank 0): right after ``step()``, or with
    ``overlap`` (``overlap_param_update=True``) after, in turn, ``wait_param_update()``,
    ``model.state_dict()`` and a forward; "stale_before_wait" then says whether step 0's
    weights read before the wait were the old ones. ``reduce_dtype``: a
    MixedPrecisionPolicy(reduce_dtype=...) for every unit. ``variant``: MODEL_VARIANTS;
    ``optimizer``: OPTIMIZERS; ``layout``: shard_model's; ``overlaps``: keyword arguments
    of amsp.set_overlap; ``clip``: clip_grad_norm_ before each step ("norms" empty if not);
    ``compression``: keyword arguments of amsp.set_compression (then "p_shards": this
    rank's P shard of each parameter after training, and "residual_norm").
    """
    import amsp_dtensor as amsp
    from amsp_dtensor.engine.handle import root_state
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ranks_per_node = int(__import__("os").environ["LOCAL_WORLD_SIZE"])
    sharding = amsp.ShardingPlan(*plan)
    mesh = plan_mesh(sharding, ranks_per_node)
    model = make_model(dtype, variant=variant)
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype else None
    shard_model(model, mesh, sharding, policy, layout)
    if overlaps:
        amsp.set_overlap(model, **overlaps)
    if compression:
        amsp.set_compression(model, **compression)
    cls, kwargs = OPTIMIZERS[optimizer]
    groups = param_groups([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                          optimizer)
    optim = amsp.AMSPOptimizer(model, cls, overlap_param_update=overlap, param_groups=groups,
                               **kwargs)
    losses, norms, memory, step_weights = [], [], {}, []
    in_flight_after_backward = []  # gradient collectives still in flight when step() begins
    stale_before_wait = None
    # Events land when their collective completes (with overlap, the post-step all-gather
    # completes in the next forward), so the recorder is read after training.
    recorder = amsp.CommRecorder()
    for step in range(steps):
        batch = global_batches(step, world_size, micro_batches, model.cfg)
        ctx = amsp.record_comms(recorder) if step == record_step else contextlib.nullcontext()
        step_loss = torch.zeros(1)
        with ctx:
            for micro, mb, loss in micro_batch_backwards(model, batch, rank, world_size,
                                                         micro_batches):
                step_loss += loss.detach().float()
                if step == 0 and micro == 0 and micro_batches > 1:
                    memory["grad"] = amsp.memory_by_state(model)["grad"]
            in_flight_after_backward.append(len(root_state(model).in_flight))
            if clip:
                norms.append(optim.clip_grad_norm_(MAX_NORM).item())
            optim.step()
            if step < read_steps:
                if overlap:
                    if step == 0:
                        before = full_weights(model)
                    _land_by(step % 3, model, optim, mb)
                    if step == 0:
                        after = full_weights(model)
                        stale_before_wait = any(not torch.equal(before[n], after[n]) for n in after)
                step_weights.append(full_weights(model))
            optim.zero_grad()
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    mem = amsp.memory_by_state(model, optim)
    memory["param"], memory["optim"] = mem["param"], mem["optim"]
    optim.wait_param_update()
    events = [e.key() for e in recorder.events]
    timings = [(e.seconds, e.blocked_seconds) for e in recorder.events]
    weights = full_weights(model)
    extra = {}
    if compression:
        units = root_state(model).units
        extra["p_shards"] = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                             for n, p in model.named_parameters()}
        extra["residual_norm"] = sum(r.float().norm().item() ** 2 for u in units
                                     for r in u.residuals.values()) ** 0.5
        extra["residual_bytes"] = amsp.memory_by_state(model).get("residual", 0)
    return {
        **extra,
        "losses": losses,
        "norms": norms,
        "weights": weights if rank == 0 else None,
        "step_weights": step_weights if rank == 0 else None,
        "stale_before_wait": stale_before_wait,
        "memory": memory,
        "events": events,
        "timings": timings,
        "in_flight_after_backward": in_flight_after_backward,
        "async_all_gathers": async_all_gathers(model),
    }


def micro_batch_backwards(model, batch, rank, world_size, micro_batches, seq_chunk=(0, 1)):
    """Forward and backward of each micro-batch of one step, all but the last under
    ``amsp.no_sync`` (DDP's convention); yields (index, micro-batch, scaled loss) after each.
    ``seq_chunk`` (c, n): this rank trains chunk c of n equal chunks of each sequence
    (context parallelism; ``rank`` and ``world_size`` are then those of the batch's split)."""
    import amsp_dtensor as amsp

    c, n = seq_chunk
    for micro in range(micro_batches):
        mb = local_micro_batch(batch, rank, world_size, micro)
        inputs, targets = (part.chunk(n, dim=1)[c] for part in (mb[:, :-1], mb[:, 1:]))
        last = micro == micro_batches - 1
        with contextlib.nullcontext() if last else amsp.no_sync(model):
            loss = loss_fn(model(inputs), targets) / micro_batches
            loss.backward()
        yield micro, mb, loss


def train_steps(model, optim, rank, world_size, steps, micro_batches=2, record_step=None,
                cp=1, after_first_micro=None):
    """Train ``steps`` (step numbers: the global batch of step s is the same for every
    world with the same (world / cp) x micro_batches), clipping before each step; returns
    (losses, global grad norms, the events of ``record_step``, the model's own collectives
    with them). ``cp``: context parallelism, rank r training the rows of batch split
    r // cp and chunk r % cp of their sequences. ``after_first_micro``: called after the
    first micro-batch of the first step (a no_sync partial sum is then in place)."""
    import amsp_dtensor as amsp

    splits = world_size // cp  # ranks that split the batch
    recorder = amsp.CommRecorder()
    losses, norms = [], []
    for step in steps:
        batch = global_batches(step, splits, micro_batches, model.cfg)
        record = (amsp.record_comms(recorder, model_collectives=True) if step == record_step
                  else contextlib.nullcontext())
        total = torch.zeros(1)
        with record:
            for micro, _, loss in micro_batch_backwards(model, batch, rank // cp, splits,
                                                        micro_batches, (rank % cp, cp)):
                total += loss.detach()
                if after_first_micro is not None and step == steps[0] and micro == 0:
                    after_first_micro()
            norms.append(optim.clip_grad_norm_(MAX_NORM).item())
            optim.step()
            optim.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses, norms, [e.key() for e in recorder.events]


LAND_METHODS = ("wait_param_update", "state_dict", "forward")


def _land_by(method: int, model, optim, micro_batch) -> None:
    """With overlap_param_update=True: the three supported ways to make the parameters
    current after a step (LAND_METHODS)."""
    if method == 0:
        optim.wait_param_update()
    elif method == 1:
        model.state_dict()
    else:
        with torch.no_grad():
            model(micro_batch[:, :-1])

