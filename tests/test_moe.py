"""Mixture of experts: a small MoE model (router, top-k, grouped experts, a shared expert,
a dense first layer) on 4 CPU ranks (2 nodes x 2), expert parallelism 1 and 2, every
valid (dense plan, expert plan) pair: losses, global grad norms and every weight against
single-process training of the same model on the whole batch; the bytes of P, G and OS
of each group against the formula for its own factors; the misuse errors. The ranks'
side is moe_cases.py (one process group for the module)."""

from __future__ import annotations

import math
from collections import Counter
from functools import partial

import pytest
import torch

from amsp_dtensor.plan import ShardingPlan, expert_parallel_world
from amsp_dtensor.plan.cost.comm import (event_counter, predicted_ep_events,
                                         predicted_events, predicted_expert_events)
from amsp_dtensor.testing.scenarios import MICRO_BATCH, SEQ_LEN
from amsp_dtensor.plan.cost.memory import state_bytes_of_rank
from amsp_dtensor.testing.moe import moe_unit_shapes, reference_training
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.tiny_moe import TinyMoE, TinyMoEConfig
from engine_cases import rel_diff
from moe_cases import (CKPT_AT, PER_NODE, RESUMED, SAVED, STEPS, WORLD, cases, pairs,
                       resume_case)

PAIRS = pairs()
PAIR_IDS = [f"ep{ep}-p{d[0]}-g{d[1]}-os{d[2]}-expert-p{e[0]}-g{e[1]}-os{e[2]}"
            for ep, d, e in PAIRS]
TOLERANCE = 1e-5  # fp32


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_checkpoint"))


@pytest.fixture(scope="module")
def world(checkpoint_dir):
    return run_cases(cases(checkpoint_dir), WORLD, PER_NODE, timeout=1200)


@pytest.fixture(scope="module")
def resumed(world, checkpoint_dir):
    """The 2-rank world (1 rank per node) that resumes what the 4-rank world saved."""
    world.get("save")  # saved (or the test fails with the save's traceback)
    return run_cases({"resume": partial(resume_case, path=checkpoint_dir)}, 2, 1,
                     timeout=600).get("resume")


@pytest.fixture(scope="module")
def reference():
    return reference_training(WORLD, STEPS)


@pytest.mark.parametrize("ep,dense,expert", PAIRS, ids=PAIR_IDS)
def test_matches_single_process(world, reference, ep, dense, expert):
    case = world.get(("pair", ep, dense, expert))
    rank0 = case[0]
    assert rel_diff(rank0["losses"], reference["losses"]) <= TOLERANCE, (
        rank0["losses"], reference["losses"])
    assert rel_diff(rank0["norms"], reference["norms"]) <= TOLERANCE, (
        rank0["norms"], reference["norms"])
    assert set(rank0["weights"]) == set(reference["weights"])
    for name, want in reference["weights"].items():
        got = rank0["weights"][name]
        assert got.shape == want.shape, name
        assert rel_diff(got, want) <= TOLERANCE, (name, rel_diff(got, want))
    for other in case[1:]:  # every rank saw the same losses and global norms
        assert other["losses"] == rank0["losses"] and other["norms"] == rank0["norms"]
    assert rank0["losses"][-1] < rank0["losses"][0]
    # FSDP2's all-gathers are async on CPU only without EP's all-to-alls on the training
    # thread (engine/overlap.py, Note: async all-gathers on CPU)
    fsdp = dense[0] > 1 or expert[0] > 1
    assert all(r["async_all_gathers"] == ([ep == 1] if fsdp else []) for r in case), (
        [r["async_all_gathers"] for r in case])


def _groups() -> dict[str, list[tuple[int, int]]]:
    """(rows, cols) of every trainable tensor of the tiny MoE, by group: the grouped
    experts' weights ([experts, ...], "expert") and everything else ("dense")."""
    model = TinyMoE(TinyMoEConfig())
    out = {"dense": [], "expert": []}
    for name, param in model.named_parameters():
        group = "expert" if ".moe.experts." in name else "dense"
        out[group].append((param.shape[0], math.prod(param.shape[1:])))
    return out


@pytest.mark.parametrize("ep,dense,expert", PAIRS, ids=PAIR_IDS)
def test_bytes_per_group(world, ep, dense, expert):
    """fp32 params and AdamW: per rank, P = 4/s_p, G (a no_sync micro-batch's partial
    sum) = 4/s_g and OS = 8/s_os bytes per element of the group's tensors this rank's
    model holds (the experts: 1/ep of them), plus at most one padding row per tensor,
    and exactly the formula for the rank's own chunks; one copy of the OS is spread
    exactly over the ranks of one shard group (dense: ranks 0 .. s_os - 1; experts: s_os
    expert-world ranks x ep)."""
    case = world.get(("pair", ep, dense, expert))
    shapes = _groups()
    shapes["expert"] = [(rows // ep, cols) for rows, cols in shapes["expert"]]
    for group, plan in (("dense", dense), ("expert", expert)):
        numel = sum(r * c for r, c in shapes[group])
        row = sum(c for _, c in shapes[group])  # one row of every tensor
        for rank, result in enumerate(case):
            mem = result["memory"][group]
            for state, s, elem in (("param", plan[0], 4), ("grad", plan[1], 4),
                                   ("optim", plan[2], 8)):
                ideal = elem * numel / s
                assert ideal <= mem[state] <= ideal + elem * row, (group, state, rank, mem)
        copy = plan[2] * (ep if group == "expert" else 1)
        assert sum(case[r]["memory"][group]["optim"] for r in range(copy)) == 8 * numel * (
            ep if group == "expert" else 1), group
    # exactly the cost model's formula for the rank's own chunks (state_bytes_of_rank):
    # the dense group at the rank's place in the dense plan, the experts at its place in
    # the expert world (ep is the fastest dim: expert-world rank = rank // ep)
    dense_units, _, expert_units = moe_unit_shapes(TinyMoE(TinyMoEConfig()), ep)
    e_world, e_per_node = expert_parallel_world(WORLD, PER_NODE, ep)
    for group, units, plan, where in (
            ("dense", dense_units, ShardingPlan(*dense).resolve(WORLD, PER_NODE), lambda r: r),
            ("expert", expert_units, ShardingPlan(*expert).resolve(e_world, e_per_node),
             lambda r: r // ep)):
        for rank, result in enumerate(case):
            mem = result["memory"][group]
            held = state_bytes_of_rank(units, plan, where(rank), 4)  # accumulating G
            assert (mem["param"], mem["grad"], mem["optim"]) == (
                held.param, held.grad, held.optim), (group, rank, mem, held)


@pytest.mark.parametrize("ep,dense,expert", [
    (2, (2, 2, 4), (1, 1, 2)), (1, (1, 1, 4), (2, 2, 4)), (2, (4, 4, 4), (2, 2, 2))])
def test_expert_collectives_on_their_own_mesh(world, ep, dense, expert):
    """The experts' collectives are recorded on the expert mesh ("expert_" dims), over
    groups of the expert plan's sizes, and cross nodes where the expert world does (one
    expert-world rank per node under ep 2); the dense ones keep their names."""
    events = world.get(("pair", ep, dense, expert))[0]["events"]
    e_world, e_per_node = expert_parallel_world(WORLD, PER_NODE, ep)
    sizes = {"p": expert[0], "g": expert[1] // expert[0], "os": expert[2] // expert[1],
             "rep": e_world // expert[2], "shard": expert[2]}
    expert_events = [e for e in events if e[1].startswith("expert_")]
    seen = Counter((op, dim) for op, dim, *_ in expert_events)
    want = set()
    if expert[0] > 1:
        want |= {("all_gather", "expert_p"), ("reduce_scatter", "expert_p")}
    if expert[1] > expert[0]:
        want.add(("reduce_scatter", "expert_g"))
    if expert[1] == expert[0] < expert[2]:
        want.add(("reduce_scatter", "expert_os"))
    if sizes["rep"] > 1:
        want.add(("all_reduce", "expert_rep"))
    if expert[2] > expert[0]:
        want.add(("all_gather", "expert_g" if expert[1] > expert[0] else "expert_os"))
    if expert[2] > 1:  # the global grad norm: the experts' part over one copy of them
        want.add(("all_reduce", "expert_shard"))
    assert set(seen) == want, (sorted(seen), sorted(want))
    for op, dim, size, nbytes, inter, phase in expert_events:
        base = dim.removeprefix("expert_")
        assert size == sizes[base], (dim, size)
        assert inter == (e_per_node == 1 or size * _stride(base, expert) > e_per_node), dim
    assert any(not e[1].startswith("expert_") for e in events)


@pytest.mark.parametrize("ep,dense,expert", PAIRS, ids=PAIR_IDS)
def test_recorded_collectives_equal_the_cost_model(world, ep, dense, expert):
    """Every collective of a step (2 micro-batches, clipping), by op, mesh dim, group
    size, bytes, locality and phase, equals the cost model's: predicted_events of the dense
    plan on the dense units, predicted_expert_events of the expert plan on the experts'
    EP-local shapes, and predicted_ep_events, the model's own token all-to-alls over "ep"
    (see _split_by_routing for the bytes that follow the routing)."""
    dense_units, root, local = moe_unit_shapes(TinyMoE(TinyMoEConfig()), ep)
    e_world, e_per_node = expert_parallel_world(WORLD, PER_NODE, ep)
    want = event_counter(predicted_events(
        ShardingPlan(*dense).resolve(WORLD, PER_NODE), dense_units, 2, 4, root, clip=True))
    want += event_counter(predicted_expert_events(
        ShardingPlan(*expert).resolve(e_world, e_per_node), ep, PER_NODE, local, 2, 4,
        clip=True))
    cfg = TinyMoEConfig()
    tokens = MICRO_BATCH * SEQ_LEN  # per rank and micro-batch
    token_events = predicted_ep_events(ep, PER_NODE, cfg.n_layers - cfg.n_dense_layers,
                                       tokens, cfg.top_k, cfg.dim, cfg.n_experts, 2, 4)
    assert (ep > 1) == bool(token_events)
    shape = Counter()  # the model's all-to-alls without their bytes
    for t in token_events:
        shape[(t.op, t.dim, t.group_size, t.inter_node, t.phase)] += t.count
    results = world.get(("pair", ep, dense, expert))
    for rank, result in enumerate(results):
        ours = [tuple(e) for e in result["events"] if not _is_token_exchange(e)]
        assert Counter(ours) == want, (rank, sorted((Counter(ours) - want).items()),
                                       sorted((want - Counter(ours)).items()))
        theirs = [tuple(e) for e in result["events"] if _is_token_exchange(e)]
        assert Counter((op, dim, size, inter, phase)
                       for op, dim, size, _, inter, phase in theirs) == shape, rank
        # exact on every rank: the counts, and what a rank sends of its own tokens (the
        # dispatch forward, the combine's gradient backward)
        for t, exact in zip(token_events, (1, 2, 2)):  # counts; tokens forward, backward
            sent = sum(1 for e in theirs if e[5] == t.phase and e[3] == t.nbytes)
            assert sent >= t.count // exact, (rank, t, theirs)
    # the returns follow the routing: summed over each EP group, the model's bytes
    for group in range(WORLD // ep):
        for phase in ("forward", "backward"):
            got = sum(e[3] for r in range(group * ep, (group + 1) * ep)
                      for e in results[r]["events"] if _is_token_exchange(e) and e[5] == phase)
            model = sum(t.nbytes * t.count for t in token_events if t.phase == phase)
            assert got == ep * model, (group, phase, got, ep * model)


def _is_token_exchange(event) -> bool:
    return event[0] == "all_to_all" and event[1] == "ep"


def _stride(dim: str, plan) -> int:
    return {"p": 1, "g": plan[0], "os": plan[1], "rep": plan[2], "shard": 1}[dim]


def test_expert_parallel_world():
    assert expert_parallel_world(8, 4, 2) == (4, 2)
    assert expert_parallel_world(8, 4, 4) == (2, 1)
    assert expert_parallel_world(16, 4, 8) == (2, 1)  # an EP group over two nodes
    with pytest.raises(ValueError, match=r"ep=6 with 4 data-parallel ranks per node"):
        expert_parallel_world(12, 4, 6)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the data-parallel world of 8"):
        expert_parallel_world(8, 4, 3)
    with pytest.raises(ValueError, match="ep must be a positive int"):
        expert_parallel_world(8, 4, 0)
    # beside tp, EP spans the tp ranks: torchtitan's efsdp = dp x tp / ep
    assert expert_parallel_world(2, 1, 4, tp=2) == (1, 1)
    assert expert_parallel_world(4, 2, 2, tp=2) == (4, 2)
    with pytest.raises(ValueError, match=r"ep=3 does not divide the data-parallel world x tp 2 of 8"):
        expert_parallel_world(4, 2, 3, tp=2)


def test_misuse_errors(world):
    out = world.get("errors")[0]
    assert "ep=3 does not divide the data-parallel world of 4 ranks" in out["ep_not_dividing"]
    assert out["expert_plan_too_big"].startswith("expert_plan: the expert plan's factors are "
                                                 "those of the expert world")
    assert "(2 ranks, 1 per node)" in out["expert_plan_too_big"]
    # rank 0's groups beside tp 2, against torchtitan's meshes over the same 4 ranks: the
    # dense (dp 2, tp 2) and the sparse (efsdp = dp x tp / ep, ep), both row-major
    for ep in (2, 4):
        dense, sparse = torch.arange(4).reshape(2, 2), torch.arange(4).reshape(4 // ep, ep)
        assert out[f"groups_tp2_ep{ep}"] == {
            "tp": dense[0].tolist(), "os": dense[:, 0].tolist(),
            "expert_ep": sparse[0].tolist(), "expert_os": sparse[:, 0].tolist()}, ep
    assert out["ep_group_sum"] == 2.0  # the mesh built after the refusals works
    assert "amsp.init_mesh(plan, ep=N)" in out["no_expert_mesh"]
    assert "shard the experts on amsp.expert_mesh(mesh)" in out["experts_on_dense_mesh"]
    assert "on the expert mesh contains sharded modules" in out["root_on_expert_mesh"]
    assert "Adafactor with an expert mesh is not supported" in out["adafactor"]


def test_checkpoint_resumes_under_another_ep_plan_pair_and_world(world, resumed):
    """Saved under ep 2, dense p2-g2-os4 / experts p1-g1-os2 on 4 ranks; loaded under
    ep 1, dense p1-g1-os2 / experts p2-g2-os2 on 2 ranks: every weight and optimizer state
    (fp32 masters, both moments, step) bit-identical, and the remaining steps' losses
    within 1e-5 of the uninterrupted run's."""
    saved = world.get("save")[0]
    assert saved["first"] == saved["whole"][:CKPT_AT]
    for rank, got in enumerate(resumed):
        assert set(got["state"]["weights"]) == set(saved["state"]["weights"])
        for name, want in saved["state"]["weights"].items():
            assert torch.equal(got["state"]["weights"][name], want), (rank, name)
        assert set(got["state"]["optim"]) == set(saved["state"]["optim"])
        assert any(k.endswith("moe.experts.w2.exp_avg_sq") for k in saved["state"]["optim"])
        for key, want in saved["state"]["optim"].items():
            assert torch.equal(got["state"]["optim"][key], want), (rank, key)
        rest = saved["whole"][CKPT_AT:]
        assert rel_diff(got["rest"], rest) <= TOLERANCE, (got["rest"], rest)
    assert SAVED[0] != RESUMED[0] and SAVED[1:] != RESUMED[1:]


def test_compression_residuals_of_both_groups_resume(world):
    """With int8 gradients the error-feedback residuals of the dense and the expert units
    are saved and restored bit-identically under the same plan pair (the resumed steps'
    losses equal the uninterrupted run's); under another expert plan they start from zero
    with one warning (their key names the expert plan too)."""
    out = world.get("compressed_checkpoint")
    for rank, got in enumerate(out):
        assert got["expert_residuals"], rank  # the experts' os stage crosses nodes
        assert got["restored"], rank
        assert got["resumed"] == got["straight"], (rank, got["resumed"], got["straight"])
        assert got["other_residuals"] == 0
    warned = out[0]["other_warnings"]  # rank 0 warns, once
    assert len(warned) == 1 and "experts p1-g1-os2 on 2 ranks x ep 2" in warned[0], warned
    assert "experts p2-g2-os2 on 2 ranks x ep 2: they start from zero" in warned[0], warned
    assert all(not got["other_warnings"] for got in out[1:])


def test_a_unit_inside_an_activation_checkpointed_block(fake_four_ranks):
    """The routed experts are a unit of their own inside their block; with activation
    checkpointing the block is torch's CheckpointWrapper, whose parameters are named
    without "_checkpoint_wrapped_module." and whose modules with it. Sharding the block
    after the inner unit takes the block's other parameters only (it raised "tied
    parameters: 'feed_forward.w1.weight' is the same tensor as a parameter of
    '_checkpoint_wrapped_module.feed_forward'" before the names were compared without
    wrappers; torchtitan 0.3's deepseek_v3 and gpt_oss with EP, PP and SAC stopped there)."""
    import amsp_dtensor as amsp
    import amsp_dtensor.titan  # noqa: F401  torchtitan's CPU shims
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    from amsp_dtensor.engine import handle
    from amsp_dtensor.testing.tiny_llama import TinyLlama

    plan = amsp.ShardingPlan(2, 2, 2)
    mesh = amsp.init_mesh(plan, ranks_per_node=2, device_type="cpu")
    model = TinyLlama()
    apply_ac(model, ActivationCheckpoint(mode="full"))
    block = model.layers[0]
    assert type(block).__name__ == "CheckpointWrapper"
    amsp.fully_shard(block.feed_forward, mesh=mesh, plan=plan)
    amsp.fully_shard(block, mesh=mesh, plan=plan)
    inner, outer = handle.unit_of(block.feed_forward), handle.unit_of(block)
    assert len(inner.params) == 3 and len(outer.params) == 6  # w1-w3; norms and wq-wo
    assert not {id(p) for p in inner.params} & {id(p) for p in outer.params}
