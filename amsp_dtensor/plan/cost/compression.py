"""Byte arithmetic of the opt-in codecs for the cross-node stages (one source for both sides).

The engine's ``amsp.set_compression(model, grads=..., weights=...)`` and the cost model
(``predicted_events(..., compression=...)``) both size the compressed collectives from
this module, so the model's events equal the recorder's byte for byte. It is pure
integer arithmetic with no dependencies (no torch), so the engine can import it freely.

Codecs, for a chunk of m elements:
  "bf16": the chunk cast to bfloat16, 2*m bytes. Applies only to 4-byte (fp32) data.
  "int8": blockwise absmax quantisation, blocks of INT8_BLOCK elements, each with one
          fp32 scale: blocks = ceil(m / INT8_BLOCK); INT8_BLOCK*blocks bytes of int8
          payload (the last block padded to a whole block) + 4*blocks bytes of scales.
          Applies to any data wider than 1 byte.
A codec that does not apply to a stage's dtype leaves that stage exact (uncompressed).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "INT8_BLOCK",
    "CODECS",
    "codec_applies",
    "chunk_nbytes",
    "Compression",
]

INT8_BLOCK = 256  # elements per int8 block (one fp32 scale each)
CODECS = ("bf16", "int8")


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; valid codecs: {', '.join(CODECS)}")


def codec_applies(codec: str | None, dtype_bytes: int) -> bool:
    """Whether `codec` compresses data of `dtype_bytes` bytes per element: bf16 only
    4-byte data, int8 anything wider than 1 byte; None never."""
    if codec is None:
        return False
    _check_codec(codec)
    if codec == "bf16":
        return int(dtype_bytes) == 4
    return int(dtype_bytes) > 1


def chunk_nbytes(codec: str, m: int) -> int:
    """Bytes of one compressed chunk of m elements (module docstring)."""
    _check_codec(codec)
    m = int(m)
    if m < 0:
        raise ValueError(f"chunk length must be >= 0, got {m}")
    if codec == "bf16":
        return 2 * m
    blocks = -(-m // INT8_BLOCK)
    return INT8_BLOCK * blocks + 4 * blocks


@dataclass(frozen=True)
class Compression:
    """Which codec (or None) the cross-node gradient and weight stages use.

    grads: the gradient stages (reduce-scatter over "g" or "os", all-reduce over "rep");
    weights: the post-step all-gather of the updated params. Validated on creation."""

    grads: str | None = None
    weights: str | None = None

    def __post_init__(self) -> None:
        for field_name in ("grads", "weights"):
            value = getattr(self, field_name)
            if value is not None and value not in CODECS:
                raise ValueError(
                    f"compression {field_name}={value!r}; valid codecs: "
                    f"{', '.join(CODECS)} (or None)"
                )

    @property
    def enabled(self) -> bool:
        """Whether any stage may be compressed."""
        return self.grads is not None or self.weights is not None

    def __str__(self) -> str:
        if not self.enabled:
            return "none"
        parts = [f"{k}={v}" for k, v in (("grads", self.grads), ("weights", self.weights))
                 if v is not None]
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str | None) -> "Compression":
        """'grads=int8,weights=bf16' (either key optional), or 'none' / '' for no
        compression. Raises ValueError naming the valid keys and codecs."""
        text = (text or "").strip()
        if text.lower() in ("", "none"):
            return cls()
        values: dict[str, str | None] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip().lower(), value.strip().lower()
            if not sep or key not in ("grads", "weights"):
                raise ValueError(
                    f"compression {part!r}: expected grads=CODEC and/or weights=CODEC "
                    f"(CODEC one of {', '.join(CODECS)}, none), e.g. grads=int8,weights=bf16"
                )
            if key in values:
                raise ValueError(f"compression: {key} given twice in {text!r}")
            if value == "none":
                values[key] = None
                continue
            if value not in CODECS:
                raise ValueError(
                    f"compression {key}={value!r}: unknown codec; valid codecs: "
                    f"{', '.join(CODECS)}, none"
                )
            values[key] = value
        return cls(**values)
