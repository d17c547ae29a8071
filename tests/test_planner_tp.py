"""The planner with tensor parallelism (TP), against independent references.

- DTensor itself: this file doubles as a probe script. Run as a subprocess (its own process,
  so torch's fake process group does not leak into other tests), it builds torchtitan's
  llama3 model, applies torchtitan's own ``apply_tp`` on a fake TP group and reports the
  local parameter shapes on the first and the last TP rank, the bytes autograd saves in a
  block and in the root under TP, and every collective DTensor and FSDP2 issue in one
  micro-batch's forward and backward (with loss_parallel on and off, and with torchtitan's
  full activation checkpointing). The cost model must equal all of them.
- The formulas by hand: the data-parallel world, group geometry and state bytes of a plan
  beside TP, the TP collectives' time.
- The refusals (one line naming the key or flag), and ``--tp auto``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from amsp_dtensor.plan import ShardingPlan, data_parallel_world, enumerate_plans
from amsp_dtensor.plan.__main__ import main
from amsp_dtensor.plan.cost.comm import predicted_events
from amsp_dtensor.plan.cost.memory import (
    block_activation_bytes,
    estimate_memory,
    root_activation_bytes,
    state_bytes,
)
from amsp_dtensor.plan.cost.models import MODELS, ModelShape, llama3_ffn_hidden
from amsp_dtensor.plan.cost.nccl import NcclModel
from amsp_dtensor.plan.cost.planner import choose_plan
from amsp_dtensor.plan.cost.tensor_parallel import tp_events

GiB = 2**30

# The probe's model: torchtitan's debugmodel widths with GQA (4 KV heads, so at tp 4 each
# rank holds one) and a vocabulary that 4 does not divide (DTensor's uneven chunks: 513,
# 513, 513, 511 rows), one layer.
PROBE_ARGS = dict(dim=256, n_layers=1, n_heads=16, n_kv_heads=4, vocab_size=2050,
                  multiple_of=256, ffn_dim_multiplier=None)
TP, BATCH, SEQ = 4, 2, 64


def probe_shape(layout: str = "blocks") -> ModelShape:
    a = PROBE_ARGS
    return ModelShape("probe", a["dim"], a["n_layers"], a["n_heads"], a["vocab_size"],
                      llama3_ffn_hidden(a["dim"], a["multiple_of"], a["ffn_dim_multiplier"]),
                      a["n_kv_heads"], layout=layout)


# ---------------------------------------------------------------------------------------
# the probe (runs in its own process: python tests/test_planner_tp.py)


def _probe() -> dict:
    import copy

    import torch
    import torch.nn.functional as F

    import amsp_dtensor.titan  # noqa: F401  (CPU shims before torchtitan is imported)
    from amsp_dtensor.compat import init_fake_process_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    args = copy.deepcopy(llama3_args["debugmodel"])
    for key, value in PROBE_ARGS.items():
        setattr(args, key, value)
    args.max_seq_len = SEQ
    out: dict = {"shapes": {}}

    def world(rank):
        torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
        init_fake_process_group(rank, TP)
        # ("dp", "tp"): tp innermost, as torchtitan builds it; one DP rank suffices here
        return init_device_mesh("cpu", (1, TP), mesh_dim_names=("dp", "tp"))

    # 1. local shapes on the first and the last TP rank (meta: no memory)
    for rank in (0, TP - 1):
        mesh = world(rank)
        with torch.device("meta"):
            model = Transformer(args)
        apply_tp(model, mesh["tp"], loss_parallel=True, enable_float8_tensorwise_tp=False)
        out["shapes"][rank] = {name.removeprefix("layers.0."): list(p.to_local().shape)
                               for name, p in model.named_parameters()}

    class Collectives(TorchDispatchMode):
        """Functional collectives (what DTensor and FSDP2's TP handling issue), with the
        recorder's byte convention: AG output, RS input, AR tensor."""

        def __init__(self):
            super().__init__()
            self.events = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # let DTensor turn the op into collectives first
            name = func._overloadpacket.__name__
            if func.namespace == "_c10d_functional" and name in (
                    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
                x = args[0]
                nbytes = x.numel() * x.element_size() * (
                    args[1] if name == "all_gather_into_tensor" else 1)
                self.events.append([name.split("_into")[0].removesuffix("_tensor"),
                                    nbytes, self.phase])
            return func(*args, **(kwargs or {}))

    mesh = world(0)
    tokens = torch.randint(0, PROBE_ARGS["vocab_size"], (BATCH, SEQ))

    def build(loss_par: bool, ac: str):
        torch.manual_seed(0)
        model = Transformer(args).to(torch.bfloat16)
        apply_tp(model, mesh["tp"], loss_parallel=loss_par, enable_float8_tensorwise_tp=False)
        if ac == "full":
            apply_ac(model, ActivationCheckpoint(mode="full"))
        return model

    # 2. saved activations under TP (no FSDP2: only the model's own tensors)
    model = build(True, "none")
    skip = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(model.freqs_cis.untyped_storage().data_ptr())
    saved: dict = {}

    def pack(x):
        local = x._local_tensor if isinstance(x, DTensor) else x
        storage = local.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), loss_parallel():
        h = model.tok_embeddings(tokens)
        saved.clear()
        h = model.layers["0"](h, model.freqs_cis, None, None)
        out["block_saved"] = sum(saved.values())
        saved.clear()
        logits = model.output(model.norm(h))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="sum")
        out["root_tail_saved"] = sum(saved.values())
        loss.backward()
    # the gradients autograd leaves before any data-parallel code sees them
    out["grads"] = {name: [type(p.grad.placements[0]).__name__, list(p.grad.to_local().shape)]
                    for name, p in model.named_parameters()
                    if name in ("tok_embeddings.weight", "norm.weight", "output.weight")}

    # 3. the collectives of one micro-batch, with FSDP2 over a one-rank DP mesh (its
    # post-backward is what all-reduces the norms' Partial gradients)
    out["collectives"] = {}
    for loss_par, ac in ((True, "none"), (False, "none"), (True, "full")):
        model = build(loss_par, ac)
        fully_shard(model.layers["0"], mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        rec = Collectives()
        ctx = loss_parallel() if loss_par else torch.autograd.graph.saved_tensors_hooks(
            lambda x: x, lambda x: x)
        with rec, ctx:
            rec.phase = "forward"
            loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten(),
                                   reduction="sum")
            rec.phase = "backward"
            loss.backward()
        out["collectives"][f"{loss_par}-{ac}"] = rec.events
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def probe():
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:  # pragma: no cover
        pytest.skip("torchtitan not installed")
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# DTensor vs the model


@pytest.mark.parametrize("rank", ["0", str(TP - 1)])
def test_tp_local_shapes_equal_dtensor(probe, rank):
    shape = probe_shape()
    real = probe["shapes"][rank]
    model = {p.name: list(p.shape) for unit in shape.units(TP) for p in unit}
    if rank == "0":  # the model takes rank 0's chunk, the largest: exactly rank 0's shapes
        assert model == real
    else:  # the last rank holds the short vocab chunk (2050 = 3 x 513 + 511), nothing else
        assert {k: v for k, v in real.items() if v != model[k]} == {
            "tok_embeddings.weight": [511, 256], "output.weight": [511, 256]}
    # and the mapping itself, stated: Colwise dim 0, Rowwise dim 1, norms whole
    assert real["attention.wk.weight"] == [4 * 16 // TP, 256]  # one KV head per rank
    assert real["attention.wo.weight"] == [256, 256 // TP]
    assert real["feed_forward.w2.weight"] == [256, 768 // TP]
    assert real["attention_norm.weight"] == real["norm.weight"] == [256]


def test_tp_activations_equal_saved_tensors(probe):
    shape = probe_shape()
    assert probe["block_saved"] == block_activation_bytes(shape, SEQ, BATCH, 2, tp=TP)
    # the root minus the token ids (saved by the embedding, before the probe's clear),
    # plus the 4-byte total_weight scalar of nll_loss
    root = root_activation_bytes(shape, SEQ, BATCH, 2, tp=TP)
    assert probe["root_tail_saved"] == root - 8 * SEQ * BATCH + 4


def test_tp_gradients_as_the_memory_and_comm_models_take_them(probe):
    # the embedding's gradient comes out replicated, the whole vocab x dim on every TP
    # rank (memory.py's fifth backward moment); a SequenceParallel norm's is Partial, so
    # FSDP2 or the engine all-reduces it over TP (tensor_parallel.py); the output head's
    # stays sharded like its weight
    assert probe["grads"] == {"tok_embeddings.weight": ["Replicate", [2050, 256]],
                              "norm.weight": ["Partial", [256]],
                              "output.weight": ["Shard", [513, 256]]}


@pytest.mark.parametrize("loss_parallel, ac", [(True, "none"), (False, "none"),
                                               (True, "full")])
def test_tp_collectives_equal_dtensor(probe, loss_parallel, ac):
    recorded = Counter(tuple(e) for e in probe["collectives"][f"{loss_parallel}-{ac}"])
    predicted = Counter()
    for ev in tp_events(probe_shape(), TP, seq_len=SEQ, micro_batch=BATCH, micro_batches=1,
                        dtype_bytes=2, activation_checkpointing=ac,
                        loss_parallel=loss_parallel):
        predicted[(ev.op, ev.nbytes, ev.phase)] += ev.count
    assert recorded == predicted


# ---------------------------------------------------------------------------------------
# the formulas by hand


def test_clip_adds_one_scalar_all_reduce_over_tp():
    # the engine's clip_grad_norm_ under TP: its "shard" all-reduce, then one over "tp"
    # (the one TP collective amsp.record_comms sees)
    evs = tp_events(probe_shape(), TP, seq_len=SEQ, micro_batch=BATCH, micro_batches=3,
                    dtype_bytes=2, clip=True)
    step = [(e.op, e.dim, e.group_size, e.nbytes, e.inter_node, e.phase, e.count)
            for e in evs if e.phase == "step"]
    assert step == [("all_reduce", "tp", TP, 4, False, "step", 1)]
    # everything else is per micro-batch: 3 x the one-micro-batch schedule
    one = tp_events(probe_shape(), TP, seq_len=SEQ, micro_batch=BATCH, micro_batches=1,
                    dtype_bytes=2)
    assert [e.count for e in evs if e.phase != "step"] == [3 * e.count for e in one]


def test_data_parallel_world_and_group_geometry():
    assert data_parallel_world(1024, 8, 8) == (128, 1)
    assert data_parallel_world(1024, 8, 2) == (512, 4)
    # "node" is the node's DP ranks: R / tp
    assert ShardingPlan("node", "node", "full").resolve(1024, 8, tensor_parallel_degree=2) \
        == ShardingPlan(4, 4, 512).resolve(512, 4)
    assert len(enumerate_plans(1024, 8, 2)) == len(enumerate_plans(512, 4))
    # p8 beside tp 2 on 2 nodes of 8 GPUs: 8 DP ranks, 4 per node, so "p" spans both nodes
    rp = ShardingPlan(8, 8, 8).resolve(16, 8, tensor_parallel_degree=2)
    m = MODELS["llama3_debugmodel"]
    ag = next(e for e in predicted_events(rp, m.unit_param_shapes(2), 1, 2, m.root_unit_index)
              if e.op == "all_gather")
    assert (ag.group_size, ag.group_nodes, ag.inter_node) == (8, 2, True)
    # its bytes: the block's TP-local shapes, each padded over 8
    block = (3 * 128 * 256 + 256 * 128 + 2 * 384 * 256 + 256 * 384 + 2 * 256)
    assert ag.nbytes == 2 * block


def test_state_bytes_of_tp_local_shapes_by_hand():
    m = MODELS["llama3_70b"]
    h, f, kv, V, L = 8192, 28672, 1024, 128256, 80
    # per TP rank at tp 8: wq, wo 1/8; wk, wv 128 rows; w1, w2, w3 1/8; norms whole
    block = h * h // 8 * 2 + 2 * kv // 8 * h + 3 * f // 8 * h + 2 * h
    root = 2 * (V // 8) * h + h
    phi_local = L * block + root
    rp = ShardingPlan(1, 1, 16).resolve(1024, 8, tensor_parallel_degree=8)
    sb = state_bytes(m.unit_param_shapes(8), rp.s_p, rp.s_g, rp.s_os, 2)
    assert (sb.param, sb.grad) == (2 * phi_local, 2 * phi_local)
    # OS over 16 (every dim0 divides 16 here, norms' 8192 too): 12 / 16 per element
    assert sb.optim == 12 * phi_local // 16
    # against tp 1: the replicated norms are the only parameters not divided by 8
    assert 8 * phi_local - m.num_params == 7 * (2 * L + 1) * h


def test_tp_comm_time_on_the_critical_path():
    """One block's forward under tp 8 (llama3_70b, seq 8192): 2 all-gathers and 2
    reduce-scatters of 8192 x 8192 x 2 B over one node's 8 GPUs, NCCL ring/Simple
    (tests/test_cost_nccl.py checks that formula), added to the step."""
    m = MODELS["llama3_70b"]
    evs = tp_events(m, 8, seq_len=8192, micro_batch=1, micro_batches=1, dtype_bytes=2)
    block_fwd = [e for e in evs if e.unit == 0 and e.phase == "forward"]
    assert {(e.op, e.nbytes, e.count, e.group_size, e.inter_node) for e in block_fwd} == {
        ("all_gather", 8192 * 8192 * 2, 2, 8, False),
        ("reduce_scatter", 8192 * 8192 * 2, 2, 8, False)}
    nccl = NcclModel()
    per_call = 8192 * 8192 * 2 * 7 / 8 / 150e9  # ring: (n-1)/n of the buffer at 150 GB/s
    t_ag = nccl.time("all_gather", 8192 * 8192 * 2, block_fwd[0].group)
    assert per_call < t_ag < per_call + 50e-6  # plus NCCL's latency, tens of us


@pytest.fixture(scope="module")
def tp_70b():
    """llama3_70b on 1024 GPUs, 16M tokens, full checkpointing: tp 1 and 8."""
    kw = dict(seq_len=8192, micro_batch=1, world_size=1024, ranks_per_node=8,
              memory_budget_bytes=80 * GiB, reserve_bytes=5 * GiB,
              activation_checkpointing="full", global_batch_tokens=16 * 2**20)
    return {t: choose_plan("llama3_70b", tp=t, **kw) for t in (1, 8)}


def test_step_time_adds_tp_comm_and_divides_compute(tp_70b):
    one, eight = tp_70b[1].best, tp_70b[8].best
    assert tp_70b[8].settings["micro_batches"] == 8 * tp_70b[1].settings["micro_batches"]
    # same global batch: the GPU computes the same FLOPs (1/8 of 8x the micro-batches),
    # so the compute differs only by the optimizer step (OS elements differ)
    assert eight.step.compute_seconds == pytest.approx(one.step.compute_seconds, rel=0.01)
    # TP's time is the sum of its collectives, all exposed
    tm = NcclModel()
    assert eight.tp_comm_seconds == pytest.approx(
        sum(e.count * tm.time(e.op, e.nbytes, e.group) for e in eight.tp_events))
    assert eight.step.exposed_comm_seconds >= eight.tp_comm_seconds
    assert eight.step.seconds >= eight.step.compute_seconds + eight.tp_comm_seconds
    # MFU is the GPU's share: the same model FLOPs per step, the longer step
    assert eight.step.mfu * eight.step_seconds == pytest.approx(one.step.mfu * one.step_seconds)
    # memory is of the TP-local shapes: P at s_p = 1 is the TP-local model
    assert eight.memory.states.param == 2 * sum(
        -(-s[0] // eight.plan.s_p) * (s[1] if len(s) > 1 else 1)
        for u in MODELS["llama3_70b"].unit_param_shapes(8) for s in u)


def test_tp_1_is_the_data_parallel_planner(tp_70b):
    # the explicit tp=1 path and the global batch give today's plan at micro_batches=2
    default = choose_plan("llama3_70b", seq_len=8192, micro_batch=1, micro_batches=2,
                          world_size=1024, ranks_per_node=8, memory_budget_bytes=80 * GiB,
                          reserve_bytes=5 * GiB, activation_checkpointing="full")
    a, b = tp_70b[1], default
    assert [c.as_dict() for c in a.candidates] == [c.as_dict() for c in b.candidates]
    assert a.best.tp_events == [] and a.best.tp_comm_seconds == 0.0


def test_tp_memory_activations_shrink():
    m = MODELS["llama3_70b"]
    rp1 = ShardingPlan(64, 64, 256).resolve(1024, 8)
    rp8 = ShardingPlan(8, 8, 32).resolve(1024, 8, tensor_parallel_degree=8)
    one = estimate_memory(m, rp1, 8192, 1, activation_checkpointing="full")
    eight = estimate_memory(m, rp8, 8192, 1, activation_checkpointing="full", tp=8)
    # full checkpointing keeps each block's input: a sequence shard under TP
    L, T, h, V = 80, 8192, 8192, 128256
    root1 = T * (8 + 8 * h + 4 + 2 * h + 4 * V + 8)  # ids, norm (+ its output), log-softmax, labels
    assert one.activations == L * T * 2 * h + root1
    root8 = T * (8 + 2 * h + 4 * (V // 8) + 8) + T // 8 * (8 * h + 4)
    assert eight.activations == L * T // 8 * 2 * h + root8


# ---------------------------------------------------------------------------------------
# refusals and --tp auto


def test_refusals_name_the_key():
    with pytest.raises(ValueError, match=r"^tensor_parallel_degree=3 does not divide "
                       r"ranks_per_node=8: .*use one of 1, 2, 4, 8$"):
        ShardingPlan(1, 1, 8).resolve(64, 8, tensor_parallel_degree=3)
    with pytest.raises(ValueError, match=r"under tensor_parallel_degree=4 .* 64 / 4 = 16 ranks "
                       r"\(2 per node\): .*optim=32 does not divide 16"):
        ShardingPlan(2, 2, 32).resolve(64, 8, tensor_parallel_degree=4)
    # "node" (8) beside tp 2 is 4 DP ranks; an explicit 8 still fits 32 DP ranks
    assert ShardingPlan(8, 8, 8).resolve(64, 8, tensor_parallel_degree=2).s_p == 8
    with pytest.raises(ValueError, match="n_kv_heads=8: every TP rank needs whole KV heads"):
        choose_plan("llama3_8b", tp=16, seq_len=8192, micro_batch=1, micro_batches=1,
                    world_size=64, ranks_per_node=16, memory_budget_bytes=80 * GiB)
    with pytest.raises(ValueError, match=r"seq_len=100 is not a multiple of 2 x "
                       "tensor_parallel_degree = 8"):
        choose_plan("llama3_8b", tp=4, seq_len=100, micro_batch=1, micro_batches=1,
                    world_size=64, ranks_per_node=8, memory_budget_bytes=80 * GiB)
    with pytest.raises(ValueError, match="tp='auto' compares TP degrees at one global batch"):
        choose_plan("llama3_8b", tp="auto", seq_len=8192, micro_batch=1, micro_batches=1,
                    world_size=64, ranks_per_node=8, memory_budget_bytes=80 * GiB)


CLI = ["--model", "llama3_70b", "--gpus", "1024", "--gpus-per-node", "8", "--gpu-mem", "80",
       "--seq-len", "8192", "--global-batch-tokens", str(16 * 2**20)]


@pytest.mark.parametrize("extra, message", [
    (["--tp", "3"], "--tp 3 does not divide --gpus-per-node 8: a TP group must sit inside "
                    "one node (consecutive ranks, tp innermost); use one of 1, 2, 4, 8"),
    (["--tp", "x"], "argument --tp: invalid value 'x' (a TP degree or 'auto')"),
    (["--tp", "0"], "--tp must be positive or auto, got 0"),
    (["--tp", "8", "--global-batch-tokens", str(8192 * 64)],
     "not a multiple of seq-len x micro-batch x data-parallel ranks (gpus / tp 8) = 1048576"),
])
def test_cli_tp_refusals(extra, message, capsys):
    args = CLI[:-2] + extra if "--global-batch-tokens" in extra else CLI + extra
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_cli_tp_auto_fits_and_is_no_slower_than_tp1(capsys):
    assert main(CLI + ["--activation-checkpointing", "full", "--tp", "auto", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_tp = data["by_tp"]
    assert set(by_tp) == {"1", "2", "4", "8"}
    chosen = data["chosen"]
    assert chosen["fits"] and chosen["tensor_parallel_degree"] == data["tensor_parallel_degree"]
    assert by_tp["1"]["chosen"]["fits"]
    assert chosen["step_seconds"] <= by_tp["1"]["chosen"]["step_seconds"]
    fastest = min(v["chosen"]["step_seconds"] for v in by_tp.values() if v["chosen"]["fits"])
    assert chosen["step_seconds"] <= fastest * 1.01
    # the global batch is the same at every degree: DP ranks x micro-batches
    for t, v in by_tp.items():
        s = v["settings"]
        assert s["data_parallel_world_size"] * s["micro_batches"] == 1024 * 2
        assert s["data_parallel_world_size"] == 1024 // int(t)


def test_tp_auto_where_tp1_does_not_fit():
    """llama3_405b on 1024 GPUs: no data-parallel plan fits 80 GB at seq 8192 (the
    activations); some TP degree does, and its TOML names it."""
    r = choose_plan("llama3_405b", tp="auto", seq_len=8192, micro_batch=1, world_size=1024,
                    ranks_per_node=8, memory_budget_bytes=80 * GiB, reserve_bytes=5 * GiB,
                    activation_checkpointing="full", global_batch_tokens=16 * 2**20)
    assert not r.by_tp[1].best.fits
    assert r.best.fits and r.tp > 1
    assert r.best.memory.total <= 80 * GiB
    assert r.to_toml().startswith(f"[parallelism]\ntensor_parallel_degree = {r.tp}\n\n[amsp]\n")


def test_cli_tp_table(capsys):
    assert main(CLI + ["--activation-checkpointing", "full", "--tp", "auto"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    rows = [line for line in out.splitlines() if line[:1] in "* " and line[1:4].strip().isdigit()]
    assert [int(r[1:4]) for r in rows] == [1, 2, 4, 8]
    assert sum(r.startswith("*") for r in rows) == 1


if __name__ == "__main__":  # the probe: one process, torch's fake process group
    print(json.dumps(_probe()))
