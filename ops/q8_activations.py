"""The numerics of the opt-in 8-bit-activation CPU dot product (`--cpu-dot q8`, backends/cpu/qdot8.c).

As llama.cpp's CPU kernels do, each row of activations is rounded to 8 bits per block and every block of a
weight row is multiplied with it in integers; floats only combine whole blocks:

- **Q8_K** (activations of the 256-value types: the K-quants, IQ4_XS, the IQ codebook types IQ2_XXS, IQ2_XS, IQ2_S,
  IQ3_XXS, IQ3_S, IQ1_S, IQ1_M and the ternary TQ1_0, TQ2_0): per 256 values,
  `max` = the first value of the largest magnitude, `iscale = -127 / max`, `q = min(127, round(iscale * x))`
  (halves to even), `d = 1 / iscale`, and the sums of q over each 16 values (`bsums`); an all-zero block
  has d = 0 and q = 0.
- **Q8_0** (activations of Q8_0, Q4_0, Q5_0, IQ4_NL and MXFP4 weights): per 32 values, `d = amax / 127`,
  `q = roundf(x / d)` (halves away from zero), d stored as f16.
- **Q8_1** (activations of Q4_1 and Q5_1 weights): Q8_0's, plus `s = f16(d * sum of q)` (d before its f16
  rounding).
- **F16** (activations of F16 weights, llama.cpp's `vec_dot_type` for F16): each value rounded to the nearest
  f16 (halves to even); the products of two f16 values are exact in float32. **BF16** the same with bf16.

Per weight block the dot is an exact integer sum; the float combination, in block order along the row: IQ2_XXS
`acc += (d_w d_x) bsum` (bsum = sum over groups of (2 ls + 1) times the group's integer dot), and 0.125 acc at the
end; Q2_K, Q4_K, Q5_K `acc += (d_x d) isum - (d_x dmin) msum` (isum = sum over sub-blocks of scale times the
sub-block's integer dot, msum = sum of min times bsums); Q3_K, Q6_K (signed sub-block scales, no mins) and IQ4_XS
(isum = sum of (ls - 32) times each 32's integer dot) `acc += (d_w d_x) isum`; Q8_0 the same in whole blocks (isum
the block's integer dot), as llama.cpp's generic kernel and prefill's `qgemm8` (one float step per block and row,
which AMX tiles give every row of a verify at about the cost of one); in 8 lanes as llama.cpp's AVX2 kernel (lane l
adds `(d_w d_x) sumi_l`, sumi_l the integer dot of values 4l..4l+3 of each 32, block after block; then the lanes in
order) the types whose 32 values are integer codes times one scale: Q4_0 (q - 8), Q5_0 (q - 16), IQ4_NL (its table),
MXFP4 (twice the E2M1 value; the scale 2^(e - 128)); Q4_1 and Q5_1 (unsigned codes, a min `m`) as those, then
`+ summs` at the end (summs adds `m_w s_x` block after block); F16 in 32 lanes (lane l adds the products of values
l, l + 32, l + 64, ... in order; then the lanes in order), BF16 the same. The codebook and ternary types as
llama.cpp's generic kernels: `acc += (d_w d_x) bsum` block after block, bsum = sum over groups of (2 ls + 1) times
the group's integer dot with the signed grid values (IQ2_XS, IQ2_S per 16 values, IQ3_XXS, IQ3_S per 32), then
0.125 acc (IQ2_XS, IQ2_S) or 0.25 acc (IQ3_XXS) at the end; TQ1_0, TQ2_0 `acc += (d_w d_x) isum` (codes q - 1);
IQ1_S, IQ1_M `acc += (d_w d_x) (sumi + 0.125 sumd)` (sumi: (2 ls + 1) times the integer dot with the grid's -1, 0,
1; sumd: (2 ls + 1) times each delta's sign times the activations' sum; the float sum rounded once). These are the
formulas of llama.cpp's
`ggml_vec_dot_<type>_q8_K` / `ggml_vec_dot_<type>_q8_0` / `_q8_1` / `ggml_vec_dot_f16` (per-block integers equal;
IQ2_XXS, Q2_K, Q8_0 and the codebook and ternary types add the block terms in the generic version's float order;
llama.cpp's SIMD variants use other float orders). The C kernel matches this reference bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.quants import QTensor, iq1_s, iq2_s, iq2_xs, iq3_s, iq3_xxs
from ops.quants._blocks import bit_planes, f16_field, round_half_away, u16_fields, u32_fields
from ops.quants.iq2_xxs import GRID, KSIGNS
from ops.quants.iq4_nl import KVALUES
from ops.quants.mxfp4 import E2M1, _half_scale
from ops.quants.q4_0 import nibbles
from ops.quants.q4_k import _unpack_scales
from ops.quants.q5_0 import codes as q5_codes
from ops.quants.tq1_0 import _digits as tq1_digits

Q8_K_TYPES = ("IQ2_XXS", "Q2_K", "Q4_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS",   # weights multiplied with Q8_K
              "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "TQ2_0", "TQ1_0", "IQ1_S", "IQ1_M")
Q8_0_TYPES = ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4")                       # ... with Q8_0 activations
Q8_1_TYPES = ("Q4_1", "Q5_1")                                                   # ... with Q8_1 activations
F16_TYPES = ("F16",)                          # weights multiplied with activations rounded to f16
BF16_TYPES = ("BF16",)                        # ... with activations rounded to bf16
TYPES = Q8_K_TYPES + Q8_0_TYPES + Q8_1_TYPES + F16_TYPES + BF16_TYPES
FACTOR = {"IQ2_XXS": 0.125, "IQ2_XS": 0.125, "IQ2_S": 0.125, "IQ3_XXS": 0.25}   # applied to a row's sum at the end


@dataclass(frozen=True)
class Q8Blocks:
    """Activations rounded to 8 bits per block: `d` [M, nb] float32, `q` [M, nb, B] int32 in -127..127,
    `bsums` [M, nb, B // 16] int32 (Q8_K) or None (Q8_0, Q8_1), `s` [M, nb] float32 (Q8_1) or None."""

    d: torch.Tensor
    q: torch.Tensor
    bsums: torch.Tensor | None
    s: torch.Tensor | None = None


def _check(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` as float32 [M, K], K a multiple of `block`, or ValueError/TypeError."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"activations must be a floating-point tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] % block:
        raise ValueError(f"activations must be [M, K] with K a multiple of {block}, got {tuple(x.shape)}")
    return x.to(torch.float32)


def quantize_q8_k(x: torch.Tensor) -> Q8Blocks:
    """llama.cpp's `quantize_row_q8_K` on every row of `x` [M, K] (K a multiple of 256)."""
    x = _check(x, 256)
    v = x.reshape(x.shape[0], -1, 256)
    first = v.abs().argmax(-1, keepdim=True)          # the first of equal magnitudes, as the C loop's `>`
    peak = v.gather(-1, first)[..., 0]
    nonzero = peak != 0
    iscale = torch.full_like(peak, -127.0) / torch.where(nonzero, peak, 1)
    q = torch.round(iscale[..., None] * v).clamp(max=127).to(torch.int32)
    q = torch.where(nonzero[..., None], q, 0)
    d = torch.where(nonzero, 1 / iscale, 0)
    return Q8Blocks(d, q, q.reshape(*q.shape[:2], 16, 16).sum(-1))


def quantize_q8_0(x: torch.Tensor) -> Q8Blocks:
    """llama.cpp's `quantize_row_q8_0_ref` on every row of `x` [M, K] (K a multiple of 32); d rounded to f16."""
    x = _check(x, 32)
    v = x.reshape(x.shape[0], -1, 32)
    d = v.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    q = round_half_away((v * inverse[..., None]).double())    # in float64: halves exact, as C's roundf
    return Q8Blocks(d.to(torch.float16).to(torch.float32), q.to(torch.int32), None)


def quantize_q8_1(x: torch.Tensor) -> Q8Blocks:
    """llama.cpp's `quantize_row_q8_1_ref`: Q8_0's d and quants, and `s` = the quants' sum times the unrounded d,
    rounded to f16."""
    q8_0 = quantize_q8_0(x)
    d = x.to(torch.float32).reshape(x.shape[0], -1, 32).abs().amax(-1) / 127
    s = (q8_0.q.sum(-1).to(torch.float32) * d).to(torch.float16).to(torch.float32)
    return Q8Blocks(q8_0.d, q8_0.q, None, s)


def round_f16(x: torch.Tensor) -> torch.Tensor:
    """Activations `x` [M, K] (K a multiple of 32) rounded to the nearest f16, as float32 (llama.cpp's F16 rows)."""
    return _check(x, 32).to(torch.float16).to(torch.float32)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Activations `x` [M, K] (K a multiple of 32) rounded to the nearest bf16 (halves to even), as float32
    (llama.cpp's BF16 rows)."""
    return _check(x, 32).to(torch.bfloat16).to(torch.float32)


def _iq2_xxs(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of IQ2_XXS blocks [P, nb, 66] against Q8_K rows (0.125 not applied)."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 66)
    g = b[:, 2:].reshape(-1, 8, 8).to(torch.int64)
    bits = g[:, :, 4] | (g[:, :, 5] << 8) | (g[:, :, 6] << 16) | (g[:, :, 7] << 24)
    signs = KSIGNS[(bits[:, :, None] >> (7 * torch.arange(4))) & 127]
    sign = 1 - 2 * ((signs[..., None] >> torch.arange(8)) & 1)
    values = (GRID.to(torch.int64)[g[:, :, :4]] * sign).reshape(P, nb, 8, 32)
    dots = (values * xq.q.reshape(P, nb, 8, 32)).sum(-1)
    bsum = ((2 * (bits >> 28) + 1).reshape(P, nb, 8) * dots).sum(-1)
    d = f16_field(b, 0).reshape(P, nb) * xq.d
    return d * bsum.to(torch.float32)


def _q2_k(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of Q2_K blocks [P, nb, 84] against Q8_K rows."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 84).to(torch.int64)
    q = ((b[:, 16:80].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6]).reshape(1, 1, 4, 1)) & 3)
    dots = (q.reshape(P, nb, 16, 16) * xq.q.reshape(P, nb, 16, 16)).sum(-1)
    s = b[:, :16].reshape(P, nb, 16)
    isum, msum = ((s & 15) * dots).sum(-1), ((s >> 4) * xq.bsums).sum(-1)
    bu = blocks.reshape(-1, 84)
    dall, dmin = f16_field(bu, 80).reshape(P, nb) * xq.d, f16_field(bu, 82).reshape(P, nb) * xq.d
    return dall * isum.to(torch.float32) - dmin * msum.to(torch.float32)


def _q4_k(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of Q4_K blocks [P, nb, 144] against Q8_K rows."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 144)
    sc, m = (t.to(torch.int64).reshape(P, nb, 8) for t in _unpack_scales(bu[:, 4:16]))
    qs = bu[:, 16:].to(torch.int64).reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(P, nb, 8, 32)
    dots = (q * xq.q.reshape(P, nb, 8, 32)).sum(-1)
    isum = (sc * dots).sum(-1)
    msum = (m * xq.bsums.reshape(P, nb, 8, 2).sum(-1)).sum(-1)
    d, dmin = f16_field(bu, 0).reshape(P, nb) * xq.d, f16_field(bu, 2).reshape(P, nb) * xq.d
    return d * isum.to(torch.float32) - dmin * msum.to(torch.float32)


def _lanes(codes: torch.Tensor, d: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb, 8] of integer codes [P, nb, 32] times block scales `d` [P, nb] against Q8_0
    rows, in 8 lanes (lane l: values 4l..4l+3 of the block)."""
    P, nb = d.shape
    lanes = (codes.to(torch.int64) * xq.q).reshape(P, nb, 8, 4).sum(-1)
    return (d * xq.d)[..., None] * lanes.to(torch.float32)


def _q8_0(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of Q8_0 blocks [P, nb, 34] against Q8_0 rows, whole blocks: (d_w d_x) isum."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 34)
    isum = (bu[:, 2:].contiguous().view(torch.int8).reshape(P, nb, 32).to(torch.int64) * xq.q).sum(-1)
    return (f16_field(bu, 0).reshape(P, nb) * xq.d) * isum.to(torch.float32)


def _q4_0(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Q4_0 blocks [P, nb, 18] (codes q - 8) against Q8_0 rows, in 8 lanes."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 18)
    return _lanes(nibbles(bu[:, 2:]).to(torch.int64).reshape(P, nb, 32) - 8, f16_field(bu, 0).reshape(P, nb), xq)


def _q5_0(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Q5_0 blocks [P, nb, 22] (codes q - 16) against Q8_0 rows, in 8 lanes."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 22)
    return _lanes(q5_codes(bu, 2).to(torch.int64).reshape(P, nb, 32) - 16, f16_field(bu, 0).reshape(P, nb), xq)


def _iq4_nl(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ4_NL blocks [P, nb, 18] (codes: the table's integers) against Q8_0 rows, in 8 lanes."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 18)
    codes = KVALUES.to(torch.int64)[nibbles(bu[:, 2:]).to(torch.int64)].reshape(P, nb, 32)
    return _lanes(codes, f16_field(bu, 0).reshape(P, nb), xq)


def _mxfp4(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """MXFP4 blocks [P, nb, 17] (codes: twice the E2M1 values, scale 2^(e - 128)) against Q8_0 rows, in 8 lanes."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 17)
    codes = (2 * E2M1).to(torch.int64)[nibbles(bu[:, 1:]).to(torch.int64)].reshape(P, nb, 32)
    return _lanes(codes, _half_scale(bu[:, :1]).reshape(P, nb), xq)


def _with_mins(codes: torch.Tensor, bu: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb, 9] of Q4_1/Q5_1 (unsigned `codes` [P, nb, 32], blocks `bu` [P * nb, bytes]
    with f16 d and m first) against Q8_1 rows: the 8 lanes of `_lanes`, then `m_w s_x` as a ninth."""
    P, nb = codes.shape[:2]
    lanes = _lanes(codes, f16_field(bu, 0).reshape(P, nb), xq)
    return torch.cat([lanes, (f16_field(bu, 2).reshape(P, nb) * xq.s)[..., None]], -1)


def _q4_1(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Q4_1 blocks [P, nb, 20] (codes q, a min) against Q8_1 rows: 8 lanes and the mins."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 20)
    return _with_mins(nibbles(bu[:, 4:]).to(torch.int64).reshape(P, nb, 32), bu, xq)


def _q5_1(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Q5_1 blocks [P, nb, 24] (5-bit codes q, a min) against Q8_1 rows: 8 lanes and the mins."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 24)
    return _with_mins(q5_codes(bu, 4).to(torch.int64).reshape(P, nb, 32), bu, xq)


def _iq4_xs(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of IQ4_XS blocks [P, nb, 136] against Q8_K rows."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 136)
    b = bu.to(torch.int64)
    low = bit_planes(b[:, 4:8, None], [0, 4], 15).reshape(P, nb, 8)
    high = ((b[:, 2] | (b[:, 3] << 8))[:, None] >> (2 * torch.arange(8))) & 3
    codes = KVALUES.to(torch.int64)[nibbles(b[:, 8:].reshape(-1, 16))].reshape(P, nb, 8, 32)
    dots = (codes * xq.q.reshape(P, nb, 8, 32)).sum(-1)
    isum = (((low | (high.reshape(P, nb, 8) << 4)) - 32) * dots).sum(-1)
    return f16_field(bu, 0).reshape(P, nb) * xq.d * isum.to(torch.float32)


def _q3_k(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of Q3_K blocks [P, nb, 110] against Q8_K rows."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 110).to(torch.int64)
    low = bit_planes(b[:, 96:104], [0, 4], 15).reshape(P, nb, 16)
    high = bit_planes(b[:, 104:108], [0, 2, 4, 6], 3).reshape(P, nb, 16)
    q = bit_planes(b[:, 32:96].reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(P, nb, 256)
    h = bit_planes(b[:, :32], list(range(8)), 1).reshape(P, nb, 256)
    dots = ((q - 4 * (1 - h)) * xq.q).reshape(P, nb, 16, 16).sum(-1)
    isum = (((low | (high << 4)) - 32) * dots).sum(-1)
    return f16_field(blocks.reshape(-1, 110), 108).reshape(P, nb) * xq.d * isum.to(torch.float32)


def _q5_k(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of Q5_K blocks [P, nb, 176] against Q8_K rows."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 176)
    sc, m = (t.to(torch.int64).reshape(P, nb, 8) for t in _unpack_scales(bu[:, 4:16]))
    qs = bu[:, 48:].to(torch.int64).reshape(-1, 4, 1, 32)
    high = bit_planes(bu[:, 16:48].to(torch.int64), list(range(8)), 1)
    q = (torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32) | (high << 4)).reshape(P, nb, 8, 32)
    isum = (sc * (q * xq.q.reshape(P, nb, 8, 32)).sum(-1)).sum(-1)
    msum = (m * xq.bsums.reshape(P, nb, 8, 2).sum(-1)).sum(-1)
    d, dmin = f16_field(bu, 0).reshape(P, nb) * xq.d, f16_field(bu, 2).reshape(P, nb) * xq.d
    return d * isum.to(torch.float32) - dmin * msum.to(torch.float32)


def _q6_k(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """Per-block float terms [P, nb] of Q6_K blocks [P, nb, 210] against Q8_K rows."""
    P, nb = blocks.shape[:2]
    bu = blocks.reshape(-1, 210)
    b = bu.to(torch.int64)
    low = bit_planes(b[:, :128].reshape(-1, 2, 64), [0, 4], 15).reshape(P, nb, 256)
    high = bit_planes(b[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(P, nb, 256)
    dots = (((low | (high << 4)) - 32) * xq.q).reshape(P, nb, 16, 16).sum(-1)
    scales = bu[:, 192:208].contiguous().view(torch.int8).to(torch.int64).reshape(P, nb, 16)
    return f16_field(bu, 208).reshape(P, nb) * xq.d * (scales * dots).sum(-1).to(torch.float32)


def _f16(blocks: torch.Tensor, x16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-block products [P, nb, 32] of F16 (BF16) weight rows [P, nb, 64 bytes] with rows of f16 (bf16) rounded
    activations [P, nb, 32] (exact in float32: lane l of a block holds the product of its value l)."""
    return blocks.contiguous().view(dtype).to(torch.float32) * x16


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """Sign bytes `[...]` -> +-1 int64 `[..., 8]` (bit j set: value j negative)."""
    return 1 - 2 * ((bits[..., None].to(torch.int64) >> torch.arange(8)) & 1)


def _scaled(values: torch.Tensor, ls: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """bsum [P, nb] int64: integer `values` [P, nb, 256] dotted with the Q8_K rows per group of 256 / G values,
    each group's dot times its scale `ls` [P, nb, G]."""
    P, nb, G = ls.shape
    dots = (values * xq.q).reshape(P, nb, G, -1).sum(-1)
    return (ls * dots).sum(-1)


def _grid_term(blocks: torch.Tensor, bsum: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """(d_w d_x) bsum, d_w the f16 at byte 0 of each block (the IQ codebook types)."""
    P, nb = bsum.shape
    return f16_field(blocks.reshape(P * nb, -1), 0).reshape(P, nb) * xq.d * bsum.to(torch.float32)


def _iq3_xxs(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ3_XXS blocks [P, nb, 98] against Q8_K rows: (d_w d_x) bsum, bsum = sum over the 32s of (2 ls + 1)
    times their integer dot (0.25 per row at the end)."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 98)
    aux = u32_fields(b, 66, 8)
    signs = _signs(KSIGNS[(aux[..., None] >> (7 * torch.arange(4))) & 127])              # [n, 8, 4, 8]
    grid = iq3_xxs.GRID.to(torch.int64)[b[:, 2:66].to(torch.int64)].reshape(-1, 8, 4, 8)
    values = (grid * signs).reshape(P, nb, 256)
    return _grid_term(blocks, _scaled(values, (2 * (aux >> 28) + 1).reshape(P, nb, 8), xq), xq)


def _iq3_s(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ3_S blocks [P, nb, 110] against Q8_K rows: (d_w d_x) bsum, bsum = sum over the 32s of (2 ls + 1) times
    their integer dot."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 110)
    high = bit_planes(b[:, 66:74, None].to(torch.int64), list(range(8)), 1).reshape(-1, 64)
    grid = iq3_s.GRID.to(torch.int64)[b[:, 2:66].to(torch.int64) | (high << 8)].reshape(-1, 32, 8)
    values = (grid * _signs(b[:, 74:106])).reshape(P, nb, 256)
    ls = bit_planes(b[:, 106:110, None].to(torch.int64), [0, 4], 15).reshape(P, nb, 8)
    return _grid_term(blocks, _scaled(values, 2 * ls + 1, xq), xq)


def _iq2_16(blocks: torch.Tensor, grid: torch.Tensor, signs: torch.Tensor, scales: torch.Tensor,
            xq: Q8Blocks) -> torch.Tensor:
    """IQ2_XS / IQ2_S: grid rows [n, 32, 8] and signs [n, 32, 8] of each block, scale bytes [n, 8] (nibble h of
    byte i: the 16 values 32i + 16h..) -> (d_w d_x) bsum (0.125 per row at the end)."""
    P, nb = blocks.shape[:2]
    ls = bit_planes(scales[..., None].to(torch.int64), [0, 4], 15).reshape(P, nb, 16)
    values = (grid.to(torch.int64) * signs).reshape(P, nb, 256)
    return _grid_term(blocks, _scaled(values, 2 * ls + 1, xq), xq)


def _iq2_xs(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ2_XS blocks [P, nb, 74] against Q8_K rows."""
    b = blocks.reshape(-1, 74)
    qs = u16_fields(b, 2, 32)
    return _iq2_16(blocks, iq2_xs.GRID[qs & 511], _signs(KSIGNS[qs >> 9]), b[:, 66:74], xq)


def _iq2_s(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ2_S blocks [P, nb, 82] against Q8_K rows."""
    b = blocks.reshape(-1, 82)
    high = bit_planes(b[:, 66:74, None].to(torch.int64), [0, 2, 4, 6], 3).reshape(-1, 32)
    grid = iq2_s.GRID[b[:, 2:34].to(torch.int64) | (high << 8)]
    return _iq2_16(blocks, grid, _signs(b[:, 34:66]), b[:, 74:82], xq)


def _ternary(blocks: torch.Tensor, codes: torch.Tensor, at_d: int, xq: Q8Blocks) -> torch.Tensor:
    """TQ1_0 / TQ2_0: codes [n, 256] in -1..1 of blocks [P, nb, bytes] (f16 d at byte `at_d`) against Q8_K rows:
    (d_w d_x) isum."""
    P, nb = blocks.shape[:2]
    isum = (codes.reshape(P, nb, 256) * xq.q).sum(-1)
    return f16_field(blocks.reshape(P * nb, -1), at_d).reshape(P, nb) * xq.d * isum.to(torch.float32)


def _tq2_0(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """TQ2_0 blocks [P, nb, 66] (2-bit codes q - 1) against Q8_K rows."""
    b = blocks.reshape(-1, 66).to(torch.int64)
    return _ternary(blocks, bit_planes(b[:, :64].reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 256) - 1, 64, xq)


def _tq1_0(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """TQ1_0 blocks [P, nb, 54] (base-3 digits q - 1) against Q8_K rows."""
    b = blocks.reshape(-1, 54)
    codes = torch.cat([tq1_digits(b[:, :32], 5), tq1_digits(b[:, 32:48], 5), tq1_digits(b[:, 48:52], 4)], -1)
    return _ternary(blocks, codes - 1, 52, xq)


def _with_delta(d: torch.Tensor, sumi: torch.Tensor, sumi_delta: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ1_S / IQ1_M's float step: (d_w d_x) (sumi + 0.125 sumi_delta), the sum rounded once in float32."""
    return d * xq.d * (sumi.to(torch.float32) + 0.125 * sumi_delta.to(torch.float32))


def _iq1_s(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ1_S blocks [P, nb, 50] against Q8_K rows: sumi = sum over the 32s of ls times their integer dot with the
    grid, the delta's sum = sum of ls delta times the 32's activation sum."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 50)
    qh = u16_fields(b, 34, 8)
    high = ((qh[..., None] >> (3 * torch.arange(4))) & 7).reshape(-1, 32)
    values = iq1_s.GRID.to(torch.int64)[b[:, 2:34].to(torch.int64) | (high << 8)].reshape(P, nb, 256)
    ls = (2 * ((qh >> 12) & 7) + 1).reshape(P, nb, 8)
    delta = torch.where(qh & 0x8000 != 0, -1, 1).reshape(P, nb, 8)
    sums = xq.bsums.reshape(P, nb, 8, 2).sum(-1)
    return _with_delta(f16_field(b, 0).reshape(P, nb), _scaled(values, ls, xq), (ls * delta * sums).sum(-1), xq)


def _iq1_m(blocks: torch.Tensor, xq: Q8Blocks) -> torch.Tensor:
    """IQ1_M blocks [P, nb, 56] against Q8_K rows: as IQ1_S per 16 values, a delta per 8."""
    P, nb = blocks.shape[:2]
    b = blocks.reshape(-1, 56)
    sc = u16_fields(b, 48, 4)
    d_bits = ((sc >> 12) << (4 * torch.arange(4))).sum(-1, keepdim=True)
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32).reshape(P, nb)
    ls = (2 * ((sc[..., None] >> (3 * torch.arange(4))) & 7) + 1).reshape(P, nb, 16)
    nib = bit_planes(b[:, 32:48, None].to(torch.int64), [0, 4], 15).reshape(-1, 32)
    values = iq1_s.GRID.to(torch.int64)[b[:, :32].to(torch.int64) | ((nib & 7) << 8)].reshape(P, nb, 256)
    delta = torch.where(nib & 8 != 0, -1, 1).reshape(P, nb, 16, 2)
    chunk_sums = xq.q.reshape(P, nb, 16, 2, 8).sum(-1)
    return _with_delta(d, _scaled(values, ls, xq), (ls * (delta * chunk_sums).sum(-1)).sum(-1), xq)


_BLOCK_TERMS = {"IQ2_XXS": _iq2_xxs, "Q2_K": _q2_k, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q3_K": _q3_k, "Q5_K": _q5_k,
                "Q6_K": _q6_k, "IQ4_XS": _iq4_xs, "Q4_0": _q4_0, "Q5_0": _q5_0, "IQ4_NL": _iq4_nl, "MXFP4": _mxfp4,
                "Q4_1": _q4_1, "Q5_1": _q5_1, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s, "IQ2_XS": _iq2_xs,
                "IQ2_S": _iq2_s, "TQ2_0": _tq2_0, "TQ1_0": _tq1_0, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m}


def quantize_activations(x: torch.Tensor, qtype: str) -> Q8Blocks:
    """The 8-bit activations a weight of `qtype` is multiplied with (Q8_0, Q8_1 for their types, else Q8_K)."""
    if qtype in Q8_0_TYPES:
        return quantize_q8_0(x)
    return quantize_q8_1(x) if qtype in Q8_1_TYPES else quantize_q8_k(x)


def qdot8(x: torch.Tensor, w: QTensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T` with 8-bit activations, float32 [M, N]; with `experts` [M] int64, row m uses expert
    experts[m] of a stacked [E, N, K] weight (an expert < 0 gives a row of zeros)."""
    if not isinstance(w, QTensor) or w.qtype.name not in TYPES:
        raise TypeError(f"qdot8 serves {', '.join(TYPES)} weights, got {getattr(w, 'qtype', type(w).__name__)}")
    K = w.shape[-1]
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"activations must be [M, {K}], got {tuple(x.shape)}")
    if (experts is None) != (len(w.shape) == 2):
        raise ValueError(f"a weight of shape {w.shape} needs experts exactly when it is stacked [E, N, K]")
    M, N, nb = x.shape[0], w.shape[-2], K // (256 if w.qtype.name in Q8_K_TYPES else 32)
    if experts is None:
        data = w.data.reshape(1, N, -1).expand(M, N, -1)
    else:
        data = w.data.reshape(w.shape[0], N, -1)[experts.clamp(min=0)]
    blocks = data.reshape(M * N, nb, -1)
    if w.qtype.name in F16_TYPES + BF16_TYPES:
        f16 = w.qtype.name in F16_TYPES
        x16 = (round_f16 if f16 else round_bf16)(x).reshape(M, 1, nb, 32).expand(M, N, nb, 32)
        terms = _f16(blocks, x16.reshape(M * N, nb, 32), torch.float16 if f16 else torch.bfloat16)
    else:
        xq = quantize_activations(x, w.qtype.name)
        rows = Q8Blocks(*(None if t is None else t.repeat_interleave(N, 0) for t in (xq.d, xq.q, xq.bsums, xq.s)))
        terms = _BLOCK_TERMS[w.qtype.name](blocks, rows)
    acc = torch.zeros(M * N, *terms.shape[2:], dtype=torch.float32)
    for b in range(nb):                               # in block order, as the kernel adds them
        acc = acc + terms[:, b]
    if acc.dim() == 2:               # the lanes of Q4_0..MXFP4, Q8_1_TYPES (their mins last), F16, BF16, in order
        acc = sum((acc[:, lane] for lane in range(1, acc.shape[1])), start=acc[:, 0])
    if w.qtype.name in FACTOR:
        acc = FACTOR[w.qtype.name] * acc
    out = acc.reshape(M, N)
    return out if experts is None else torch.where(experts[:, None] >= 0, out, 0)


def qgemm8(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """`x [M, K] @ W.T` for a Q8_0 weight with Q8_0 activations in prefill's block order (the GEMM of more than
    SMALL_M rows): each block's integer dot whole, `acc += (d_w d_x) isum` block after block, as llama.cpp's generic
    `ggml_vec_dot_q8_0_q8_0` and its AMX kernel, and as `qdot8` (the same bits as its rows). Float32 [M, N]."""
    if not isinstance(w, QTensor) or w.qtype.name != "Q8_0" or len(w.shape) != 2:
        raise TypeError(f"qgemm8 serves 2-D Q8_0 weights, got {getattr(w, 'qtype', type(w).__name__)}")
    N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"activations must be [M, {K}], got {tuple(x.shape)}")
    xq = quantize_q8_0(x)
    blocks = w.data.reshape(N, K // 32, 34)
    dw = f16_field(blocks.reshape(-1, 34), 0).reshape(N, K // 32)
    qw = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int32)
    acc = torch.zeros(x.shape[0], N, dtype=torch.float32)
    for b in range(K // 32):                          # in block order, as the kernel adds them
        isum = xq.q[:, b] @ qw[:, b].T                # exact: at most 32 * 128 * 127 in magnitude
        acc = acc + (dw[None, :, b] * xq.d[:, b, None]) * isum.to(torch.float32)
    return acc
