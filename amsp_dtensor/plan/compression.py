"""Compression of the cross-node stages: the setting, and the bytes of a compressed chunk.

``Compression(grads=..., weights=...)`` names a codec per kind of stage (None: exact):

- ``grads``: the gradient stages whose group spans nodes (the reduce-scatter over "g" or
  "os", the replica all-reduce over "rep"), sent as quantize, all-to-all, dequantize and
  a sum in fp32 (an all-reduce adds an all-gather of the compressed sums), with error
  feedback;
- ``weights``: the post-step all-gather of the new weights when its group spans nodes.

Codecs: ``"bf16"`` (2 bytes an element; applies to 4-byte data only) and ``"int8"``
(one signed byte an element plus an fp32 scale per block of ``INT8_BLOCK`` elements; a
chunk is padded to whole blocks). A codec that would not make a stage narrower leaves it
exact. Pure arithmetic: the engine and the cost model both count bytes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

CODECS = ("bf16", "int8")
INT8_BLOCK = 256
_WIDTH = {"bf16": 2, "int8": 1}


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid codecs: {', '.join(CODECS)}")


def codec_applies(codec: str | None, dtype_bytes: int) -> bool:
    """A codec compresses data of ``dtype_bytes`` only if it is narrower (None: never)."""
    if codec is None:
        return False
    _check_codec(codec)
    return _WIDTH[codec] < int(dtype_bytes)


def int8_blocks(numel: int) -> int:
    return -(-numel // INT8_BLOCK)


def chunk_nbytes(codec: str, numel: int) -> int:
    """Bytes of one compressed chunk of ``numel`` elements (payload plus scales)."""
    _check_codec(codec)
    if numel < 0:
        raise ValueError(f"chunk length must be >= 0, got {numel}")
    if codec == "bf16":
        return 2 * numel
    blocks = int8_blocks(numel)
    return INT8_BLOCK * blocks + 4 * blocks


@dataclass(frozen=True)
class Compression:
    """Which codec each kind of cross-node stage uses (None: sent exactly, the default)."""

    grads: str | None = None
    weights: str | None = None
    error_feedback: bool = True  # grads: the dropped error is added to the next step's

    def __post_init__(self):
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"compression error_feedback must be a bool, got {self.error_feedback!r}")
        for key in ("grads", "weights"):
            value = getattr(self, key)
            if value is not None and value not in CODECS:
                raise ValueError(
                    f"compression {key}={value!r} is not a codec: use one of "
                    f"{', '.join(CODECS)} (valid codecs: {', '.join(CODECS)}), or None to "
                    f"send {key} exactly"
                )

    @property
    def enabled(self) -> bool:
        return self.grads is not None or self.weights is not None

    @classmethod
    def parse(cls, text: str | None) -> "Compression":
        """``"grads=int8,weights=bf16"`` (either key optional), or ``"none"`` / ``""``."""
        text = (text or "").strip()
        if text.lower() in ("", "none"):
            return cls()
        fields: dict[str, str | None] = {}
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition("=")
            key, value = key.strip().lower(), value.strip().lower()
            if not sep or key not in ("grads", "weights"):
                raise ValueError(
                    f"compression {item!r}: expected grads=CODEC and/or weights=CODEC "
                    f"(CODEC one of {', '.join(CODECS)}, none), e.g. grads=int8,weights=bf16"
                )
            if key in fields:
                raise ValueError(f"compression: {key} given twice in {text!r}")
            fields[key] = None if value == "none" else value
        return cls(**fields)

    def __str__(self) -> str:
        if not self.enabled:
            return "none"
        text = ",".join(f"{k}={getattr(self, k)}" for k in ("grads", "weights")
                        if getattr(self, k) is not None)
        return text if self.error_feedback or self.grads is None else text + " (no error feedback)"
