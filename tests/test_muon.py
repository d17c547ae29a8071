"""torch.optim.Muon under AMSPOptimizer, on 4 CPU ranks (2 nodes x 2), every plan.

- The step, bit for bit: AMSP's Muon step alone (the sharded optimizer, its momentum on
  the OS rows, each matrix orthogonalized by one owner of the shard group) fed the same
  gradients as single-process ``torch.optim.Muon`` + ``torch.optim.AdamW`` (the embeddings,
  head and norms in a group naming AdamW) gives the same weights, momentum buffers and
  AdamW moments, ``torch.equal`` after 3 steps; also with ``adjust_lr_fn =
  "match_rms_adamw"``, no Nesterov and a third group on SGD. Its collectives: two
  all-to-alls over the shard group per step, of 2 bytes (bfloat16) per element of this
  rank's rows of the Muon matrices, none at s_os = 1.
- Training: every plan, 3 steps of 2 micro-batches, clipped, against single-process
  training with the same optimizers. The losses agree within 1e-5 at every step; after
  step 1 the AdamW parameters within 1e-5 and the Muon matrices within one bfloat16
  rounding of an update (|dW| <= lr' x 2^-5), after 3 steps within three. Muon's
  Newton-Schulz runs in bfloat16, so a gradient summed over ranks in another order (fp32
  rounding, ~1e-7) flips the bfloat16 rounding of a few inputs and the update moves by a
  bfloat16 step; plain data parallelism (plan p1-g1-os1: no sharding, no owner) sits at
  the same distance, and so would any data-parallel Muon. Bit-exactness against torch is
  the step test's.
- Bad input, refused in one line before anything is built: a non-matrix in a Muon group,
  a group naming a non-elementwise optimizer, a group optimizer beside AdamW, only group
  optimizers.
One process group for the module (run_cases); 8 ranks: test_muon_world8.py.
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch

from amsp_dtensor.plan import enumerate_plans
from amsp_dtensor.testing.multiproc import run_cases
from amsp_dtensor.testing.scenarios import (
    OPTIMIZERS,
    amsp_training,
    make_model,
    reference_training,
)
from muon_cases import (check_exchange, compare_exact, exact_step_case, muon_matrix_shapes,
                        reference_steps, shard)

WORLD, PER_NODE, STEPS, MICRO_BATCHES = 4, 2, 3, 2
PLANS = [(p.s_p, p.s_g, p.s_os) for p in enumerate_plans(WORLD, PER_NODE)]
STEP_OPTIMIZERS = ("muon", "muon_rms")
TOL = 1e-5


def _plan_id(plan) -> str:
    return "p{}-g{}-os{}".format(*plan)


def refusals_case(rank, world):
    """Each bad construction's error (None where it was accepted)."""
    import amsp_dtensor as amsp

    model = shard((2, 2, 4))
    named = dict(model.named_parameters())
    norms = [p for n, p in named.items() if "norm" in n]
    ends = [named["tok_embeddings.weight"], named["output.weight"]]
    matrices = [p for n, p in named.items() if p.dim() == 2 and "layers" in n]
    cases = {
        "non-matrix": (torch.optim.Muon, [{"params": matrices + norms},
                                          {"params": ends, "optimizer": torch.optim.AdamW}]),
        "not elementwise": (torch.optim.Muon, [{"params": matrices},
                                               {"params": ends + norms,
                                                "optimizer": torch.optim.Adafactor}]),
        "beside AdamW": (torch.optim.AdamW, [{"params": matrices},
                                             {"params": ends + norms,
                                              "optimizer": torch.optim.SGD}]),
        "only group optimizers": (torch.optim.Muon, [{"params": list(named.values()),
                                                      "optimizer": torch.optim.AdamW}]),
        "Muon key in an AdamW group": (torch.optim.Muon, [
            {"params": matrices}, {"params": ends + norms, "optimizer": torch.optim.AdamW,
                                   "ns_steps": 3}]),
    }
    errors = {}
    for name, (cls, groups) in cases.items():
        try:
            amsp.AMSPOptimizer(model, cls, lr=1e-2, param_groups=groups)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return errors


def _cases():
    cases = {("step", optimizer, plan): partial(exact_step_case, plan=plan, optimizer=optimizer)
             for optimizer in STEP_OPTIMIZERS for plan in PLANS}
    cases.update({("train", plan): partial(amsp_training, plan=plan, dtype=torch.float32,
                                           micro_batches=MICRO_BATCHES, steps=STEPS,
                                           read_steps=1, optimizer="muon")
                  for plan in PLANS})
    cases["refusals"] = refusals_case
    return cases


@pytest.fixture(scope="module")
def results():
    if os.environ.get("AMSP_SKIP_MULTIPROC") == "1":
        pytest.skip("multi-process")
    return run_cases(_cases(), WORLD, PER_NODE)


@pytest.fixture(scope="module")
def step_references():
    return {optimizer: reference_steps(optimizer) for optimizer in STEP_OPTIMIZERS}


@pytest.mark.parametrize("optimizer,plan", [(o, p) for o in STEP_OPTIMIZERS for p in PLANS],
                         ids=lambda v: v if isinstance(v, str) else _plan_id(v))
def test_muon_step_is_torchs_bit_for_bit(results, step_references, optimizer, plan):
    ranks = results.get(("step", optimizer, plan))
    want = step_references[optimizer]
    got = ranks[0]["state"]
    assert {k for entry in want.values() for k in entry} >= {"momentum_buffer", "exp_avg"}
    assert compare_exact(got, want) == []
    check_exchange(ranks, plan, WORLD, PER_NODE, muon_matrix_shapes())


def test_the_step_reference_moves_and_differs_from_adamw(step_references):
    """The weights moved, and Muon's are not AdamW's: a path that ran AdamW (or nothing)
    on the matrices would fail the bit-for-bit test."""
    model_weights = dict(make_model(torch.float32).named_parameters())
    muon = step_references["muon"]
    name = "layers.0.attention.wq.weight"
    moved = (muon[name]["master"] - model_weights[name].detach()).abs().max().item()
    assert moved > 1e-3
    assert "momentum_buffer" in muon[name] and "exp_avg" in muon["norm.weight"]


@pytest.fixture(scope="module")
def training_reference():
    return reference_training(WORLD, MICRO_BATCHES, STEPS, torch.float32, read_steps=1,
                              optimizer="muon")


def _bf16_bound(steps: int) -> float:
    """|dW| of a Muon matrix after ``steps`` steps: one bfloat16 rounding (2^-5 of an
    O(1) orthogonalized entry, generously) of each step's update, at the largest adjusted
    lr (sqrt(64 / 32) for the 64 x 32 matrices)."""
    return steps * OPTIMIZERS["muon"][1]["lr"] * math.sqrt(2) * 2 ** -5


def _max_abs(a: dict, b: dict, names) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in names)


@pytest.mark.parametrize("plan", PLANS, ids=_plan_id)
def test_muon_training_matches_single_process(results, training_reference, plan):
    """Losses within 1e-5 at every step; after step 1 the AdamW parameters within 1e-5
    and the Muon matrices within one bfloat16 step; after step 3 the Muon matrices within
    three. Printed beside: the unsharded plan p1-g1-os1's distance (the same), the AdamW
    parameters' later distance (it follows the matrices'), and the distance to
    p1-g1-os1 (0 where the engine sums the gradients in the same order, one bfloat16
    step where not)."""
    ref = training_reference
    got = results.get(("train", plan))[0]
    plain = results.get(("train", (1, 1, 1)))[0]
    for step, (g, w) in enumerate(zip(got["losses"], ref["losses"]), start=1):
        assert abs(g - w) <= TOL * abs(w), (step, got["losses"], ref["losses"])
    weights = ref["weights"]
    matrix = [n for n, w in weights.items() if w.dim() == 2 and n.startswith("layers.")]
    rest = [n for n in weights if n not in matrix]
    first, ref_first = got["step_weights"][0], ref["step_weights"][0]
    rel = {n: (first[n] - ref_first[n]).abs().max().item() / ref_first[n].abs().max().item()
           for n in rest}
    print(f"{_plan_id(plan)}: step 1: AdamW max rel {max(rel.values()):.1e}, Muon max |dW| "
          f"{_max_abs(first, ref_first, matrix):.2e} (bound {_bf16_bound(1):.2e}); step "
          f"{STEPS}: Muon max |dW| {_max_abs(got['weights'], weights, matrix):.2e} "
          f"(p1-g1-os1: {_max_abs(plain['weights'], weights, matrix):.2e}, bound "
          f"{_bf16_bound(STEPS):.2e}), AdamW max |dW| {_max_abs(got['weights'], weights, rest):.2e}"
          f", against p1-g1-os1 {_max_abs(got['weights'], plain['weights'], weights):.1e}")
    assert max(rel.values()) <= TOL, rel
    assert _max_abs(first, ref_first, matrix) <= _bf16_bound(1)
    assert _max_abs(got["weights"], weights, matrix) <= _bf16_bound(STEPS)


def test_bad_muon_input_is_one_line_naming_the_fix(results):
    errors = results.get("refusals")[0]
    assert errors["non-matrix"] == (
        "Muon: 'layers.0.attention_norm.weight' has shape (32,), not a matrix: Muon "
        "orthogonalizes 2-D weights only; put it in a parameter group with its own "
        "optimizer, e.g. {'params': [...], 'optimizer': torch.optim.AdamW, 'lr': 3e-4}")
    assert errors["not elementwise"].startswith(
        "param_groups[1]: 'optimizer' must be an elementwise optimizer class (SGD, Adam, "
        "AdamW, ")
    assert errors["beside AdamW"] == (
        "param_groups[1] names its own optimizer, which only Muon groups take (for the "
        "parameters it does not step); with AdamW, drop 'optimizer' and set the group's "
        "options")
    assert errors["only group optimizers"] == (
        "Muon: every parameter group names its own optimizer, so Muon steps nothing; use "
        "that optimizer class itself")
    assert errors["Muon key in an AdamW group"].startswith(
        "param_groups[1] has 'ns_steps', which AdamW does not take: use ")
    assert all("\n" not in e for e in errors.values())


def test_newton_schulz_flops_are_torchs_own_count():
    """The cost model's Newton-Schulz FLOPs equal torch's FlopCounterMode count of torch's
    own Newton-Schulz (wide, tall and square matrices)."""
    from torch.utils.flop_counter import FlopCounterMode

    from amsp_dtensor import compat
    from amsp_dtensor.plan.muon_owners import newton_schulz_flops

    for shape in ((64, 32), (32, 96), (48, 48)):
        with FlopCounterMode(display=False) as counter:
            compat.muon_orthogonalize(torch.randn(shape), (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5), shape


def test_owners_balance_newton_schulz_at_8b_dims_on_64_ranks():
    """llama3 8B's 224 block matrices over a shard group of 64: every member's
    Newton-Schulz FLOPs within 10% of the mean (the engine's assignment)."""
    from amsp_dtensor.plan.cost.models import MODELS
    from amsp_dtensor.plan.cost.muon import owner_flops

    shapes = [s for unit in MODELS["llama3_8b"].unit_param_shapes()[:-1] for s in unit if len(s) == 2]
    assert len(shapes) == 32 * 7
    load = owner_flops(shapes, 64)
    mean = sum(load) / len(load)
    print(f"8B, 64 OS ranks: Newton-Schulz TFLOPs per rank per step max {max(load) / 1e12:.2f}, "
          f"mean {mean / 1e12:.2f}, min {min(load) / 1e12:.2f} "
          f"({max(load) / mean - 1:+.1%} / {min(load) / mean - 1:+.1%})")
    assert max(load) <= 1.10 * mean and min(load) >= 0.90 * mean
