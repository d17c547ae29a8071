"""A torch.profiler trace of one training step of the README example (units cut as
torchtitan cuts them, two micro-batches under no_sync, clip, step) shows the engine's
``AMSP::`` ranges for every unit, named like FSDP2's ``FSDP::`` ranges beside them.

One process as rank 0 of a 4-rank job (2 per node) on torch's fake process group: the
collectives move no data, the ranges are what is read, from the exported chrome trace.
The ranges expected of each unit follow from the plan alone: a reduce-scatter over "g"
when s_g > s_p, over "os" when s_g = s_p < s_os, an all-reduce over "rep" when a copy of
the OS shard is replicated (world / s_os > 1), an optimizer step (units stepped in one call
share one range, which names them all: ``AMSP::optimizer_step (layers.0 + layers.1)``), and
the post-step all-gather (issue, land) when s_os > s_p."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import amsp_dtensor as amsp
from amsp_dtensor import compat
from amsp_dtensor.testing.scenarios import shard_model
from amsp_dtensor.testing.tiny_llama import TinyLlama, loss_fn

WORLD, PER_NODE = 4, 2
UNITS = ["tok_embeddings", "layers.0", "layers.1", "[norm, output]"]  # TinyLlama's 2 blocks


def expected_ranges(s_p: int, s_g: int, s_os: int) -> set[str]:
    per_unit = ["optimizer_step"]
    if s_g > s_p:
        per_unit += ["g_reduce_issue", "g_reduce_wait"]
    elif s_os > s_g:
        per_unit += ["os_reduce_issue", "os_reduce_wait"]
    if WORLD // s_os > 1:
        per_unit += ["rep_reduce_issue", "rep_reduce_wait"]
    if s_os > s_p:
        per_unit += ["param_update_issue", "param_update_land"]
    return ({f"AMSP::{r} ({u})" for r in per_unit for u in UNITS}
            | {"AMSP::clip_grad_norm", "AMSP::end_of_backward"})


@pytest.fixture
def fake_world():
    if dist.is_initialized():
        pytest.skip("needs its own (fake) default process group")
    compat.init_fake_process_group(rank=0, world_size=WORLD)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _trace_one_step(plan: amsp.ShardingPlan, path) -> set[str]:
    mesh = amsp.init_mesh(plan, ranks_per_node=PER_NODE, device_type="cpu")
    torch.manual_seed(0)
    model = TinyLlama()
    assert len(model.layers) == 2
    shard_model(model, mesh, plan, layout="titan")  # the README's cut, as torchtitan's
    optim = amsp.AMSPOptimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    micro_batches = torch.randint(0, model.cfg.vocab_size, (2, 2, 17))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else amsp.no_sync(model):
                (loss_fn(model(mb[:, :-1]), mb[:, 1:]) / len(micro_batches)).backward()
        optim.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if str(e.get("name", "")).startswith(("AMSP::", "FSDP::"))}


@pytest.mark.parametrize("factors", [(2, 2, 4), (1, 2, 2), (2, 4, 4)],
                         ids=["readme-p2-g2-os4", "p1-g2-os2", "p2-g4-os4"])
def test_every_unit_shows_its_amsp_ranges(fake_world, tmp_path, factors):
    names = _trace_one_step(amsp.ShardingPlan(*factors), tmp_path / "trace.json")
    amsp_names = set()
    for n in names:
        if n.startswith("AMSP::optimizer_step ("):  # one range per call of the optimizer
            amsp_names |= {f"AMSP::optimizer_step ({u})" for u in n[22:-1].split(" + ")}
        elif n.startswith("AMSP::"):
            amsp_names.add(n)
    assert amsp_names == expected_ranges(*factors), (
        sorted(expected_ranges(*factors) - amsp_names), sorted(amsp_names - expected_ranges(*factors)))
    if factors[0] > 1:  # FSDP2 runs the parameter path: its ranges sit beside ours
        assert "FSDP::post_backward_reduce (layers.0)" in names


def test_the_readme_plan_is_the_first_case():
    plan = amsp.ShardingPlan(param="node", grad="node", optim="full").resolve(WORLD, PER_NODE)
    assert (plan.s_p, plan.s_g, plan.s_os) == (2, 2, 4)
