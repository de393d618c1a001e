"""store_rows, embed and compress: Triton kernels (interpreter) against the PyTorch references.

store_rows and embed are exact (the FP8 simulation and the dequantizers are bit-exact; float16
rounding is the same conversion). compress: 1e-5 relative/absolute (a different reduction order).
Batch invariance: row r of every M-row call, M = 2..16, equals the 1-row call bit for bit.
"""
import pytest
import torch

from backends.registry import implementations
from backends.triton.quants import SUPPORTED
from ops.qmatmul import SMALL_M
from ops.quants import QTensor, get

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)


def impl(op: str, backend: str):
    """The registered implementation of op for backend."""
    return implementations(op)[backend].fn


@pytest.mark.parametrize("d,fp8_dims,f16", [(80, 64, True), (80, 0, False), (130, 128, False), (33, 0, True)])
def test_store_rows(d, fp8_dims, f16):
    """M = 1..17 rows into a 40-row cache (odd row length, partial last FP8 block row), exact."""
    tri, ref = impl("store_rows", "triton"), impl("store_rows", "torch")
    g = torch.Generator().manual_seed(d + fp8_dims)
    rows = torch.randn(SMALL_M + 1, d, generator=g) * 10
    slots = torch.randperm(40, generator=g)[:SMALL_M + 1]
    cache = torch.randn(40, d, generator=g)
    want = ref(cache.clone(), slots, rows, fp8_dims, f16)
    got_cache = cache.clone()
    got = tri(got_cache, slots, rows, fp8_dims, f16)
    assert got.data_ptr() == got_cache.data_ptr()          # in place, like the reference
    assert torch.equal(got, want)
    for m in (1, 16):                                      # batch invariance: the rows written are the same
        part = tri(cache.clone(), slots[:m], rows[:m], fp8_dims, f16)
        assert torch.equal(part[slots[:m]], want[slots[:m]])


def test_store_rows_strided_rows():
    """Rows given as a column slice of a wider tensor (a strided view) are read correctly."""
    tri, ref = impl("store_rows", "triton"), impl("store_rows", "torch")
    wide = torch.randn(5, 100)
    slots = torch.tensor([4, 0, 2, 1, 3])
    rows = wide[:, 10:74]
    assert torch.equal(tri(torch.zeros(5, 64), slots, rows, 64), ref(torch.zeros(5, 64), slots, rows, 64))


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_embed(qtype):
    """Rows of a quantized table, repeated ids, M = 1..17: exact, for every type Triton serves."""
    tri, ref = impl("embed", "triton"), impl("embed", "torch")
    block = get(qtype).block_size
    D = 300 if block == 1 else block * (2 if block < 256 else 1)
    g = torch.Generator().manual_seed(D)
    table = QTensor.quantize(torch.randn(23, D, generator=g), qtype, name="embd")
    ids = torch.randint(0, 23, (SMALL_M + 1,), generator=g)
    ids[3] = ids[4]
    want = ref(table, ids)
    assert torch.equal(tri(table, ids), want)
    assert torch.equal(tri(table, ids[:1]), want[:1])


@pytest.mark.parametrize("B,n,d", [(SMALL_M + 1, 8, 37), (3, 128, 80), (2, 1, 5)])
def test_compress(B, n, d):
    """Candidates with −inf scores (absent), odd n and d, B = 1..17; batch invariance for B <= 16."""
    tri, ref = impl("compress", "triton"), impl("compress", "torch")
    g = torch.Generator().manual_seed(n + d)
    kv, score = torch.randn(B, n, d, generator=g), torch.randn(B, n, d, generator=g) * 3
    if n > 1:
        score[:, : n // 2, : d // 2] = float("-inf")
    torch.testing.assert_close(tri(kv, score), ref(kv, score), rtol=1e-5, atol=1e-5)
    single = torch.cat([tri(kv[b:b + 1], score[b:b + 1]) for b in range(min(B, SMALL_M))])
    for m in range(2, min(B, SMALL_M) + 1):
        assert torch.equal(tri(kv[:m], score[:m]), single[:m])
