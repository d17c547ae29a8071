"""Run a function on N CPU ranks (gloo) once and collect each rank's return value.

Tests start one process group per test module (8 processes on 2 cores are slow to start
and to connect), run every case inside it and hand the results back to pytest.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from ..compat import destroy_process_group_at_exit


def _worker(rank, world_size, ranks_per_node, init_file, out_dir, fn, args):
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    os.environ["LOCAL_RANK"] = str(rank % ranks_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
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
        ok, result = result is not None and result[0] == "ok", None
        if dist.is_initialized():
            if ok:  # after a failure the other ranks may be stuck in a collective: no barrier
                try:
                    destroy_process_group_at_exit()
                except RuntimeError:  # another rank failed and never reached the barrier
                    pass
            if dist.is_initialized():
                dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, ranks_per_node: int, *args, timeout: float = 600):
    """fn(rank, world_size, *args) on every rank; returns the list of results by rank.

    Raises RuntimeError with the rank's traceback if any rank failed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _worker,
            args=(world_size, ranks_per_node, init_file, tmp, fn, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        import time

        deadline = time.time() + timeout
        while not ctx.join(timeout=5):
            if time.time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout}s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
