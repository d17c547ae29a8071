"""Run functions on N CPU ranks (gloo) in one process group and collect each rank's results.

Tests start one process group per test module (8 processes on 2 cores are slow to start
and to connect) and run every case of the module inside it::

    results = run_cases({"plain": plain_case, ("plan", 2): partial(plan_case, s=2)},
                        world_size=4, ranks_per_node=2)
    per_rank = results.get("plain")  # [rank 0's return value, rank 1's, ...]

``run_cases`` runs each case on its own: the rank worker catches an exception per case
and records its traceback, the ranks agree after every case on which of them failed it
(an ``all_gather_object`` of each rank's status), and the next case runs. ``get`` of a
case that failed on any rank fails the calling test with that case's traceback(s); every
other case's values are unaffected. Values reach the test process as each case ends (one
file per rank and case), so a world that later dies keeps the cases it finished.

The limit: a case that raises on SOME ranks only can leave the other ranks inside one of
its collectives, waiting for ranks that have moved on to the status exchange. The group
does not recover from that: the world runs until ``timeout`` and is killed, and every
case that had not finished by then fails (its message says which case each rank was in).
That is accepted: the cases here fail on every rank alike (the same code on the same
data), and the failing case is still the first one reported.

``run_on_ranks`` is the older form: one function, every rank's return value, and any
rank's exception raised in the caller.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Mapping

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from ..compat import destroy_process_group_at_exit


# [Note: ranks forked from a server that imported torch once] Spawned ranks each start
# an interpreter and import torch and amsp_dtensor afresh: on 2 cores a 4-rank world took
# 8 s and an 8-rank one 13 s before its first case, for every world of every test module.
# The ranks are forked instead from multiprocessing's fork server, which imports these
# modules once per test process and runs no work of its own (forking it is safe: the only
# thread it starts, OpenBLAS's pool, is stopped by OpenBLAS around a fork). As with spawn,
# a rank sees none of the parent's in-memory changes (module state, monkeypatches), and
# multiprocessing hands over sys.path and the working directory. Three things differ,
# and are handled here:
# - the environment is the server's, from its own start: the parent's current one is
#   restored in the rank before the case functions are unpickled (which imports their
#   modules); what a C library read at the server's import stays as it was then;
# - the rank's parent is the server, so torch's parent-death signal would never fire if
#   the test process died: each rank watches the test process and ends with it;
# - every rank shares the server's hash seed and memory layout (under torchrun each rank
#   has its own): AMSP_TEST_START_METHOD=spawn runs the worlds spawned, as before.
_PRELOAD = ["torch", "torch.distributed", "amsp_dtensor", "amsp_dtensor.testing.multiproc"]


def _start_ranks(worker, args: tuple, world_size: int):
    """``worker(rank, *args)`` in ``world_size`` processes (see the note above)."""
    method = os.environ.get("AMSP_TEST_START_METHOD", "forkserver")
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts
    return mp.start_processes(_as_parent, args=(dict(os.environ), pickle.dumps((worker, args))),
                              nprocs=world_size, join=False, start_method=method)


def _as_parent(rank, environ: dict, worker_and_args: bytes) -> None:
    os.environ.clear()
    os.environ.update(environ)
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_end_with, args=(parent.sentinel,), daemon=True).start()
    worker, args = pickle.loads(worker_and_args)
    worker(rank, *args)


def _end_with(parent_sentinel) -> None:
    """Kill this rank once the process that started it is gone."""
    multiprocessing.connection.wait([parent_sentinel])
    os.kill(os.getpid(), signal.SIGKILL)


def _setup_rank(rank, ranks_per_node):
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    os.environ["LOCAL_RANK"] = str(rank % ranks_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def _end_group(healthy: bool) -> None:
    if not dist.is_initialized():
        return
    if healthy:  # after a failure the other ranks may be stuck in a collective: no barrier
        try:
            destroy_process_group_at_exit()
        except RuntimeError:  # another rank failed and never reached the barrier
            pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank, world_size, ranks_per_node, init_file, out_dir, fn, args):
    _setup_rank(rank, ranks_per_node)
    result = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report, never hang the parent
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        _end_group(result is not None and result[0] == "ok")


def _join(ctx, timeout: float) -> str | None:
    """Wait for every rank; None when all exited, else why the world was stopped."""
    deadline = time.time() + timeout
    try:
        while not ctx.join(timeout=5):
            if time.time() > deadline:
                _kill(ctx)
                return f"the world did not finish within {timeout:g}s and was killed"
    except ProcessException as e:  # a rank died (signal, os._exit): join killed the rest
        return f"a rank process died: {e}"
    except BaseException:  # interrupted here (Ctrl-C, a test timeout): no rank outlives it
        _kill(ctx)
        raise
    return None


def _kill(ctx) -> None:
    for p in ctx.processes:
        p.kill()
    for p in ctx.processes:
        p.join()


def run_on_ranks(fn, world_size: int, ranks_per_node: int, *args, timeout: float = 600):
    """fn(rank, world_size, *args) on every rank; returns the list of results by rank.

    Raises RuntimeError with the rank's traceback if any rank failed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = _start_ranks(_worker, (world_size, ranks_per_node, init_file, tmp, fn, args),
                           world_size)
        stopped = _join(ctx, timeout)
        if stopped is not None:
            raise TimeoutError(stopped) if "did not finish" in stopped else RuntimeError(stopped)
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


# ---- one process group, many cases ----------------------------------------------------------
def _write(path: str, obj) -> None:
    """Write atomically: the test process never reads half a file of a killed rank."""
    with open(path + ".part", "wb") as f:
        pickle.dump(obj, f)
    os.replace(path + ".part", path)


def _case_worker(rank, world_size, ranks_per_node, init_file, out_dir, fns, args):
    _setup_rank(rank, ranks_per_node)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
    except BaseException:
        _write(os.path.join(out_dir, f"rank{rank}.start"), traceback.format_exc())
        _end_group(False)
        return
    healthy = True
    for index, fn in enumerate(fns):
        with open(os.path.join(out_dir, f"rank{rank}.current"), "w") as f:
            f.write(str(index))
        try:
            # pickled here, so that a value that cannot travel fails its case like a raise
            value, ok = pickle.dumps(fn(rank, world_size, *args)), True
        except Exception:
            value, ok = traceback.format_exc(), False
        _write(os.path.join(out_dir, f"rank{rank}.case{index}"), (ok, value))
        try:
            # every rank learns which ranks failed the case, and no rank starts the next
            # case before all have left this one
            statuses = [None] * world_size
            dist.all_gather_object(statuses, ok)
        except Exception:  # the group is broken: nothing later can run
            healthy = False
            _write(os.path.join(out_dir, f"rank{rank}.broken"),
                   (index, traceback.format_exc()))
            break
        if not all(statuses):
            # a failed case drops its model and optimizer mid-step, possibly in reference
            # cycles through its traceback: free them on every rank before the next case
            import gc

            gc.collect()
    _end_group(healthy)


class CaseResults:
    """The outcome of run_cases: per case, every rank's value or why it has none."""

    def __init__(self, names, world_size, values, failures):
        self.names = list(names)
        self.world_size = world_size
        self._values = values  # name -> [per-rank value]
        self._failures = failures  # name -> report

    def failure(self, name: Hashable) -> str | None:
        """The report of a case that failed or did not finish; None if it passed."""
        if name not in self._values and name not in self._failures:
            raise KeyError(f"no case {name!r} was run (cases: {self.names})")
        return self._failures.get(name)

    def get(self, name: Hashable) -> list:
        """Every rank's return value of case ``name``, by rank; fails the calling test
        with the case's traceback(s) if it raised on any rank or did not finish."""
        report = self.failure(name)
        if report is None:
            return self._values[name]
        try:
            import pytest
        except ImportError:
            raise CaseFailed(report) from None
        pytest.fail(report, pytrace=False)

    def __repr__(self):
        return (f"CaseResults({len(self.names)} cases on {self.world_size} ranks, "
                f"failed: {sorted(map(repr, self._failures))})")


class CaseFailed(AssertionError):
    """A case of run_cases failed (raised by CaseResults.get without pytest)."""


def _tracebacks(by_rank: dict[int, str]) -> str:
    """Each distinct traceback once, headed by the ranks that raised it; ranks whose
    tracebacks differ in the final line only (a message naming the rank) share one, with
    each rank's final line listed."""
    groups: dict[str, dict[int, str]] = {}  # the traceback less its final line -> rank: line
    for rank, text in sorted(by_rank.items()):
        lines = text.rstrip().splitlines() or [""]
        groups.setdefault("\n".join(lines[:-1]), {})[rank] = lines[-1]
    out = []
    for frames, last in groups.items():
        ranks = ", ".join(map(str, last))
        out.append(f"--- rank{'s' if len(last) > 1 else ''} {ranks} ---\n{frames}")
        if len(set(last.values())) == 1:
            out.append(next(iter(last.values())))
        else:
            out.extend(f"[rank {rank}] {line}" for rank, line in last.items())
    return "\n".join(out)


def _read(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _collect(names, world_size, out_dir, stopped):
    values, failures = {}, {}
    started = {r: _read(p) for r in range(world_size)
               if os.path.exists(p := os.path.join(out_dir, f"rank{r}.start"))}
    broken = {r: _read(p) for r in range(world_size)
              if os.path.exists(p := os.path.join(out_dir, f"rank{r}.broken"))}
    current = {}
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.current")
        if os.path.exists(path):
            with open(path) as f:
                current[r] = int(f.read() or -1)
    for index, name in enumerate(names):
        per_rank, errors, missing = {}, {}, []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.case{index}")
            if not os.path.exists(path):
                missing.append(r)
                continue
            ok, value = _read(path)
            if not ok:
                errors[r] = value
                continue
            try:
                per_rank[r] = pickle.loads(value)
            except Exception:
                errors[r] = "its value could not be unpickled here:\n" + traceback.format_exc()
        if errors:
            failures[name] = (f"case {name!r} failed on rank(s) {sorted(errors)} of "
                              f"{world_size}:\n{_tracebacks(errors)}")
            if missing:
                failures[name] += f"\n(and did not finish on rank(s) {missing})"
        elif missing:
            failures[name] = (f"case {name!r} did not finish on rank(s) {missing} of "
                              f"{world_size}: " + _why_stopped(names, started, broken, current,
                                                               stopped))
        else:
            values[name] = [per_rank[r] for r in range(world_size)]
    return values, failures


def _why_stopped(names, started, broken, current, stopped) -> str:
    if started:
        return "the process group did not start:\n" + _tracebacks(started)
    lines = [stopped or "the world ended early"]
    if broken:
        lines.append("the status exchange failed after a case, so the group stopped:\n"
                     + _tracebacks({r: f"after case {names[i]!r}:\n{tb}"
                                    for r, (i, tb) in broken.items()}))
    if current:
        lines.append("the last case each rank entered: " + ", ".join(
            f"rank {r}: {names[i]!r}" for r, i in sorted(current.items()) if 0 <= i < len(names)))
    return "\n".join(lines)


def run_cases(cases: Mapping[Hashable, Callable], world_size: int, ranks_per_node: int,
              *args, timeout: float = 600) -> CaseResults:
    """Run every case, in order, on one ``world_size``-rank gloo process group.

    ``cases``: name -> fn, called as fn(rank, world_size, *args) on every rank (other
    processes: fn and args must pickle, e.g. a module-level function or a
    functools.partial of one). Returns a CaseResults; its ``get(name)`` is the list of
    the ranks' return values, or fails the calling test with the case's traceback. Never
    raises for a failed case or a failed world: those fail the ``get`` of each case they
    cost.
    """
    names = list(cases)
    fns = [cases[name] for name in names]
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = _start_ranks(_case_worker, (world_size, ranks_per_node, init_file, tmp, fns, args),
                           world_size)
        stopped = _join(ctx, timeout)
        values, failures = _collect(names, world_size, tmp, stopped)
    return CaseResults(names, world_size, values, failures)
