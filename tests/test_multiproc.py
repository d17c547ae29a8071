"""amsp_dtensor.testing.multiproc.run_cases: cases share one gloo process group, and one
that raises fails only the tests that read it, with its traceback, while the cases around
it return their values."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from amsp_dtensor.testing.multiproc import run_cases

pytestmark = pytest.mark.skipif(os.environ.get("AMSP_SKIP_MULTIPROC") == "1",
                                reason="multi-process")


def _rank_times_ten(rank, world):
    return rank * 10


def _raises_everywhere(rank, world):
    raise ValueError(f"middle case broke on rank {rank}")


def _raises_on_rank_1(rank, world):
    # before any collective: the other rank is not left waiting
    if rank == 1:
        raise KeyError("only rank 1")
    return "fine"


def _sum_of_ranks(rank, world):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the group still works after the failed cases
    return total.item()


def _sleeps(rank, world):
    time.sleep(120)


@pytest.fixture(scope="module")
def results():
    return run_cases({"first": _rank_times_ten, "middle": _raises_everywhere,
                      "one rank": _raises_on_rank_1, "last": _sum_of_ranks}, 2, 1, timeout=120)


def test_cases_around_a_failure_return_their_values(results):
    assert results.get("first") == [0, 10]
    assert results.get("last") == [3.0, 3.0]  # 1 + 2, on both ranks


def test_a_case_raising_on_every_rank_fails_its_get_with_the_traceback(results):
    with pytest.raises(pytest.fail.Exception) as info:
        results.get("middle")
    report = str(info.value)
    assert "case 'middle' failed on rank(s) [0, 1] of 2" in report, report
    # the frame that raised, shown once for both ranks, then each rank's message
    assert report.count("in _raises_everywhere") == 1, report
    assert "--- ranks 0, 1 ---" in report, report
    assert "[rank 0] ValueError: middle case broke on rank 0" in report, report
    assert "[rank 1] ValueError: middle case broke on rank 1" in report, report


def test_a_case_raising_on_one_rank_fails_and_names_it(results):
    with pytest.raises(pytest.fail.Exception) as info:
        results.get("one rank")
    report = str(info.value)
    assert "failed on rank(s) [1] of 2" in report and "KeyError: 'only rank 1'" in report, report
    assert results.failure("first") is None and results.failure("one rank") == report
    with pytest.raises(KeyError):
        results.get("never defined")


def test_a_world_that_times_out_keeps_the_cases_it_finished():
    results = run_cases({"first": _rank_times_ten, "stuck": _sleeps, "after": _rank_times_ten},
                        2, 1, timeout=10)
    assert results.get("first") == [0, 10]
    for name in ("stuck", "after"):
        report = results.failure(name)
        assert f"case {name!r} did not finish on rank(s) [0, 1] of 2" in report, report
        assert "did not finish within 10s" in report, report
        assert "rank 0: 'stuck', rank 1: 'stuck'" in report, report


def _env_value(rank, world):
    return os.environ.get("AMSP_TEST_HANDED_OVER")


def test_a_rank_sees_the_environment_of_the_call(monkeypatch):
    """Ranks are forked from a server started earlier (see multiproc's note): each one
    still gets the caller's environment as it is now."""
    monkeypatch.setenv("AMSP_TEST_HANDED_OVER", "yes")
    assert run_cases({"env": _env_value}, 2, 1, timeout=60).get("env") == ["yes", "yes"]


_ORPHAN_WORLD = """
import os, sys, time
from amsp_dtensor.testing.multiproc import run_cases

def write_pid_and_wait(rank, world, folder):
    open(os.path.join(folder, f"rank{rank}"), "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    run_cases({"wait": write_pid_and_wait}, 2, 1, sys.argv[1], timeout=120)
"""


def test_ranks_end_with_a_killed_test_process(tmp_path):
    """The test process SIGKILLed mid-case (a CI timeout): its ranks do not live on."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "orphan_world.py"
    script.write_text(_ORPHAN_WORLD)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    deadline = time.time() + 60
    while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
        assert time.time() < deadline and parent.poll() is None, "the ranks never started"
        time.sleep(0.2)
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    while any(_alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids), pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
