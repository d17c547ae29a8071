"""What the launchers of both torchtitans share (``amsp_dtensor.train``, and
``titan.v03.launch`` on torchtitan 0.3): which rank shows the console, how long the other
ranks wait on a refused config, and the offline data. Imports nothing of torchtitan at
module level."""

from __future__ import annotations

import os
from pathlib import Path

# seconds a rank other than 0 waits before exiting on a refused config (see main)
REFUSAL_GRACE_S = 5.0


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))



def _shown_rank() -> bool:
    """True on the ranks listed in LOG_RANK (default "0")."""
    return str(_rank()) in {r.strip() for r in os.environ.get("LOG_RANK", "0").split(",")}



def quiet_other_ranks() -> None:
    """torchtitan's logger: the ranks in LOG_RANK (default "0") log at INFO, as torchtitan's
    run_train.sh arranges with torchrun's --local-ranks-filter; the others log errors only
    (their warnings repeat rank 0's, see quiet_warnings)."""
    import logging

    from torchtitan.tools.logging import logger

    if not _shown_rank():
        logger.setLevel(logging.ERROR)



def prepare_data_at(paths) -> None:
    """Build the offline tokenizer/corpus if any path points into the project's data folder."""
    from amsp_dtensor.data import DEFAULT_ROOT, ensure_assets, set_hf_home

    set_hf_home(DEFAULT_ROOT)
    root = DEFAULT_ROOT.resolve()
    if any(p and Path(p).resolve().is_relative_to(root) for p in paths):
        ensure_assets(DEFAULT_ROOT)


