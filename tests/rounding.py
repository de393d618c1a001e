"""What the exact-kernel and prefill tests (test_cpu_q8_0_exact.py, test_cpu_grouped_types.py, test_cpu_prefill.py)
share: the float32 rounding bound against a float64 product."""
from __future__ import annotations

import torch


def within_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """got [M, N] against x @ dense.T in float64: each output within 1e-5 of the sum of its products' magnitudes."""
    want = x.double() @ dense.double().T
    scale = x.double().abs() @ dense.double().abs().T
    assert ((got.double() - want).abs() <= 1e-5 * scale).all()
