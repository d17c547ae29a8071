"""Offline training data for the CPU recipes: a generated corpus and a tokenizer trained on it.

``ensure_assets(root)`` makes, once, under ``root`` (default ``outputs/amsp_data``):
  corpus/train.jsonl            JSON lines with a "text" field (torchtitan ``c4_test`` loader)
  tokenizer/tokenizer.json      byte-level BPE, vocab < 2048
  tokenizer/tokenizer_config.json  bos/eos token names
Deterministic (seeded), about 2 MB, no network. Safe to call from every rank at once: the
first caller builds under an exclusive file lock, the others wait and reuse.
Run ``python -m amsp_dtensor.data [root]`` to build it by hand.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from .corpus import iter_texts, write_corpus
from .tokenizer import train_tokenizer

DEFAULT_ROOT = Path("outputs") / "amsp_data"

__all__ = ["DEFAULT_ROOT", "DataAssets", "ensure_assets", "set_hf_home"]


@dataclass(frozen=True)
class DataAssets:
    root: Path

    @property
    def corpus_dir(self) -> Path:
        return self.root / "corpus"

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    def complete(self) -> bool:
        return (
            (self.corpus_dir / "train.jsonl").is_file()
            and (self.tokenizer_dir / "tokenizer.json").is_file()
            and (self.tokenizer_dir / "tokenizer_config.json").is_file()
        )


def set_hf_home(root: Path | str = DEFAULT_ROOT) -> Path:
    """Keep HuggingFace `datasets` caches in a known place (``root/hf_home``) unless set.

    torchtitan's c4_test loader calls ``datasets.load_dataset(path)``, which writes an Arrow
    cache under HF_HOME; pointing it into the project's data folder keeps runs offline and
    out of the user's home. HF_DATASETS_OFFLINE forbids any hub lookup.
    """
    home = Path(root).resolve() / "hf_home"
    os.environ.setdefault("HF_HOME", str(home))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return Path(os.environ["HF_HOME"])


def ensure_assets(root: Path | str = DEFAULT_ROOT) -> DataAssets:
    assets = DataAssets(Path(root))
    if assets.complete():
        return assets
    assets.root.mkdir(parents=True, exist_ok=True)
    with open(assets.root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not assets.complete():  # another rank may have built it while we waited
            corpus = write_corpus(assets.corpus_dir)
            train_tokenizer(iter_texts(corpus), assets.tokenizer_dir)
    return assets
