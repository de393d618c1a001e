"""fp8_sim, fp4_sim and hadamard: Triton kernels (interpreter) against the PyTorch references.

All three are exact: the kernels compute the power-of-two scales from exponent bits and round half to
even on the same grids, and the Hadamard butterfly adds in the reference's order, so outputs are
compared bit for bit (signed zeros included), at odd row counts and with rows that are all zero,
tiny, huge or exactly on rounding ties. Batch invariance follows (row-wise kernels) and is checked
bit for bit for M = 1..16.
"""
import pytest
import torch

from backends.registry import implementations
from ops.qmatmul import SMALL_M

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)


def impl(op: str, backend: str):
    """The registered implementation of op for backend."""
    return implementations(op)[backend].fn


def awkward(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    """Random rows at mixed magnitudes, plus a zero row, a subnormal-scale row and exact ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-6, 4, rows)[:, None]
    x[0] = 0.0
    if rows > 2:
        x[1] = torch.randn(n, generator=g) * 1e-38
        x[2] = torch.arange(n) * 0.25 - n / 8  # many values on the e2m1/e4m3 rounding ties
    return x


@pytest.mark.parametrize("op,block", [("fp8_sim", 64), ("fp4_sim", 32), ("fp8_sim", 16)])
def test_block_sims_equal_reference(op, block):
    """M = 1..17 rows of 3 blocks, and a 3-D input, equal the reference bit for bit."""
    tri, ref = impl(op, "triton"), impl(op, "torch")
    x = awkward(SMALL_M + 1, 3 * block)
    want = ref(x, block)
    got = tri(x, block)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for m in (1, 5, 16):
        assert torch.equal(tri(x[:m], block), want[:m])
    x3 = x[:12].reshape(3, 4, -1)
    assert torch.equal(tri(x3, block), ref(x3, block))


@pytest.mark.parametrize("n", [1, 2, 32, 128])
def test_hadamard_equals_reference(n):
    """Bit-exact for n = 1..128, M = 1..17 and float16 input."""
    tri, ref = impl("hadamard", "triton"), impl("hadamard", "torch")
    x = torch.randn(SMALL_M + 1, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(tri(x), ref(x))
    assert torch.equal(tri(x[:1]), ref(x[:1]))
    assert torch.equal(tri(x.half()), ref(x.half()))
    with pytest.raises(ValueError, match="power-of-two"):
        tri(torch.zeros(2, 12))
