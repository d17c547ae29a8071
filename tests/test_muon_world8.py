"""torch.optim.Muon's step under AMSPOptimizer on 8 CPU ranks (4 nodes x 2), every plan:
fed the same gradients as single-process ``torch.optim.Muon`` + ``torch.optim.AdamW``, the
weights, momentum buffers and AdamW moments are the same, ``torch.equal``, after 3 steps
(muon_cases.exact_step_case; the 4-rank module test_muon.py has the training and the
refusals). Shard groups of 8, 4 and 2 members, across nodes and inside them, whose
group-rank order is not the order of their rows under some plans; 14 matrices' owners
balanced over up to 8 members. One process group for the module."""

from __future__ import annotations

import os
from functools import partial

import pytest

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_cases
from muon_cases import (check_exchange, compare_exact, exact_step_case, muon_matrix_shapes,
                        reference_steps)

WORLD, PER_NODE = 8, 2
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]


@pytest.fixture(scope="module")
def results():
    if os.environ.get("AMSP_SKIP_MULTIPROC") == "1":
        pytest.skip("multi-process")
    return run_cases({plan: partial(exact_step_case, plan=plan) for plan in PLANS}, WORLD,
                     PER_NODE)


@pytest.fixture(scope="module")
def reference():
    return reference_steps("muon")


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "p{}-g{}-os{}".format(*p))
def test_muon_step_is_torchs_bit_for_bit_on_8_ranks(results, reference, plan):
    ranks = results.get(plan)
    assert compare_exact(ranks[0]["state"], reference) == []
    check_exchange(ranks, plan, WORLD, PER_NODE, muon_matrix_shapes())
