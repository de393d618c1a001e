"""rms_norm and rope_tail: Triton kernels (interpreter) against the PyTorch references.

Tolerances: rms_norm 1e-5 relative (the sum of squares is reduced in a different order); rope_tail
1e-5 absolute on unit-scale inputs (cos/sin differ from torch's by a few ulps, at the same float32
angle). Batch invariance is exact: row r of every M-row call (M = 2..16) equals the 1-row call bit
for bit.
"""
import pytest
import torch

from backends.registry import implementations
from ops.qmatmul import SMALL_M
from ops.rope_tail import rope_freqs

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)


def impl(op: str, backend: str):
    """The registered implementation of op for backend."""
    return implementations(op)[backend].fn


def assert_batch_invariant(fn, x: torch.Tensor, *rest) -> torch.Tensor:
    """Row r of fn(x[:m]) equals fn(x[r:r+1]) bitwise for m = 2..16 (rest: per-row args first)."""
    def call(a, b):
        return fn(x[a:b], *[r[a:b] if isinstance(r, torch.Tensor) and r.shape[:1] == x.shape[:1] else r
                             for r in rest])
    single = torch.cat([call(r, r + 1) for r in range(SMALL_M)])
    for m in range(2, SMALL_M + 1):
        assert torch.equal(call(0, m), single[:m]), f"M={m} differs from 1-row calls"
    return single


@pytest.mark.parametrize("n,weighted,dtype", [(1, True, torch.float32), (37, False, torch.float32),
                                              (80, True, torch.float16), (2500, True, torch.float32)])
def test_rms_norm(n, weighted, dtype):
    """Odd and multi-chunk row lengths, with and without weight, float16 input, M = 1..17 and 3-D x."""
    tri, ref = impl("rms_norm", "triton"), impl("rms_norm", "torch")
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(SMALL_M + 1, n, generator=g) * 3).to(dtype)
    w = torch.randn(n, generator=g) if weighted else None
    torch.testing.assert_close(tri(x, w, 1e-6), ref(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    x3 = x[:SMALL_M].reshape(2, SMALL_M // 2, n)
    torch.testing.assert_close(tri(x3, w), ref(x3, w), rtol=1e-5, atol=1e-6)
    if n < 100:
        assert_batch_invariant(lambda a: tri(a, w, 1e-6), x)


@pytest.mark.parametrize("shape,n_rot,inverse", [((80,), 16, False), ((4, 80), 16, True), ((3, 32), 32, False),
                                                  ((2, 7), 2, True)])
def test_rope_tail(shape, n_rot, inverse):
    """Rows of 2-D and 3-D x, odd copied prefix, whole-row rotation, inverse, large positions, M = 1..17."""
    tri, ref = impl("rope_tail", "triton"), impl("rope_tail", "torch")
    g = torch.Generator().manual_seed(n_rot)
    x = torch.randn(SMALL_M + 1, *shape, generator=g)
    pos = torch.tensor([0, 1, 5, 63, 64, 1000, 4095, 70000] + list(range(7, 17)))[:SMALL_M + 1]
    freqs = rope_freqs(n_rot, 10000.0, (16.0, 32.0, 1.0, 64) if n_rot == 16 else None)
    got = tri(x, pos, freqs, inverse)
    torch.testing.assert_close(got, ref(x, pos, freqs, inverse), rtol=0, atol=1e-5)
    d = shape[-1]
    assert torch.equal(got[..., :d - n_rot], x[..., :d - n_rot])
    assert_batch_invariant(lambda a, p: tri(a, p, freqs, inverse), x, pos)
