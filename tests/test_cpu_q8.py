"""The opt-in 8-bit-activation dot product (`--cpu-dot q8`): the reference (ops/q8_activations.py) against
llama.cpp's formulas (quantize_row_q8_K_ref, quantize_row_q8_0_ref and the generic ggml_vec_dot_<type>_q8_K,
written out here as loops), the C kernel (backends/cpu/qdot8.c) bit for bit against the reference (AVX-512, AVX2
and plain C builds), its batch invariance, thread splits and experts addressing, and the switch: refused under
--strict and off the cpu backend, shown in the op report, taken by scripts/generate.py."""
from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.cpu import kernels
from backends.registry import OpSet
from ds4.errors import BackendUnavailable, UsageError
from ops import q8_activations as ref
from ops.quants import QTensor, iq1_s, iq2_s, iq2_xs, iq3_s, iq3_xxs
from ops.quants.iq2_xxs import GRID, KSIGNS
from tests.script_modules import script

F32 = np.float32


def weight(qtype: str, *shape: int, seed: int = 0) -> QTensor:
    """A random weight of `qtype`."""
    return QTensor.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / 16, qtype, "w")


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """Random rows with the cases the rounding rule must get right: an all-zero block, a block whose largest
    magnitude appears twice with both signs (the first wins), and a block of exact halves after scaling."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0
    if M > 1:
        x[1, :256] = torch.linspace(-1, 1, 256)
        x[1, 7], x[1, 9] = -3.0, 3.0
    if M > 2:
        x[2, :256] = (torch.arange(256) % 5 - 2).float()    # peak -2: the values +-1 scale to +-63.5
    return x


# llama.cpp's formulas as loops (the names and steps of ggml-quants.c and ggml-cpu/quants.c).
def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2^23 in float32 and read the low mantissa bits."""
    return ((v.astype(F32) + F32(12582912.0)).view(np.int32) & 0x007FFFFF) - 0x00400000


def quantize_row_q8_k_ref(x: np.ndarray) -> list[tuple]:
    """Per 256 values: (d, qs, bsums) as llama.cpp's quantize_row_q8_K_ref."""
    out = []
    for blk in x.reshape(-1, 256):
        amax, peak = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, peak = abs(v), v
        if not amax:
            out.append((F32(0), np.zeros(256, np.int32), np.zeros(16, np.int32)))
            continue
        iscale = F32(-127.0) / peak
        qs = np.minimum(127, nearest_int(iscale * blk))
        out.append((F32(1) / iscale, qs, qs.reshape(16, 16).sum(1)))
    return out


def quantize_row_q8_0_ref(x: np.ndarray) -> list[tuple]:
    """Per 32 values: (d as f16, qs) as llama.cpp's quantize_row_q8_0_ref (roundf: halves away from zero)."""
    out = []
    for blk in x.reshape(-1, 32):
        d = np.abs(blk).max() / F32(127)
        inverse = F32(1) / d if d else F32(0)
        v = (blk * inverse).astype(np.float64)
        out.append((F32(np.float16(d)), (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int32)))
    return out


def quantize_row_q8_1_ref(x: np.ndarray) -> list[tuple]:
    """Per 32 values: (d as f16, qs, s) as llama.cpp's quantize_row_q8_1_ref: s = f16(sum of qs times d)."""
    out = []
    for blk, (d16, qs) in zip(x.reshape(-1, 32), quantize_row_q8_0_ref(x), strict=True):
        d = np.abs(blk).max() / F32(127)
        out.append((d16, qs, F32(np.float16(F32(int(qs.sum())) * d))))
    return out


def f16(b: np.ndarray, at: int) -> np.float32:
    """The f16 at byte `at` of block `b`."""
    return F32(b[at:at + 2].view(np.float16)[0])


def vec_dot_iq2_xxs_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq2_xxs_q8_K_generic on one row."""
    grid, ksigns = GRID.numpy().astype(np.int32), KSIGNS.numpy()
    sumf = F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 66), y, strict=True):
        d = f16(b, 0) * yd
        bsum = 0
        for ib32 in range(8):
            aux = b[2 + 8 * ib32:10 + 8 * ib32]
            aux1 = int(aux[4:].view(np.uint32)[0])
            ls = 2 * (aux1 >> 28) + 1
            sumi = 0
            for ll in range(4):
                signs = int(ksigns[(aux1 >> (7 * ll)) & 127])
                sign = np.where([(signs >> j) & 1 for j in range(8)], -1, 1)
                sumi += int((grid[aux[ll]] * q8[32 * ib32 + 8 * ll:32 * ib32 + 8 * ll + 8] * sign).sum())
            bsum += sumi * ls
        sumf += d * F32(bsum)
    return F32(0.125) * sumf


def vec_dot_q2_k_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_q2_K_q8_K_generic on one row."""
    sumf = F32(0)
    for b, (yd, q8, bsums) in zip(w.reshape(-1, 84), y, strict=True):
        sc, q2 = b[:16].astype(np.int32), b[16:80].astype(np.int32)
        summs = int((bsums * (sc >> 4)).sum())
        dall, dmin = yd * f16(b, 80), yd * f16(b, 82)
        isum, is_ = 0, 0
        for k in range(2):
            for j in range(4):
                for half in range(2):
                    part = slice(16 * half, 16 * half + 16)
                    q = (q2[32 * k:][part] >> 2 * j) & 3
                    isum += int(sc[is_] & 15) * int((q8[128 * k + 32 * j:][part] * q).sum())
                    is_ += 1
        sumf += dall * F32(isum) - dmin * F32(summs)
    return sumf


def sign_of(signs: int, j: int) -> int:
    """ggml's `signs & kmask_iq2xs[j] ? -1 : 1`."""
    return -1 if (signs >> j) & 1 else 1


def vec_dot_iq2_xs_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq2_xs_q8_K_generic on one row."""
    grid, ksigns, sumf = iq2_xs.GRID.numpy().astype(np.int32), KSIGNS.numpy(), F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 74), y, strict=True):
        q2, sc, bsum = b[2:66].view(np.uint16).astype(np.int64), b[66:74].astype(np.int64), 0
        for ib32 in range(8):
            for half, ls in enumerate((2 * (sc[ib32] & 0xF) + 1, 2 * (sc[ib32] >> 4) + 1)):
                sumi = 0
                for ll in range(2 * half, 2 * half + 2):
                    v = int(q2[4 * ib32 + ll])
                    signs = int(ksigns[v >> 9])
                    sumi += sum(int(grid[v & 511, j]) * int(q8[32 * ib32 + 8 * ll + j]) * sign_of(signs, j)
                                for j in range(8))
                bsum += sumi * int(ls)
        sumf += f16(b, 0) * yd * F32(bsum)
    return F32(0.125) * sumf


def vec_dot_iq2_s_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq2_s_q8_K_generic on one row."""
    grid, sumf = iq2_s.GRID.numpy().astype(np.int32), F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 82), y, strict=True):
        qs, signs, qh, sc = (b[a:z].astype(np.int64) for a, z in ((2, 34), (34, 66), (66, 74), (74, 82)))
        bsum = 0
        for ib32 in range(8):
            sumi = [0, 0]
            for ll in range(4):
                row = grid[qs[4 * ib32 + ll] | ((qh[ib32] << (8 - 2 * ll)) & 0x300)]
                sumi[ll // 2] += sum(int(q8[32 * ib32 + 8 * ll + j]) * int(row[j])
                                     * sign_of(int(signs[4 * ib32 + ll]), j) for j in range(8))
            bsum += int(2 * (sc[ib32] & 0xF) + 1) * sumi[0] + int(2 * (sc[ib32] >> 4) + 1) * sumi[1]
        sumf += f16(b, 0) * yd * F32(bsum)
    return F32(0.125) * sumf


def vec_dot_iq3_xxs_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq3_xxs_q8_K_generic on one row."""
    grid, ksigns, sumf = iq3_xxs.GRID.numpy().astype(np.int32), KSIGNS.numpy(), F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 98), y, strict=True):
        q3, gas, bsum = b[2:66].astype(np.int64), b[66:98].view(np.uint32).astype(np.int64), 0
        for ib32 in range(8):
            aux32, sumi = int(gas[ib32]), 0
            for ll in range(4):
                signs = int(ksigns[(aux32 >> (7 * ll)) & 127])
                g1, g2 = grid[q3[8 * ib32 + 2 * ll]], grid[q3[8 * ib32 + 2 * ll + 1]]
                at = 32 * ib32 + 8 * ll
                sumi += sum(int(g1[j]) * int(q8[at + j]) * sign_of(signs, j)
                            + int(g2[j]) * int(q8[at + 4 + j]) * sign_of(signs, j + 4) for j in range(4))
            bsum += sumi * (2 * (aux32 >> 28) + 1)
        sumf += f16(b, 0) * yd * F32(bsum)
    return F32(0.25) * sumf


def vec_dot_iq3_s_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq3_s_q8_K_generic on one row."""
    grid, sumf = iq3_s.GRID.numpy().astype(np.int32), F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 110), y, strict=True):
        qs, qh, signs, sc = (b[a:z].astype(np.int64) for a, z in ((2, 66), (66, 74), (74, 106), (106, 110)))
        bsum = 0
        for ib32 in range(8):
            sumi = 0
            for ll in range(4):
                e = 8 * ib32 + 2 * ll
                g1 = grid[qs[e] | ((qh[ib32] << (8 - 2 * ll)) & 256)]
                g2 = grid[qs[e + 1] | ((qh[ib32] << (7 - 2 * ll)) & 256)]
                at, sg = 32 * ib32 + 8 * ll, int(signs[4 * ib32 + ll])
                sumi += sum(int(g1[j]) * int(q8[at + j]) * sign_of(sg, j)
                            + int(g2[j]) * int(q8[at + 4 + j]) * sign_of(sg, j + 4) for j in range(4))
            bsum += sumi * int(2 * ((sc[ib32 // 2] >> (4 * (ib32 % 2))) & 0xF) + 1)
        sumf += f16(b, 0) * yd * F32(bsum)
    return sumf


def vec_dot_iq1_s_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq1_s_q8_K_generic on one row (IQ1S_DELTA = 0.125f)."""
    grid, sumf = iq1_s.GRID.numpy().astype(np.int32), F32(0)
    for b, (yd, q8, bsums) in zip(w.reshape(-1, 50), y, strict=True):
        qs, qh = b[2:34].astype(np.int64), b[34:50].view(np.uint16).astype(np.int64)
        sumi = sumi1 = 0
        for ib in range(8):
            ls, delta = int(2 * ((qh[ib] >> 12) & 7) + 1), -1 if qh[ib] & 0x8000 else 1
            lsum = sum(int((q8[32 * ib + 8 * ll:32 * ib + 8 * ll + 8]
                            * grid[qs[4 * ib + ll] | (((qh[ib] >> (3 * ll)) & 7) << 8)]).sum()) for ll in range(4))
            sumi += ls * lsum
            sumi1 += ls * delta * int(bsums[2 * ib] + bsums[2 * ib + 1])
        sumf += f16(b, 0) * yd * (F32(sumi) + F32(0.125) * F32(sumi1))
    return sumf


def vec_dot_iq1_m_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq1_m_q8_K_generic on one row (IQ1M_DELTA = 0.125f)."""
    grid, sumf = iq1_s.GRID.numpy().astype(np.int32), F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 56), y, strict=True):
        qs, qh, sc = b[:32].astype(np.int64), b[32:48].astype(np.int64), b[48:56].view(np.uint16).astype(np.int64)
        bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
        d = F32(np.array([bits], np.uint16).view(np.float16)[0])
        sumi1 = sumi2 = 0
        for ib in range(8):
            sum1, sum2 = [0, 0], [0, 0]
            for ll in range(4):
                h = int(qh[2 * ib + ll // 2])
                delta = -1 if h & (0x08 if ll % 2 == 0 else 0x80) else 1
                chunk = q8[32 * ib + 8 * ll:32 * ib + 8 * ll + 8]
                sum1[ll // 2] += int((chunk * grid[qs[4 * ib + ll] | ((h << (8 - 4 * (ll % 2))) & 0x700)]).sum())
                sum2[ll // 2] += int(chunk.sum()) * delta
            ls1 = int(2 * ((sc[ib // 2] >> (6 * (ib % 2))) & 7) + 1)
            ls2 = int(2 * ((sc[ib // 2] >> (6 * (ib % 2) + 3)) & 7) + 1)
            sumi1 += sum1[0] * ls1 + sum1[1] * ls2
            sumi2 += sum2[0] * ls1 + sum2[1] * ls2
        sumf += d * yd * (F32(sumi1) + F32(0.125) * F32(sumi2))
    return sumf


def vec_dot_tq1_0_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_tq1_0_q8_K_generic on one row."""
    sumf = F32(0)

    def digit(byte: int, p: int) -> int:
        return ((((byte * 3**p) & 255) * 3) >> 8) - 1
    for b, (yd, q8, _) in zip(w.reshape(-1, 54), y, strict=True):
        total = sum(digit(int(b[m]), p) * int(q8[32 * p + m]) for p in range(5) for m in range(32))
        total += sum(digit(int(b[32 + m]), p) * int(q8[160 + 16 * p + m]) for p in range(5) for m in range(16))
        total += sum(digit(int(b[48 + j]), p) * int(q8[240 + 4 * p + j]) for p in range(4) for j in range(4))
        sumf += F32(total) * (f16(b, 52) * yd)
    return sumf


def vec_dot_tq2_0_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_tq2_0_q8_K_generic on one row."""
    sumf = F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 66), y, strict=True):
        qs = b[:64].astype(np.int64)
        sumi = sum(int(q8[4 * j + 32 * ll + k]) * int(((qs[j + k] >> (2 * ll)) & 3) - 1)
                   for j in (0, 32) for ll in range(4) for k in range(32))
        sumf += F32(sumi) * (yd * f16(b, 64))
    return sumf


# The types whose generic ggml kernel the reference follows step for step: one row's dot, bit for bit.
GENERIC = {"IQ2_XXS": vec_dot_iq2_xxs_q8_k, "Q2_K": vec_dot_q2_k_q8_k, "IQ2_XS": vec_dot_iq2_xs_q8_k,
           "IQ2_S": vec_dot_iq2_s_q8_k, "IQ3_XXS": vec_dot_iq3_xxs_q8_k, "IQ3_S": vec_dot_iq3_s_q8_k,
           "IQ1_S": vec_dot_iq1_s_q8_k, "IQ1_M": vec_dot_iq1_m_q8_k, "TQ1_0": vec_dot_tq1_0_q8_k,
           "TQ2_0": vec_dot_tq2_0_q8_k}


def vec_dot_q4_k_q8_k(w: np.ndarray, y: list[tuple]) -> tuple[list[int], list[int]]:
    """The integer sums of ggml_vec_dot_q4_K_q8_K_generic per block: (sum of its 8 aux32 lanes, sumi)."""
    isums, msums = [], []
    for b, (_, q8, bsums) in zip(w.reshape(-1, 144), y, strict=True):
        scales, mins = k_scales_mins(b[4:16])
        q4 = b[16:].astype(np.int32).reshape(4, 32)
        a = np.concatenate([np.concatenate([c & 15, c >> 4]) for c in q4])
        msums.append(sum(int(bsums[j]) * int(mins[j // 2]) for j in range(16)))
        dots = (q8 * a).reshape(8, 32).sum(1)
        isums.append(sum(int(scales[j]) * int(dots[j]) for j in range(8)))
    return isums, msums


def vec_dot_q3_k_q8_k(w: np.ndarray, y: list[tuple]) -> tuple[list[int], list[int]]:
    """The integer sums of ggml_vec_dot_q3_K_q8_K_generic per block: (sum of its 8 aux32 lanes, 0: no mins)."""
    isums = []
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    for b, (_, q8, _) in zip(w.reshape(-1, 110), y, strict=True):
        hm, q3 = b[:32].astype(np.int32), b[32:96].astype(np.int32)
        a, m = [], 1
        for j in range(2):
            for shift in (0, 2, 4, 6):
                a.append(((q3[32 * j:32 * j + 32] >> shift) & 3) - np.where(hm & m, 0, 4))
                m <<= 1
        a = np.concatenate(a)
        aux = [int(v) for v in b[96:108].view(np.uint32)]
        tmp = aux[2]
        words = [(aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4), (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4),
                 ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4),
                 ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)]
        scales = np.array(words, np.uint32).view(np.int8).astype(np.int32)
        isums.append(sum(int(scales[j] - 32) * int((q8[16 * j:16 * j + 16] * a[16 * j:16 * j + 16]).sum())
                         for j in range(16)))
    return isums, [0] * len(isums)


def k_scales_mins(s: np.ndarray) -> tuple[list[int], list[int]]:
    """ggml's get_scale_min_k4 on the 12 scale bytes of a Q4_K/Q5_K block."""
    s = s.astype(np.int32)
    scales = [s[j] & 63 for j in range(4)] + [(s[8 + j] & 15) | ((s[j] >> 6) << 4) for j in range(4)]
    mins = [s[4 + j] & 63 for j in range(4)] + [(s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4) for j in range(4)]
    return scales, mins


def vec_dot_q5_k_q8_k(w: np.ndarray, y: list[tuple]) -> tuple[list[int], list[int]]:
    """The integer sums of ggml_vec_dot_q5_K_q8_K_generic per block: (sum of its 8 aux32 lanes, sumi)."""
    isums, msums = [], []
    for b, (_, q8, bsums) in zip(w.reshape(-1, 176), y, strict=True):
        scales, mins = k_scales_mins(b[4:16])
        hm, q4 = b[16:48].astype(np.int32), b[48:].astype(np.int32).reshape(4, 32)
        a = np.concatenate([np.concatenate([(c & 15) + np.where(hm & (1 << 2 * j), 16, 0),
                                            (c >> 4) + np.where(hm & (2 << 2 * j), 16, 0)]) for j, c in enumerate(q4)])
        msums.append(sum(int(bsums[j]) * int(mins[j // 2]) for j in range(16)))
        dots = (q8 * a).reshape(8, 32).sum(1)
        isums.append(sum(int(scales[j]) * int(dots[j]) for j in range(8)))
    return isums, msums


def vec_dot_q6_k_q8_k(w: np.ndarray, y: list[tuple]) -> tuple[list[int], list[int]]:
    """The integer sums of ggml_vec_dot_q6_K_q8_K_generic per block: (sum of its 8 aux32 lanes, 0: no mins)."""
    isums = []
    for b, (_, q8, _) in zip(w.reshape(-1, 210), y, strict=True):
        a = np.zeros(256, np.int32)
        for j in range(2):
            q4, qh = b[64 * j:64 * j + 64].astype(np.int32), b[128 + 32 * j:160 + 32 * j].astype(np.int32)
            a[128 * j:128 * j + 32] = ((q4[:32] & 15) | (((qh >> 0) & 3) << 4)) - 32
            a[128 * j + 32:128 * j + 64] = ((q4[32:] & 15) | (((qh >> 2) & 3) << 4)) - 32
            a[128 * j + 64:128 * j + 96] = ((q4[:32] >> 4) | (((qh >> 4) & 3) << 4)) - 32
            a[128 * j + 96:128 * j + 128] = ((q4[32:] >> 4) | (((qh >> 6) & 3) << 4)) - 32
        scales = b[192:208].view(np.int8).astype(np.int32)
        isums.append(sum(int(scales[j]) * int((q8[16 * j:16 * j + 16] * a[16 * j:16 * j + 16]).sum())
                         for j in range(16)))
    return isums, [0] * len(isums)


def vec_dot_f16(w: np.ndarray, x: np.ndarray) -> np.float32:
    """ggml_vec_dot_f16's scalar loop on one row: f16 products summed in double."""
    return F32(sum(float(F32(a) * F32(b)) for a, b in zip(w.view(np.float16), x.astype(np.float16), strict=True)))


def vec_dot_bf16(w: np.ndarray, x: np.ndarray) -> np.float32:
    """ggml_vec_dot_bf16's scalar loop on one row (x rounded by GGML_FP32_TO_BF16: to nearest, ties to even):
    products summed in double."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    x16 = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    w32 = (w.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return F32(sum(float(F32(a) * F32(b)) for a, b in zip(w32, x16, strict=True)))


KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int32)


def vec_dot_iq4_xs_q8_k(w: np.ndarray, y: list[tuple]) -> tuple[list[int], list[int]]:
    """The integer sum per block of ggml_vec_dot_iq4_xs_q8_K's AVX2 kernel (the generic one adds a float per 32):
    sum over the 32s of (ls - 32) times their integer dot; no mins."""
    isums = []
    for b, (_, q8, _) in zip(w.reshape(-1, 136), y, strict=True):
        h, qs, isum = int(b[2:4].view(np.uint16)[0]), b[8:].astype(np.int32), 0
        for ib in range(0, 8, 2):
            ls1 = (int(b[4 + ib // 2]) & 0xF) | ((h << 4) & 0x30)
            ls2 = (int(b[4 + ib // 2]) >> 4) | ((h << 2) & 0x30)
            h >>= 4
            for k, ls in ((ib, ls1), (ib + 1, ls2)):
                q = qs[16 * k:16 * k + 16]
                sumi = int((q8[32 * k:32 * k + 16] * KVALUES_IQ4NL[q & 0xF]).sum())
                sumi += int((q8[32 * k + 16:32 * k + 32] * KVALUES_IQ4NL[q >> 4]).sum())
                isum += (ls - 32) * sumi
        isums.append(isum)
    return isums, [0] * len(isums)


# Per K-quant whose ggml dot adds its float terms in 8 lanes (the generic kernels) or per block (IQ4_XS's AVX2
# kernel): the block's integer sums and its f16 fields (d, dmin; dmin None for the types without mins).
K_LANES = {"Q3_K": (vec_dot_q3_k_q8_k, 110, 108, None), "Q4_K": (vec_dot_q4_k_q8_k, 144, 0, 2),
           "Q5_K": (vec_dot_q5_k_q8_k, 176, 0, 2), "Q6_K": (vec_dot_q6_k_q8_k, 210, 208, None),
           "IQ4_XS": (vec_dot_iq4_xs_q8_k, 136, 0, None)}


def codes_32(qtype: str, b: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """The integer codes and scale of one 32-value block as ggml's dequantize_row_<type> reads them."""
    if qtype == "Q8_0":
        return b[2:].view(np.int8).astype(np.int32), f16(b, 0)
    if qtype == "MXFP4":
        e = int(b[0])
        half = np.array([0x00200000 << e if e < 2 else (e - 1) << 23], np.uint32).view(np.float32)[0]
        return KVALUES_MXFP4[np.concatenate([b[1:] & 15, b[1:] >> 4])], half
    if qtype == "Q5_0":
        qh, qs = int(b[2:6].view(np.uint32)[0]), b[6:].astype(np.int32)
        j = np.arange(16)
        x0 = (qs & 0x0F) | (((qh >> j) << 4) & 0x10)
        x1 = (qs >> 4) | ((qh >> (j + 12)) & 0x10)
        return np.concatenate([x0, x1]) - 16, f16(b, 0)
    qs = b[2:].astype(np.int32)
    nib = np.concatenate([qs & 0x0F, qs >> 4])
    return (nib - 8 if qtype == "Q4_0" else KVALUES_IQ4NL[nib]), f16(b, 0)


def vec_dot_32_q8_1(w: np.ndarray, y: list[tuple], five: bool) -> np.float32:
    """ggml_vec_dot_q4_1_q8_1_generic / q5_1 on one row: sumi times d_w d_x plus m_w s_x per block."""
    sumf = F32(0)
    for b, (yd, q8, ys) in zip(w.reshape(-1, 24 if five else 20), y, strict=True):
        qs = b[8 if five else 4:].astype(np.int32)
        codes = np.concatenate([qs & 0x0F, qs >> 4])
        if five:
            qh = int(b[4:8].view(np.uint32)[0])
            codes = codes | (((qh >> np.arange(32)) & 1) << 4)
        sumf += F32(int((codes * q8).sum())) * (f16(b, 0) * yd) + f16(b, 2) * ys
    return sumf


def vec_dot_32_q8_0(qtype: str, w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_<type>_q8_0_generic on one row (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4): sumi times d_w d_x per block."""
    sumf = F32(0)
    for b, (yd, q8) in zip(w.reshape(-1, w.size // len(y)), y, strict=True):
        codes, d = codes_32(qtype, b)
        sumf += F32(int((codes * q8).sum())) * (d * yd)
    return sumf


def test_q8_k_rounding_is_llama_cpps():
    """Q8_K, Q8_0 and Q8_1 of random rows (with a zero block, a tied peak and exact halves): the reference and the
    C kernel's rounding give llama.cpp's d, quants and sums."""
    x = activations(3, 512)
    mine = ref.quantize_q8_k(x)
    raw = kernels.q8_quantize(x, "Q2_K").reshape(3, 2, 320)
    for m in range(3):
        for b, (d, qs, bsums) in enumerate(quantize_row_q8_k_ref(x[m].numpy())):
            assert mine.d[m, b].item() == d and np.array_equal(mine.q[m, b].numpy(), qs)
            assert np.array_equal(mine.bsums[m, b].numpy(), bsums)
            blk = raw[m, b]
            assert blk[256:260].view(torch.float32).item() == d
            assert np.array_equal(blk[:256].view(torch.int8).numpy(), qs)
            assert np.array_equal(blk[260:292].view(torch.int16).numpy(), bsums)
    mine0 = ref.quantize_q8_0(x)
    raw0 = kernels.q8_quantize(x, "Q8_0").reshape(3, 16, 36)
    for m in range(3):
        for b, (d, qs) in enumerate(quantize_row_q8_0_ref(x[m].numpy())):
            assert mine0.d[m, b].item() == d and np.array_equal(mine0.q[m, b].numpy(), qs)
            assert raw0[m, b, :4].view(torch.float32).item() == d
            assert np.array_equal(raw0[m, b, 4:].view(torch.int8).numpy(), qs)
    mine1 = ref.quantize_q8_1(x)
    raw1 = kernels.q8_quantize(x, "Q4_1").reshape(3, 16, 40)
    for m in range(3):
        for b, (d, qs, s) in enumerate(quantize_row_q8_1_ref(x[m].numpy())):
            assert mine1.d[m, b].item() == d and mine1.s[m, b].item() == s
            assert np.array_equal(mine1.q[m, b].numpy(), qs)
            assert raw1[m, b, :8].view(torch.float32).tolist() == [d, s]
            assert np.array_equal(raw1[m, b, 8:].view(torch.int8).numpy(), qs)


def test_f16_rounding():
    """F16 weights' activations: the reference and the C kernel (SIMD and scalar tail alike) round each value to
    the nearest f16 as numpy does: ties to even, f16 subnormals, overflow to infinity."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * torch.logspace(-9, 4, 64)
    x[0, :8] = torch.tensor([65519.0, 65520.0, -65520.0, 2**-25, 3 * 2**-25, -(2**-24), 1e-30, 1 + 2**-11])
    with np.errstate(over="ignore"):         # 65520 rounds to infinity: that is the point
        expected = x.numpy().astype(np.float16).astype(np.float32)
    assert np.array_equal(ref.round_f16(x).numpy(), expected)
    assert np.array_equal(kernels.q8_quantize(x, "F16").view(torch.float32).reshape(3, 64).numpy(), expected)


@pytest.mark.parametrize("qtype", ref.TYPES)
def test_reference_dot_is_llama_cpps(qtype):
    """Each output of the reference equals llama.cpp's generic dot product of the same blocks (IQ2_XXS, Q2_K, the
    IQ codebook and ternary types: the same float steps, bit for bit; Q3_K..Q6_K: llama.cpp adds its float terms in
    8 lanes, so its per-block integer sums give the reference's float result; Q8_0: whole blocks, bit for bit;
    Q4_0..MXFP4: ours adds 8 lanes, the generic one a scalar; F16, BF16: ours 32 float lanes, the generic one a
    double: within rounding)."""
    w, x = weight(qtype, 4, 512), activations(2, 512)
    out = ref.qdot8(x, w)
    for m in range(2):
        q8_0 = qtype in ref.Q8_0_TYPES
        xq = quantize_row_q8_0_ref(x[m].numpy()) if q8_0 else quantize_row_q8_k_ref(x[m].numpy())
        if qtype in ref.Q8_1_TYPES:
            xq = quantize_row_q8_1_ref(x[m].numpy())
        for n in range(4):
            row = w.data[n].numpy()
            if qtype in K_LANES:
                sums, size, at_d, at_dmin = K_LANES[qtype]
                isums, msums = sums(row, xq)
                blocks = list(zip(row.reshape(-1, size), xq, strict=True))
                terms = torch.tensor([f16(b, at_d) * xd for b, (xd, _, _) in blocks]) * torch.tensor(isums).float()
                if at_dmin is not None:
                    dmin = torch.tensor([f16(b, at_dmin) * xd for b, (xd, _, _) in blocks])
                    terms = terms - dmin * torch.tensor(msums, dtype=torch.float32)
                assert out[m, n].item() == (terms[0] + terms[1]).item(), (qtype, m, n)
                continue
            if qtype in ("F16", "BF16"):
                dot = vec_dot_f16 if qtype == "F16" else vec_dot_bf16
                assert out[m, n].item() == pytest.approx(dot(row, x[m].numpy()), rel=1e-5, abs=1e-6)
                continue
            if qtype in ref.Q8_1_TYPES:
                assert out[m, n].item() == pytest.approx(vec_dot_32_q8_1(row, xq, qtype == "Q5_1"), rel=1e-5, abs=1e-6)
                continue
            if q8_0:     # Q8_0 whole blocks; the others 8 lanes (as llama.cpp's AVX2 kernel) against its scalar sum
                generic = vec_dot_32_q8_0(qtype, row, xq)
                assert out[m, n].item() == (generic if qtype == "Q8_0" else pytest.approx(generic, rel=1e-5, abs=1e-6))
                continue
            assert out[m, n].item() == GENERIC[qtype](row, xq), (qtype, m, n)


@pytest.mark.parametrize("qtype", ref.TYPES)
def test_kernel_equals_reference_rows_threads_experts(qtype, monkeypatch):
    """The C kernel equals the reference bit for bit, plain and by expert (an expert -1 gives 0), for every
    M in 1..16 (row m the same bits as the 1-row call) and split across 1, 2 or 3 threads."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the pool follows torch's thread count
    before = torch.get_num_threads()
    w, stacked = weight(qtype, 40, 512), weight(qtype, 3, 40, 512, seed=2)
    x = activations(16, 512)
    ids = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(4))
    ids[5] = -1
    expected, expected_experts = ref.qdot8(x, w), ref.qdot8(x, stacked, ids)
    assert torch.equal(expected_experts[5], torch.zeros(40))
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for M in (1, 2, 3, 7, 16) if threads > 1 else range(1, 17):
                assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (threads, M)
                assert torch.equal(kernels.qdot8(x[:M], stacked, ids[:M]), expected_experts[:M]), (threads, M)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", ("IQ2_XXS", "Q2_K", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S"))
def test_rows_of_many_blocks_equal_reference(qtype):
    """Rows of 5 blocks (the AVX-512 kernels reduce 4 blocks' integer sums together and compute their float terms
    in one vector, then take the fifth alone), 10 of them (a row of its own goes four rows at a time, then the last
    2 alone): the reference's bits, plain (M = 1 and 3) and by expert."""
    w, stacked = weight(qtype, 10, 1280), weight(qtype, 2, 10, 1280, seed=2)
    x, ids = activations(3, 1280), torch.tensor([1, 0, 1])
    assert torch.equal(kernels.qdot8(x, w), ref.qdot8(x, w))
    assert torch.equal(kernels.qdot8(x[:1], w), ref.qdot8(x[:1], w))
    assert torch.equal(kernels.qdot8(x, stacked, ids), ref.qdot8(x, stacked, ids))


def test_q8_0_whole_blocks_on_every_path_and_in_prefill():
    """Q8_0 in whole blocks: rows of 9 and 35 blocks (two blocks a step, then the last alone), 37 rows (whole tiles
    of 16, then the rest), every M in 1..16 with the AMX tiles on for every M (where the CPU has them) and off
    (qdot8_rows' AVX rows): the reference's bits; and prefill's GEMM (qgemm8, 20 rows) gives each row the bits of
    its decode call."""
    try:
        for K in (288, 1120):
            w, x = weight("Q8_0", 37, K), activations(20, K)
            expected = ref.qdot8(x[:16], w)
            for tiles in (True, False):
                kernels.amx_rows(tiles, every_m=tiles)
                for M in range(1, 17):
                    assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (K, tiles, M)
            assert torch.equal(ref.qgemm8(x, w)[:16], expected)
            assert torch.equal(kernels.qgemm8(x, w)[:16], expected), (K, kernels.gemm8_path())
    finally:
        kernels.amx_rows(True)


@pytest.mark.parametrize("qtype", ("IQ2_XXS", "Q2_K"))
def test_several_rows_of_many_blocks_equal_reference(qtype, monkeypatch):
    """Rows of 9 blocks (qdot8_rows' AVX-512 paths take 4 blocks at a time for every row, then the ninth; Q2_K's
    weight rows in four streams for M <= 3, then the rows left alone) for M = 2..16, with the AMX tiles off (those
    paths for every M) and on, on 1 and 3 threads (chunks of a few rows): the reference's bits, so row m of an M-row
    call equals the 1-row call."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even this small weight
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the pool follows torch's thread count
    before = torch.get_num_threads()
    w, x = weight(qtype, 30, 2304), activations(16, 2304)
    expected = ref.qdot8(x, w)
    try:
        for threads, on in ((1, False), (1, True), (3, False)):
            torch.set_num_threads(threads)
            kernels.amx_rows(on)
            for M in range(2, 17):
                assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (threads, on, M)
    finally:
        kernels.amx_rows(True)
        torch.set_num_threads(before)


def rebuild_with(flags: str, tmp_path, monkeypatch) -> None:
    """Make the next kernel call build the library afresh with gcc and `flags` added, into a cache of its own."""
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nexec gcc "$@" {flags}\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("DS4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_lib", False)
    monkeypatch.setattr(kernels, "_failure", None)


@pytest.mark.parametrize("flags", ("-mno-avx512f", "-mno-avx512f -mno-avx2"))
def test_avx2_and_plain_c_builds_equal_reference(flags, tmp_path, monkeypatch):
    """The AVX2 build (what an AVX2-only machine compiles) and the plain C build give the same bits, for every
    M in 1..16 (qdot8_rows' shared-block paths of AVX2 and the plain per-row loop; at M = 1 10 rows: four at a
    time, then the last 2 alone)."""
    rebuild_with(flags, tmp_path, monkeypatch)
    x = activations(16, 512)
    for qtype in ref.TYPES:
        w = weight(qtype, 10, 512)
        expected = ref.qdot8(x, w)
        for M in range(1, 17):
            assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (flags, qtype, M)


def test_switch_refusals_and_report(monkeypatch):
    """q8 is refused off the cpu backend, without the kernel library, for an unknown name, under
    --strict-backend and on a strict generation; on the cpu backend the op report shows it."""
    with monkeypatch.context() as m:
        m.setattr(kernels, "_lib", None)
        m.setattr(kernels, "_failure", "cc failed on purpose")
        with pytest.raises(BackendUnavailable, match="cannot be built here .*cc failed on purpose"):
            OpSet("cpu", cpu_dot="q8")
    with pytest.raises(BackendUnavailable, match="--cpu-dot q8 needs the cpu backend"):
        OpSet("torch", cpu_dot="q8")
    with pytest.raises(BackendUnavailable, match="needs the cpu backend.*qmatmul on torch"):
        OpSet("auto", {"qmatmul": "torch"}, cpu_dot="q8")
    with pytest.raises(BackendUnavailable, match="unknown cpu dot 'q4'"):
        OpSet("cpu", cpu_dot="q4")
    import ds4
    with pytest.raises(UsageError, match="--strict-backend"):
        ds4.load(strict_backend=True, cpu_dot="q8")
    engine = ds4.load(cpu_dot="q8")
    with pytest.raises(UsageError, match="--strict promises the reference's tokens"):
        engine.generate("def f():", max_tokens=2, raw=True, strict=True)
    tokens = [t.id for t in engine.generate("def f():", max_tokens=4, raw=True, mtp_draft=0)]
    assert len(tokens) == 4
    report = engine.ops.format_report()
    assert "auto; --cpu-dot q8" in report and "cpu dot q8: activations rounded to 8 bits" in report


def q8_greedy_and_speculative(prompt_len: int, seed: int, max_tokens: int) -> list[list[int]]:
    """The default model under q8: the greedy tokens of plain decoding and of strict speculative decoding at depth 2."""
    from ds4.engine import default_model_paths, open_model, open_mtp
    from ds4.sampling import Sampler, SamplingParams
    from ds4.session import Session
    from ds4.speculative import generate_ids
    path, mtp_path = default_model_paths()
    prompt = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    runs = []
    for draft in (None, 2):
        trunk = open_model(path, OpSet("auto", cpu_dot="q8"))
        session = Session(trunk, 128, 16, open_mtp(trunk, mtp_path))
        runs.append(list(generate_ids(session, prompt, max_tokens=max_tokens,
                                      sampler=Sampler(SamplingParams(temperature=0.0)),
                                      eos_id=None, draft=draft, strict=draft is not None)))
    return runs


def test_q8_speculation_is_exact_against_q8_decoding():
    """On the default model (IQ2_XXS, Q2_K and Q8_0 weights) q8 is batch-invariant end to end: strict
    speculative decoding (depth 2, batched verify) commits plain q8 greedy decoding's tokens."""
    plain, speculative = q8_greedy_and_speculative(40, 1, 12)
    assert plain == speculative and len(plain) == 12


def test_generate_cli_flag(capsys):
    """scripts/generate.py --cpu-dot q8 runs and reports it; with --strict it stops before loading; the server
    passes the flag to the load, which refuses it on the torch backend."""
    generate = script("generate")
    before = torch.get_num_threads()
    assert generate.main(["-n", "3", "--cpu-dot", "q8", "--mtp-draft", "0", "--explain-backends"]) == 0
    assert "--cpu-dot q8" in capsys.readouterr().err
    assert generate.main(["-n", "3", "--cpu-dot", "q8", "--strict"]) == 2
    assert "--strict promises the reference's tokens" in capsys.readouterr().err
    torch.set_num_threads(before)
    from ds4.server.app import main as serve
    assert serve(["--cpu-dot", "q8", "--backend", "torch", "--threads", "1"]) == 2      # refused before serving
    assert "--cpu-dot q8 needs the cpu backend" in capsys.readouterr().err
    torch.set_num_threads(before)


def test_bench_flags(tmp_path, capsys, monkeypatch):
    """`bench.py cpu --full-layers` times ds4py once per --cpu-dot given (smoke size, no llama-bench)."""
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # tiny rows fall back to F16 with a warning each
        script("bench").main(["cpu", "--full-layers", "2", "--full-tiny", "--full-mixes", "q2", "--threads", "1",
                              "--rounds", "1", "--prompt", "4", "--tokens", "2", "--workdir", str(tmp_path),
                              "--cpu-dot", "exact", "q8"])
    out = capsys.readouterr().out
    assert "ds4py --cpu-dot q8" in out and "decode_tok_s" in out


# llama.cpp's own CPU kernels (the SIMD ones this machine runs), through a small C program linked against the
# static ggml libraries of a llama.cpp build: LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin.
HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-cpu.h"
int main(void) {   /* stdin: type M N K, weight rows, float32 x [M, K]; stdout: activation blocks, y [M, N] */
    int type; long M, N, K;
    if (fread(&type, 4, 1, stdin) != 1 || fread(&M, 8, 1, stdin) != 1 || fread(&N, 8, 1, stdin) != 1
        || fread(&K, 8, 1, stdin) != 1) return 1;
    ggml_cpu_init();
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu(type);
    size_t wrow = ggml_row_size(type, K), xrow = ggml_row_size(t->vec_dot_type, K);
    char *w = malloc(N * wrow), *xq = malloc(M * xrow);
    float *x = malloc(M * K * 4);
    if (fread(w, wrow, N, stdin) != (size_t)N || fread(x, 4 * K, M, stdin) != (size_t)M) return 1;
    for (long m = 0; m < M; m++) ggml_get_type_traits_cpu(t->vec_dot_type)->from_float(x + m * K, xq + m * xrow, K);
    fwrite(xq, xrow, M, stdout);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float y;
            t->vec_dot(K, &y, 0, w + n * wrow, 0, xq + m * xrow, 0, 1);
            fwrite(&y, 4, 1, stdout);
        }
    return 0;
}
"""


@pytest.fixture(scope="module")
def ggml_harness(tmp_path_factory) -> Path:
    """The harness built against $LLAMA_CPP_BIN/../ (skips when LLAMA_CPP_BIN is unset)."""
    binary = os.environ.get("LLAMA_CPP_BIN")
    if not binary:
        pytest.skip("LLAMA_CPP_BIN (a llama.cpp build/bin directory) is not set")
    build = Path(binary).resolve().parent
    source = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", (build / "CMakeCache.txt").read_text(), re.M)[1]
    out = tmp_path_factory.mktemp("ggml")
    (out / "harness.c").write_text(HARNESS)
    libs = [str(build / "ggml" / "src" / f"libggml-{name}.a") for name in ("cpu", "base")]
    subprocess.run(["g++", "-x", "c", str(out / "harness.c"), "-x", "none", f"-I{source}/ggml/include", *libs,
                    "-fopenmp", "-lm", "-lpthread", "-o", str(out / "harness")], check=True)
    return out / "harness"


@pytest.mark.parametrize("qtype", ref.TYPES)
def test_against_ggml_itself(qtype, ggml_harness):
    """llama.cpp's from_float and vec_dot on the same weight and rows: Q8_K activations identical to the
    reference's (d, quants, sums), Q8_0 quants within one step where its AVX rounding differs from its own
    reference quantizer, F16 rows the reference's f16 values, and every output within float32 rounding of the
    reference (llama.cpp adds the same block terms in SIMD lanes)."""
    w, x = weight(qtype, 24, 512), activations(4, 512)
    header = np.array([w.qtype.ggml_type], np.int32).tobytes() + np.array([4, 24, 512], np.int64).tobytes()
    done = subprocess.run([str(ggml_harness)], input=header + w.data.numpy().tobytes() + x.numpy().tobytes(),
                          capture_output=True, check=True)
    if qtype in ("F16", "BF16"):
        if qtype == "F16":
            rows = np.frombuffer(done.stdout[:4 * 512 * 2], np.float16).reshape(4, 512).astype(np.float32)
        else:
            rows = (np.frombuffer(done.stdout[:4 * 512 * 2], np.uint16).astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(rows.reshape(4, 512), (ref.round_f16 if qtype == "F16" else ref.round_bf16)(x).numpy())
        y = np.frombuffer(done.stdout[4 * 512 * 2:], np.float32).reshape(4, 24)
        assert np.allclose(y, ref.qdot8(x, w).numpy(), rtol=1e-5, atol=1e-6 * np.abs(y).max())
        return
    mine = ref.quantize_activations(x, qtype)
    if qtype in ref.Q8_0_TYPES + ref.Q8_1_TYPES:
        size = 34 if qtype in ref.Q8_0_TYPES else 36       # Q8_1: f16 d, f16 s, 32 quants
        blocks = np.frombuffer(done.stdout[:4 * 16 * size], np.uint8).reshape(4, 16, size)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        assert np.array_equal(d, mine.d.numpy())
        assert np.abs(blocks[..., size - 32:].view(np.int8) - mine.q.numpy()).max() <= 1
        y = np.frombuffer(done.stdout[4 * 16 * size:], np.float32).reshape(4, 24)
    else:
        blocks = np.frombuffer(done.stdout[:4 * 2 * 292], np.uint8).reshape(4, 2, 292)
        assert np.array_equal(blocks[..., :4].copy().view(np.float32)[..., 0], mine.d.numpy())
        assert np.array_equal(blocks[..., 4:260].view(np.int8), mine.q.numpy())
        assert np.array_equal(blocks[..., 260:].copy().view(np.int16), mine.bsums.numpy())
        y = np.frombuffer(done.stdout[4 * 2 * 292:], np.float32).reshape(4, 24)
    assert np.allclose(y, ref.qdot8(x, w).numpy(), rtol=1e-5, atol=1e-6 * np.abs(y).max())


def test_qmatmul_takes_q8_for_the_codebook_ternary_and_bf16_types():
    """The cpu backend's qmatmul under q8 gives the reference's q8 bits for the types added in session 14 (M = 1
    and 3, through the weight's bound call), not the exact kernel's."""
    from backends.cpu.qmatmul import qmatmul
    x = activations(3, 512)
    for qtype in ("IQ3_XXS", "IQ2_S", "IQ1_M", "TQ1_0", "BF16"):
        w = weight(qtype, 8, 512)
        for M in (1, 3):
            q8 = qmatmul(x[:M], w, "q8")
            assert torch.equal(q8, ref.qdot8(x[:M], w)), (qtype, M)
            assert not torch.equal(q8, qmatmul(x[:M], w)), (qtype, M)


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ2_XXS"])
def test_prefill_routed_experts_take_q8(qtype):
    """A prefill (M > 16) under q8: each expert's few rows go through qdot8, so every row equals that row's
    1-row q8 call (within float rounding of the SwiGLU) and not the exact kernel's."""
    from backends.cpu import ffn
    from ops.moe import Experts
    E, D, inter, g = 8, 256, 256, torch.Generator().manual_seed(11)

    def stack(*shape):
        return QTensor.quantize(torch.randn(E, *shape, generator=g) * 0.3, qtype, "stack")
    ex = Experts(router=QTensor.quantize(torch.randn(E, D, generator=g), "F32", "router"),
                 bias=torch.randn(E, generator=g) * 0.1, tid2eid=None, gate=stack(inter, D), up=stack(inter, D),
                 down=stack(D, inter), top_k=2, route_scale=1.5, normalize=True, clamp=10.0)
    x, ids = torch.randn(20, D, generator=g), torch.zeros(20, dtype=torch.int64)
    prefill = ffn.moe(x, ids, ex, "q8")
    rows = torch.cat([ffn.moe(x[m:m + 1], ids[m:m + 1], ex, "q8") for m in range(20)])
    tol = 1e-5 * prefill.abs().max().item()
    torch.testing.assert_close(prefill, rows, rtol=0, atol=tol)
    assert (prefill - ffn.moe(x, ids, ex)).abs().max() > 100 * tol     # the exact kernel's differ


@pytest.mark.parametrize("dot", ("exact", "q8"))
def test_prefill_routed_experts_in_one_call_equal_the_per_expert_loop(dot):
    """ffn.grouped (every expert of the layer in one kernel call per projection) gives the bits of the loop over
    experts (ffn.grouped_loop) where no expert gets more than 16 rows, with all experts and with a rank's share."""
    from backends.cpu import ffn
    from ops.moe import Experts
    E, D, inter, g = 8, 256, 256, torch.Generator().manual_seed(12)

    def stack(n, *shape):
        return QTensor.quantize(torch.randn(n, *shape, generator=g) * 0.3, "Q4_K", "stack")
    x, ids = torch.randn(24, D, generator=g), torch.zeros(24, dtype=torch.int64)
    for first, n in ((0, E), (3, 4)):
        ex = Experts(router=QTensor.quantize(torch.randn(E, D, generator=g), "F32", "router"),
                     bias=torch.randn(E, generator=g) * 0.1, tid2eid=None, gate=stack(n, inter, D),
                     up=stack(n, inter, D), down=stack(n, D, inter), top_k=2, route_scale=1.5, normalize=True,
                     clamp=10.0, first=first)
        chosen, w = ffn.route(x, ids, ex, dot)
        assert torch.bincount(chosen.reshape(-1)).max() <= 16
        assert torch.equal(ffn.grouped(x, chosen, w, ex, dot), ffn.grouped_loop(x, chosen, w, ex, dot)), (dot, first)
