"""``--experimental.custom_import`` for the torchtitan restart test: the AMSP plug-in, plus
a SIGKILL of one rank at the start of one step in torchrun's first attempt.

    AMSP_TEST_KILL=<rank>:<step> torchrun --max-restarts 1 ... -m amsp_dtensor.train \\
        --experimental.custom_import amsp_dtensor.testing.titan_fault
"""

from __future__ import annotations

import os
import signal

import amsp_dtensor.titan  # noqa: F401  (what the recipe's custom_import would import)
from amsp_dtensor.titan.trainer import AmspTrainer

_train_step = AmspTrainer.train_step


def _train_step_or_die(self, data_iterator):
    rank, step = (int(x) for x in os.environ.get("AMSP_TEST_KILL", "-1:-1").split(":"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if first_attempt and self.step == step and int(os.environ.get("RANK", "0")) == rank:
        # said first: torchrun may report a peer's failure (its collective with this rank
        # reset) before this rank's exit code -9
        print(f"[amsp-test] rank {rank} SIGKILLs itself at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_step(self, data_iterator)


AmspTrainer.train_step = _train_step_or_die
