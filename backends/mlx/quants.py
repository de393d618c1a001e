"""Quantized weights as MLX arrays: each GGUF block type gets a *format* that repacks its raw blocks once,
at load time, from the memory-mapped bytes (never through `mx.load`, which drops K/IQ types).

Two kinds of format (docs/mlx.md has the table):
- exact MLX repacks, served by `mx.quantized_matmul` / `mx.gather_qmm` / `mx.dequantize`:
  Q8_0 -> affine 8-bit, group 32 (`q + 128` unsigned, scale `d`, bias `-128 d`);
  Q4_0, Q5_0 -> affine 4/5-bit, group 32 (scale `d`, bias `-8 d` / `-16 d`); Q4_1, Q5_1 -> the same with
  bias `m`; Q4_K, Q5_K -> affine 4/5-bit, group 32 (scale `d·sc[j]`, bias `-dmin·m[j]`, exact float32 products);
  MXFP4 -> MLX's `mxfp4` mode (the same E2M1 codes and e8m0 exponent byte).
  Every dequantized value equals the reference's float32 value bit for bit (tests/test_mlx_ops.py).
- dequantize formats: the block fields are split into arrays once (f16 fields, code bytes), and
  `dequant` rebuilds float32 weights with MLX ops, tile by tile inside `qmatmul`:
  F32, F16, BF16, I32 (plain arrays), Q2_K (16-value sub-blocks: MLX has no group of 16),
  IQ2_XXS (grid lookups), FP8_E4M3 (arbitrary float32 block scales: a byte table lookup).
- dequantized at load (AT_LOAD): the reference dequantizer's float32 weights, kept as a plain array (4 bytes
  a weight): types with 16-value sub-blocks (MLX has no group of 16), non-linear levels or codebooks.

A placed weight is an `ops.quants.QTensor` whose `data` is a `Packed` record of MLX arrays sharing the
weight's leading dims `[..., out]`, so the model's row slices (`w.data[a:b]`) and expert gathers
(`w.data[ids]`) work unchanged on it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch

from backends.registry import declare_quants
from ops.quants import QTensor, get, iq2_xxs
from ops.quants import fp8_e4m3 as fp8

# ---- the placed record ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Packed:
    """A weight's repacked blocks: MLX arrays whose leading dims are the weight's `[..., out]`."""

    fmt: str
    fields: tuple

    def __getitem__(self, idx) -> Packed:
        """The same rows of every field (a slice of output rows, or gathered experts)."""
        return Packed(self.fmt, tuple(f[idx] for f in self.fields))


@dataclass(frozen=True)
class Format:
    """How one quant type lives in MLX."""

    pack: Callable[[np.ndarray, tuple[int, ...]], tuple]  # raw uint8 [..., out, row_bytes] -> fields
    dequant: Callable[..., mx.array] | None = None  # fields -> float32 [..., out, K] (dequantize formats)
    quant: tuple[str, int, int] | None = None  # (mode, bits, group_size) of an exact MLX repack


def lead(raw: np.ndarray, nb: int, nbytes: int) -> np.ndarray:
    """Raw rows [..., out, row_bytes] as blocks [..., out, nb, block_bytes]."""
    return raw.reshape(*raw.shape[:-1], nb, nbytes)


def f16_at(b: np.ndarray, offset: int) -> np.ndarray:
    """The f16 at byte `offset` of each block [..., nb, bytes], as float16 [..., nb]."""
    return np.ascontiguousarray(b[..., offset:offset + 2]).view(np.float16)[..., 0]


def words(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [..., K] (each < 2**bits) packed into uint32 words as MLX reads them: a little-endian bit stream,
    element i at bits `bits·i` (4 and 8 bits: whole bytes, so only uint8 temporaries)."""
    c = codes.astype(np.uint8)
    if bits == 4:
        c = c[..., 0::2] | (c[..., 1::2] << 4)
    elif bits == 5:
        planes = (c[..., None] >> np.arange(5, dtype=np.uint8)) & 1  # [..., K, 5]: bit j of element i at 5i + j
        c = np.packbits(planes.reshape(*c.shape[:-1], -1, 8), axis=-1, bitorder="little")[..., 0]
    elif bits != 8:
        raise ValueError(f"no packing for {bits}-bit codes")
    return np.ascontiguousarray(c).view("<u4")


# ---- plain float/int types ----------------------------------------------------------------------------

def plain(np_dtype) -> Format:
    """A type stored as one value per element: kept in its own dtype, widened to float32 per tile."""
    def pack(raw, shape):
        return (mx.array(np.ascontiguousarray(raw).view(np_dtype).reshape(shape)),)
    return Format(pack, lambda w: w.astype(mx.float32))


def pack_bf16(raw: np.ndarray, shape) -> tuple:
    return (mx.array(np.ascontiguousarray(raw).view(np.uint16).reshape(shape)).view(mx.bfloat16),)


# ---- exact repacks ---------------------------------------------------------------------------------------

def pack_q8_0(raw: np.ndarray, shape) -> tuple:
    """Q8_0 -> affine 8-bit: w = d·(q + 128) − 128·d = d·q, every step exact in float32."""
    b = lead(raw, shape[-1] // 32, 34)
    d = f16_at(b, 0).astype(np.float32)
    bias = -128 * d
    q = b[..., 2:] ^ np.uint8(0x80)                    # int8 q as the unsigned code q + 128
    wq = words(q.reshape(*shape[:-1], shape[-1]), 8)
    return mx.array(wq), mx.array(d), mx.array(bias)


def k_scales(b: np.ndarray, shape) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K blocks [..., nb, bytes] -> MLX scales d·sc[j] and biases −dmin·m[j] per 32 (exact products)."""
    d, dmin = f16_at(b, 0).astype(np.float32), f16_at(b, 2).astype(np.float32)
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], -1).astype(np.float32)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], -1).astype(np.float32)
    scales = (d[..., None] * sc).reshape(*shape[:-1], -1)
    biases = (-(dmin[..., None] * m)).reshape(*shape[:-1], -1)
    return mx.array(scales), mx.array(biases)


def k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K nibble bytes [..., nb, 128] -> codes [..., nb, 8, 32] (element order 64c + 32h + l)."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], -2).reshape(*qs.shape[:-3], 8, 32)


def pack_q4_k(raw: np.ndarray, shape) -> tuple:
    """Q4_K -> affine 4-bit, group 32: scale d·sc[j], bias −dmin·m[j] (exact float32 products)."""
    b = lead(raw, shape[-1] // 256, 144)
    q = k_nibbles(b[..., 16:]).reshape(*shape[:-1], shape[-1])
    return mx.array(words(q, 4)), *k_scales(b, shape)


def pack_q5_k(raw: np.ndarray, shape) -> tuple:
    """Q5_K -> affine 5-bit, group 32: Q4_K's scales and biases, the 5th bit of sub-block j from bit j of `qh`."""
    b = lead(raw, shape[-1] // 256, 176)
    high = (b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., nb, 8, 32]
    q = (k_nibbles(b[..., 48:]) | (high << 4)).reshape(*shape[:-1], shape[-1])
    return mx.array(words(q, 5)), *k_scales(b, shape)


def q4_codes(qs: np.ndarray) -> np.ndarray:
    """16 nibble bytes [..., 16] -> 32 codes in element order (low nibbles, then high ones)."""
    return np.concatenate([qs & 15, qs >> 4], -1)


def q5_codes(b: np.ndarray, qh_at: int) -> np.ndarray:
    """The 5-bit codes [..., 32] of Q5_0/Q5_1 blocks [..., bytes] whose u32 `qh` is at byte `qh_at`."""
    qh = np.unpackbits(b[..., qh_at:qh_at + 4], axis=-1, bitorder="little")
    return q4_codes(b[..., qh_at + 4:]) | (qh << 4)


def legacy(nbytes: int, bits: int, offset: float | None):
    """Pack for Q4_0/Q5_0 (`offset` = -8/-16: bias `offset·d`) and Q4_1/Q5_1 (`offset` None: bias `m`)."""
    def pack(raw: np.ndarray, shape) -> tuple:
        b = lead(raw, shape[-1] // 32, nbytes)
        d = f16_at(b, 0).astype(np.float32)
        bias = offset * d if offset is not None else f16_at(b, 2).astype(np.float32)
        q = q4_codes(b[..., 2 if offset is not None else 4:]) if bits == 4 else q5_codes(b, nbytes - 20)
        return mx.array(words(q.reshape(*shape[:-1], shape[-1]), bits)), mx.array(d), mx.array(bias)
    return pack


def pack_mxfp4(raw: np.ndarray, shape) -> tuple:
    """MXFP4 -> MLX mxfp4: the e8m0 byte as MLX's scale, codes in element order (byte j: j low, j+16 high)."""
    b = lead(raw, shape[-1] // 32, 17)
    codes = np.concatenate([b[..., 1:] & 15, b[..., 1:] >> 4], -1).reshape(*shape[:-1], shape[-1])
    return mx.array(words(codes, 4)), mx.array(np.ascontiguousarray(b[..., 0]))


# ---- dequantize formats ------------------------------------------------------------------------------

def pack_q2_k(raw: np.ndarray, shape) -> tuple:
    b = lead(raw, shape[-1] // 256, 84)
    return (mx.array(np.ascontiguousarray(b[..., :16])), mx.array(np.ascontiguousarray(b[..., 16:80])),
            mx.array(f16_at(b, 80)), mx.array(f16_at(b, 82)))


def dequant_q2_k(s: mx.array, qs: mx.array, d: mx.array, dmin: mx.array) -> mx.array:
    """y = d·(s & 15)·q − dmin·(s >> 4) per 16; element 128k + 32i + l is bits 2i..2i+1 of byte 32k + l."""
    scale = (d.astype(mx.float32)[..., None] * (s & 15).astype(mx.float32))[..., None]
    low = (dmin.astype(mx.float32)[..., None] * (s >> 4).astype(mx.float32))[..., None]
    shifts = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(4, 1)
    q = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3                     # [..., nb, 2, 4, 32]
    q = q.reshape(*qs.shape[:-1], 16, 16).astype(mx.float32)
    y = scale * q - low                                                            # [..., nb, 16, 16]
    return y.reshape(*y.shape[:-3], -1)


IQ2_GRID = mx.array(iq2_xxs.GRID.numpy().astype(np.float32))                       # [256, 8]
IQ2_SIGNS = mx.array((1 - 2 * ((iq2_xxs.KSIGNS[:, None] >> torch.arange(8)) & 1)).numpy().astype(np.float32))


def pack_iq2_xxs(raw: np.ndarray, shape) -> tuple:
    b = lead(raw, shape[-1] // 256, 66)
    g = np.ascontiguousarray(b[..., 2:]).reshape(*b.shape[:-1], 8, 8)
    idx = np.ascontiguousarray(g[..., :4])
    w = np.ascontiguousarray(g[..., 4:]).view(np.uint32)[..., 0]                    # little-endian u32 per group
    return mx.array(f16_at(b, 0)), mx.array(idx), mx.array(w)


def dequant_iq2_xxs(d: mx.array, idx: mx.array, w: mx.array) -> mx.array:
    """Chunk l of group g: d·(0.5 + (w >> 28))/4 · grid[idx_l] · signs[(w >> 7l) & 127]."""
    db = d.astype(mx.float32)[..., None] * (0.5 + (w >> 28).astype(mx.float32)) * 0.25       # [..., nb, 8]
    sign_idx = (w[..., None] >> mx.array([0, 7, 14, 21], dtype=mx.uint32)) & 127            # [..., nb, 8, 4]
    y = db[..., None, None] * IQ2_GRID[idx.astype(mx.int32)] * IQ2_SIGNS[sign_idx.astype(mx.int32)]
    return y.reshape(*y.shape[:-4], -1)


E4M3_TABLE = mx.array(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy())


def pack_fp8(raw: np.ndarray, shape) -> tuple:
    b = lead(raw, shape[-1] // fp8.BLOCK, fp8.BYTES)
    scale = np.ascontiguousarray(b[..., :4]).view(np.float32)[..., 0]
    return mx.array(scale), mx.array(np.ascontiguousarray(b[..., 4:]))


def dequant_fp8(scale: mx.array, vals: mx.array) -> mx.array:
    y = E4M3_TABLE[vals.astype(mx.int32)] * scale[..., None]
    return y.reshape(*y.shape[:-2], -1)


def at_load(name: str) -> Format:
    """A type placed as the reference dequantizer's float32 weights (exact; 4 bytes a weight)."""
    def pack(raw, shape):
        blocks = torch.from_numpy(raw).reshape(-1, get(name).block_bytes)
        return (mx.array(get(name).dequantize(blocks).numpy().reshape(shape)),)
    return Format(pack, lambda w: w)


# Types without an MLX-native format: Q6_K and Q3_K (16-value sub-blocks), IQ4 (non-linear levels),
# ternary and codebook types.
AT_LOAD = frozenset({"Q3_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                     "IQ1_S", "IQ1_M"})

FORMATS: dict[str, Format] = {
    "F32": plain(np.float32), "F16": plain(np.float16), "I32": plain(np.int32),
    "BF16": Format(pack_bf16, lambda w: w.astype(mx.float32)),
    "Q8_0": Format(pack_q8_0, quant=("affine", 8, 32)),
    "Q4_K": Format(pack_q4_k, quant=("affine", 4, 32)),
    "MXFP4": Format(pack_mxfp4, quant=("mxfp4", 4, 32)),
    "Q2_K": Format(pack_q2_k, dequant_q2_k),
    "IQ2_XXS": Format(pack_iq2_xxs, dequant_iq2_xxs),
    "FP8_E4M3": Format(pack_fp8, dequant_fp8),
    "Q4_0": Format(legacy(18, 4, -8.0), quant=("affine", 4, 32)),
    "Q4_1": Format(legacy(20, 4, None), quant=("affine", 4, 32)),
    "Q5_0": Format(legacy(22, 5, -16.0), quant=("affine", 5, 32)),
    "Q5_1": Format(legacy(24, 5, None), quant=("affine", 5, 32)),
    "Q5_K": Format(pack_q5_k, quant=("affine", 5, 32)),
    **{name: at_load(name) for name in AT_LOAD},
}
declare_quants("mlx", {name: "exact MLX repack" if f.quant else "dequantized at load (float32)" if name in AT_LOAD
                       else "dequantized by MLX ops per tile" for name, f in FORMATS.items()})


def fmt_of(w: QTensor | Packed) -> Format:
    """The MLX format of a placed weight (or of its Packed blocks)."""
    data = w if isinstance(w, Packed) else w.data
    if not isinstance(data, Packed):
        raise TypeError(f"{w.name or 'weight'}: not placed for MLX (use the OpSet's place())")
    return FORMATS[data.fmt]


def place(w: QTensor) -> QTensor:
    """A weight's raw blocks (torch uint8, usually memory-mapped) repacked once into its MLX format."""
    if isinstance(w.data, Packed):
        return w
    if w.qtype.name not in FORMATS:
        raise TypeError(f"{w.name or 'weight'}: quant type {w.qtype.name} has no MLX format "
                        f"(add one to backends/mlx/quants.py; see docs/mlx.md)")
    raw = w.data.detach().cpu().contiguous().numpy()
    with np.errstate(all="ignore"):  # inf/NaN scales stay inf/NaN, as in the reference
        fields = FORMATS[w.qtype.name].pack(raw, tuple(w.shape))
    return QTensor(w.qtype, tuple(w.shape), Packed(w.qtype.name, fields), w.name)


def dequantize(data: Packed) -> mx.array:
    """Float32 weights [..., out, K] of (a slice or gather of) a placed weight."""
    f = FORMATS[data.fmt]
    if f.quant is None:
        return f.dequant(*data.fields)
    mode, bits, group = f.quant
    wq, scales, *biases = data.fields
    shape = wq.shape
    flat = [a.reshape(-1, a.shape[-1]) for a in data.fields]
    y = mx.dequantize(flat[0], flat[1], flat[2] if biases else None, group_size=group, bits=bits, mode=mode,
                      dtype=mx.float32)
    return y.reshape(*shape[:-1], -1)
