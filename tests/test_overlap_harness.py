"""tools/comm_modes on a 2-process gloo group, and tools/bench_overlap's report.

One process group for the module: two spawned processes run every comm-mode check and
send back what they saw; the report tests need no processes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import traceback

import pytest

from tools import bench_overlap as B


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checks(rank: int) -> dict:
    """Every comm-mode case on this rank; values as plain lists."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tools import comm_modes as C

    C.install()
    C.install()  # idempotent
    out: dict = {}
    assert dist.all_gather_single is c10d.all_gather_single
    r = float(rank + 1)

    def run(mode: str, async_op: bool) -> dict:
        res = {}
        with C.mode(mode):
            ag = torch.zeros(4)
            w1 = dist.all_gather_single(ag, torch.full((2,), r), async_op=async_op)
            rs = torch.zeros(2)
            w2 = dist.reduce_scatter_single(rs, torch.arange(4.0) + 10 * rank, async_op=async_op)
            ar = torch.full((3,), r)
            w3 = dist.all_reduce(ar, async_op=async_op)
            bc = torch.full((2,), r)
            w4 = dist.broadcast(bc, src=0, async_op=async_op)
            # the deprecated forms forward to the wrapped module globals
            ag2 = torch.zeros(2, 2)
            with pytest.warns(FutureWarning):
                w5 = c10d.all_gather_into_tensor(ag2, torch.full((1, 2), r), async_op=async_op)
            works = [w1, w2, w3, w4, w5]
            res["types"] = [type(w).__name__ for w in works]
            res["is_work"] = [isinstance(w, dist.distributed_c10d.Work) for w in works]
            res["completed"] = [bool(w.is_completed()) if w is not None else None
                                for w in works]
            res["waits"] = [w.wait() if w is not None else None for w in works]
            res["future"] = (w1.get_future().value()[0].tolist()
                             if isinstance(w1, C.CompletedWork) and mode == "noop" else None)
        res.update(ag=ag.tolist(), rs=rs.tolist(), ar=ar.tolist(), bc=bc.tolist(),
                   ag2=ag2.flatten().tolist(), mode_after=C.get_mode())
        return res

    for mode in C.MODES:
        for async_op in (False, True):
            out[f"{mode}/{'async' if async_op else 'sync'}"] = run(mode, async_op)
    try:
        C.set_mode("bogus")
    except ValueError as e:
        out["bad_mode"] = str(e)
    # FSDP2 accepts the completed works (isinstance Work, then wait) in a whole step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for layer in [model, *model]:
        layer.set_force_sum_reduction_for_comms(True)
    model[0].set_modules_to_forward_prefetch([model[1]])
    fsdp = {}
    for mode in C.MODES:
        with C.mode(mode):
            loss = model(torch.ones(2, 8) * (rank + 1)).sum()
            loss.backward()
        fsdp[mode] = {"grad_norm": float(sum(p.grad.to_local().norm() ** 2
                                             for p in model.parameters()))}
        model.zero_grad()
    out["fsdp"] = fsdp
    C.uninstall()
    out["uninstalled"] = not getattr(dist.all_gather_single, "_amsp_comm_mode", False)
    return out


def _proc(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        result = _checks(rank)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, result, None))
    except BaseException:  # noqa: BLE001 - report to the parent
        queue.put((rank, None, traceback.format_exc()))


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_proc, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, result, err = queue.get(timeout=120)
            if err:
                pytest.fail(f"rank {rank} failed:\n{err}")
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_real_mode_communicates(ranks):
    for rank, res in ranks.items():
        for kind in ("sync", "async"):
            r = res[f"real/{kind}"]
            assert r["ag"] == [1, 1, 2, 2] and r["ag2"] == [1, 1, 2, 2]
            # inputs [0, 1, 2, 3] and [10, 11, 12, 13] summed: [10, 12 | 14, 16]
            assert r["rs"] == [10 + 4 * rank, 12 + 4 * rank]
            assert r["ar"] == [3, 3, 3] and r["bc"] == [1, 1]
            assert r["mode_after"] == "real"
        assert ranks[rank]["real/async"]["types"] != ["CompletedWork"] * 5


def test_noop_mode_copies_locally_and_completes(ranks):
    for rank, res in ranks.items():
        mine = float(rank + 1)
        for kind in ("sync", "async"):
            r = res[f"noop/{kind}"]
            assert r["ag"] == [mine] * 4 and r["ag2"] == [mine] * 4  # input in every chunk
            assert r["rs"] == [10 * rank + 2 * rank, 10 * rank + 2 * rank + 1]  # own chunk
            assert r["ar"] == [mine] * 3 and r["bc"] == [mine] * 2  # untouched
        sync, asy = res["noop/sync"], res["noop/async"]
        assert sync["types"] == ["NoneType"] * 5
        assert asy["types"] == ["CompletedWork"] * 5
        assert all(asy["is_work"]) and all(asy["completed"]) and asy["waits"] == [True] * 5
        assert asy["future"] == [mine] * 4


def test_serial_mode_is_real_and_already_complete(ranks):
    for rank, res in ranks.items():
        r = res["serial/async"]
        assert r["ag"] == [1, 1, 2, 2] and r["ar"] == [3, 3, 3] and r["bc"] == [1, 1]
        assert r["rs"] == [10 + 4 * rank, 12 + 4 * rank]
        assert r["types"] == ["CompletedWork"] * 5 and all(r["completed"])
        assert res["serial/sync"]["types"] == ["NoneType"] * 5
        assert "unknown comm mode 'bogus'" in res["bad_mode"]
        assert res["uninstalled"]


def test_fsdp2_runs_in_every_mode(ranks):
    for res in ranks.values():
        f = res["fsdp"]
        assert f["real"]["grad_norm"] == pytest.approx(f["serial"]["grad_norm"])
        assert f["noop"]["grad_norm"] > 0
    # real gradients are summed over the ranks: identical on both
    assert ranks[0]["fsdp"]["real"] != ranks[0]["fsdp"]["noop"]


# ------------------------------------------------------------------ the report


def _fixture() -> dict:
    """2 reps x (AMSP all_on / none real, all_on noop / serial; ZeRO-3 real/noop/serial),
    one rep more for all_on; step times per rep chosen so the numbers are easy by hand."""
    res = []

    def add(system, config, mode, rep, times, blocked=None):
        res.append({"system": system, "config": config, "mode": mode, "rep": rep,
                    "step_times": times, "losses": [8.0, 7.9],
                    "recorded_blocked_s": blocked})

    p = "amsp:p2-g2-os4"
    # rep: real all_on, real none, noop, serial
    table = [(1.0, 1.5, 0.5, 1.5), (1.2, 1.5, 0.6, 1.6), (1.1, 1.65, 0.5, 1.5)]
    for rep, (on, none, noop, serial) in enumerate(table):
        add(p, "all_on", "real", rep, [on - 0.1, on + 0.1], blocked=0.2 + rep / 10)
        add(p, "none", "real", rep, [none, none])
        add(p, "all_on", "noop", rep, [noop])
        add(p, "all_on", "serial", rep, [serial])
        add("zero3", "all_on", "real", rep, [3.0])
        add("zero3", "all_on", "noop", rep, [1.0])
        add("zero3", "all_on", "serial", rep, [4.0 + rep])
    meta = {"amsp_plan": "p2-g2-os4", "bw": "200mbit", "link": "x", "link_short": "200mbit",
            "planner_note": "planner choice p2-g2-os4", "wall_s": 1.0, "nodes": 2,
            "ranks_per_node": 2, "machine": "test", "tokens_per_step": 1024,
            "model": {"params": 10},
            "args": {"flavor": "debugmodel", "seq": 64, "micro_batches": 4, "warmup": 1,
                     "steps": 2, "reps": 3, "plans": "", "inter_bw": 25e6,
                     "amsp_layout": "titan", "modes_per_config": False}}
    return {"meta": meta, "results": res}


def test_report_numbers_by_hand():
    rows = {(r["system"], r["config"]): r for r in B.summarize(_fixture())}
    on, none, z3 = rows[("amsp:p2-g2-os4", "all_on")], rows[("amsp:p2-g2-os4", "none")], \
        rows[("zero3", "all_on")]
    assert on["real"]["med"] == pytest.approx(1.1)
    # efficiency per rep: (1.5-1.0)/(1.5-0.5)=0.5, (1.6-1.2)/(1.6-0.6)=0.4, (1.5-1.1)/1.0=0.4
    assert on["efficiency"]["med"] == pytest.approx(0.4)
    assert (on["efficiency"]["min"], on["efficiency"]["max"]) == (pytest.approx(0.4),
                                                                   pytest.approx(0.5))
    # exposed per rep: 0.5, 0.6, 0.6
    assert on["exposed"]["med"] == pytest.approx(0.6)
    # speed-up vs none per rep: 1.5, 1.25, 1.5
    assert on["speedup"]["med"] == pytest.approx(1.5)
    assert on["speedup"]["min"] == pytest.approx(1.25)
    assert none["speedup"]["med"] == pytest.approx(1.0)
    assert none["shared"] and not on["shared"]  # none borrows all_on's noop / serial
    assert none["noop"]["med"] == pytest.approx(0.5)
    # none: efficiency (1.5-1.5)/1=0, (1.6-1.5)/1=0.1, (1.5-1.65)/1=-0.15
    assert none["efficiency"]["med"] == pytest.approx(0.0)
    assert on["recorded"]["med"] == pytest.approx(0.3)
    # ZeRO-3: (4-3)/(4-1)=1/3, (5-3)/4=0.5, (6-3)/5=0.6
    assert z3["efficiency"]["med"] == pytest.approx(0.5) and z3["speedup"] is None
    text = "\n".join(B.targets(_fixture()))
    assert "= 1.50 (1.25-1.50) (target >= 1.25x: met)" in text
    assert "overlap efficiency 0.40 (0.40-0.50) (target >= 0.6: MISSED)" in text
    # compute 0.5 s, communication 1.0 s: perfect overlap leaves 1.0 s; efficiency <= 0.5,
    # speed-up <= T_real(none) 1.5 / 1.0
    assert "efficiency can reach at most min / communication = 0.50" in text
    assert "beat none (T_real 1.500 s) by at most 1.50x" in text
    assert "(target efficiency 0.6 out of reach by construction here)" in text
    tab = B.table(_fixture())
    assert "| AMSP p2-g2-os4 (planned): none | 1.500 (1.500-1.650) | 0.500 (0.500-0.600) *" in tab


def test_overlap_section_replaced_in_place_and_kept_by_bench_report(tmp_path):
    from tools import bench_report

    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nbefore\n")
    data = _fixture()
    json_path = tmp_path / "overlap.json"
    json_path.write_text(json.dumps({"command": "python -m tools.bench_overlap --bw 200mbit",
                                     "runs": [data]}))
    png = tmp_path / "overlap.png"
    assert B.main(["--from-json", str(json_path), "--doc", str(doc), "--png", str(png)]) == 0
    assert png.stat().st_size > 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n\n" + B.BEGIN)
    assert text.rstrip().endswith(B.END) and "(overlap.png)" in text
    assert "python -m tools.bench_overlap --bw 200mbit" in text
    # a second render replaces the section, the text around it stays
    doc.write_text(text.rstrip("\n") + "\n\nafter\n")
    B.write([data], str(doc), str(png), "second command")
    again = doc.read_text()
    assert again.count(B.BEGIN) == 1 and "second command" in again
    assert again.startswith("# Benchmarks\n\nbefore\n") and again.endswith("after\n")
    # tools/bench.py's report rewrites the file and keeps the section
    kept = bench_report.keep_sections("# new report\n", str(doc))
    section = again[again.index(B.BEGIN):again.index(B.END) + len(B.END)]
    assert kept == "# new report\n\n" + section + "\n"
    assert bench_report.keep_sections("# new report\n", str(tmp_path / "missing.md")) == \
        "# new report\n"
    # other tools' marked sections are kept too, in their order
    other = "<!-- frontier-2x2:begin -->\nF\n<!-- frontier-2x2:end -->"
    doc.write_text("# old\n\n" + other + "\n\n" + section + "\n\ntail\n")
    assert bench_report.keep_sections("# new\n", str(doc)) == \
        "# new\n\n" + other + "\n\n" + section + "\n"


def test_options_reach_the_worker_and_schedule():
    """tools/bench_overlap forwards every workload and overlap option to the worker, and
    one repetition measures each configuration in real mode, noop / serial once per plan
    (with all switches on), and the baselines in all three modes."""
    from tools import bench_worker as W
    from tools import overlap_worker as O

    args = O.parse_args(["--out", "x", "--steps", "3", "--configs", "all_on,none",
                         "--modes-per-config", "--amsp-layout", "blocks"])
    assert (args.warmup, args.reps, args.plans) == (1, 3, "p1-g1-os2")  # harness defaults
    again = O.parse_args(O.overlap_argv(args) + ["--out", "x"])
    for dest in (*W.WORKLOAD_DESTS, "configs", "modes", "modes_per_config"):
        assert getattr(again, dest) == getattr(args, dest), dest
    plan = W.parse_plan("p2-g2-os4", 4, 2)
    default = O.parse_args(["--out", "x"])
    runs = O.schedule(default, plan, 4, 2)
    planned = [(c, m) for k, _p, c, m in runs if k == "amsp"]
    assert planned == [(c, "real") for c in O.CONFIGS] + [("all_on", "noop"),
                                                          ("all_on", "serial")]
    assert [k for k, *_ in runs].count("amsp:p1-g1-os2") == len(O.CONFIGS) + 2
    assert [(k, m) for k, _p, _c, m in runs if k in O.BASELINES] == [
        (k, m) for k in ("zero3", "hsdp") for m in ("real", "noop", "serial")]
    assert B.steps_for_bw("zero3@200mbit=1,hsdp=2", "200mbit") == "zero3=1,hsdp=2"
    assert B.steps_for_bw("zero3@200mbit=1,hsdp=2", "1gbit") == "hsdp=2"
    assert O.steps_for("zero3=1,hsdp=2") == {"zero3": 1, "hsdp": 2}
    per = O.schedule(args, plan, 4, 2)
    assert [(c, m) for k, _p, c, m in per if k == "amsp"] == [
        (c, m) for c in ("all_on", "none") for m in ("real", "noop", "serial")]
