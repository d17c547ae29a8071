"""The cost-model validation harness (amsp_dtensor/harness/validate.py) on 2 gloo ranks:
every collective of a real step of the debugmodel is timed, and its calls are the
planner's predicted events, one for one. The numbers of the 4-rank runs (predicted vs
measured communication time and peak memory) come from tools/cost_validation.sh and are
in docs/planner.md; timing targets are not asserted here."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import pytest

from amsp_dtensor.plan.cost.comm import predicted_events
from amsp_dtensor.plan.cost.models import MODELS
from amsp_dtensor.harness.validate import call_breakdown, summarize
from amsp_dtensor.plan import ShardingPlan

pytestmark = pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1",
                                reason="multi-process")


def _torchrun(*args: str, env=None) -> None:
    # --standalone: a local rendezvous on a free port (fixed ports collide with other jobs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--standalone", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # our collectives use torch's current names, not the *_tensor forms it warns about
    assert "is deprecated" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One profile and one validate run of p2-g2-os2 (FSDP2 over p, RS over os is empty,
    post-step AG over the OS subgroup, clip's scalar AR): W=2 as 2 nodes of 1."""
    d = tmp_path_factory.mktemp("validate")
    _torchrun("-m", "amsp_dtensor.plan.profile", "--out", str(d / "bw.json"),
              "--ranks-per-node", "1", "--dtype", "float32", "--max-bytes", "1M",
              "--repeats", "2", "--target-ms", "1", "--rounds", "1")
    _torchrun("-m", "amsp_dtensor.plan.validate", "--plan", "2,2,2",
              "--ranks-per-node", "1", "--seq-len", "32", "--micro-batch", "1",
              "--steps", "3", "--table", str(d / "bw.json"), "--out", str(d / "val.json"))
    return d


def test_every_timed_call_is_a_predicted_event(run):
    r = json.loads((run / "val.json").read_text())
    plan = ShardingPlan(2, 2, 2).resolve(2, 1)
    model = MODELS["llama3_debugmodel"]
    events = predicted_events(plan, model.unit_param_shapes(), 2, 4, model.root_unit_index,
                              clip=True)
    predicted = collections.Counter()
    for ev in events:
        predicted[(ev.op, ev.group.size, ev.nbytes)] += ev.count
    assert r["predicted_calls"] == sum(predicted.values())
    for rank in r["ranks"]:
        # 2 timed steps (the first is warm-up), each the predicted schedule exactly
        assert rank["measured_comm_calls"] == [sum(predicted.values())] * 2
        timed = collections.Counter((op, len(group), nbytes)
                                    for op, group, nbytes, _ in rank["last_step_calls"])
        assert timed == predicted
        assert all(s > 0 for step in rank["call_seconds_by_step"] for s in step)


def test_summary_and_breakdown_agree(run):
    (row,) = summarize([run / "val.json"], run / "bw.json")
    r = json.loads((run / "val.json").read_text())
    assert row["plan"] == "p2-g2-os2" and row["calls"] == r["predicted_calls"]
    assert math.isfinite(row["predicted_comm"]) and row["predicted_comm"] > 0
    breakdown = call_breakdown(run / "val.json", run / "bw.json")
    # the step's prediction is the sum over kinds of call of count * table time
    total = sum(c["calls_per_step"] * c["predicted"] for c in breakdown)
    assert total == pytest.approx(row["predicted_comm"], rel=1e-9)
    assert sum(c["calls_per_step"] for c in breakdown) == row["calls"]
    # every step's measured comm time is the sum of its calls' slowest-rank times
    ranks = r["ranks"]
    per_step = [sum(max(x["call_seconds_by_step"][s][i] for x in ranks)
                    for i in range(len(ranks[0]["call_seconds_by_step"][s])))
                for s in range(2)]
    assert row["comm_per_step"] == pytest.approx(per_step)
    assert row["measured_peak"] > 0 and row["predicted_peak"] > 0


def test_summarize_cli_needs_a_table_or_memory(run, tmp_path, capsys):
    r = json.loads((run / "val.json").read_text())
    r["predicted_comm_seconds"] = None  # as a run without --table writes it
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(r))
    # `python -m amsp_dtensor.plan.validate summarize ...`, run in-process
    from amsp_dtensor.harness.validate import summarize_main

    with pytest.raises(SystemExit) as exit_:
        summarize_main([str(bare)])
    assert exit_.value.code == 2 and "pass --table, or --memory" in capsys.readouterr().err
    assert summarize_main(["--memory", str(bare)]) == 0
    out = capsys.readouterr().out
    assert "p2-g2-os2" in out and "pred ms" not in out
    assert summarize_main(["--table", str(run / "bw.json"), str(bare)]) == 0
    assert "per kind of call" in capsys.readouterr().out
