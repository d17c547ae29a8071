"""amsp.set_compression: the codecs and error feedback on one process; then on 4 gloo
ranks (2 nodes of 2) the recorded collectives of a compressed step against the exact
step's with every cross-node gradient stage and post-step all-gather rewritten by hand
(and against the cost model), replicas holding identical weights, and losses within the
codec's tolerance of single-process training. With compression off every other test
module is the reference: nothing changes when it is unused."""

from __future__ import annotations

import math
from collections import Counter
from functools import partial

import pytest
import torch

import amsp_dtensor as amsp
from amsp_dtensor.engine import compression as C
from amsp_dtensor.plan.compression import Compression
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import amsp_training, reference_training
from engine_expectations import expected_step_events, unit_shapes

WORLD, PER_NODE, MICRO_BATCHES, STEPS = 4, 2, 2, 3


# ---- the codecs, on one process ---------------------------------------------------------
def _chunk_bytes(codec, m):
    """Written out: bf16 two bytes an element; int8 one byte an element, padded to whole
    blocks of 256, plus a 4-byte scale per block."""
    if codec == "bf16":
        return 2 * m
    blocks = math.ceil(m / 256)
    return 256 * blocks + 4 * blocks


@pytest.mark.parametrize("m", [1, 255, 256, 700])
def test_codec_round_trip_and_size(m):
    torch.manual_seed(m)
    rows = torch.randn(3, m) * torch.logspace(-3, 2, 3).unsqueeze(1)
    for codec in ("bf16", "int8"):
        chunks = C.encode(rows, codec)
        assert chunks.dtype == torch.uint8 and chunks.shape == (3, _chunk_bytes(codec, m))
        back = C.decode(chunks, codec, m)
        if codec == "bf16":
            assert torch.equal(back, rows.to(torch.bfloat16).float())
        else:  # each element within half a quantization step of its block's scale
            padded = torch.zeros(3, math.ceil(m / 256) * 256)
            padded[:, :m] = rows
            scale = padded.view(3, -1, 256).abs().amax(2, keepdim=True) / 127
            bound = (scale / 2).expand(-1, -1, 256).reshape(3, -1)[:, :m]
            assert ((back - rows).abs() <= bound * (1 + 1e-5)).all()


def test_error_feedback_telescopes():
    """sum_t sent_t == sum_t x_t - residual_T: the dropped error lags, never grows."""
    torch.manual_seed(0)
    residual = torch.zeros(4, 300)
    sent_sum = torch.zeros(4, 300, dtype=torch.float64)
    true_sum = torch.zeros(4, 300, dtype=torch.float64)
    for _ in range(20):
        x = torch.randn(4, 300)
        chunks = C._with_feedback(x, residual, "int8")
        sent_sum += C.decode(chunks, "int8", 300).double()
        true_sum += x.double()
    assert (sent_sum - (true_sum - residual.double())).abs().max() < 1e-4
    assert residual.abs().max() < 0.05  # bounded by half a step, not 20 of them


def test_without_feedback_the_error_is_lost():
    """The same stream without a residual: the sums drift by the accumulated rounding."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 300) * 1e-3 + 0.05 for _ in range(20)]
    sent = sum(C.decode(C._with_feedback(x, None, "int8"), "int8", 300).double() for x in xs)
    residual = torch.zeros(4, 300)
    fed = sum(C.decode(C._with_feedback(x, residual, "int8"), "int8", 300).double() for x in xs)
    true = sum(x.double() for x in xs)
    assert (fed - true).abs().max() < (sent - true).abs().max() / 4


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="compression grads='fp8' is not a codec: use one of bf16, int8"):
        Compression(grads="fp8")
    with pytest.raises(TypeError, match="error_feedback must be a bool, got 'no'"):
        Compression(grads="int8", error_feedback="no")
    with pytest.raises(ValueError, match="expected grads=CODEC and/or weights=CODEC"):
        Compression.parse("gradients=int8")
    assert Compression.parse("grads=int8,weights=none") == Compression(grads="int8")
    assert str(Compression.parse("none")) == "none" and not Compression().enabled


# ---- 4 ranks, 2 nodes -------------------------------------------------------------------
# plan -> set_compression keywords; which stages cross nodes at 2 ranks per node:
CASES = {
    (1, 1, 4): dict(grads="int8", weights="int8"),  # os RS and os AG cross
    (1, 1, 2): dict(grads="int8"),  # os inside the node (exact), rep AR crosses
    (1, 4, 4): dict(grads="bf16", weights="bf16"),  # g RS every micro-batch, g AG
    (2, 2, 4): dict(grads="int8", weights="int8"),  # FSDP units; os RS and AG cross
    (1, 2, 2): dict(grads="bf16"),  # g RS inside the node (exact), rep AR crosses
}
LOSS_TOLERANCE = {"bf16": 1e-3, "int8": 5e-3}  # |loss - single-process loss|


def _case(rank, world, plan, setting):
    return amsp_training(rank, world, plan, torch.float32, MICRO_BATCHES, STEPS,
                         compression=setting)


def _checkpoint_case(rank, world, folder):
    """Save at step 2 of 4 under int8 gradients (p1-g1-os4: the os reduce-scatter crosses
    nodes), then resume from it twice: under the same plan (residuals restored) and under
    p1-g1-os2 (rep crosses; other residual shapes: reset with a warning)."""
    import warnings

    from amsp_dtensor import checkpoint
    from amsp_dtensor.engine.handle import root_state
    from amsp_dtensor.testing.scenarios import (
        global_batches, make_model, micro_batch_backwards, plan_mesh, shard_model)

    def build(plan, grads="int8"):
        model = make_model(torch.float32)
        sharding = amsp.ShardingPlan(*plan)
        shard_model(model, plan_mesh(sharding, PER_NODE), sharding)
        amsp.set_compression(model, grads=grads)
        return model, amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3)

    def train(model, optim, steps):
        losses = []
        for step in steps:
            batch = global_batches(step, world, MICRO_BATCHES, model.cfg)
            total = sum(float(loss) for _, _, loss in
                        micro_batch_backwards(model, batch, rank, world, MICRO_BATCHES))
            optim.step()
            optim.zero_grad()
            losses.append(total)
        return losses

    def residuals(model):
        return {f"{i}.{k}": v.clone() for i, u in enumerate(root_state(model).units)
                for k, v in u.residual_state().items()}

    out = {}
    model, optim = build((1, 1, 4), None)
    train(model, optim, range(1))
    checkpoint.save(folder, 1, model, optim)  # exact: no residuals in it
    model, optim = build((1, 1, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(checkpoint.step_path(folder, 1), model, optim)
    out["no_residuals_warnings"] = [str(w.message) for w in caught
                                    if "error-feedback" in str(w.message)]
    model, optim = build((1, 1, 4))
    train(model, optim, range(2))
    checkpoint.save(folder, 2, model, optim)
    saved = residuals(model)
    straight = train(model, optim, range(2, 4))
    out.update(straight=straight, saved_residuals=len(saved), folder=folder)
    model, optim = build((1, 1, 4))
    checkpoint.load(checkpoint.step_path(folder, 2), model, optim)
    loaded = residuals(model)
    out["residuals_equal"] = loaded.keys() == saved.keys() and all(
        torch.equal(loaded[k], saved[k]) for k in saved)
    out["resumed"] = train(model, optim, range(2, 4))
    model, optim = build((1, 1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load(checkpoint.step_path(folder, 2), model, optim)
    out["other_plan_warnings"] = [str(w.message) for w in caught
                                  if "error-feedback" in str(w.message)]
    out["other_plan_residuals"] = len(residuals(model))
    out["other_plan_trains"] = train(model, optim, range(2, 3))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cases = {plan: partial(_case, plan=plan, setting=s) for plan, s in CASES.items()}
    cases["misuse"] = _misuse_case
    cases["checkpoint"] = partial(_checkpoint_case, folder=str(tmp_path_factory.mktemp("ckpt")))
    return run_cases(cases, WORLD, PER_NODE, timeout=1200)


@pytest.fixture(scope="module")
def reference():
    return reference_training(WORLD, MICRO_BATCHES, STEPS, torch.float32)


def compressed_by_hand(exact: Counter, grads, weights) -> Counter:
    """The exact step's events with each cross-node stage replaced by its compressed
    form: a reduce-scatter of k x m elements -> an all-to-all of k chunks; the replica
    all-reduce of n -> an all-to-all and an all-gather of k chunks of ceil(n/k); the
    post-step all-gather of k x m -> k chunks. Everything else as it was."""
    out = Counter()
    for (op, dim, k, nbytes, inter, phase), count in exact.items():
        n = nbytes // 4  # fp32 elements
        if inter and grads and op == "reduce_scatter" and dim in ("g", "os"):
            out[("all_to_all", dim, k, k * _chunk_bytes(grads, n // k), inter, phase)] += count
        elif inter and grads and op == "all_reduce" and dim == "rep":
            chunks = k * _chunk_bytes(grads, math.ceil(n / k))
            out[("all_to_all", dim, k, chunks, inter, phase)] += count
            out[("all_gather", dim, k, chunks, inter, phase)] += count
        elif inter and weights and op == "all_gather" and phase == "step":
            out[(op, dim, k, k * _chunk_bytes(weights, n // k), inter, phase)] += count
        else:
            out[(op, dim, k, nbytes, inter, phase)] += count
    return out


@pytest.mark.parametrize("plan", list(CASES))
def test_recorded_bytes_are_the_exact_step_compressed_by_hand(world, plan):
    setting = CASES[plan]
    exact = expected_step_events(plan, WORLD, PER_NODE, MICRO_BATCHES, 4)
    want = compressed_by_hand(exact, setting.get("grads"), setting.get("weights"))
    assert want != exact  # something in every case crosses nodes
    for rank, result in enumerate(world.get(plan)):
        got = Counter(result["events"])
        assert got == want, (rank, sorted((got - want).items()), sorted((want - got).items()))
    # inside a node nothing changed: every intra-node event is the exact step's
    intra = Counter({k: v for k, v in exact.items() if not k[4]})
    assert intra == Counter({k: v for k, v in want.items() if not k[4]})


def test_int8_gradients_carry_about_a_quarter_of_the_bytes(world):
    exact = expected_step_events((1, 1, 4), WORLD, PER_NODE, MICRO_BATCHES, 4)
    got = Counter(world.get((1, 1, 4))[0]["events"])
    sent = {op: sum(k[3] * v for k, v in c.items() if k[0] == op and k[5] == "sync")
            for op, c in (("reduce_scatter", exact), ("all_to_all", got))}
    ratio = sent["all_to_all"] / sent["reduce_scatter"]
    # payload 1/4 plus a scale per 256 elements, plus the padding of small chunks to
    # whole blocks (the test model's tensors are tiny)
    assert 0.25 + 1 / 256 <= ratio < 0.30, ratio


@pytest.mark.parametrize("plan", list(CASES))
def test_ranks_holding_the_same_rows_hold_identical_weights(world, plan):
    """Every rank lands the dequantized values of the same bytes, its own rows included:
    the ranks that share a P shard (same coordinate on "p": rank % s_p) agree bit for bit."""
    results = world.get(plan)
    s_p = plan[0]
    for rank, result in enumerate(results):
        twin = results[rank % s_p]
        for name, shard in result["p_shards"].items():
            assert torch.equal(shard, twin["p_shards"][name]), (rank, name)


@pytest.mark.parametrize("plan", list(CASES))
def test_losses_stay_within_the_codec_tolerance(world, reference, plan):
    setting = CASES[plan]
    tol = max(LOSS_TOLERANCE[c] for c in setting.values())
    losses = world.get(plan)[0]["losses"]
    gaps = [abs(a - b) for a, b in zip(losses, reference["losses"])]
    assert gaps[0] == pytest.approx(0, abs=1e-6)  # the first forward is before any exchange
    assert max(gaps) < tol, gaps
    assert 0 < world.get(plan)[0]["residual_norm"] < 1.0


def _misuse_case(rank, world):
    """Messages of the refused calls; the group still trains after them."""
    import warnings

    from amsp_dtensor.testing.scenarios import make_model, plan_mesh, shard_model

    plan = amsp.ShardingPlan(1, 1, 4)
    model = make_model(torch.float32)
    out = {}
    try:
        amsp.set_compression(model, grads="int8")
    except Exception as exc:  # noqa: BLE001 - the message is the result
        out["unsharded"] = f"{type(exc).__name__}: {exc}"
    shard_model(model, plan_mesh(plan, PER_NODE), plan)
    out["set"] = str(amsp.set_compression(model, grads="int8"))
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=1e-3)
    try:
        amsp.set_compression(model, grads="int8", weights="bf16")
    except Exception as exc:  # noqa: BLE001
        out["weights after optimizer"] = f"{type(exc).__name__}: {exc}"
    out["kept"] = str(amsp.set_compression(model, grads="bf16"))  # grads may change
    del optim
    # a plan with every stage inside a node (one node of 4 here): one warning, no error
    inside = make_model(torch.float32)
    shard_model(inside, plan_mesh(amsp.ShardingPlan(1, 1, 4), WORLD), amsp.ShardingPlan(1, 1, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amsp.set_compression(inside, grads="int8")
    out["inside a node"] = [str(w.message) for w in caught]
    return out


def test_misuse_is_refused_naming_the_fix(world):
    for result in world.get("misuse"):
        assert "not an AMSP root" in result["unsharded"], result
        assert result["set"] == "grads=int8" and result["kept"] == "grads=bf16"
        assert result["weights after optimizer"] == (
            "ValueError: set_compression(weights='bf16') after AMSPOptimizer was built: call "
            "amsp.set_compression before building the optimizer (with fp32 parameters its "
            "masters are views into them unless weights are compressed)")
        assert result["inside a node"] == [
            "set_compression(grads=int8): no stage of plan p1-g1-os4 on 4 ranks per node "
            "crosses nodes, so nothing is compressed (stages inside a node are always sent "
            "exactly)"]


def test_checkpoint_keeps_the_residuals_and_resets_them_on_another_plan(world):
    results = world.get("checkpoint")
    for rank, got in enumerate(results):
        assert got["saved_residuals"] > 0 and got["residuals_equal"], rank
        assert got["resumed"] == got["straight"], rank  # bit for bit, residuals included
        assert got["other_plan_residuals"] == 0
    assert results[0]["no_residuals_warnings"] == [
        f"{results[0]['folder']}/step-1 holds no error-feedback residuals and this job runs "
        "p1-g1-os4 on 4 ranks, 2 per node, grads=int8: they start from zero"]
    assert not any(got["no_residuals_warnings"] for got in results[1:])
    warned = [got["other_plan_warnings"] for got in results]
    # rank 0 alone warns, once, naming both settings
    assert len(warned[0]) == 1 and not any(warned[1:]), warned
    assert warned[0][0].endswith(
        "holds error-feedback residuals for p1-g1-os4 on 4 ranks, 2 per node, grads=int8 and "
        "this job runs p1-g1-os2 on 4 ranks, 2 per node, grads=int8: they start from zero")
