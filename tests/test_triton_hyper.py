"""hc_pre, hc_post and hc_head: Triton kernels (interpreter) against the PyTorch references.

Shapes: S = 4 streams (the model's) and S = 3 (odd, masked 4×4 tile), D = 37 and 300 (several chunks),
M = 1..17. Tolerance 1e-5 (absolute and relative; sigmoid, the Sinkhorn iterations and, for hc_head,
the RMS factor applied after the matmul round differently from torch). Batch invariance: row r of
every M-row call, M = 2..16, equals the 1-row call bit for bit.
"""
import pytest
import torch

from backends.registry import implementations
from ops.qmatmul import SMALL_M
from ops.quants import QTensor

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def impl(op: str, backend: str):
    """The registered implementation of op for backend."""
    return implementations(op)[backend].fn


def rows_equal_single_calls(fn, *per_row) -> None:
    """fn(*per_row[:m]) equals the concatenated 1-row calls bitwise for m = 2..16 (tuples compared itemwise)."""
    def call(a, b):
        out = fn(*[t[a:b] for t in per_row])
        return out if isinstance(out, tuple) else (out,)
    single = [torch.cat(parts) for parts in zip(*[call(r, r + 1) for r in range(SMALL_M)], strict=True)]
    for m in range(2, SMALL_M + 1):
        for got, want in zip(call(0, m), single, strict=True):
            assert torch.equal(got, want[:m]), f"M={m} differs from 1-row calls"


@pytest.mark.parametrize("S,D", [(4, 37), (3, 300)])
def test_hc_pre(S, D):
    """x, post and comb for M = 1..17 (20 Sinkhorn iterations, the model's count), and batch invariance."""
    tri, ref = impl("hc_pre", "triton"), impl("hc_pre", "torch")
    g = torch.Generator().manual_seed(S * D)
    X = torch.randn(SMALL_M + 1, S, D, generator=g)
    mixes = torch.randn(SMALL_M + 1, 2 * S + S * S, generator=g)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(2 * S + S * S, generator=g)
    for got, want in zip(tri(X, mixes, scale, base, 20, 1e-6), ref(X, mixes, scale, base, 20, 1e-6), strict=True):
        torch.testing.assert_close(got, want, **TOL)
    one = tri(X[:3], mixes[:3], scale, base, 1, 1e-6)      # a single iteration (no loop)
    torch.testing.assert_close(one[2], ref(X[:3], mixes[:3], scale, base, 1, 1e-6)[2], **TOL)
    if D < 100:
        rows_equal_single_calls(lambda a, b: tri(a, b, scale, base, 3, 1e-6), X, mixes)  # 3 iterations: faster


@pytest.mark.parametrize("S,D", [(4, 37), (3, 300)])
def test_hc_post(S, D):
    """M = 1..17 against the reference, and batch invariance."""
    tri, ref = impl("hc_post", "triton"), impl("hc_post", "torch")
    g = torch.Generator().manual_seed(S + D)
    X, y = torch.randn(SMALL_M + 1, S, D, generator=g), torch.randn(SMALL_M + 1, D, generator=g)
    post, comb = torch.rand(SMALL_M + 1, S, generator=g), torch.rand(SMALL_M + 1, S, S, generator=g)
    torch.testing.assert_close(tri(X, y, post, comb), ref(X, y, post, comb), **TOL)
    if D < 100:
        rows_equal_single_calls(tri, X, y, post, comb)


@pytest.mark.parametrize("S,D,qtype", [(4, 32, "F32"), (3, 64, "Q8_0")])
def test_hc_head(S, D, qtype):
    """The fused head (norm folded into the gates) against the reference, M = 1..17, and batch invariance."""
    tri, ref = impl("hc_head", "triton"), impl("hc_head", "torch")
    g = torch.Generator().manual_seed(S + D)
    X = torch.randn(SMALL_M + 1, S, D, generator=g) * 2
    fn = QTensor.quantize(torch.randn(S, S * D, generator=g) * 0.1, qtype, name="hc_head.fn")
    scale, base = torch.rand(1, generator=g) + 0.5, torch.randn(S, generator=g)
    torch.testing.assert_close(tri(X, fn, scale, base, 1e-6, 1e-6), ref(X, fn, scale, base, 1e-6, 1e-6), **TOL)
    if S == 4:
        rows_equal_single_calls(lambda a: tri(a, fn, scale, base, 1e-6, 1e-6), X)
