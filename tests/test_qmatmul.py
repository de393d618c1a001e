"""qmatmul: the Triton kernel (interpreter) against the PyTorch reference, and batch invariance of both.

Tolerance: |y - x @ dequantize(W).T| <= 1e-5 * (|x| @ |W|.T) elementwise (float32 accumulation in a
different order; tf32x3 on a GPU). Batch invariance is checked bit for bit for M = 1..16.
"""
import sys

import pytest
import torch
import triton
import triton.language as tl

from backends.registry import OpSet, implementations
from backends.triton.quants import SUPPORTED, dequant, tables
from ds4.errors import BackendUnavailable, UsageError
from ops.qmatmul import SMALL_M
from ops.qmatmul import qmatmul as reference
from ops.quants import QTensor, get
from tests.script_modules import script

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)

def k_of(qtype: str) -> int:
    """K for a type's tests: not a multiple of 256 (or of a power of two) where the block size allows."""
    block = get(qtype).block_size
    return 41 if block == 1 else block * (5 if block <= 32 else 3 if block < 256 else 1)


RTOL = 1e-5


def weight(qtype: str, n: int, seed: int = 0) -> QTensor:
    """A random [n, k_of(qtype)] weight quantized with the reference quantizer."""
    g = torch.Generator().manual_seed(seed)
    return QTensor.quantize(torch.randn(n, k_of(qtype), generator=g), qtype, name=f"w.{qtype}")


def activations(m: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    """Random activations [m, k] (float16 ones stay in range)."""
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, w: QTensor) -> None:
    """y within RTOL * (|x| @ |W|.T) of x @ dequantize(W).T."""
    dense = w.dequantize()
    expected = x.float() @ dense.T
    bound = RTOL * (x.float().abs() @ dense.abs().T) + 1e-30
    assert y.dtype == torch.float32 and y.shape == expected.shape
    assert ((y - expected).abs() <= bound).all(), f"max error ratio {((y - expected).abs() / bound).max():.3g}"


@triton.jit
def dequant_tile_kernel(w_ptr, out_ptr, grid_ptr, signs_ptr, N, K, row_bytes,
                        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = the type's Triton block-dequantize helper applied to raw rows."""
    n = tl.arange(0, BLOCK_N)[:, None]
    k = tl.arange(0, BLOCK_K)[None, :]
    mask = (n < N) & (k < K)
    w = dequant(QTYPE, w_ptr + n * row_bytes, k, mask, grid_ptr, signs_ptr)
    tl.store(out_ptr + n * K + k, w, mask=mask)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_triton_dequant_is_bit_exact_on_random_bytes(qtype):
    """Every bit pattern (NaN/inf/subnormal scales included) dequantizes exactly as the reference."""
    qt = get(qtype)
    n, k = 5, k_of(qtype)
    data = torch.randint(0, 256, (n, qt.row_bytes(k)), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    w = QTensor(qt, (n, k), data)
    out = torch.empty(n, k)
    grid_bytes, signs = tables(data.device)
    dequant_tile_kernel[(1,)](data, out, grid_bytes, signs, n, k, data.stride(0), QTYPE=qtype,
                              BLOCK_N=8, BLOCK_K=triton.next_power_of_2(k))
    torch.testing.assert_close(out, w.dequantize(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_triton_matches_reference_and_is_batch_invariant(qtype):
    """M = 1..17 on N = 1 (split-K) against the reference; rows of M <= 16 equal the 1-row calls bitwise."""
    triton_qmatmul = implementations("qmatmul")["triton"].fn
    w = weight(qtype, 1)
    x = activations(SMALL_M + 1, k_of(qtype))
    single = torch.cat([triton_qmatmul(x[r:r + 1], w) for r in range(SMALL_M)])
    assert_close_to_reference(single, x[:SMALL_M], w)
    for m in range(2, SMALL_M + 1):
        assert torch.equal(triton_qmatmul(x[:m], w), single[:m]), f"M={m} differs from 1-row calls"
    assert_close_to_reference(triton_qmatmul(x, w), x, w)


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K", "IQ2_XXS", "MXFP4"])
@pytest.mark.parametrize("m", [1, 7, 17])
def test_triton_odd_n_and_float16_activations(qtype, m):
    """N = 37 (a partial N tile) with float16 activations, decode, verify and prefill."""
    triton_qmatmul = implementations("qmatmul")["triton"].fn
    w = weight(qtype, 37, seed=3)
    x = activations(m, k_of(qtype), torch.float16)
    assert_close_to_reference(triton_qmatmul(x, w), x, w)


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_reference_is_batch_invariant(qtype):
    """The reference: row r of every M-row call (M <= 16) equals the 1-row call bitwise."""
    w = weight(qtype, 37)
    x = activations(SMALL_M + 1, k_of(qtype))
    single = torch.cat([reference(x[r:r + 1], w) for r in range(SMALL_M)])
    for m in range(2, SMALL_M + 1):
        assert torch.equal(reference(x[:m], w), single[:m])
    assert_close_to_reference(reference(x, w), x, w)


def test_registry_serves_triton_and_declares_invariance():
    """The registry resolves qmatmul to the Triton kernel, marked batch-invariant like the reference."""
    ops = OpSet(backend="triton", strict=True)
    w = weight("Q8_0", 4)
    ops.qmatmul(activations(2, k_of("Q8_0")), w)
    assert ops.report()["qmatmul"] == {"backend": "triton", "how": "requested", "calls": 1, "batch_invariant": True}
    assert implementations("qmatmul")["torch"].batch_invariant


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_arguments_name_the_weight(backend):
    """Shape and dtype mistakes raise ValueError/TypeError naming the weight (ops do not raise Ds4Errors)."""
    fn = implementations("qmatmul")[backend].fn
    w = weight("Q8_0", 4)
    with pytest.raises(ValueError, match="w.Q8_0"):
        fn(torch.randn(2, 64), w)
    with pytest.raises(TypeError, match="float32/float16"):
        fn(torch.randn(2, k_of("Q8_0"), dtype=torch.float64), w)


def test_triton_on_cpu_tensors_without_the_interpreter_is_a_clear_error(monkeypatch):
    """Outside the interpreter, CPU tensors raise BackendUnavailable before any kernel launch."""
    import backends.triton.qmatmul as kernel
    monkeypatch.setattr(kernel, "INTERPRET", False)
    with torch.device("cpu"), pytest.raises(BackendUnavailable, match="w.Q8_0.*are on cpu; use DS4_OPS=qmatmul:torch"):
        kernel.qmatmul(activations(2, k_of("Q8_0")), weight("Q8_0", 4))


def load_bench():
    """scripts/bench.py as a module."""
    return script("bench")


def test_bench_prints_a_csv_row_per_case(capsys):
    """scripts/bench.py qmatmul on a tiny shape: machine comment lines, then one CSV row per (type, M)."""
    bench = load_bench()
    bench.main(["qmatmul", "--csv", "--types", "Q8_0", "F16", "--shapes", "8x64", "--m", "1", "3", "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ") and "copy" in lines[1]
    assert lines[2] == "type,N,K,M,backend,time_us,GB/s,%copy,x_baseline"
    assert [line.split(",")[:4] for line in lines[3:]] == [
        ["Q8_0", "8", "64", "1"], ["Q8_0", "8", "64", "3"], ["F16", "8", "64", "1"], ["F16", "8", "64", "3"]]


def test_bench_unknown_type_is_a_usage_error():
    """An unknown --types name raises UsageError naming the flag (bench.py prints it as one line)."""
    with pytest.raises(UsageError, match="--types: unknown quant type 'Q9'"):
        load_bench().run(["qmatmul", "--types", "Q9", "--shapes", "8x64", "--m", "1", "--reps", "1"])


def test_bench_machine_line_without_triton(monkeypatch):
    """The CPU benchmark runs where triton is not installed: the machine line says so."""
    from ds4.bench.common import machine
    monkeypatch.setitem(sys.modules, "triton", None)
    assert machine(torch.device("cpu")).endswith(", no triton")
