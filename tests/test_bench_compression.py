"""tools/bench's compressed AMSP keys and their report, on hand-made results (no processes)."""

from __future__ import annotations

import pytest

from tools import bench_report as R
from tools.bench_systems import amsp_key, label


def test_amsp_key_carries_the_compression_setting():
    assert amsp_key("p2-g2-os4") == ("p2-g2-os4", "", {}, None)
    assert amsp_key("p2-g2-os4/step_off+g-int8+w-bf16") == (
        "p2-g2-os4", "step_off", {"grads": "int8", "weights": "bf16"}, None)
    assert amsp_key("p1-g1-os2+g-int8+noef")[2] == {"grads": "int8", "error_feedback": False}
    assert label("amsp:p2-g2-os4+g-bf16", 2) == "AMSP p2-g2-os4 +g-bf16"
    # the MoE flavour's plan pair: the expert plan is not a compression setting
    assert amsp_key("p2-g2-os4+e-p1-g1-os2+g-int8") == (
        "p2-g2-os4", "", {"grads": "int8"}, "p1-g1-os2")
    assert label("amsp:p2-g2-os4+e-p1-g1-os2+g-int8", 2) == \
        "AMSP p2-g2-os4 / experts p1-g1-os2 +g-int8"
    with pytest.raises(ValueError, match="unknown setting"):
        amsp_key("p2-g2-os4+fp8")
    with pytest.raises(ValueError, match="unknown setting"):
        amsp_key("p2-g2-os4+e-p1-g1-os1+e-p1-g1-os2")


def _res(config, rep, t, inter, loss):
    return {"config": config, "rep": rep, "mode": "real", "step_times": [t, t],
            "losses": [5.0, loss], "comm": {"recorder_wire": {"inter": inter, "intra": 1}}}


def test_wire_bytes_count_the_ring_factor():
    from types import SimpleNamespace as E

    from tools.bench_worker import wire_by_locality

    ev = [E(op="all_reduce", nbytes=400, group_size=2, inter_node=True),
          E(op="all_to_all", nbytes=200, group_size=2, inter_node=True),
          E(op="all_gather", nbytes=200, group_size=2, inter_node=False)]
    assert wire_by_locality(ev) == {"inter": 400 + 100, "intra": 100}


def test_compression_rows_pair_each_setting_with_its_exact_plan_per_repetition():
    data = {"meta": {"nodes": 2, "ranks_per_node": 2, "world": 4, "bw": "1gbit",
                     "planned": "p2-g2-os4", "wall_s": 10.0, "loadavg": [1.0, 2.0],
                     "machine": "cpu", "tokens_per_step": 1024,
                     "args": {"reps": 2, "warmup": 1, "steps": 2, "micro_batches": 4, "seq": 64}},
            "results": [_res("amsp:p2-g2-os4", 0, 9.0, 0, 4.0),  # the warm-up measurement
                        _res("amsp:p2-g2-os4", 0, 2.0, 400, 4.0),
                        _res("amsp:p2-g2-os4+g-int8", 0, 1.0, 100, 4.04),
                        _res("amsp:p2-g2-os4", 1, 4.0, 400, 4.0),
                        _res("amsp:p2-g2-os4+g-int8", 1, 3.0, 100, 4.04)]}
    rows = {r["setting"]: r for r in R.compression_rows(data)}
    assert rows["exact"]["ratio"]["med"] == 1.0
    g = rows["g-int8"]
    assert (g["ratio"]["min"], g["ratio"]["max"]) == (0.5, 0.75)
    assert g["bytes_ratio"] == 0.25 and g["loss_gap"] == pytest.approx(0.01)
    sec = R.compression_section({"2x2 1gbit": data}, ["cmd"])
    assert "| p2-g2-os4 (planned) | g-int8 | 2.000 (1.000-3.000) | 0.62 (0.50-0.75) |" in sec
    doc = R.assemble("# old\n\n" + R.OVERLAP[0] + "\nov\n" + R.OVERLAP[1], "# H\n", compression=sec)
    assert "ov" in doc and doc.index(R.OVERLAP[1]) < doc.index(R.COMPRESSION[0])
    assert R.assemble(doc, "# H\n").count(R.COMPRESSION[0]) == 1
