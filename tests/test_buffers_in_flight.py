"""Every buffer handed to one of the engine's asynchronous collectives is kept alive by the
engine's own PendingComm until its wait (collectives.py, Note: buffers in flight, rule 1).

gloo's ``Work`` happens to hold its tensors, so a dropped reference would go unseen on it.
Here, on 4 gloo ranks (2 nodes of 2), the engine's collectives run through a stand-in
backend (``collectives.LAUNCH``) that holds the caller's tensors by weak reference only:
it runs the real collective on copies, and at the wait writes the result back into the
caller's output, if that is still alive, and notes every caller tensor that was freed
before its wait. Plans cover every gradient stage (reduce-scatter over "g" and "os", the
replica all-reduce, on FSDP2's own buffer too), the post-step all-gather landed in
``step()`` or in the next forward, and the compressed forms (int8 gradients, bf16
weights); one case in bf16 with fp32 gradients. Then:

- no buffer is freed before its wait, and training equals single-process training
  (so the stand-in's write-back is the collective's result);
- the replica all-reduce runs in place on FSDP2's reduce-scatter output only where FSDP2
  no longer reads it (fp32 throughout), and on a copy where FSDP2 still casts it for
  ``.grad`` after the hook (bf16 parameters, fp32 gradients) (rule 2 of the Note);
- with the engine's keepalive removed (a PendingComm that drops its ``input``, or the
  compressed forms' encoded chunks, ``held``), the stand-in sees the buffers freed: the
  check fails, so it would catch a keepalive dropped from the engine.
"""

from __future__ import annotations

import weakref
from functools import partial

import pytest
import torch

from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import amsp_training, reference_training

WORLD, PER_NODE, STEPS = 4, 2, 2
EXACT = dict(rtol=1e-5, atol=1e-6)

# name -> (plan, micro-batches, overlap_param_update, compression[, reduce_dtype]); the
# parameters are fp32, or bf16 where a reduce_dtype is given
CASES = {
    # reduce-scatter over "g" (across nodes); post-step all-gather in the next forward
    "p1-g4-os4": ((1, 4, 4), 2, True, None),
    # one micro-batch: the replica all-reduce gets FSDP2's reduce-scatter output (copied)
    "p2-g2-os2-single-micro-batch": ((2, 2, 2), 1, False, None),
    # s_g = s_p < s_os: reduce-scatter over "os", then the replica all-reduce
    "p1-g1-os2": ((1, 1, 2), 2, False, None),
    # compressed: gradient stages across nodes as all-to-alls of int8 chunks, weights bf16
    "p2-g4-os4-int8-bf16": ((2, 4, 4), 2, True, dict(grads="int8", weights="bf16")),
    # compressed replica all-reduce (all-to-all, then all-gather of the sums)
    "p2-g2-os2-int8": ((2, 2, 2), 2, False, dict(grads="int8")),
    # bf16 parameters, fp32 gradients: FSDP2 casts its buffer after the hook
    "p2-g2-os2-single-micro-batch-bf16": ((2, 2, 2), 1, False, None, torch.float32),
}
MUTANTS = {  # the engine's keepalive removed -> name of the case it runs
    "drop-input": "p1-g4-os4",
    "drop-held": "p2-g4-os4-int8-bf16",
}


class _WeakWork:
    """A collective run on copies of the caller's tensors, holding the caller's own only by
    weak reference: what a backend that keeps nothing alive would show."""

    freed: list[str] = []  # "<op> <which>" for each caller tensor freed before its wait

    def __init__(self, kind, launch, out, inp, group, **kwargs):
        self.op = kind
        self.out, self.inp = weakref.ref(out), weakref.ref(inp)
        self.own_out = inp.clone() if out is inp else torch.empty_like(out)
        own_in = self.own_out if out is inp else inp.clone()
        self.work = launch(self.own_out, own_in, group, **kwargs)

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        out, inp = self.out(), self.inp()
        if inp is None:
            _WeakWork.freed.append(f"{self.op} input")
        if out is None:
            _WeakWork.freed.append(f"{self.op} output")
        else:
            out.copy_(self.own_out)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _install_weak_backend() -> None:
    from amsp_dtensor.engine import collectives

    real = dict(collectives.LAUNCH)
    for op, launch in real.items():
        collectives.LAUNCH[op] = partial(_WeakWork, op, launch)


def _drop_keepalive(what: str) -> None:
    """The mutant: every PendingComm forgets its ``input`` (or its ``held`` chunks)."""
    from amsp_dtensor.engine.collectives import PendingComm

    if what == "input":
        init = PendingComm.__init__

        def forgetful_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.input = None

        PendingComm.__init__ = forgetful_init
    else:
        then = PendingComm.then

        def forgetful_then(self, *args, **kwargs):
            then(self, *args, **kwargs)
            self.held = ()
            return self

        PendingComm.then = forgetful_then


def _spy_replica_reduce(shared: list) -> None:
    """Note, for each replica all-reduce issued from a unit's hook, whether it runs on the
    hook's own input (FSDP2's buffer) rather than a copy."""
    from amsp_dtensor.engine.root import RootState

    on_unit_grads = RootState.on_unit_grads

    def spy(self, unit, flat_p):
        on_unit_grads(self, unit, flat_p)
        entry = unit.stage_in_flight
        if entry is not None and entry.stage.value == "rep_reduce" and unit.uses_fsdp:
            mine = entry.pending.input.untyped_storage().data_ptr()
            shared.append(mine == flat_p.untyped_storage().data_ptr())

    RootState.on_unit_grads = spy


def _case(rank, world, plan, micro_batches, overlap, compression, reduce_dtype=None,
          mutant=None):
    import gc

    from amsp_dtensor.engine import collectives
    from amsp_dtensor.engine.collectives import PendingComm
    from amsp_dtensor.engine.root import RootState

    saved = (dict(collectives.LAUNCH), PendingComm.__init__, PendingComm.then,
             RootState.on_unit_grads)
    _install_weak_backend()
    shared = []
    _spy_replica_reduce(shared)
    if mutant:
        _drop_keepalive(mutant)
    _WeakWork.freed = []
    gc.disable()  # weak references die when the last strong one goes, not at a collection
    try:
        dtype = torch.float32 if reduce_dtype is None else torch.bfloat16
        out = amsp_training(rank, world, plan, dtype, micro_batches, STEPS,
                            overlap=overlap, compression=compression, reduce_dtype=reduce_dtype)
    finally:
        gc.enable()
        collectives.LAUNCH.clear()
        collectives.LAUNCH.update(saved[0])
        PendingComm.__init__, PendingComm.then, RootState.on_unit_grads = saved[1:]
    out["freed"] = sorted(set(_WeakWork.freed))
    out["rep_on_hook_input"] = shared
    return out


@pytest.fixture(scope="module")
def results():
    cases = {name: partial(_case, plan=case[0], micro_batches=case[1], overlap=case[2],
                           compression=case[3], reduce_dtype=(case[4:] or [None])[0])
             for name, case in CASES.items()}
    for mutant, base in MUTANTS.items():
        plan, mb, ov, c = CASES[base]
        cases[mutant] = partial(_case, plan=plan, micro_batches=mb, overlap=ov, compression=c,
                                mutant=mutant.removeprefix("drop-"))
    return run_cases(cases, WORLD, PER_NODE, timeout=900)


@pytest.fixture(scope="module")
def references():
    return {mb: reference_training(WORLD, mb, STEPS, torch.float32) for mb in (1, 2)}


@pytest.mark.parametrize("name", list(CASES))
def test_every_buffer_lives_until_its_wait(results, references, name):
    plan, micro_batches, _, compression, *reduce_dtype = CASES[name]
    ranks = results.get(name)
    for rank, out in enumerate(ranks):
        assert out["freed"] == [], f"rank {rank}: freed before the wait: {out['freed']}"
    if reduce_dtype:  # bf16: trains; the exactness of bf16 is test_reduce_dtype's
        assert all(abs(a - b) < 0.05 * abs(b) for a, b in
                   zip(ranks[0]["losses"], references[micro_batches]["losses"]))
        return
    if compression:  # lossy: the codecs' own tests bound the error; here it must train
        assert all(abs(a - b) < 0.05 * abs(b) for a, b in
                   zip(ranks[0]["losses"], references[micro_batches]["losses"]))
        return
    want = references[micro_batches]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(want["losses"]),
                               **EXACT)
    for fqn, weight in want["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][fqn], weight, **EXACT, msg=fqn)


def test_the_replica_all_reduce_never_writes_a_buffer_fsdp2_still_reads(results):
    # one micro-batch, s_g = s_p = s_os = 2 with 2 replicas: every FSDP unit's replica
    # all-reduce is issued from its hook on (a copy of) FSDP2's reduce-scatter output
    fp32 = results.get("p2-g2-os2-single-micro-batch")[0]["rep_on_hook_input"]
    bf16 = results.get("p2-g2-os2-single-micro-batch-bf16")[0]["rep_on_hook_input"]
    assert fp32 and all(fp32), fp32  # in place: FSDP2 only views it after the hook
    assert bf16 and not any(bf16), bf16  # a copy: FSDP2 casts it to bf16 after the hook


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_check_catches_a_dropped_keepalive(results, mutant):
    # the gradient reduce-scatter's packed input and the post-step all-gather's send
    # buffer are held by nothing else; so are the compressed forms' encoded chunks
    expected = {"drop-input": ["reduce_scatter input", "all_gather input"],
                "drop-held": ["all_to_all input"]}[mutant]
    for rank, out in enumerate(results.get(mutant)):
        assert all(e in out["freed"] for e in expected), (rank, out["freed"])
