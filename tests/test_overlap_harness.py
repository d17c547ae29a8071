"""tools/bench_comm on a 2-process gloo group (counting, and the real / noop / serial modes
the overlap ablation times), and the overlap numbers of tools/bench_report by hand."""

from __future__ import annotations

import collections

import multiprocessing as mp
import socket
import traceback

import pytest

from tools import bench_report as R


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checks(rank: int) -> dict:
    """Every comm-mode case on this rank, and what the counter saw; plain lists."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from tools import bench_comm as C

    counter = C.install(ranks_per_node=1)  # one rank per node: every group crosses nodes
    # this torch's base tensor forms (*_single from 2.13; the *_tensor forms before)
    ag_name, rs_name = C._AG, C._RS
    assert C.install(1) is counter and getattr(dist, ag_name) is getattr(c10d, ag_name)
    out: dict = {}
    r = float(rank + 1)

    def run(mode: str, async_op: bool) -> dict:
        res = {}
        with C.mode(mode), counter.recording():
            ag = torch.zeros(4)
            w1 = getattr(dist, ag_name)(ag, torch.full((2,), r), async_op=async_op)
            rs = torch.zeros(2)
            w2 = getattr(dist, rs_name)(rs, torch.arange(4.0) + 10 * rank, async_op=async_op)
            ar = torch.full((3,), r)
            w3 = dist.all_reduce(ar, async_op=async_op)
            bc = torch.full((2,), r)
            w4 = dist.broadcast(bc, src=0, async_op=async_op)
            # the deprecated form forwards to the wrapped module global (2.13+), or is the
            # base form (2.11, 2.12): counted once either way
            ag2 = torch.zeros(2, 2)
            w5 = c10d.all_gather_into_tensor(ag2, torch.full((1, 2), r), async_op=async_op)
            works = [w1, w2, w3, w4, w5]
            res["types"] = [type(w).__name__ for w in works]
            res["completed"] = [bool(w.is_completed()) if w is not None else None for w in works]
            res["waits"] = [w.wait() if w is not None else None for w in works]
        res.update(ag=ag.tolist(), rs=rs.tolist(), ar=ar.tolist(), bc=bc.tolist(),
                   ag2=ag2.flatten().tolist(), counted=counter.bytes_by_locality(),
                   events=sorted(collections.Counter(counter.events).items()))
        return res

    for mode in C.MODES:
        for async_op in (False, True):
            out[f"{mode}/{'async' if async_op else 'sync'}"] = run(mode, async_op)
    # the list forms DeepSpeed uses are counted too (all-gather: the output list)
    with counter.recording():
        dist.all_gather([torch.zeros(3), torch.zeros(3)], torch.ones(3))
    out["list_form"] = counter.bytes_by_locality()
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
    out["fsdp"] = {}
    for mode in C.MODES:
        with C.mode(mode):
            model(torch.ones(2, 8) * (rank + 1)).sum().backward()
        out["fsdp"][mode] = float(sum(p.grad.to_local().norm() ** 2 for p in model.parameters()))
        model.zero_grad()
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


def test_real_mode_communicates_and_every_byte_is_counted_once(ranks):
    for rank, res in ranks.items():
        for kind in ("sync", "async"):
            r = res[f"real/{kind}"]
            assert r["ag"] == [1, 1, 2, 2] and r["ag2"] == [1, 1, 2, 2]
            # inputs [0, 1, 2, 3] and [10, 11, 12, 13] summed: [10, 12 | 14, 16]
            assert r["rs"] == [10 + 4 * rank, 12 + 4 * rank]
            assert r["ar"] == [3, 3, 3] and r["bc"] == [1, 1]
            # AG output 16 B, RS input 16 B, AR 12 B, BC 8 B, AG (old name) 16 B
            assert r["counted"] == {"intra": 0, "inter": 68}
            assert [e for e, _ in r["events"]] == [
                ("all_gather", 2, 16, True), ("all_reduce", 2, 12, True),
                ("broadcast", 2, 8, True), ("reduce_scatter", 2, 16, True)]
        assert res["list_form"] == {"intra": 0, "inter": 24}


def test_noop_mode_copies_locally_and_completes(ranks):
    for rank, res in ranks.items():
        mine = float(rank + 1)
        for kind in ("sync", "async"):
            r = res[f"noop/{kind}"]
            assert r["ag"] == [mine] * 4 and r["ag2"] == [mine] * 4  # input in every chunk
            assert r["rs"] == [10 * rank, 10 * rank + 1]  # a local chunk, values moot
            assert r["ar"] == [mine] * 3 and r["bc"] == [mine] * 2  # untouched
        assert res["noop/sync"]["types"] == ["NoneType"] * 5
        asy = res["noop/async"]
        assert asy["types"] == ["_Done"] * 5 and all(asy["completed"])
        assert asy["waits"] == [True] * 5


def test_serial_mode_is_real_and_already_complete(ranks):
    for rank, res in ranks.items():
        r = res["serial/async"]
        assert r["ag"] == [1, 1, 2, 2] and r["ar"] == [3, 3, 3] and r["bc"] == [1, 1]
        assert r["rs"] == [10 + 4 * rank, 12 + 4 * rank]
        assert r["types"] == ["_Done"] * 5 and all(r["completed"])
        assert res["serial/sync"]["types"] == ["NoneType"] * 5
        assert "unknown comm mode 'bogus'" in res["bad_mode"]


def test_fsdp2_runs_in_every_mode(ranks):
    for res in ranks.values():
        assert res["fsdp"]["real"] == pytest.approx(res["fsdp"]["serial"])
        assert res["fsdp"]["noop"] > 0 and res["fsdp"]["noop"] != res["fsdp"]["real"]


def _fixture() -> dict:
    """3 reps of AMSP all-on / none (real) with all-on noop and serial, and FSDP2 ZeRO-3
    in every mode; step times per rep chosen so the numbers are easy by hand."""
    res = []

    def add(config, mode, rep, times, blocked=None):
        res.append({"config": config, "mode": mode, "rep": rep, "step_times": times,
                    "losses": [8.0, 7.9], "waited_s_per_rank": [
                        None if blocked is None else {"in_step": blocked, "after_step": 0}]})

    p = "amsp:p2-g2-os4"
    table = [(1.0, 1.5, 0.5, 1.5), (1.2, 1.5, 0.6, 1.6), (1.1, 1.65, 0.5, 1.5)]
    for rep, (on, none, noop, serial) in enumerate(table):
        add(p, "real", rep, [on - 0.1, on + 0.1], blocked=0.2 + rep / 10)
        add(p + "/none", "real", rep, [none, none])
        add(p, "noop", rep, [noop])
        add(p, "serial", rep, [serial])
        add("zero3", "real", rep, [3.0])
        add("zero3", "noop", rep, [1.0])
        add("zero3", "serial", rep, [4.0 + rep])
    meta = {"bw": "200mbit", "link_short": "200mbit", "wall_s": 1.0, "nodes": 2,
            "ranks_per_node": 2, "machine": "test", "tokens_per_step": 1024,
            "args": {"warmup": 1, "steps": 2, "reps": 3}}
    return {"meta": meta, "results": res}


def test_overlap_numbers_by_hand():
    rows = {r["key"]: r for r in R.overlap_rows(_fixture())}
    on, none, z3 = rows["amsp:p2-g2-os4"], rows["amsp:p2-g2-os4/none"], rows["zero3"]
    assert on["real"]["med"] == pytest.approx(1.1) and on["noop"]["med"] == pytest.approx(0.5)
    # exposed per rep 0.5, 0.6, 0.6; efficiency (1.5-1.0)/1.0, (1.6-1.2)/1.0, (1.5-1.1)/1.0
    assert on["exposed"]["med"] == pytest.approx(0.6)
    assert on["efficiency"]["med"] == pytest.approx(0.4)
    assert on["efficiency"]["max"] == pytest.approx(0.5)
    assert on["speedup"]["med"] == pytest.approx(1.5) and on["recorded"]["med"] == pytest.approx(0.3)
    # none shares all-on's noop / serial (flagged); its speed-up against itself is 1
    assert none["shared"] and not on["shared"] and none["speedup"]["med"] == pytest.approx(1.0)
    assert z3["efficiency"]["med"] == pytest.approx(0.5) and z3["speedup"] is None
    table = R.overlap_table(_fixture())
    assert "| AMSP p2-g2-os4 (none) | 1.500 (1.500-1.650) | 0.500 (0.500-0.600) * |" in table
    assert "| FSDP2 reshard | 3.000 (3.000-3.000) |" in table
    sec = R.overlap_section([_fixture()], "python -m tools.bench_overlap --bw 200mbit")
    assert sec.startswith(R.OVERLAP[0]) and sec.endswith(R.OVERLAP[1]) and table in sec
