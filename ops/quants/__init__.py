"""Quant-type registry and QTensor: a weight kept as its raw blocks, exactly as stored on disk.

Porting a type = one file in this folder defining `QTYPE` (with its `error_bound`) + one line in `_MODULES` below.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MODULES = (  # module names in this package, each defining QTYPE; filled in as types land
    "f32", "f16", "bf16", "i32", "q8_0", "q4_k", "q2_k", "iq2_xxs", "mxfp4", "fp8_e4m3",
    "q4_0", "q4_1", "q5_0", "q5_1", "q3_k", "q5_k", "q6_k", "tq1_0", "tq2_0", "iq4_nl", "iq4_xs",
    "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
)


@dataclass(frozen=True)
class QuantType:
    """A block format: `block_size` values stored in `block_bytes` bytes."""

    name: str
    ggml_type: int | None  # GGUF type id; None for formats that never appear in a GGUF (e.g. FP8 blocks)
    block_size: int
    block_bytes: int
    dequantize: Callable[[torch.Tensor], torch.Tensor]  # uint8 [..., block_bytes] -> float32 [..., block_size]
    quantize: Callable[[torch.Tensor], torch.Tensor]  # float32 [..., block_size] -> uint8 [..., block_bytes]
    # the most relative RMS error quantize -> dequantize may make on Gaussian weights (sigma 1000, so I32
    # rounding shows), ~1.3x the measured value; tests/test_quants.py enforces it
    error_bound: float

    def row_bytes(self, n: int) -> int:
        """Bytes taken by a row of `n` values (n must be a multiple of block_size)."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: row length {n} is not a multiple of block size {self.block_size}")
        return n // self.block_size * self.block_bytes


def _load() -> dict[str, QuantType]:
    types = [importlib.import_module(f"{__name__}.{m}").QTYPE for m in _MODULES]
    return {t.name: t for t in types}


def get(name: str) -> QuantType:
    """The quant type called `name` (e.g. "Q8_0"); KeyError names the known ones."""
    try:
        return TYPES[name]
    except KeyError:
        raise KeyError(f"unknown quant type {name!r}; known: {', '.join(TYPES)}") from None


@dataclass
class QTensor:
    """A logical `[..., out, in]` weight held as raw blocks: `data` is uint8 `[..., out, row_bytes]`."""

    qtype: QuantType
    shape: tuple[int, ...]
    data: torch.Tensor
    name: str = ""

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 with the logical shape."""
        blocks = self.data.reshape(-1, self.qtype.block_bytes)
        return self.qtype.dequantize(blocks).reshape(self.shape)

    @classmethod
    def quantize(cls, weight: torch.Tensor, qtype: QuantType | str, name: str = "") -> QTensor:
        """Quantize a float weight row by row into `qtype` blocks."""
        qt = get(qtype) if isinstance(qtype, str) else qtype
        w = weight.detach().to(torch.float32).contiguous()
        blocks = qt.quantize(w.reshape(-1, qt.block_size))
        return cls(qt, tuple(w.shape), blocks.reshape(*w.shape[:-1], qt.row_bytes(w.shape[-1])), name)


# loaded last, so a type module may import QuantType and QTensor from this package
TYPES: dict[str, QuantType] = _load()
BY_GGML: dict[int, QuantType] = {t.ggml_type: t for t in TYPES.values() if t.ggml_type is not None}
