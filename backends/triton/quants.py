"""Block dequantization in Triton: one `@triton.jit` helper per quant type, inlined by every kernel.

Every helper has the same shape-agnostic contract:
    dequant_<type>(row, k, mask) -> float32 tile
`row` is a uint8 pointer tensor to the first byte of each weight row (for an expert weight
`[E, N, row_bytes]`, add the expert offset to the base pointer first), `k` holds column indices
along K, and `mask` says which (row, k) pairs are real; the three broadcast together, so the same
helper fills a GEMV tile, a GEMM tile or a transposed tile. Layouts follow `ops/quants/<type>.py`
(docs/model.md §4); every product below is exact in float32, so the values equal the reference
dequantizers bit for bit.

Table-driven types read one small uint8 tensor `grid_ptr` (`tables()`): each codebook's grid, one byte per
value, at the byte offsets TABLE_* below (IQ4_NL's levels as int8, IQ1's {-1, 0, 1} stored plus one);
`signs_ptr` holds the 128 even-parity sign bytes of IQ2_XXS, IQ2_XS and IQ3_XXS.
Registered types without a helper here are declared in UNSUPPORTED; the kernels refuse them by name.
"""
import functools

import torch
import triton
import triton.language as tl

from backends.registry import declare_quants
from ops.quants import iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs, iq4_nl

# byte offsets in `tables()`'s grid tensor
TABLE_IQ4 = tl.constexpr(2048)  # after IQ2_XXS's 256x8 grid
TABLE_IQ2_XS = tl.constexpr(TABLE_IQ4.value + 16)
TABLE_IQ2_S = tl.constexpr(TABLE_IQ2_XS.value + 512 * 8)
TABLE_IQ3_XXS = tl.constexpr(TABLE_IQ2_S.value + 1024 * 8)
TABLE_IQ3_S = tl.constexpr(TABLE_IQ3_XXS.value + 256 * 4)
TABLE_IQ1 = tl.constexpr(TABLE_IQ3_S.value + 512 * 4)


@triton.jit
def _f16(ptr, mask):
    """Load float16 values at byte pointers (2-byte aligned) as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u16(ptr, mask):
    """Load little-endian uint16 values at byte pointers (2-byte aligned) as uint32."""
    return tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.uint32)


@triton.jit
def _u8(ptr, mask):
    """Load bytes as int32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def dequant_f32(row, k, mask):
    """F32: one little-endian float per value."""
    return tl.load((row + 4 * k).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)


@triton.jit
def dequant_f16(row, k, mask):
    """F16: one little-endian half per value."""
    return _f16(row + 2 * k, mask)


@triton.jit
def dequant_bf16(row, k, mask):
    """BF16: the top 16 bits of a float32."""
    return (_u16(row + 2 * k, mask) << 16).to(tl.float32, bitcast=True)


@triton.jit
def dequant_q8_0(row, k, mask):
    """Q8_0: 34-byte blocks of 32 = f16 d, int8 qs[32]; y = d*q."""
    block = row + (k // 32) * 34
    q = tl.load((block + 2 + k % 32).to(tl.pointer_type(tl.int8)), mask=mask, other=0)
    return _f16(block, mask) * q.to(tl.float32)


@triton.jit
def dequant_q4_k(row, k, mask):
    """Q4_K: 144-byte blocks of 256 = f16 d, f16 dmin, scales[12] (8 six-bit scale/min pairs), qs[128]."""
    block = row + (k // 256) * 144
    j = k % 256
    sub = j // 32  # sub-block 0..7; chunk c = sub // 2 holds sub-blocks 2c (low nibbles) and 2c+1 (high)
    byte = _u8(block + 16 + (sub // 2) * 32 + j % 32, mask)
    q = (byte >> ((sub % 2) * 4)) & 15
    sc, m = _k4_scale_min(block, sub, mask)
    d = _f16(block, mask)
    dmin = _f16(block + 2, mask)
    return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)


@triton.jit
def dequant_q2_k(row, k, mask):
    """Q2_K: 84-byte blocks of 256 = scales[16], qs[64], f16 d, f16 dmin; y = d*(sc&15)*q - dmin*(sc>>4)."""
    block = row + (k // 256) * 84
    j = k % 256
    byte = _u8(block + 16 + (j // 128) * 32 + j % 32, mask)
    q = (byte >> (((j // 32) % 4) * 2)) & 3
    sc = _u8(block + j // 16, mask)
    d = _f16(block + 80, mask)
    dmin = _f16(block + 82, mask)
    return (d * (sc & 15).to(tl.float32)) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)


@triton.jit
def dequant_iq2_xxs(row, k, mask, grid_ptr, signs_ptr):
    """IQ2_XXS: 66-byte blocks of 256 = f16 d, then per 32 values 4 grid indices and a u32 of signs/scale.

    `grid_ptr` is the 256x8 uint8 grid (one byte per value), `signs_ptr` the 128 sign bytes.
    """
    block = row + (k // 256) * 66
    j = k % 256
    group = block + 2 + (j // 32) * 8
    lane = (j % 32) // 8  # which of the 4 grid indices
    i = j % 8
    index = _u8(group + lane, mask)
    aux = _u16(group + 4, mask) | (_u16(group + 6, mask) << 16)
    ls = (aux >> 28).to(tl.float32)
    sign_index = ((aux >> (7 * lane).to(tl.uint32)) & 127).to(tl.int32)
    magnitude = tl.load(grid_ptr + index * 8 + i, mask=mask, other=0).to(tl.float32)
    negative = (tl.load(signs_ptr + sign_index, mask=mask, other=0).to(tl.int32) >> i) & 1
    db = _f16(block, mask) * (0.5 + ls) * 0.25
    return tl.where(negative != 0, -db, db) * magnitude


@triton.jit
def _nibble(qs, j, mask):
    """Code j (0..31) of a 16-byte nibble run: low nibble of qs[j % 16] for j < 16, else the high one."""
    return (_u8(qs + j % 16, mask) >> ((j // 16) * 4)) & 15


@triton.jit
def dequant_q4_0(row, k, mask):
    """Q4_0: 18-byte blocks of 32 = f16 d, qs[16]; y = d*(q - 8)."""
    block = row + (k // 32) * 18
    return _f16(block, mask) * (_nibble(block + 2, k % 32, mask) - 8).to(tl.float32)


@triton.jit
def dequant_q4_1(row, k, mask):
    """Q4_1: 20-byte blocks of 32 = f16 d, f16 m, qs[16]; y = d*q + m (d*q is exact)."""
    block = row + (k // 32) * 20
    return _f16(block, mask) * _nibble(block + 4, k % 32, mask).to(tl.float32) + _f16(block + 2, mask)


@triton.jit
def _q5(block, qh_at, j, mask):
    """5-bit code j of a Q5_0/Q5_1 block: nibble from the bytes after `qh`, 5th bit = bit j of `qh`."""
    high = (_u8(block + qh_at + j // 8, mask) >> (j % 8)) & 1
    return _nibble(block + qh_at + 4, j, mask) | (high << 4)


@triton.jit
def dequant_q5_0(row, k, mask):
    """Q5_0: 22-byte blocks of 32 = f16 d, u32 qh, qs[16]; y = d*(q - 16)."""
    block = row + (k // 32) * 22
    return _f16(block, mask) * (_q5(block, 2, k % 32, mask) - 16).to(tl.float32)


@triton.jit
def dequant_q5_1(row, k, mask):
    """Q5_1: 24-byte blocks of 32 = f16 d, f16 m, u32 qh, qs[16]; y = d*q + m (d*q is exact)."""
    block = row + (k // 32) * 24
    return _f16(block, mask) * _q5(block, 4, k % 32, mask).to(tl.float32) + _f16(block + 2, mask)


@triton.jit
def dequant_q3_k(row, k, mask):
    """Q3_K: 110-byte blocks of 256 = hmask[32], qs[64], scales[12], f16 d; y = d*(s - 32)*(q - 4*(1 - h))."""
    block = row + (k // 256) * 110
    e = k % 256
    j = e // 16  # sub-block of 16
    low = (_u8(block + 96 + j % 8, mask) >> ((j // 8) * 4)) & 15
    high = (_u8(block + 104 + j % 4, mask) >> ((j // 4) * 2)) & 3
    scale = _f16(block + 108, mask) * ((low | (high << 4)) - 32).to(tl.float32)
    ql = (_u8(block + 32 + (e // 128) * 32 + e % 32, mask) >> (((e % 128) // 32) * 2)) & 3
    h = (_u8(block + e % 32, mask) >> (e // 32)) & 1
    return scale * (ql - 4 * (1 - h)).to(tl.float32)


@triton.jit
def _k4_scale_min(block, sub, mask):
    """Q4_K/Q5_K: the 6-bit (scale, min) of sub-block `sub` (0..7) from the 12 bytes at block + 4."""
    s_lo = _u8(block + 4 + sub % 4, mask)  # scales[sub - 4] for sub >= 4, scales[sub] below
    s_mid = _u8(block + 4 + sub, mask)
    s_hi = _u8(block + 8 + sub, mask)  # scales[sub + 4]
    low = sub < 4
    sc = tl.where(low, s_mid & 63, (s_hi & 15) | ((s_lo >> 6) << 4))
    m = tl.where(low, s_hi & 63, (s_hi >> 4) | ((s_mid >> 6) << 4))
    return sc, m


@triton.jit
def dequant_q5_k(row, k, mask):
    """Q5_K: 176-byte blocks of 256 = f16 d, f16 dmin, scales[12] (as Q4_K), qh[32], qs[128]."""
    block = row + (k // 256) * 176
    j = k % 256
    sub = j // 32
    low = (_u8(block + 48 + (sub // 2) * 32 + j % 32, mask) >> ((sub % 2) * 4)) & 15
    q = low | (((_u8(block + 16 + j % 32, mask) >> sub) & 1) << 4)
    sc, m = _k4_scale_min(block, sub, mask)
    d = _f16(block, mask)
    dmin = _f16(block + 2, mask)
    return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)


@triton.jit
def dequant_q6_k(row, k, mask):
    """Q6_K: 210-byte blocks of 256 = ql[128], qh[64], int8 scales[16], f16 d; y = d*scales[j]*(q - 32)."""
    block = row + (k // 256) * 210
    e = k % 256
    scale = _f16(block + 208, mask) * ((_u8(block + 192 + e // 16, mask) ^ 128) - 128).to(tl.float32)
    low = (_u8(block + (e // 128) * 64 + e % 64, mask) >> (((e // 64) % 2) * 4)) & 15
    high = (_u8(block + 128 + (e // 128) * 32 + e % 32, mask) >> (((e // 32) % 4) * 2)) & 3
    return scale * ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def dequant_tq1_0(row, k, mask):
    """TQ1_0: 54-byte blocks of 256 = qs[48], qh[4], f16 d; digit p of byte b is ((b*3^p) mod 256)*3 >> 8."""
    block = row + (k // 256) * 54
    e = k % 256
    byte = tl.where(e < 160, e % 32, tl.where(e < 240, 32 + (e - 160) % 16, 48 + (e - 240) % 4))
    p = tl.where(e < 160, e // 32, tl.where(e < 240, (e - 160) // 16, (e - 240) // 4))
    pow3 = tl.where(p == 0, 1, tl.where(p == 1, 3, tl.where(p == 2, 9, tl.where(p == 3, 27, 81))))
    digit = (((_u8(block + byte, mask) * pow3) & 255) * 3) >> 8
    return _f16(block + 52, mask) * (digit - 1).to(tl.float32)


@triton.jit
def dequant_tq2_0(row, k, mask):
    """TQ2_0: 66-byte blocks of 256 = qs[64], f16 d; element 128c + 32s + l is bits 2s of qs[32c + l]."""
    block = row + (k // 256) * 66
    e = k % 256
    q = (_u8(block + (e // 128) * 32 + e % 32, mask) >> (((e % 128) // 32) * 2)) & 3
    return _f16(block + 64, mask) * (q - 1).to(tl.float32)


@triton.jit
def _iq4_level(grid_ptr, q, mask):
    """IQ4_NL's level of code q (the int8 table at TABLE_IQ4 in `tables()`), as float32."""
    level = (grid_ptr + TABLE_IQ4 + q).to(tl.pointer_type(tl.int8))
    return tl.load(level, mask=mask, other=0).to(tl.float32)


@triton.jit
def dequant_iq4_nl(row, k, mask, grid_ptr):
    """IQ4_NL: 18-byte blocks of 32 = f16 d, qs[16] (as Q4_0); y = d*levels[q]."""
    block = row + (k // 32) * 18
    return _f16(block, mask) * _iq4_level(grid_ptr, _nibble(block + 2, k % 32, mask), mask)


@triton.jit
def dequant_iq4_xs(row, k, mask, grid_ptr):
    """IQ4_XS: 136-byte blocks of 256 = f16 d, u16 scales_h, scales_l[4], qs[128]; y = d*(ls - 32)*levels[q]."""
    block = row + (k // 256) * 136
    e = k % 256
    sub = e // 32
    low = (_u8(block + 4 + sub // 2, mask) >> ((sub % 2) * 4)) & 15
    high = ((_u16(block + 2, mask) >> (2 * sub).to(tl.uint32)) & 3).to(tl.int32)
    scale = _f16(block, mask) * ((low | (high << 4)) - 32).to(tl.float32)
    return scale * _iq4_level(grid_ptr, _nibble(block + 8 + sub * 16, e % 32, mask), mask)


@triton.jit
def _signed(magnitude, negative, db):
    """`db * magnitude`, negated where `negative` (as the reference's db * grid * ±1)."""
    return tl.where(negative != 0, -db, db) * magnitude


@triton.jit
def _nibble_scale(byte, c):
    """IQ2_XS/IQ2_S: 4-bit scale `ls` of 8-value chunk c (two chunks per nibble), as float32."""
    return ((byte >> (((c // 2) % 2) * 4)) & 15).to(tl.float32)


@triton.jit
def dequant_iq2_xs(row, k, mask, grid_ptr, signs_ptr):
    """IQ2_XS: 74-byte blocks of 256 = f16 d, u16 qs[32] (9-bit grid index, 7-bit sign index), scales[8]."""
    block = row + (k // 256) * 74
    j = k % 256
    c = j // 8
    i = j % 8
    qs = _u16(block + 2 + 2 * c, mask).to(tl.int32)
    negative = (tl.load(signs_ptr + (qs >> 9), mask=mask, other=0).to(tl.int32) >> i) & 1
    magnitude = tl.load(grid_ptr + TABLE_IQ2_XS + (qs & 511) * 8 + i, mask=mask, other=0).to(tl.float32)
    db = _f16(block, mask) * (0.5 + _nibble_scale(_u8(block + 66 + c // 4, mask), c)) * 0.25
    return _signed(magnitude, negative, db)


@triton.jit
def dequant_iq2_s(row, k, mask, grid_ptr):
    """IQ2_S: 82-byte blocks of 256 = f16 d, qs[32], signs[32], qh[8] (2 index bits a chunk), scales[8]."""
    block = row + (k // 256) * 82
    j = k % 256
    c = j // 8
    i = j % 8
    index = _u8(block + 2 + c, mask) | (((_u8(block + 66 + c // 4, mask) >> ((c % 4) * 2)) & 3) << 8)
    db = _f16(block, mask) * (0.5 + _nibble_scale(_u8(block + 74 + c // 4, mask), c)) * 0.25
    magnitude = tl.load(grid_ptr + TABLE_IQ2_S + index * 8 + i, mask=mask, other=0).to(tl.float32)
    return _signed(magnitude, (_u8(block + 34 + c, mask) >> i) & 1, db)


@triton.jit
def dequant_iq3_xxs(row, k, mask, grid_ptr, signs_ptr):
    """IQ3_XXS: 98-byte blocks of 256 = f16 d, qs[64] (grid indices of 4 values), u32 aux[8] (signs, scale)."""
    block = row + (k // 256) * 98
    j = k % 256
    sub = j // 32
    aux = _u16(block + 66 + 4 * sub, mask) | (_u16(block + 68 + 4 * sub, mask) << 16)
    db = _f16(block, mask) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    index = _u8(block + 2 + j // 4, mask)
    magnitude = tl.load(grid_ptr + TABLE_IQ3_XXS + index * 4 + j % 4, mask=mask, other=0).to(tl.float32)
    sign_index = ((aux >> (7 * ((j % 32) // 8)).to(tl.uint32)) & 127).to(tl.int32)
    negative = (tl.load(signs_ptr + sign_index, mask=mask, other=0).to(tl.int32) >> (j % 8)) & 1
    return _signed(magnitude, negative, db)


@triton.jit
def dequant_iq3_s(row, k, mask, grid_ptr):
    """IQ3_S: 110-byte blocks of 256 = f16 d, qs[64], qh[8], signs[32], scales[4]; db = d*(1 + 2*ls)."""
    block = row + (k // 256) * 110
    j = k % 256
    sub = j // 32
    c = j // 4
    ls = ((_u8(block + 106 + sub // 2, mask) >> ((sub % 2) * 4)) & 15).to(tl.float32)
    db = _f16(block, mask) * (1 + 2 * ls)
    index = _u8(block + 2 + c, mask) | (((_u8(block + 66 + c // 8, mask) >> (c % 8)) & 1) << 8)
    magnitude = tl.load(grid_ptr + TABLE_IQ3_S + index * 4 + j % 4, mask=mask, other=0).to(tl.float32)
    return _signed(magnitude, (_u8(block + 74 + j // 8, mask) >> (j % 8)) & 1, db)


@triton.jit
def _iq1_value(grid_ptr, index, i, high_delta, dl, mask):
    """IQ1_S/IQ1_M: dl * (grid[index][i] + delta), delta -1/8 where `high_delta` else +1/8."""
    point = tl.load(grid_ptr + TABLE_IQ1 + index * 8 + i, mask=mask, other=1).to(tl.float32) - 1
    return dl * (point + tl.where(high_delta != 0, -0.125, 0.125))


@triton.jit
def dequant_iq1_s(row, k, mask, grid_ptr):
    """IQ1_S: 50-byte blocks of 256 = f16 d, qs[32], u16 qh[8] (3 index bits a chunk, scale, delta sign)."""
    block = row + (k // 256) * 50
    j = k % 256
    sub = j // 32
    chunk = (j % 32) // 8
    qh = _u16(block + 34 + 2 * sub, mask).to(tl.int32)
    dl = _f16(block, mask) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    index = _u8(block + 2 + j // 8, mask) | (((qh >> (3 * chunk)) & 7) << 8)
    return _iq1_value(grid_ptr, index, j % 8, qh & 0x8000, dl, mask)


@triton.jit
def dequant_iq1_m(row, k, mask, grid_ptr):
    """IQ1_M: 56-byte blocks of 256 = qs[32], qh[16], u16 sc[4] (3-bit scales per 16, f16 d in the top nibbles)."""
    block = row + (k // 256) * 56
    j = k % 256
    sc0 = _u16(block + 48, mask)
    sc1 = _u16(block + 50, mask)
    sc2 = _u16(block + 52, mask)
    sc3 = _u16(block + 54, mask)
    d_bits = (sc0 >> 12) | ((sc1 >> 8) & 0xF0) | ((sc2 >> 4) & 0xF00) | (sc3 & 0xF000)
    d = d_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sub = j // 16
    word = tl.where(sub < 4, sc0, tl.where(sub < 8, sc1, tl.where(sub < 12, sc2, sc3))).to(tl.int32)
    dl = d * (2 * ((word >> (3 * (sub % 4))) & 7) + 1).to(tl.float32)
    c = j // 8
    nibble = (_u8(block + 32 + c // 2, mask) >> ((c % 2) * 4)) & 15
    index = _u8(block + c, mask) | ((nibble & 7) << 8)
    return _iq1_value(grid_ptr, index, j % 8, nibble & 8, dl, mask)


@triton.jit
def dequant_mxfp4(row, k, mask):
    """MXFP4: 17-byte blocks of 32 = e8m0 byte e, qs[16] (value j: low nibble of qs[j], j+16: high nibble).

    As in ggml: y = (2 * e2m1(nibble)) * 2^(e-128), the doubled E2M1 magnitude being an integer.
    """
    block = row + (k // 32) * 17
    j = k % 32
    nibble = (_u8(block + 1 + j % 16, mask) >> ((j // 16) * 4)) & 15
    exponent = (nibble >> 1) & 3
    mantissa = nibble & 1
    twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0)).to(tl.float32)
    e = _u8(block, mask)
    half_scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return half_scale * tl.where((nibble & 8) != 0, 0.0 - twice, twice)  # code 8 is +0, as in gguf-py


@triton.jit
def dequant_fp8_e4m3(row, k, mask):
    """FP8_E4M3: 132-byte blocks of 128 = f32 scale, 128 e4m3fn bytes; y = scale * e4m3(byte)."""
    block = row + (k // 128) * 132
    byte = _u8(block + 4 + k % 128, mask)
    exponent = (byte >> 3) & 15
    mantissa = byte & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where((byte & 127) == 127, float("nan"), magnitude)
    scale = tl.load(block.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    return tl.where((byte & 128) != 0, -magnitude, magnitude) * scale


@triton.jit
def dequant(QTYPE: tl.constexpr, row, k, mask, grid_ptr, signs_ptr):
    """Dispatch on the quant type name (a compile-time constant) to its helper."""
    if QTYPE == "F32":
        w = dequant_f32(row, k, mask)
    elif QTYPE == "F16":
        w = dequant_f16(row, k, mask)
    elif QTYPE == "BF16":
        w = dequant_bf16(row, k, mask)
    elif QTYPE == "Q8_0":
        w = dequant_q8_0(row, k, mask)
    elif QTYPE == "Q4_K":
        w = dequant_q4_k(row, k, mask)
    elif QTYPE == "Q2_K":
        w = dequant_q2_k(row, k, mask)
    elif QTYPE == "IQ2_XXS":
        w = dequant_iq2_xxs(row, k, mask, grid_ptr, signs_ptr)
    elif QTYPE == "MXFP4":
        w = dequant_mxfp4(row, k, mask)
    elif QTYPE == "Q4_0":
        w = dequant_q4_0(row, k, mask)
    elif QTYPE == "Q4_1":
        w = dequant_q4_1(row, k, mask)
    elif QTYPE == "Q5_0":
        w = dequant_q5_0(row, k, mask)
    elif QTYPE == "Q5_1":
        w = dequant_q5_1(row, k, mask)
    elif QTYPE == "Q3_K":
        w = dequant_q3_k(row, k, mask)
    elif QTYPE == "Q5_K":
        w = dequant_q5_k(row, k, mask)
    elif QTYPE == "Q6_K":
        w = dequant_q6_k(row, k, mask)
    elif QTYPE == "TQ1_0":
        w = dequant_tq1_0(row, k, mask)
    elif QTYPE == "TQ2_0":
        w = dequant_tq2_0(row, k, mask)
    elif QTYPE == "IQ4_NL":
        w = dequant_iq4_nl(row, k, mask, grid_ptr)
    elif QTYPE == "IQ4_XS":
        w = dequant_iq4_xs(row, k, mask, grid_ptr)
    elif QTYPE == "IQ2_XS":
        w = dequant_iq2_xs(row, k, mask, grid_ptr, signs_ptr)
    elif QTYPE == "IQ2_S":
        w = dequant_iq2_s(row, k, mask, grid_ptr)
    elif QTYPE == "IQ3_XXS":
        w = dequant_iq3_xxs(row, k, mask, grid_ptr, signs_ptr)
    elif QTYPE == "IQ3_S":
        w = dequant_iq3_s(row, k, mask, grid_ptr)
    elif QTYPE == "IQ1_S":
        w = dequant_iq1_s(row, k, mask, grid_ptr)
    elif QTYPE == "IQ1_M":
        w = dequant_iq1_m(row, k, mask, grid_ptr)
    else:
        tl.static_assert(QTYPE == "FP8_E4M3", "no Triton dequantizer for this quant type")
        w = dequant_fp8_e4m3(row, k, mask)
    return w


SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4", "FP8_E4M3", "Q4_0", "Q4_1", "Q5_0",
             "Q5_1", "Q3_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
             "IQ3_S", "IQ1_S", "IQ1_M")
UNSUPPORTED = frozenset({"I32"})  # integer indices (tid2eid), never a matmul weight
declare_quants("triton", {t: "kernel" for t in SUPPORTED}, UNSUPPORTED)


@functools.cache
def tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup tables of the table-driven helpers on `device`: (grid bytes, IQ2_XXS sign bytes)."""
    parts = [iq2_xxs.GRID, iq4_nl.KVALUES.to(torch.int8).view(torch.uint8), iq2_xs.GRID, iq2_s.GRID, iq3_xxs.GRID,
             iq3_s.GRID, iq1_s.GRID + 1]
    grid = torch.cat([p.to(torch.uint8).flatten() for p in parts])
    return grid.to(device), iq2_xxs.KSIGNS.to(torch.uint8).to(device)
