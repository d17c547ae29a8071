"""Launch one torchrun per emulated node, wait, and always tear everything down.

``run_cluster``: clean stale namespaces, build the network, start ``torchrun --nnodes N
--node_rank i`` in node i's namespace (or on loopback), stream their output prefixed with
``[n<i>]``, wait for all (or the first failure, or the timeout), then kill what is left and
delete the namespaces, also on an exception or SIGINT/SIGTERM/SIGHUP. A SIGKILLed tool
cannot clean up: its torchruns get SIGTERM (PR_SET_PDEATHSIG) and the next run (or
``python -m tools.cluster clean``) deletes the namespaces of owners that no longer exist.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import netns

REPO_ROOT = Path(__file__).resolve().parents[2]
EXIT_TIMEOUT = 124


class _Interrupted(BaseException):
    """Raised from a signal handler so that `finally` blocks run."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class ClusterSpec:
    nodes: int = 2
    ranks_per_node: int = 2
    link: netns.LinkSpec = field(default_factory=netns.LinkSpec)
    netns: bool = True  # False: N torchruns on the host loopback, no shaping
    timeout_s: float | None = None
    master_port: int = 29500
    prefix_output: bool = True


def _set_pdeathsig() -> None:
    """In the child: get SIGTERM if the tool dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    os.setsid()  # own process group: teardown signals the group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All live descendants of pid (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM each launcher and all its descendants, then SIGKILL survivors."""
    pids: set[int] = set()
    for p in procs:
        if p.poll() is None:
            pids.add(p.pid)
        pids.update(descendants(p.pid))

    def live() -> set[int]:
        for p in procs:
            p.poll()  # reap our direct children
        return {pid for pid in pids if _alive(pid)}

    netns.stop_processes(live, grace_s)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pump(stream, tag: str, out) -> None:
    for line in iter(stream.readline, b""):
        try:
            out.write(f"{tag}{line.decode(errors='replace')}")
            out.flush()
        except (ValueError, OSError):
            pass
    stream.close()


def torchrun_argv(spec: ClusterSpec, node_rank: int, master_addr: str, port: int,
                  command: list[str]) -> list[str]:
    if not command:
        raise ValueError("nothing to run: give `-- <python module or script> [args]`")
    if command[0] in ("-m", "--module") or command[0].endswith(".py"):
        target = command
    else:  # a bare dotted name is a module
        target = ["-m", *command]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(spec.nodes), "--node_rank", str(node_rank),
        "--nproc_per_node", str(spec.ranks_per_node),
        "--master_addr", master_addr, "--master_port", str(port),
        "--max_restarts", "0",
        *target,
    ]


def run_cluster(spec: ClusterSpec, command: list[str], log=None) -> int:
    """Run `command` on the emulated cluster; return the worst exit code (124 = timeout)."""
    log = log or (lambda msg: print(f"[cluster] {msg}", file=sys.stderr, flush=True))

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    old_handlers = {sig: signal.signal(sig, on_signal)
                    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    net: netns.Network | None = None
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    rc = 1
    try:
        if spec.netns:
            stale = netns.clean_stale()
            if stale:
                log(f"removed stale namespaces of dead runs: {' '.join(stale)}")
            net = netns.Network(spec.nodes, spec.link).create()
            log(net.describe())
            master_addr, port, iface = net.node_addr(0), spec.master_port, netns.NODE_IFACE
        else:
            master_addr, port, iface = "127.0.0.1", _free_port(), "lo"
            log(f"no-netns: {spec.nodes} torchrun(s) on loopback, master port {port}")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(GLOO_SOCKET_IFNAME=iface, TP_SOCKET_IFNAME=iface,
                   AMSP_CLUSTER_NODES=str(spec.nodes),
                   AMSP_CLUSTER_RANKS_PER_NODE=str(spec.ranks_per_node),
                   AMSP_CLUSTER_LINK=net.describe() if net else "loopback (no shaping)")
        for i in range(spec.nodes):
            argv = torchrun_argv(spec, i, master_addr, port, command)
            if net is not None:
                argv = ["ip", "netns", "exec", net.node_ns(i), *argv]
            p = subprocess.Popen(
                argv, cwd=REPO_ROOT, env=env, preexec_fn=_set_pdeathsig,
                stdout=subprocess.PIPE if spec.prefix_output else None,
                stderr=subprocess.STDOUT if spec.prefix_output else None)
            procs.append(p)
            if spec.prefix_output:
                t = threading.Thread(target=_pump, args=(p.stdout, f"[n{i}] ", sys.stdout),
                                     daemon=True)
                t.start()
                pumps.append(t)
        rc = _wait_all(procs, spec.timeout_s, log)
    except _Interrupted as e:
        log(f"{e}: tearing down")
        rc = 128 + e.signum
    finally:
        for sig in old_handlers:  # a second Ctrl-C must not cut teardown short
            signal.signal(sig, signal.SIG_IGN)
        try:
            _kill_tree(procs)
            if net is not None:
                net.destroy()
            for t in pumps:
                t.join(timeout=2)
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
    return rc


def _exit_code(p: subprocess.Popen) -> int:
    rc = p.returncode
    return 128 - rc if rc is not None and rc < 0 else (rc or 0)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float | None, log) -> int:
    """Wait for every node; stop early when one fails. Returns the worst exit code."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return max(_exit_code(p) for p in procs)
        failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed:
            # one node failed: the others would wait for it in the next collective
            time.sleep(2.0)  # let peers report their own error first
            log(f"node(s) {failed} exited with {[_exit_code(procs[i]) for i in failed]}; "
                "stopping the rest")
            return max(_exit_code(p) for p in procs if p.returncode is not None)
        if deadline is not None and time.monotonic() > deadline:
            log(f"timeout after {timeout_s:g}s: stopping all nodes")
            return EXIT_TIMEOUT
        time.sleep(0.1)
