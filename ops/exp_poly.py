"""e^x and the sigmoid from rounded +, −, · and exact powers of two only, so that a C kernel computes the same bits
(torch's exp and sigmoid round differently in each build and vector width): the references of the cpu backend's
glue kernels (backends/cpu/glue.c) use them. Accuracy ~1e-7 relative (tests/test_cpu_glue.py).
"""
from __future__ import annotations

import torch

EXP_LOW = -87.0     # exp_poly gives 0 below this (e^-87 is near float32's smallest normal)
EXP_HIGH = 88.0     # and +inf above this (e^88.7 overflows float32)


def exp_poly(x: torch.Tensor) -> torch.Tensor:
    """e^x of float32 `x`: n = floor(x·log2 e + 1/2), r = x − n·ln 2 in two parts, a degree-5 polynomial in r, times
    2^n; 0 below EXP_LOW (and for NaN), +inf above EXP_HIGH."""
    x = x.to(torch.float32)
    low, high = ~(x >= EXP_LOW), x > EXP_HIGH
    x = torch.where(low | high, 0.0, x)
    n = torch.floor(x * 1.44269504088896341 + 0.5)
    r = x - n * 0.693359375
    r = r - n * -2.12194440e-4
    p = torch.full_like(r, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + c
    y = p * (r * r) + r + 1.0
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(low, 0.0, torch.where(high, float("inf"), y * two_n))


def sigmoid_poly(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp_poly(−x))."""
    return 1 / (1 + exp_poly(-x.to(torch.float32)))


def silu_poly(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp_poly(−x))."""
    x = x.to(torch.float32)
    return x / (1 + exp_poly(-x))


def swiglu_poly(g: torch.Tensor, u: torch.Tensor, clamp: float | None = None,
                weight: torch.Tensor | None = None) -> torch.Tensor:
    """The gated activation of the experts: silu_poly(min(g, clamp)) · clamp(u, ±clamp) (· weight [rows, 1])."""
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    h = silu_poly(g) * u
    return h if weight is None else h * weight
