"""Repeat the multi-dimensional torchtitan runs beside a CPU load and tally the crashes.

    python tools/stress.py --configs pp_dp_tp,tp --runs 5 --load 8 [--systems amsp,titan]
        [--steps 12] [--switch no_async_unshard ...] [--src DIR] [--max-minutes M]
    python tools/stress.py --tally outputs/stress/<sweep> [...]   # tally recorded runs

Configurations (the debug recipe, recipes/debug_cpu.toml, gloo on CPU):
  tp        4 ranks, tensor_parallel_degree 2, AMSP plan p2-g2-os2 (tests/test_titan_tp.py)
  pp_dp_tp  8 ranks, pp 2 x dp 2 x tp 2, 1F1B, local batch 4, global -1, p2-g2-os2
            (tests/test_titan_pp.py, "1F1B-tp2")
  hsdp_tp   8 ranks, tp 2, AMSP p2-g2-os2 on dp 4 (2 replicas); torchtitan: replicate 2 x
            shard 2
Systems, alternating run by run within a configuration: ``amsp`` (``llama3_amsp`` and the
[amsp] factors) and ``titan`` (torchtitan's own FSDP2 trainer, ``--model.name llama3``
and its parallelism flags, same recipe and launcher).

Each run: ``torchrun -m amsp_dtensor.train`` from ``--src`` (cwd and PYTHONPATH: measure
another checkout, e.g. a ``git worktree``), PYTHONFAULTHANDLER=1, OMP_NUM_THREADS=1, its
own free rendezvous port, its own process group (killed on timeout, Ctrl-C or exit), a
timeout, a log and dump folder under ``--out`` (default outputs/stress/<UTC time>).
``--load L`` keeps busy-loop burners running so that the 1-minute load average (the runs'
ranks included) stays at least L: a burner is added while it is below L, one removed
while it is above L + 4. ``--switch`` (repeatable, AMSP runs only) turns one difference
off for a bisect; see SWITCHES.

A run is: pass (exit 0), crash (a signal: exit code < 0, a rank's negative exit code, or
a fatal line in the log: "Fatal Python error", "malloc()", "free()", "corrupted",
"Segmentation fault", "Aborted"; signature = the first such line + the innermost 3
Python frames of the crashing thread of faulthandler's dump), fail (an exception; its
last line) or timeout. One line per run; each run is also appended to
<out>/runs.jsonl; at the end a tally per (config, system). Exit 1 if any run crashed.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent

PLAN_222 = ["--amsp.param_shard", "2", "--amsp.grad_shard", "2", "--amsp.optim_shard", "2"]
# config -> (ranks, flags of both systems, AMSP-only flags, torchtitan-only flags)
CONFIGS = {
    "tp": (4, ["--parallelism.tensor_parallel_degree", "2"], PLAN_222, []),
    "pp_dp_tp": (8, ["--parallelism.pipeline_parallel_degree", "2",
                     "--training.local_batch_size", "4", "--training.global_batch_size", "-1",
                     "--parallelism.pipeline_parallel_schedule", "1F1B",
                     "--parallelism.tensor_parallel_degree", "2"], PLAN_222, []),
    "hsdp_tp": (8, ["--parallelism.tensor_parallel_degree", "2"], PLAN_222,
                ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2"]),
}
# bisect switch -> [amsp] flags it adds; a switch with no flags is a patch in
# tools/stress_switches.py (PATCHES), applied through --experimental.custom_import
SWITCHES = {
    "no_async_unshard": [],  # FSDP2 all-gathers synchronous on CPU (compat patch)
    "no_prefetch": ["--amsp.no-overlap-prefetch"],  # FSDP2's default prefetch, no explicit lists
    "no_grad_overlap": ["--amsp.no-overlap-grad-sync"],  # each grad collective waited at issue
    "no_param_update_overlap": ["--amsp.no-overlap-param-update"],
    "no_step_overlap": ["--amsp.no-overlap-step"],
}
FATAL = re.compile(r"Fatal Python error|malloc\(\)|free\(\)|corrupted|Segmentation fault"
                   r"|Aborted|double free")
NATIVE = re.compile(r"malloc\(\)|free\(\)|corrupted|double free")  # glibc's own line
RANK_SIGNAL = re.compile(r"exitcode\s*:\s*-(\d+)")
EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_LOSS = re.compile(r"step:\s*(\d+)\s.*?loss:\s*(-?[0-9.]+)")


# ---- load ------------------------------------------------------------------------------
class Load:
    """Busy-loop burner processes kept so the 1-minute load average is at least ``target``."""

    def __init__(self, target: float, initial: int, cap: int):
        self.target, self.cap = target, cap
        self.procs: list[subprocess.Popen] = []
        self.stop = threading.Event()
        for _ in range(initial):
            self._add()
        self.thread = None
        if target > 0:
            self.thread = threading.Thread(target=self._control, daemon=True)
            self.thread.start()

    def _add(self):
        self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                           start_new_session=True))

    def _control(self):
        while not self.stop.wait(20):
            load = os.getloadavg()[0]
            if load < self.target and len(self.procs) < self.cap:
                self._add()
            elif load > self.target + 4 and len(self.procs) > 1:
                self._kill(self.procs.pop())

    @staticmethod
    def _kill(proc):
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def close(self):
        self.stop.set()
        while self.procs:
            self._kill(self.procs.pop())


# ---- one run -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


CURRENT: dict = {"proc": None, "load": None}


def kill_group(proc):
    """SIGKILL the run's process group and every process below it: torchrun starts each
    rank in a session of its own, out of the group's reach, so a sweep stopped by hand left
    its ranks running until they found their peers gone."""
    if proc is None:
        return
    from cluster.launch import descendants  # tools/ is on sys.path (this script's folder)

    for pid in [proc.pid, *descendants(proc.pid)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


def command(config: str, system: str, steps: int, dump: Path, switches: list[str],
            port: int) -> list[str]:
    ranks, both, amsp_only, titan_only = CONFIGS[config]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(ranks), "--master_addr", "localhost",
           "--master_port", str(port), "-m", "amsp_dtensor.train",
           "--job.config_file", "recipes/debug_cpu.toml", "--job.dump_folder", str(dump),
           "--training.steps", str(steps), *both]
    if system == "titan":
        return cmd + ["--model.name", "llama3", *titan_only]
    cmd += amsp_only
    for name in switches:
        cmd += SWITCHES[name]
    if any(not SWITCHES[name] for name in switches):
        cmd += ["--experimental.custom_import", "stress_switches"]
    return cmd


def frames_of_crashing_thread(lines: list[str], start: int) -> list[str]:
    """The innermost 3 frames under faulthandler's "Current thread" (or the first thread)
    after line ``start``."""
    heads = [i for i in range(start, len(lines))
             if re.match(r"\s*(Current thread|Thread) 0x", lines[i])]
    current = [i for i in heads if "Current thread" in lines[i]]
    head = (current or heads or [None])[0]
    if head is None:
        return []
    frames = []
    for line in lines[head + 1:]:
        m = re.match(r'\s*File "([^"]+)", line (\d+) in (\S+)', line)
        if not m:
            break
        frames.append(f"{Path(m.group(1)).name}:{m.group(2)} {m.group(3)}")
        if len(frames) == 3:
            break
    return frames


def classify(rc: int | None, log: str) -> tuple[str, str]:
    lines = [ANSI.sub("", l) for l in log.splitlines()]
    if rc is None:
        return "timeout", ""
    fatal = [i for i, l in enumerate(lines) if FATAL.search(l) and "torch.distributed" not in l]
    native = [i for i in fatal if NATIVE.search(lines[i])]
    signals = RANK_SIGNAL.findall(log)
    if fatal or rc < 0 or signals:
        if fatal:
            first = (native or fatal)[0]
            head = lines[first].strip()
            head = re.sub(r"^\[rank\d+\]:\s*", "", head)
            frames = frames_of_crashing_thread(lines, first)
            return "crash", " | ".join([head, *frames])
        sig = f"signal {-rc}" if rc < 0 else f"rank exit signal {signals[0]}"
        return "crash", sig
    if rc == 0:
        return "pass", ""
    exc = [m.group(1).strip() for l in lines if (m := EXCEPTION.match(l.strip()))]
    exc = [e for e in exc if "ChildFailedError" not in e]
    return "fail", (exc[-1] if exc else f"exit {rc}: " + (lines[-1] if lines else ""))[:300]


def final_loss(log: str, steps: int) -> str:
    got = {int(s): v for s, v in STEP_LOSS.findall(ANSI.sub("", log))}
    return got.get(steps, "none")


def run_one(args, config: str, system: str, index: int, out: Path) -> dict:
    name = f"{config}-{system}-{index:03d}"
    dump, log_path = out / name, out / f"{name}.log"
    switches = args.switch if system == "amsp" else []
    port = free_port()
    cmd = command(config, system, args.steps, dump, switches, port)
    if args.lock:
        cmd = ["flock", args.lock, *cmd]
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(args.src), str(TOOLS)]),
               AMSP_STRESS_SWITCHES=",".join(switches))
    load0 = os.getloadavg()[0]
    start = time.time()
    with open(log_path, "w") as log:
        log.write(f"# cwd {args.src}\n# PYTHONPATH {env['PYTHONPATH']}\n"
                  f"# switches {','.join(switches) or '-'}\n# {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=args.src, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        CURRENT["proc"] = proc
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        kill_group(proc)  # stragglers of a finished torchrun too
        CURRENT["proc"] = None
    seconds = time.time() - start
    load1 = os.getloadavg()[0]
    text = log_path.read_text(errors="replace")
    outcome, detail = classify(rc, text)
    record = {"config": config, "system": system, "index": index, "outcome": outcome,
              "detail": detail, "rc": rc, "seconds": round(seconds, 1),
              "load_start": round(load0, 2), "load_end": round(load1, 2),
              "loss": final_loss(text, args.steps), "steps": args.steps,
              "burners": len(CURRENT["load"].procs) if CURRENT["load"] else 0,
              "switches": switches, "src": str(args.src), "log": str(log_path),
              "utc": datetime.now(timezone.utc).strftime("%H:%M:%S")}
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if outcome == "pass" and not args.keep_dumps:
        subprocess.run(["rm", "-rf", str(dump)])
    return record


def line(r: dict) -> str:
    sw = f" [{','.join(r['switches'])}]" if r["switches"] else ""
    return (f"{r['utc']} {r['config']} {r['system']}{sw} #{r['index']}: {r['outcome']}, "
            f"{r['seconds']:.0f} s, loss at step {r['steps']} {r['loss']}, load "
            f"{r['load_start']:.1f} -> {r['load_end']:.1f}, {r.get('burners', '?')} burners"
            + (f", {r['detail']}" if r["detail"] else "") + f"  ({r['log']})")


def tally(records: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r["config"], r["system"] + (f" [{','.join(r['switches'])}]" if r["switches"] else ""))
        groups.setdefault(key, []).append(r)
    rows = ["| config | system | runs | passed | crashes | other failures | timeouts "
            "| median s | load (1 min) |", "|---|---|---|---|---|---|---|---|---|"]
    signatures = []
    for (config, system), rs in groups.items():
        n = lambda o: sum(r["outcome"] == o for r in rs)  # noqa: E731
        loads = [r["load_start"] for r in rs] + [r["load_end"] for r in rs]
        med = statistics.median(r["seconds"] for r in rs)
        rows.append(f"| {config} | {system} | {len(rs)} | {n('pass')} | {n('crash')} | "
                    f"{n('fail')} | {n('timeout')} | {med:.0f} | "
                    f"{min(loads):.1f}-{max(loads):.1f} |")
        for outcome in ("crash", "fail"):
            sig: dict[str, list[str]] = {}
            for r in rs:
                if r["outcome"] == outcome:
                    sig.setdefault(r["detail"], []).append(r["log"])
            for s, logs in sig.items():
                signatures.append(f"- {config} {system}, {outcome} x{len(logs)}: `{s}` "
                                  f"({', '.join(logs)})")
    return "\n".join(rows + ([""] + signatures if signatures else []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--configs", default="pp_dp_tp,tp,hsdp_tp",
                   help=f"comma-separated, run in this order: {', '.join(CONFIGS)}")
    p.add_argument("--runs", type=int, default=5, help="runs per configuration and system")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--systems", default="amsp,titan", help="amsp,titan alternate run by run")
    p.add_argument("--load", type=float, default=8.0,
                   help="keep the 1-minute load average at least this (0: no burners)")
    p.add_argument("--burners", type=int, default=None,
                   help="burners to start with (default: load - ranks of the first config, at least 2)")
    p.add_argument("--switch", action="append", default=[], choices=sorted(SWITCHES),
                   help="bisect: turn one difference off in AMSP runs (repeatable)")
    p.add_argument("--src", type=Path, default=REPO,
                   help="checkout whose amsp_dtensor runs (cwd and PYTHONPATH of each run)")
    p.add_argument("--out", type=Path, default=None, help="default outputs/stress/<UTC time>")
    p.add_argument("--timeout", type=int, default=1500, help="seconds per run")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="start no run after this many minutes (0: no limit)")
    p.add_argument("--lock", default="", help="flock this file around each run (not the sweep)")
    p.add_argument("--keep-dumps", action="store_true", help="keep the dump folders of passes")
    p.add_argument("--tally", type=Path, nargs="+", metavar="OUT",
                   help="only print the tally of the runs recorded under these folders")
    args = p.parse_args(argv)

    if args.tally:
        records = [json.loads(l) for d in args.tally
                   for l in (d / "runs.jsonl").read_text().splitlines() if l.strip()]
        print(tally(records))
        return 1 if any(r["outcome"] == "crash" for r in records) else 0

    configs = [c for c in args.configs.split(",") if c]
    systems = [s for s in args.systems.split(",") if s]
    for c in configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}: {', '.join(CONFIGS)}")
    for s in systems:
        if s not in ("amsp", "titan"):
            p.error(f"unknown system {s!r}: amsp, titan")
    args.src = args.src.resolve()
    out = (args.out or REPO / "outputs" / "stress"
           / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    initial = args.burners if args.burners is not None else max(
        int(args.load) - CONFIGS[configs[0]][0], 2) if args.load > 0 else 0
    load = Load(args.load, initial, cap=max(int(args.load), 1) * 2)
    CURRENT["load"] = load

    def stop(*_):
        kill_group(CURRENT["proc"])
        load.close()
        sys.exit(130)

    atexit.register(lambda: (kill_group(CURRENT["proc"]), load.close()))
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)

    print(f"stress: {', '.join(configs)} x {args.runs} per system ({', '.join(systems)}), "
          f"{args.steps} steps, load >= {args.load}, switches {args.switch or '-'}, "
          f"src {args.src}, out {out}", flush=True)
    t0 = time.time()
    records = []
    for config in configs:
        for i in range(args.runs * len(systems)):
            if args.max_minutes and time.time() - t0 > args.max_minutes * 60:
                break
            r = run_one(args, config, systems[i % len(systems)], i // len(systems) + 1, out)
            records.append(r)
            print(line(r), flush=True)
    print(f"\nburners: {len(load.procs)} at the end (stopped); tally ({out}/runs.jsonl):")
    load.close()
    print(tally(records))
    return 1 if any(r["outcome"] == "crash" for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
