"""Emulated nodes: network namespaces joined through a switch namespace, links shaped by tc.

    node namespace <tag>-n<i>                  switch namespace <tag>-sw
      lo (ranks of this node talk here, unshaped)
      eth0 198.18.0.<i+1>/24  <--veth-->  p<i>  --  br0 (Linux bridge)

Names carry ``PREFIX + owner pid`` so that stale ones can be found. Every veth is made inside
the switch namespace with its peer moved straight into the node's, so deleting the
namespaces removes everything. Both ends of every veth are shaped: a packet from node a to
node b crosses eth0(a) and p(b), so it sees the rate twice in series (throughput = bw). The
qdisc is netem ``rate <bw> delay <delay/2>``, or, on a kernel without sch_netem (this one),
``tbf rate <bw>`` with no delay (a warning and ``Network.describe`` say so).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass, field

PREFIX = "amspc"  # unique to this tool; stale cleanup only ever touches names with it
SUBNET = "198.18.0"  # benchmarking range (198.18.0.0/15), used only inside our namespaces
NODE_IFACE = "eth0"
MAX_NODES = 200

_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x(\d+)-(n\d+|sw)$")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one iproute2/tc command; errors carry the command and its stderr."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_available() -> str | None:
    """None if we can create namespaces here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "needs root for ip netns / tc"
    try:
        proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    except FileNotFoundError:
        return "iproute2 `ip` not installed"
    if proc.returncode != 0:
        return f"`ip netns list` failed: {proc.stderr.strip()}"
    try:
        subprocess.run(["tc", "-V"], capture_output=True, check=True)
    except (FileNotFoundError, subprocess.CalledProcessError):
        return "`tc` (iproute2) not usable"
    return None


def our_namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_processes(live, grace_s: float) -> None:
    """SIGTERM the pids ``live()`` returns, SIGKILL those still there after ``grace_s``;
    returns when ``live()`` is empty, or 5 s after the SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in live():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not live():
                return
            time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    """Stop every process in network namespace `ns`, then delete it."""
    def pids() -> list[int]:
        out = sh("ip", "netns", "pids", ns, check=False).stdout
        return [int(x) for x in out.split() if x.isdigit()]

    stop_processes(pids, grace_s=3.0)
    sh("ip", "netns", "del", ns, check=False)


def clean_stale() -> list[str]:
    """Delete our namespaces whose owner process is gone. Returns their names."""
    removed = []
    for ns in our_namespaces():
        m = _NAME_RE.match(ns)
        owner = int(m.group(1)) if m else -1
        if owner <= 0 or not _pid_alive(owner):
            delete_namespace(ns)
            removed.append(ns)
    return removed


@dataclass
class LinkSpec:
    bw: str = "1gbit"  # tc rate syntax: 1gbit, 200mbit, ...
    delay: str = "0.1ms"  # one-way node-to-node delay; half is applied at each hop
    limit: int = 10000  # netem queue length in packets (large: no tail drops at ~MB bursts)

    def _delay(self) -> tuple[float, str]:
        m = re.fullmatch(r"([0-9.]+)\s*(us|ms|s)", self.delay.strip())
        if not m:
            raise ValueError(f"--delay {self.delay!r}: use a number with us, ms or s (e.g. 0.1ms)")
        return float(m.group(1)), m.group(2)

    def half_delay(self) -> str:
        value, unit = self._delay()
        return f"{value / 2:g}{unit}"

    def delay_seconds(self) -> float:
        value, unit = self._delay()
        return value * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]

    def rate_bytes(self) -> float:
        """tc rate (bit, kbit, mbit, gbit; or ...bps for bytes) as bytes per second."""
        m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)", self.bw.strip().lower())
        if not m:
            raise ValueError(f"--bw {self.bw!r}: use tc rate syntax, e.g. 1gbit or 200mbit")
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
        value = float(m.group(1)) * scale
        return value / 8 if m.group(3) == "bit" else value


@dataclass
class Network:
    """N node namespaces + one switch namespace: ``create()``, then ``destroy()``."""

    nodes: int
    link: LinkSpec = field(default_factory=LinkSpec)
    tag: str = ""  # <PREFIX><pid>x<seq>; set in create()
    created: list[str] = field(default_factory=list)
    qdisc: str = ""  # "netem" or "tbf" once shaped

    _seq = 0

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def node_ns(self, i: int) -> str:
        return f"{self.tag}-n{i}"

    @staticmethod
    def node_addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def create(self) -> "Network":
        if not 1 <= self.nodes <= MAX_NODES:
            raise ValueError(f"--nodes {self.nodes}: use 1..{MAX_NODES}")
        Network._seq += 1
        self.tag = f"{PREFIX}{os.getpid()}x{Network._seq}"
        half = self.link.half_delay()
        try:
            self._add_ns(self.switch)
            sh("ip", "-n", self.switch, "link", "set", "lo", "up")
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.nodes):
                ns, port = self.node_ns(i), f"p{i}"
                self._add_ns(ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "-n", self.switch, "link", "add", port, "type", "veth",
                   "peer", "name", NODE_IFACE, "netns", ns)
                sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                sh("ip", "-n", self.switch, "link", "set", port, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", NODE_IFACE)
                sh("ip", "-n", ns, "link", "set", NODE_IFACE, "up")
                for where, dev in ((ns, NODE_IFACE), (self.switch, port)):
                    self._shape(where, dev, half)
        except BaseException:
            self.destroy()
            raise
        return self

    def _shape(self, ns: str, dev: str, half_delay: str) -> None:
        if self.qdisc in ("", "netem"):
            proc = sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem",
                      "rate", self.link.bw, "delay", half_delay, "limit", str(self.link.limit),
                      check=False)
            if proc.returncode == 0:
                self.qdisc = "netem"
                return
            if "unknown" not in proc.stderr.lower():
                raise RuntimeError(f"tc netem on {ns}/{dev} failed: {proc.stderr.strip()}")
            if self.link.delay_seconds() > 0:
                warnings.warn(f"this kernel has no sch_netem: shaping with tbf rate "
                              f"{self.link.bw} only, the {self.link.delay} delay is NOT applied")
        self.qdisc = "tbf"
        rate = self.link.rate_bytes()
        # burst: >= one 64 KiB GSO packet and ~1 ms of traffic; queue: ~100 ms of traffic
        burst = max(128 * 1024, int(rate * 1e-3))
        limit = max(4 * 1024 * 1024, int(rate * 0.1))
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.link.bw,
           "burst", str(burst), "limit", str(limit))

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.created.append(name)

    def destroy(self) -> None:
        # nodes first (their processes), then the switch; deleting a namespace destroys
        # its veth ends and with them the peers in the switch namespace
        for ns in reversed(self.created):
            delete_namespace(ns)
        self.created.clear()

    def describe(self) -> str:
        return (
            f"{self.nodes} node namespaces {self.tag}-n0..n{self.nodes - 1} on bridge "
            f"{self.switch}/br0, addresses {self.node_addr(0)}..{self.node_addr(self.nodes - 1)}"
            f"/24, " + (f"netem rate {self.link.bw} delay {self.link.half_delay()} per hop "
            f"(one-way {self.link.delay})" if self.qdisc == "netem" else
            f"tbf rate {self.link.bw} (no netem in this kernel: delay not emulated)")
            + " on both ends of every link"
        )
