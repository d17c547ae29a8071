"""The profiler's group shapes and its output format (single process), and one real run
on 2 gloo ranks (spawned; small sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from amsp_dtensor.plan.cost.bandwidth import load_table
from amsp_dtensor.plan.cost.comm import dim_group
from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.harness.profile import _numel, _size, group_shapes, groups_of


def test_sizes():
    assert _size("1K") == 1024 and _size("16M") == 16 * 2**20 and _size("4096") == 4096
    assert _size("1GB") == 2**30


def test_sizes_round_to_whole_elements_per_rank():
    assert _numel("all_reduce", 4, 8, 4) == 1  # one fp32, any group size
    assert _numel("all_gather", 4, 8, 4) == 8  # one element per rank
    assert _numel("reduce_scatter", 1000, 3, 2) == 498  # multiple of 3 below 500
    assert _numel("broadcast", 4096, 4, 2) == 2048


def test_bad_arguments_exit_2_naming_the_flag(capsys):
    """Checked before any process group: argparse's one line and exit status 2 (run
    in-process; a subprocess per flag cost ~8 s of imports each)."""
    from amsp_dtensor.harness import profile

    for flag in ("--rounds", "--repeats", "--min-bytes"):
        with pytest.raises(SystemExit) as exit_:
            profile.main(["--out", "x.json", flag, "0"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and flag in err.splitlines()[-1], err
        assert "Traceback" not in err


def test_group_shapes_cover_every_plan_dim():
    W, R = 8, 2
    shapes = set(group_shapes(W, R))
    assert shapes == {(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4)}
    for plan in enumerate_plans(W, R):
        for dim in ("p", "g", "os", "rep", "shard"):
            g = dim_group(plan, dim)
            assert g.size == 1 or (g.size, g.stride) in shapes


def test_groups_tile_the_world():
    assert groups_of(2, 2, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_of(4, 1, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for size, stride in group_shapes(16, 4):
        ranks = sorted(r for g in groups_of(size, stride, 16) for r in g)
        assert ranks == list(range(16))


@pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1", reason="multi-process")
def test_profile_runs_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", "-m", "amsp_dtensor.plan.profile", "--out", str(out),
           "--ranks-per-node", "1", "--max-bytes", "16K", "--repeats", "2",
           "--target-ms", "1", "--rounds", "2", "--dtype", "float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the profiler uses torch's current collective names, not the *_tensor forms it warns about
    assert "is deprecated" not in proc.stderr, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo"
    ops = {(e["op"], e["group_size"], e["group_nodes"]) for e in data["entries"]}
    assert ops == {(op, 2, 2) for op in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")}
    assert data["rounds"] == 2
    points = {e["op"]: [p[0] for p in e["points"]] for e in data["entries"]}
    # from one fp32 (clip's scalar all-reduce) up; AG/RS need one element per rank
    assert points["all_reduce"] == points["broadcast"] == [4, 16, 64, 256, 1024, 4096, 16384]
    assert points["all_gather"] == points["reduce_scatter"] == [8, 16, 64, 256, 1024, 4096, 16384]
    table = load_table(out)  # the planner reads what the profiler writes
    assert table.time("all_reduce", 8192, dim_group(enumerate_plans(2, 1)[0], "rep")) > 0
