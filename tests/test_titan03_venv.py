"""The torchtitan 0.3 subset of the main suite: ``.ci/titan03.sh --subset`` builds a venv
with torchtitan 0.3.0 beside this one (which keeps 0.2.2: the two cannot share one) and runs
there, from tests/test_titan03.py: AMSP (2, 2, 2) x tp 2 against torchtitan 0.3's own
FSDP2 + TP, 4 CPU ranks, from the same weights, the loss at every step within 1e-4 (5 steps
here, as the 0.2.2 equivalence tests run 4); the TOML mapped onto 0.3's config; a plan that
does not divide the world refused in one line; the plan resolved once; a seed checkpoint
made by an AMSP job (one rank, in-process). It is the part of
0.3's integration the main suite can pay for: the 0.3 trainer, parallelize_fn, tensor
parallelism through 0.3's model sharding and the config mapping, two 4-rank runs. The whole
module (also AMSP (2, 2, 4) against FSDP2, 20 steps each, the checkpoint resumed on 2 ranks,
TensorBoard, plan = "auto", compile, the registry, the other refusals) and torchtitan 0.3's
own trainer run in the whole script, ``.ci/titan03.sh``.

The venv sees this Python's packages, so torch is not downloaded again; torchtitan 0.3.0
and its dependencies come from the package registry."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from amsp_dtensor.titan.version import is_titan03
from test_titan import REPO

pytestmark = pytest.mark.skipif(
    is_titan03(), reason="torchtitan 0.3 is installed here: tests/test_titan03.py runs directly")

# the tests the subset must have run (a -k that matched fewer would pass with less)
SUBSET_TESTS = 6


def test_torchtitan_03_subset_passes_in_its_own_venv():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / ".ci" / "titan03.sh"), "--subset"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0, out[-4000:]
    assert "torchtitan 0.3.0" in out, out  # the venv's torchtitan, not this one's 0.2.2
    tally = re.search(r"test_titan03 \(subset\): (\d+) passed, (\d+) deselected", out)
    assert tally, out
    assert int(tally.group(1)) == SUBSET_TESTS and "failed" not in out, out
