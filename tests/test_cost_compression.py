"""Opt-in compression of the cross-node stages in the cost model, against hand-computed
bytes (plan/compression.py, predicted_events(compression=), memory, step time, CLI)."""

from __future__ import annotations

import json

import pytest

from amsp_dtensor.plan import ShardingPlan, enumerate_plans
from amsp_dtensor.plan.__main__ import main
from amsp_dtensor.plan.cost.bandwidth import SCHEMA, parse_table
from amsp_dtensor.plan.cost.comm import (
    AlphaBeta,
    GroupShape,
    dim_group,
    error_feedback_elements,
    event_counter,
    predicted_events,
)
from amsp_dtensor.plan.compression import (
    CODECS,
    INT8_BLOCK,
    Compression,
    chunk_nbytes,
    codec_applies,
)
from amsp_dtensor.plan.cost.memory import compression_bytes, estimate_memory
from amsp_dtensor.plan.cost.models import get_model
from amsp_dtensor.plan.cost.nccl import NcclModel, node_nic_bytes
from amsp_dtensor.plan.cost.planner import choose_plan
from amsp_dtensor.plan.cost.step import codec_bytes_touched, step_time

INT8 = Compression(grads="int8")
BF16 = Compression(grads="bf16")
UNIT = [[(2048, 4)]]  # 8192 elements: whole int8 blocks at every shard factor up to 32


def _plan(p, g, o, w, r):
    return ShardingPlan(p, g, o).resolve(w, r)


# ---- the codec arithmetic ----------------------------------------------------------------

def test_chunk_nbytes_by_hand():
    assert INT8_BLOCK == 256 and CODECS == ("bf16", "int8")
    assert chunk_nbytes("bf16", 1000) == 2000
    assert chunk_nbytes("int8", 256) == 256 + 4
    assert chunk_nbytes("int8", 257) == 2 * 256 + 2 * 4  # padded to whole blocks
    assert chunk_nbytes("int8", 1000) == 4 * 256 + 4 * 4
    assert chunk_nbytes("int8", 0) == 0
    assert codec_applies("bf16", 4) and not codec_applies("bf16", 2)
    assert codec_applies("int8", 4) and codec_applies("int8", 2)
    assert not codec_applies("int8", 1) and not codec_applies(None, 4)
    with pytest.raises(ValueError, match="valid codecs: bf16, int8"):
        chunk_nbytes("fp8", 4)


def test_compression_value_and_parse():
    c = Compression.parse("grads=int8,weights=bf16")
    assert c == Compression("int8", "bf16") and c.enabled and str(c) == "grads=int8,weights=bf16"
    assert Compression.parse("none") == Compression() == Compression.parse("")
    assert not Compression().enabled and str(Compression()) == "none"
    assert Compression.parse(" weights = int8 ") == Compression(weights="int8")
    assert Compression.parse("grads=none,weights=int8") == Compression(weights="int8")
    for bad, text in (("grads=fp8", "valid codecs: bf16, int8"),
                      ("grad=int8", "expected grads=CODEC and/or weights=CODEC"),
                      ("int8", "expected grads=CODEC"),
                      ("grads=int8,grads=bf16", "given twice")):
        with pytest.raises(ValueError, match=text):
            Compression.parse(bad)
    with pytest.raises(ValueError, match="valid codecs"):
        Compression(grads="int4")


# ---- the events --------------------------------------------------------------------------

def test_g_reduce_scatter_becomes_all_to_all_by_hand():
    """p1-g8-os8 on 8 ranks, 4 per node: the "g" group spans 2 nodes. fp32, M=3."""
    plan = _plan(1, 8, 8, 8, 4)
    assert dim_group(plan, "g").inter_node
    exact = predicted_events(plan, UNIT, 3, 4, root_unit_index=None)
    rs = 4 * 8192  # RS input: padded(U,8)/s_p elements, fp32
    assert event_counter(exact) == {
        ("reduce_scatter", "g", 8, rs, True, "backward"): 2,
        ("reduce_scatter", "g", 8, rs, True, "sync"): 1,
        ("all_gather", "g", 8, rs, True, "step"): 1,
    }
    # k = 8 chunks of m = 8192/8 = 1024 elements: int8 4 blocks of 256 B + 4 scales
    int8 = 8 * (4 * 256 + 4 * 4)
    ev = predicted_events(plan, UNIT, 3, 4, root_unit_index=None, compression=INT8)
    assert event_counter(ev) == {
        ("all_to_all", "g", 8, int8, True, "backward"): 2,
        ("all_to_all", "g", 8, int8, True, "sync"): 1,
        ("all_gather", "g", 8, rs, True, "step"): 1,  # weights not compressed
    }
    assert int8 / rs == pytest.approx(0.2539, abs=1e-4)  # (1 + 4/256) / 4
    bf16 = predicted_events(plan, UNIT, 3, 4, root_unit_index=None, compression=BF16)
    assert {e.nbytes for e in bf16 if e.op == "all_to_all"} == {rs // 2}
    assert all(e.codec == "int8" and e.raw_nbytes == rs for e in ev if e.op == "all_to_all")
    # weights int8: the post-step all-gather carries k = 8 compressed chunks of m = 1024
    ev = predicted_events(plan, UNIT, 3, 4, root_unit_index=None,
                          compression=Compression(weights="int8"))
    assert event_counter(ev)[("all_gather", "g", 8, int8, True, "step")] == 1
    assert event_counter(ev)[("reduce_scatter", "g", 8, rs, True, "sync")] == 1


def test_g_group_with_p_sharding():
    """p2-g8-os8, W=8 R=4: "g" = {0,2,4,6} spans 2 nodes, k = 4 chunks of padded(U,8)/8."""
    plan = _plan(2, 8, 8, 8, 4)
    ev = predicted_events(plan, UNIT, 1, 2, root_unit_index=None,
                          compression=Compression("int8", "int8"))
    counter = event_counter(ev)
    m = 8192 // 8
    assert counter[("all_to_all", "g", 4, 4 * chunk_nbytes("int8", m), True, "sync")] == 1
    # the post-step all-gather over "g": k = s_os/s_p = 4 chunks of the OS shard, bf16 data
    assert counter[("all_gather", "g", 4, 4 * chunk_nbytes("int8", m), True, "step")] == 1
    # the "p" collectives stay exact (inside a node)
    assert counter[("all_gather", "p", 2, 2 * 8192, False, "forward")] == 1
    # bf16 weights on bf16 params do not apply: the all-gather stays exact
    ev = predicted_events(plan, UNIT, 1, 2, root_unit_index=None,
                          compression=Compression(weights="bf16"))
    assert event_counter(ev) == event_counter(
        predicted_events(plan, UNIT, 1, 2, root_unit_index=None))


def test_intra_node_os_group_is_not_compressed_and_rep_all_reduce_splits():
    """p1-g1-os4, W=8 R=4: "os" is a node (exact), "rep" = {r, r+4} spans 2 nodes."""
    plan = _plan(1, 1, 4, 8, 4)
    assert not dim_group(plan, "os").inter_node and dim_group(plan, "rep").inter_node
    ev = predicted_events(plan, UNIT, 1, 4, root_unit_index=None,
                          compression=Compression("int8", "int8"))
    # n = padded(U,4)/4 = 2048 elements, rep = 2, m = 1024: rep * C(m) each way
    nb = 2 * chunk_nbytes("int8", 1024)
    assert event_counter(ev) == {
        ("reduce_scatter", "os", 4, 4 * 8192, False, "sync"): 1,
        ("all_to_all", "rep", 2, nb, True, "sync"): 1,
        ("all_gather", "rep", 2, nb, True, "sync"): 1,
        ("all_gather", "os", 4, 4 * 8192, False, "step"): 1,
    }
    assert not any(e.op == "all_to_all" and e.dim == "os" for e in ev)


def test_rep_all_reduce_uneven_chunks():
    """One (10, 3) tensor, p2-g4-os4 on 8 ranks (4 per node): n = 36/4 = 9, m = ceil(9/2)."""
    plan = _plan(2, 4, 4, 8, 4)
    ev = predicted_events(plan, [[(10, 3)]], 1, 4, root_unit_index=None, compression=BF16)
    rep = [e for e in ev if e.dim == "rep"]
    assert [(e.op, e.nbytes, e.phase) for e in rep] == [
        ("all_to_all", 2 * 2 * 5, "sync"), ("all_gather", 2 * 2 * 5, "sync")]
    ev = predicted_events(plan, [[(10, 3)]], 1, 4, root_unit_index=None, compression=INT8)
    assert {e.nbytes for e in ev if e.dim == "rep"} == {2 * (256 + 4)}


def test_os_reduce_scatter_and_weights_all_gather_across_nodes():
    """p1-g1-os8 on 8 ranks, 2 per node: the "os" group spans 4 nodes."""
    plan = _plan(1, 1, 8, 8, 2)
    c = Compression("int8", "bf16")
    ev = predicted_events(plan, UNIT, 2, 4, root_unit_index=None, compression=c)
    assert event_counter(ev) == {
        ("all_to_all", "os", 8, 8 * chunk_nbytes("int8", 1024), True, "sync"): 1,
        ("all_gather", "os", 8, 8 * 2 * 1024, True, "step"): 1,  # bf16: half the fp32 AG
    }
    exact = event_counter(predicted_events(plan, UNIT, 2, 4, root_unit_index=None))
    assert exact[("all_gather", "os", 8, 4 * 8192, True, "step")] == 1


def _units():
    return [[(10, 3), (7,)], [(33, 5)], [(2048, 4), (300, 7)], [(5, 5)]]


@pytest.mark.parametrize("world,per_node", [(4, 2), (8, 4), (8, 2), (16, 4), (4, 4)])
def test_none_equals_exact_and_only_inter_node_stages_change(world, per_node):
    units = _units()
    for plan in enumerate_plans(world, per_node):
        for e, r in ((2, 2), (2, 4), (4, 4)):
            args = dict(root_unit_index=3, reduce_dtype_bytes=r, clip=True)
            exact = predicted_events(plan, units, 3, e, **args)
            assert predicted_events(plan, units, 3, e, compression=None, **args) == exact
            assert predicted_events(plan, units, 3, e, compression=Compression(), **args) == exact
            for c in (Compression("int8", "int8"), Compression("bf16", "bf16")):
                ev = predicted_events(plan, units, 3, e, compression=c, **args)
                assert [x for x in ev if not x.inter_node] == \
                    [x for x in exact if not x.inter_node], plan.name
                assert all(x.inter_node for x in ev if x.codec is not None)
                # same phases and counts per (unit, dim)
                assert sorted((x.unit, x.dim, x.phase, x.count) for x in ev if x.op != "all_gather"
                              or x.dim != "rep") == sorted(
                    (x.unit, x.dim, x.phase, x.count) for x in exact), plan.name


# ---- time models -------------------------------------------------------------------------

def test_all_to_all_time_models():
    g = GroupShape(4, 4, 1, 4)
    ab = AlphaBeta()
    assert ab.time("all_to_all", 4000, g) == pytest.approx(3 * ab.inter_alpha + 0.75 * 4000 / ab.inter_bw)
    assert NcclModel().time("all_to_all", 1 << 20, g) > 0
    # s0 ranks of a node send their own off-node share: more NIC bytes than a ring RS
    g2 = GroupShape(8, 1, 4, 2)
    assert node_nic_bytes("all_to_all", 1000, g2, 8) == 4 * node_nic_bytes("reduce_scatter", 1000, g2, 8)
    assert NcclModel().time("all_to_all", 1 << 24, g2) > NcclModel().time("reduce_scatter", 1 << 24, g2)


def test_measured_table_times_all_to_all_as_reduce_scatter():
    table = parse_table({"schema": SCHEMA, "entries": [
        {"op": "reduce_scatter", "group_size": 2, "stride": 4, "group_nodes": 2,
         "inter_node": True, "points": [[1024, 1e-4], [1 << 20, 1e-2]]}]})
    g = GroupShape(2, 4, 1, 2)
    assert table.covers("all_to_all", g)
    assert table.time("all_to_all", 4096, g) == table.time("reduce_scatter", 4096, g)


def test_step_time_adds_codec_passes_only_with_compression():
    model = get_model("debugmodel")
    plan = _plan(1, 8, 8, 8, 4)
    shapes = model.unit_param_shapes()
    common = dict(seq_len=256, micro_batch=1, micro_batches=2, os_numel=1000)
    exact = predicted_events(plan, shapes, 2, 2, model.root_unit_index)
    comp = predicted_events(plan, shapes, 2, 2, model.root_unit_index, compression=INT8)
    st0 = step_time(model, exact, AlphaBeta(), **common)
    st1 = step_time(model, comp, AlphaBeta(), **common)
    assert st0.codec_seconds == 0.0
    touched = sum(e.count * codec_bytes_touched(e) for e in comp)
    assert touched > 0 and st1.codec_seconds == pytest.approx(touched / 2.0e12)
    a2a = next(e for e in comp if e.op == "all_to_all")
    assert codec_bytes_touched(a2a) == 4 * a2a.raw_nbytes + 2 * a2a.nbytes


# ---- memory ------------------------------------------------------------------------------

def test_memory_residuals_and_fp32_master_by_hand():
    # g RS across nodes: residual = the RS input, padded(U,8)/s_p = 8192 fp32 elements;
    # fp32 params with weights compressed over "g": fp32 master of the OS rows, 8192/8
    plan = _plan(1, 8, 8, 8, 4)
    cb = compression_bytes(UNIT, plan, Compression("int8", "int8"), 4)
    assert (cb.error_feedback, cb.fp32_master) == (4 * 8192, 4 * 1024)
    assert compression_bytes(UNIT, plan, Compression(grads="int8"), 4).fp32_master == 0
    assert compression_bytes(UNIT, plan, Compression(weights="int8"), 2).total == 0  # bf16 P
    # the os RS (s_g = s_p < s_os, "os" spans nodes): padded(U,8)/s_p
    plan = _plan(1, 1, 8, 8, 2)
    assert compression_bytes(UNIT, plan, INT8, 2, 4).error_feedback == 4 * 8192
    # rep AR: rep * ceil(n/rep), n = 36/4 = 9, rep = 2 -> 10 elements; "g" is in a node
    plan = _plan(2, 4, 4, 8, 4)
    assert error_feedback_elements(plan, [[(10, 3)]], INT8, 2) == 10
    assert compression_bytes([[(10, 3)]], plan, INT8, 2).error_feedback == 2 * 10
    # a codec that does not apply to the grad dtype keeps no residual
    assert compression_bytes([[(10, 3)]], plan, BF16, 2).error_feedback == 0


def test_estimate_memory_counts_compression_in_both_phases():
    model = get_model("debugmodel")
    plan = _plan(1, 8, 8, 8, 4)
    base = estimate_memory(model, plan, 256, 1, mixed_precision="fp32")
    assert "compression_error_feedback" not in base.as_dict()
    assert estimate_memory(model, plan, 256, 1, mixed_precision="fp32",
                           compression=Compression()).as_dict() == base.as_dict()
    c = Compression("int8", "bf16")
    mem = estimate_memory(model, plan, 256, 1, mixed_precision="fp32", compression=c)
    cb = compression_bytes(model.unit_param_shapes(), plan, c, 4)
    assert cb.error_feedback > 0 and cb.fp32_master > 0
    assert mem.backward_total == base.backward_total + cb.total
    assert mem.step_total == base.step_total + cb.total
    d = mem.as_dict()
    assert (d["compression_error_feedback"], d["compression_fp32_master"]) == \
        (cb.error_feedback, cb.fp32_master)


# ---- planner and CLI ---------------------------------------------------------------------

def test_choose_plan_with_compression():
    kw = dict(seq_len=2048, micro_batch=1, micro_batches=2, world_size=16, ranks_per_node=4,
              memory_budget_bytes=8 << 30, mixed_precision="fp32")
    exact = choose_plan("debugmodel", **kw)
    comp = choose_plan("debugmodel", compression="grads=int8,weights=bf16", **kw)
    assert comp.settings["compression"] == "grads=int8,weights=bf16"
    assert exact.settings["compression"] is None
    for c in comp.candidates:
        assert c.wire_bytes_inter <= c.wire_bytes_inter_exact
        assert c.memory.total >= next(e for e in exact.candidates
                                      if e.plan.name == c.plan.name).memory.total
    ddp = comp.baselines["ddp"]
    assert ddp.wire_bytes_inter < 0.3 * ddp.wire_bytes_inter_exact
    assert choose_plan("debugmodel", compression="none", **kw).as_dict() == exact.as_dict()


CLI = ["--model", "llama_7b", "--gpus", "64", "--gpus-per-node", "8", "--gpu-mem", "80",
       "--global-batch-tokens", "4194304", "--precision", "fp32"]


def test_cli_compress_prints_the_comparison(capsys):
    assert main([*CLI, "--compress", "grads=int8,weights=bf16"]) == 0
    out = capsys.readouterr().out
    assert "compression grads=int8,weights=bf16: only stages whose group spans nodes" in out
    assert "cross-node wire GB" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    table = out.split("compression grads=int8,weights=bf16:")[1].splitlines()
    row = next(line for line in table if line.startswith("*"))
    chosen = out.split("chosen: ")[1].split(",")[0]
    assert row.split()[0] == "*" + chosen
    exact_wire, comp_wire, ratio = (float(x) for x in row.split()[1:4])
    assert comp_wire < exact_wire and ratio == pytest.approx(comp_wire / exact_wire, abs=2e-3)
    assert main([*CLI, "--compress", "none"]) == 0
    assert "compression" not in capsys.readouterr().out


def test_cli_compress_json(capsys):
    assert main([*CLI, "--compress", "grads=int8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["compression"]["codecs"] == {"grads": "int8", "weights": None}
    rows = data["compression"]["comparison"]
    assert rows[0]["role"] == "chosen" and rows[0]["plan"] == data["chosen"]["name"]
    assert data["chosen"]["compression"] == "grads=int8"


def test_cli_bad_codec_is_one_line(capsys):
    assert main([*CLI, "--compress", "grads=fp8"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert "--compress" in lines[0] and "valid codecs: bf16, int8" in lines[0]


def test_schedule_differences_takes_compression():
    from amsp_dtensor.plan.cost.check import schedule_differences

    plan = _plan(1, 8, 8, 8, 4)
    recorded = list(event_counter(predicted_events(
        plan, UNIT, 1, 4, None, compression=INT8)).elements())
    assert schedule_differences(plan, UNIT, 1, 4, None, recorded, compression=INT8) == []
    assert schedule_differences(plan, UNIT, 1, 4, None, recorded) != []
