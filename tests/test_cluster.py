"""tools/cluster leaves nothing behind: namespaces, links and processes are gone after a
good run, a failing command, a timeout, a SIGTERM/SIGINT of the tool, and (via the stale
cleanup) a SIGKILL of the tool. Needs root + iproute2; skips with the reason otherwise.

Runs several torchruns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tools.cluster import netns

REPO = Path(__file__).resolve().parents[1]
WHY = netns.netns_available()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"emulated cluster: {WHY}")


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def _procs_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker.encode() in cmd and not zombie:
            found.append(int(entry))
    return found


class Run:
    """The cluster CLI as a child process with its output collected."""

    def __init__(self, *cluster_args: str, mode: str = "check", probe_args=()):
        self.marker = f"amsp-test-{uuid.uuid4().hex[:10]}"
        self.links_before = _root_links()
        argv = [sys.executable, "-m", "tools.cluster", "run", *cluster_args, "--",
                str(REPO / "tests" / "cluster_probe.py"), "--mode", mode, "--marker", self.marker,
                *probe_args]
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, count: int = 1, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while self.output.count(text) < count:
            assert self.proc.poll() is None, f"exited early:\n{self.output}"
            assert time.monotonic() < deadline, f"no {text!r} x{count}:\n{self.output}"
            time.sleep(0.1)

    def finish(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc

    def assert_clean(self) -> None:
        assert netns.our_namespaces() == [], f"namespaces left: {netns.our_namespaces()}"
        assert _root_links() <= self.links_before, "links left in the root namespace"
        assert _procs_with(self.marker) == [], f"processes left:\n{self.output}"


@pytest.fixture(autouse=True)
def _no_stale():
    if WHY is None:
        netns.clean_stale()
    yield


@needs_netns
def test_good_run_measures_links_and_cleans_up():
    run = Run("--nodes", "2", "--ranks-per-node", "2", "--bw", "200mbit",
              mode="bw", probe_args=("--mbytes", "4", "--reps", "2"))
    rc = run.finish()
    assert rc == 0, run.output
    line = next(l for l in run.lines if "PROBE " in l)
    import json
    res = json.loads(line.split("PROBE ", 1)[1])
    assert res["world"] == 4 and res["iface"] == "eth0"
    # same-node traffic never touches eth0; cross-node traffic is capped at 200 Mbit/s
    assert res["intra_iface_MB_seen_by_rank0"] < 0.5
    assert res["inter_iface_MB_seen_by_rank0"] >= 2 * 4
    assert res["inter_MBps"] < 200 / 8 * 1.1
    assert res["intra_MBps"] > 2 * res["inter_MBps"]
    run.assert_clean()


@needs_netns
def test_failing_command_returns_its_failure_and_cleans_up():
    run = Run("--nodes", "2", "--ranks-per-node", "1", mode="fail",
              probe_args=("--fail-rank", "1", "--exit-code", "3"))
    rc = run.finish()
    assert rc != 0, run.output
    assert "fails on purpose" in run.output
    run.assert_clean()


@needs_netns
def test_timeout_returns_124_and_cleans_up():
    run = Run("--nodes", "2", "--ranks-per-node", "1", "--timeout", "5", mode="sleep")
    rc = run.finish()
    assert rc == 124, run.output
    run.assert_clean()


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_tool_tears_down(sig):
    run = Run("--nodes", "2", "--ranks-per-node", "1", mode="sleep")
    run.wait_for("sleeping rank", count=2)
    assert len(netns.our_namespaces()) == 3  # 2 nodes + the switch
    run.proc.send_signal(sig)
    rc = run.finish()
    assert rc == 128 + sig, run.output
    run.assert_clean()


@needs_netns
def test_sigkilled_tool_is_cleaned_by_the_next_run():
    run = Run("--nodes", "2", "--ranks-per-node", "1", mode="sleep")
    run.wait_for("sleeping rank", count=2)
    run.proc.kill()  # no handler can run: namespaces stay until a later cleanup
    run.finish()
    assert len(netns.our_namespaces()) == 3
    out = subprocess.run([sys.executable, "-m", "tools.cluster", "clean"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "removed 3" in out.stdout, out
    run.assert_clean()


def test_no_netns_mode_runs_on_loopback():
    run = Run("--no-netns", "--nodes", "2", "--ranks-per-node", "1", mode="check")
    rc = run.finish()
    assert rc == 0, run.output
    assert '"iface": "lo"' in run.output
    assert _procs_with(run.marker) == []
