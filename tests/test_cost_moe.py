"""The cost model with experts: the MoE model shapes against the models torchtitan builds
from its own args (on the meta device), the EP-local expert units, the step's events
(dense plan, expert plan, EP's all-to-alls) and the planner's choice of both plans."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from amsp_dtensor.plan.cost.models import MODELS, from_named_shapes, from_torchtitan_args

TITAN = {  # our name: (torchtitan model, flavor)
    "deepseek_v3_debugmodel": ("deepseek_v3", "debugmodel"),
    "deepseek_v3_16b": ("deepseek_v3", "16B"),
    "deepseek_v3_671b": ("deepseek_v3", "671B"),
    "qwen3_debugmodel_moe": ("qwen3", "debugmodel_moe"),
    "qwen3_30b_a3b": ("qwen3", "30B-A3B"),
}


@pytest.fixture(scope="module")
def titan():
    from amsp_dtensor.titan import cpu_compat

    cpu_compat.apply()  # torchtitan's MoE imports triton kernels; CPU stands in for them
    import torchtitan.protocols.train_spec as train_spec

    return train_spec.get_train_spec


def _built(titan, model: str, flavor: str):
    spec = titan(model)
    args = dataclasses.replace(spec.model_args[flavor])
    args.moe_impl = "standard"  # what update_from_config sets from the job (no DeepEP)
    with torch.device("meta"):
        return spec.model_cls(args), args


@pytest.mark.parametrize("name", sorted(TITAN))
def test_moe_shapes_are_torchtitans(titan, name):
    """Every parameter of torchtitan's model, by name and shape: the dense group's of each
    block (attention, norms, dense FFN or router and shared experts), the routed experts'
    of each MoE block, the root's; and from_torchtitan_args gives the same shape."""
    module, args = _built(titan, *TITAN[name])
    shape = MODELS[name]
    assert dataclasses.replace(from_torchtitan_args(name, args), notes=shape.notes) == shape
    for layer, block in enumerate(module.layers.values()):
        got = {n: tuple(p.shape) for n, p in block.named_parameters()
               if ".experts." not in f".{n}"}
        want = {p.name: p.shape for p in shape.block_params(layer=layer)}
        assert got == want, (name, layer)
        experts = {n: tuple(p.shape) for n, p in block.named_parameters()
                   if n.startswith("moe.experts.")}
        want = {p.name: p.shape for p in shape.expert_params()} if shape.is_moe_layer(layer) else {}
        assert experts == want, (name, layer)
    in_blocks = {id(p) for p in module.layers.parameters()}
    root = {n: tuple(p.shape) for n, p in module.named_parameters() if id(p) not in in_blocks}
    assert root == {p.name: p.shape for p in shape.root_params()}
    assert shape.num_params == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(TITAN))
def test_shapes_read_off_the_parameters_are_the_same(titan, name):
    """from_named_shapes (what the torchtitan 0.3 path reads, its names differing) gives
    the same ModelShape from the built model's parameters alone."""
    module, args = _built(titan, *TITAN[name])
    blocks = [{n: tuple(p.shape) for n, p in block.named_parameters()}
              for block in module.layers.values()]
    in_blocks = {id(p) for p in module.layers.parameters()}
    root = {n: tuple(p.shape) for n, p in module.named_parameters() if id(p) not in in_blocks}
    moe = getattr(args, "moe_args", None)
    got = from_named_shapes(name, dim=args.dim, n_heads=args.n_heads, blocks=blocks, root=root,
                            top_k=moe.top_k if moe is not None else None)
    want = MODELS[name]
    if want.experts.n_dense_layers == 0:  # no dense FFN: its hidden size is in no parameter
        got = dataclasses.replace(got, ffn_hidden=want.ffn_hidden)
    assert dataclasses.replace(got, notes=want.notes) == want


def test_a_model_the_cost_model_cannot_read_is_refused():
    blocks = [{"attention.wq.weight": (64, 64), "attention.wk.weight": (64, 64),
               "attention.wv.weight": (64, 64), "attention.wo.weight": (64, 64),
               "feed_forward.w1.weight": (128, 64), "feed_forward.w2.weight": (64, 128),
               "feed_forward.w3.weight": (128, 64), "attention_norm.weight": (64,),
               "ffn_norm.weight": (64,), "adapter.weight": (8, 64)}]
    root = {"tok_embeddings.weight": (100, 64), "norm.weight": (64,),
            "output.weight": (100, 64)}
    with pytest.raises(ValueError, match="block 0's parameters .* cannot plan this model"):
        from_named_shapes("odd", dim=64, n_heads=4, top_k=None, blocks=blocks, root=root)


def test_published_sizes():
    """Total and active parameters as published: DeepSeek-V3 671B / 37B, Qwen3-30B-A3B
    30.5B / 3.3B (the active count here includes embeddings and output head)."""
    v3, qwen = MODELS["deepseek_v3_671b"], MODELS["qwen3_30b_a3b"]
    assert round(v3.num_params / 1e9) == 671 and round(v3.active_params / 1e9) == 38
    assert round(qwen.num_params / 1e8) == 305 and round(qwen.active_params / 1e8) == 34
    assert v3.moe_layers == 58 and qwen.moe_layers == 48


def test_expert_units_are_ep_local():
    m = MODELS["deepseek_v3_16b"]
    assert m.expert_units(8) == [[(8, 1408, 2048), (8, 2048, 1408), (8, 1408, 2048)]] * 26
    # torchtitan's Shard(1) (its rule: the factor x ep above the experts), for the baselines
    assert m.expert_units(8, 1) == [[(1408, 8, 2048), (2048, 8, 1408), (1408, 8, 2048)]] * 26
    world = ShardingPlan(16, 16, 16).resolve(128, 1)
    assert m.titan_expert_shard_dim(world, 8) == 1  # 16 x 8 > 64 experts
    assert m.titan_expert_shard_dim(ShardingPlan(8, 8, 8).resolve(128, 1), 8) == 0
    with pytest.raises(ValueError, match="ep=3 does not divide .* 64 experts"):
        m.expert_units(3)
    with pytest.raises(ValueError, match="tensor_parallel_degree=2 .* use tp 1"):
        m.units(2)


# ---- the step's events and the planner --------------------------------------------------

from amsp_dtensor.plan import ShardingPlan, expert_parallel_world  # noqa: E402
from amsp_dtensor.plan.cost.comm import (event_counter, predicted_ep_events,  # noqa: E402
                                         predicted_events, predicted_expert_events)
from amsp_dtensor.plan.cost.memory import state_bytes  # noqa: E402
from amsp_dtensor.plan.cost.nccl import NcclModel  # noqa: E402
from amsp_dtensor.plan.cost.planner import choose_plan, estimate_plan  # noqa: E402

GiB = 2**30
W, R = 1024, 8
JOB = dict(seq_len=4096, micro_batch=1, global_batch_tokens=4096 * W * 4, world_size=W,
           ranks_per_node=R, memory_budget_bytes=75 * GiB, reserve_bytes=5 * GiB)


def test_a_pairs_estimate_is_both_groups_and_eps_all_to_alls():
    """estimate_plan of (dense plan, expert plan, ep): the events are the dense plan's on
    the dense units, the expert plan's on the EP-local expert units over the expert world,
    and EP's token all-to-alls (inside the node at ep 8: intra); the states are each
    group's formula; the step charges EP's all-to-alls on the critical path."""
    m = MODELS["deepseek_v3_16b"]
    ep, M = 8, 4
    dense = ShardingPlan(8, 8, 64).resolve(W, R)
    e_world, e_per_node = expert_parallel_world(W, R, ep)
    assert (e_world, e_per_node) == (128, 1)
    expert = ShardingPlan(1, 1, 8).resolve(e_world, e_per_node)
    est = estimate_plan(m, dense, seq_len=4096, micro_batch=1, micro_batches=M,
                        memory_budget_bytes=75 * GiB, time_model=NcclModel(gpus_per_node=R),
                        expert_plan=expert, ep=ep)
    want = event_counter(predicted_events(dense, m.unit_param_shapes(), M, 2,
                                          m.root_unit_index, clip=True))
    want += event_counter(predicted_expert_events(expert, ep, R, m.expert_units(ep), M, 2,
                                                  clip=True))
    tokens = predicted_ep_events(ep, R, 26, 4096, 6, 2048, 64, M, 2)
    want += event_counter(tokens)
    assert event_counter(est.events) == want
    assert all(not t.inter_node for t in tokens)  # ep 8 inside a node of 8
    assert tokens[1].nbytes == 4096 * 6 * 2048 * 2 and tokens[1].count == 2 * M * 26
    assert est.memory.expert_states == state_bytes(m.expert_units(ep), 1, 1, 8, 2)
    assert est.memory.states.total == (est.memory.expert_states.total + state_bytes(
        m.unit_param_shapes(), 8, 8, 64, 2).total)
    nccl = NcclModel(gpus_per_node=R)
    a2a = sum(nccl.time(t.op, t.nbytes, t.group) * t.count for t in tokens)
    assert est.step.ep_comm_seconds == pytest.approx(a2a)
    assert est.step.seconds > est.step.compute_seconds + a2a * 0.999  # on the critical path
    groups = est.group_bytes()
    assert groups["ep"] == {"intra": sum(t.nbytes * t.count for t in tokens), "inter": 0}


def test_the_steps_bound_takes_each_units_worse_moment_over_both_plans():
    """step_bytes with a dense plan and an expert plan of different all-gather buffers per
    OS element (c): each unit counts the larger of its share of an optimizer call (8 per
    element) and its all-gather buffers, by hand. Dense p1-g1-os8 in bf16 holds 2*(1+8) =
    18 per element after its update; experts p1-g1-os1 gather nothing and hold 8 in a call.
    The dense all-gathers alive while one call steps the experts is above both moments the
    bound took with one plan (every all-gather, one call over every unit)."""
    from amsp_dtensor.plan.cost.backward_peak import unit_sizes
    from amsp_dtensor.plan.cost.memory import step_bytes

    m = MODELS["deepseek_v3_16b"]
    ep, world, rpn = 8, 64, 8
    dense = ShardingPlan(1, 1, 8).resolve(world, rpn)
    expert = ShardingPlan(1, 1, 1).resolve(*expert_parallel_world(world, rpn, ep))
    dense_os = sum(unit_sizes(u, dense).os for u in m.unit_param_shapes())
    expert_os = sum(unit_sizes(u, expert).os for u in m.expert_units(ep))
    sb = step_bytes(m, dense, "bf16", expert_plan=expert, ep=ep)
    assert sb.gather == 18 * dense_os  # send buffer + output of k_os = 8, bf16
    assert sb.gather + sb.scratch == 18 * dense_os + 8 * expert_os
    assert sb.gather + sb.scratch > max(18 * dense_os, 8 * (dense_os + expert_os))
    # gloo stages two outputs per process group: the dense units' two largest (the experts
    # gather nothing here); with experts p1-g1-os2, their two largest as well
    def outputs(units, plan, k):
        return sorted((2 * k * unit_sizes(u, plan).os for u in units), reverse=True)[:2]
    gloo = step_bytes(m, dense, "bf16", expert_plan=expert, ep=ep, backend="gloo")
    assert gloo.staging == sum(outputs(m.unit_param_shapes(), dense, 8))
    e2 = ShardingPlan(1, 1, 2).resolve(*expert_parallel_world(world, rpn, ep))
    gloo2 = step_bytes(m, dense, "bf16", expert_plan=e2, ep=ep, backend="gloo")
    assert gloo2.staging == gloo.staging + sum(outputs(m.expert_units(ep), e2, 2))
    # one plan for both groups: the larger of the two moments, as before
    e8 = ShardingPlan(1, 1, 8).resolve(*expert_parallel_world(world, rpn, ep))
    same = step_bytes(m, dense, "bf16", expert_plan=e8, ep=ep)
    both_os = dense_os + sum(unit_sizes(u, e8).os for u in m.expert_units(ep))
    assert same.gather + same.scratch == max(18, 8) * both_os


@pytest.mark.parametrize("name,ep", [("deepseek_v3_16b", 8), ("qwen3_30b_a3b", 8),
                                     ("deepseek_v3_671b", 64)])
def test_the_planner_picks_both_plans(name, ep):
    """choose_plan(ep=...) on a model with experts: the chosen pair is the fastest fitting
    dense plan with the chosen expert plan and the fastest fitting expert plan with the
    chosen dense plan (the search settled), it fits, it is no slower than torchtitan's
    layout (ZeRO-3 for both groups) and its TOML names both plans and the EP degree."""
    job = dict(JOB, activation_checkpointing="full") if name.endswith("671b") else JOB
    r = choose_plan(name, ep=ep, **job)
    best = r.best
    assert best.fits and best.expert_plan is not None and best.ep == ep
    assert r.rounds[-1] == (best.plan.name, best.expert_plan.name)
    fit = [c for c in r.candidates if c.fits]
    assert best.step_seconds <= min(c.step_seconds for c in fit) * 1.01
    efit = [c for c in r.expert_candidates if c.fits]
    assert r.expert_candidates[0].expert_plan == best.expert_plan
    assert r.expert_candidates[0].step_seconds <= min(c.step_seconds for c in efit) * 1.01
    assert all(c.expert_plan == best.expert_plan for c in r.candidates)
    assert all(c.plan == best.plan for c in r.expert_candidates)
    zero3 = r.baselines["zero3"]
    assert zero3.expert_plan.s_p == zero3.expert_plan.world_size  # experts FSDP'd too
    # torchtitan's layout as the engine would run it (dim 0, padded where the factor
    # exceeds the local experts) is never faster than the chosen pair; torchtitan's own
    # Shard(1) there (the baseline) can be: at ep 64 each rank holds 4 of 671B's experts
    # per block, and the engine pads them to the factor
    padded = estimate_plan(MODELS[name], zero3.plan, seq_len=4096, micro_batch=1,
                           micro_batches=r.settings["micro_batches"],
                           memory_budget_bytes=75 * GiB, time_model=NcclModel(gpus_per_node=R),
                           expert_plan=zero3.expert_plan, ep=ep,
                           activation_checkpointing=job.get("activation_checkpointing", "none"))
    assert best.step_seconds <= padded.step_seconds
    assert (best.step_seconds <= zero3.step_seconds) == (name != "deepseek_v3_671b")
    toml = r.to_toml()
    assert f"expert_parallel_degree = {ep}" in toml
    assert f"expert_optim_shard = {best.expert_plan.s_os}" in toml


def test_bad_expert_input():
    with pytest.raises(ValueError, match="ep=2: model llama3_8b has no experts"):
        choose_plan("llama3_8b", ep=2, **JOB)
    with pytest.raises(ValueError, match="ep=3 does not divide"):
        choose_plan("deepseek_v3_16b", ep=3, **JOB)
    for tp in ("auto", 2):
        with pytest.raises(ValueError, match="neither tensor nor pipeline parallelism with "):
            choose_plan("deepseek_v3_16b", ep=8, tp=tp, **JOB)


def test_full_checkpointing_runs_eps_all_to_alls_again():
    """Full activation checkpointing recomputes each MoE block's forward in backward, its
    all-to-alls with it (the counts once, the tokens out and back)."""
    plain = predicted_ep_events(8, 8, 26, 4096, 6, 2048, 64, 4, 2)
    again = predicted_ep_events(8, 8, 26, 4096, 6, 2048, 64, 4, 2, recompute=True)
    back = lambda evs: sorted((e.nbytes, e.count) for e in evs if e.phase == "backward")
    assert back(plain) == [(4096 * 6 * 2048 * 2, 2 * 4 * 26)]
    assert back(again) == [(64 * 8, 4 * 26), (4096 * 6 * 2048 * 2, 4 * 4 * 26)]
    m = MODELS["deepseek_v3_16b"]
    dense = ShardingPlan(8, 8, 64).resolve(W, R)
    expert = ShardingPlan(1, 1, 8).resolve(128, 1)
    kw = dict(seq_len=4096, micro_batch=1, micro_batches=4, memory_budget_bytes=75 * GiB,
              time_model=NcclModel(gpus_per_node=R), expert_plan=expert, ep=8)
    full = estimate_plan(m, dense, activation_checkpointing="full", **kw)
    assert event_counter(e for e in full.events if e.dim == "ep" and e.op == "all_to_all") \
        == event_counter(again)


def test_compressed_experts_keep_their_residuals_in_memory():
    """With compression the experts' error-feedback residuals count in memory too."""
    from amsp_dtensor.plan.compression import Compression
    from amsp_dtensor.plan.cost.memory import compression_bytes

    m = MODELS["deepseek_v3_16b"]
    dense = ShardingPlan(1, 8, 8).resolve(W, R)
    expert = ShardingPlan(1, 4, 4).resolve(128, 1)
    comp = Compression(grads="int8")
    est = estimate_plan(m, dense, seq_len=4096, micro_batch=1, micro_batches=4,
                        memory_budget_bytes=75 * GiB, time_model=NcclModel(gpus_per_node=R),
                        expert_plan=expert, ep=8, compression=comp)
    want = (compression_bytes(m.unit_param_shapes(), dense, comp, 2, 2).total
            + compression_bytes(m.expert_units(8), expert, comp, 2, 2).total)
    assert est.memory.compression.total == want
    assert compression_bytes(m.expert_units(8), expert, comp, 2, 2).total > 0


def test_a_later_jobs_watch_survives_an_earlier_meshs_end():
    """torch reuses a group's name after the groups are destroyed: the first mesh's end
    must not remove the watch a second job placed on the same name."""
    import gc

    from amsp_dtensor.engine import recorder

    class Owner:
        pass

    class Group:
        group_name = "reused-name-for-this-test"

    first, second = Owner(), Owner()
    recorder.watch_group(first, Group(), "ep", 2, False)
    recorder.watch_group(second, Group(), "ep", 4, True)
    del first
    gc.collect()
    assert recorder._watched[Group.group_name] == ("ep", 4, True)
    del second
    gc.collect()
    assert Group.group_name not in recorder._watched
