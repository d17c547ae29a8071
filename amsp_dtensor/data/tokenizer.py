"""A small byte-level BPE tokenizer trained on the generated corpus.

torchtitan's HuggingFaceTokenizer loads ``tokenizer.json`` and reads the BOS/EOS token
names from ``tokenizer_config.json`` in ``model.hf_assets_path``. The llama3 debug flavor
has an embedding table of 2048 rows, so the vocab (merges + 256 bytes + 2 specials) must
stay below that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
VOCAB_SIZE = 2000  # < 2048 rows of the llama3 debugmodel embedding


def train_tokenizer(texts: Iterable[str], folder: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "tokenizer.json.tmp"
    tok.save(str(tmp))
    tmp.replace(folder / "tokenizer.json")
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 8192,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
