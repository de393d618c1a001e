"""Prefill on the CPU: the 8-bit GEMM for Q8_0 weights (`--cpu-dot q8`, M > 16), its reference
(ops/q8_activations.qgemm8) bit for bit against llama.cpp's generic ggml_vec_dot_q8_0_q8_0 written out as a loop,
and the C kernel (backends/cpu/qgemm8.c) bit for bit against the reference on its AMX path (where the CPU has it),
its AVX-512 VNNI (AMX off, where the build targets it), AVX2 and plain C paths, for any M, any split across the
library's pool and output rows that are not whole tiles, on the integer extremes; qmatmul takes it where it is
fast; and the kernel pool's threads run torch's products on one OpenMP thread."""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.cpu import glue, kernels
from backends.cpu.qmatmul import qmatmul
from backends.registry import OpSet, implementations, reference
from ops import q8_activations as ref
from ops.quants import QTensor, get
from tests.rounding import within_rounding
from tests.test_batch_invariance import CASES
from tests.test_cpu_q8 import F32, activations, f16, quantize_row_q8_0_ref, rebuild_with, weight


def vec_dot_q8_0_q8_0(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_q8_0_q8_0_generic on one row: the block sums added in block order."""
    sumf = F32(0)
    for b, (yd, q8) in zip(w.reshape(-1, 34), y, strict=True):
        sumi = int((b[2:].view(np.int8).astype(np.int32) * q8).sum())
        sumf += F32(sumi) * (f16(b, 0) * yd)
    return sumf


def test_reference_is_llama_cpps_generic_dot():
    """Every output of the reference equals the generic loop's float32 result exactly (block order)."""
    w, x = weight("Q8_0", 6, 256), activations(3, 256)
    out = ref.qgemm8(x, w)
    rows = w.data.reshape(6, -1).numpy()
    for m in range(3):
        xq = quantize_row_q8_0_ref(x[m].numpy())
        for n in range(6):
            assert out[m, n].item() == vec_dot_q8_0_q8_0(rows[n], xq), (m, n)


def test_reference_refuses_bad_input():
    """Other types, stacked weights and mismatched activations are refused with a clear error."""
    with pytest.raises(TypeError, match="2-D Q8_0"):
        ref.qgemm8(activations(2, 256), weight("Q4_K", 4, 256))
    with pytest.raises(TypeError, match="2-D Q8_0"):
        ref.qgemm8(activations(2, 256), weight("Q8_0", 2, 4, 256))
    with pytest.raises(ValueError, match=r"\[M, 256\]"):
        ref.qgemm8(activations(2, 512), weight("Q8_0", 4, 256))


def extreme_weight(N: int, K: int) -> QTensor:
    """A Q8_0 weight whose quants reach -128 and 127 (llama.cpp's quantizer stops at -127; a file may not), with
    rows of -128 only and of 127 only, and f16 scales of both signs."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (N, K // 32, 34), generator=g, dtype=torch.int32).to(torch.uint8)
    blocks[0, :, 2:], blocks[1, :, 2:] = 128, 127      # int8 -128 and 127
    scales = (torch.randn(N, K // 32, 1, generator=g) / 64).to(torch.float16)
    blocks[..., :2] = scales.view(torch.uint8)
    return QTensor(get("Q8_0"), (N, K), blocks.reshape(N, -1))


def extreme_activations(M: int, K: int) -> torch.Tensor:
    """Rows whose quants reach +-127 everywhere (every value a block's largest magnitude), mixed with random rows."""
    x = activations(M, K)
    x[::2] = torch.where(torch.arange(K) % 3 == 0, -1.0, 1.0)
    return x


def check_paths(w: QTensor, x: torch.Tensor, rows: tuple[int, ...]) -> None:
    """qgemm8 gives the reference's bits for the first M rows of x, M in `rows`, split across 1, 2 and 3 threads
    of the library's pool (every tile its own chunk)."""
    expected = ref.qgemm8(x, w)
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for M in rows if threads == 1 else rows[-2:]:
            assert torch.equal(kernels.qgemm8(x[:M], w), expected[:M]), (kernels.gemm8_path(), threads, M)


@pytest.mark.parametrize("amx", (True, False))
def test_kernel_equals_reference_rows_threads(amx, monkeypatch):
    """AMX on (where the CPU has it) and off (AVX-512 VNNI where the build targets it) give the reference's bits for
    M = 1..40 (rows not whole tiles of 16; 75 output rows: 4 tiles, two groups of 4 and 3 more), on random and
    extreme quants, split across 1, 2 or 3 threads."""
    if amx and not kernels.amx():
        pytest.skip("no AMX-INT8 on this CPU (or the build does not target it)")
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before, was = torch.get_num_threads(), kernels.amx()
    try:
        kernels.amx(amx)
        check_paths(weight("Q8_0", 75, 512), activations(40, 512), (1, 15, 16, 17, 32, 33, 40))
        check_paths(extreme_weight(75, 256), extreme_activations(40, 256), (17, 40))
    finally:
        torch.set_num_threads(before)
        kernels.amx(was)


@pytest.mark.parametrize("flags", ("-mno-avx512f", "-mno-avx512f -mno-avx2"))
def test_avx2_and_plain_c_builds_equal_reference(flags, tmp_path, monkeypatch):
    """The AVX2 build (an AVX2-only machine's, no AMX) and the plain C build give the same bits, the same cases, for
    the 8-bit GEMM and the exact dense products (qgemm.c's fused multiply-add lanes: the native build's bits)."""
    x = activations(20, 512)
    dense = [weight(qtype, 13, 512) for qtype in ("Q8_0", "F16")]
    native = [kernels.dense_product(x, d) for d in dense]
    rebuild_with(flags, tmp_path, monkeypatch)
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    assert not kernels.amx() and kernels.gemm8_path() == ("AVX2" if "avx2" not in flags else "plain C")
    before = torch.get_num_threads()
    try:
        check_paths(weight("Q8_0", 75, 512), activations(40, 512), (1, 16, 17, 32, 33, 40))
        check_paths(extreme_weight(75, 256), extreme_activations(40, 256), (17, 40))
    finally:
        torch.set_num_threads(before)
    for d, expected in zip(dense, native, strict=True):
        assert torch.equal(kernels.dense_product(x, d), expected), (flags, d.qtype.name)


def test_qmatmul_takes_it_for_prefill_rows_only(monkeypatch):
    """qmatmul's q8 takes the GEMM for a Q8_0 weight above SMALL_M rows where its path is fast (AMX, AVX-512 VNNI,
    AVX2; the exact tiles on the plain C one), qdot8's lanes at or below, and stays exact for other types and
    without q8; the op report names the path."""
    w, x = weight("Q8_0", 48, 256), activations(24, 256)
    fast = kernels.gemm8_path() in kernels.GEMM8_FAST
    assert torch.equal(qmatmul(x, w, "q8"), ref.qgemm8(x, w) if fast else qmatmul(x, w))
    report = OpSet("cpu", cpu_dot="q8").format_report()
    assert (f"Q8_0 at prefill (the 8-bit GEMM, {kernels.gemm8_path()})" in report) == fast, report
    with monkeypatch.context() as m:
        m.setattr(kernels, "gemm8_path", lambda: "plain C")
        assert torch.equal(qmatmul(x, w, "q8"), qmatmul(x, w))
        assert "8-bit GEMM" not in OpSet("cpu", cpu_dot="q8").format_report()
    assert torch.equal(qmatmul(x[:16], w, "q8"), ref.qdot8(x[:16], w))
    assert torch.equal(qmatmul(x, w), qmatmul(x, w, "exact"))
    assert not torch.equal(qmatmul(x, w), ref.qgemm8(x, w))
    f16 = weight("F16", 48, 256)
    assert torch.equal(qmatmul(x, f16, "q8"), qmatmul(x, f16))


def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (from /proc/self/maps), or None."""
    maps = Path("/proc/self/maps")
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "omp" in line} if maps.exists() else set()
    path = next((p for p in paths if re.search(r"lib(g|i)omp[^/]*\.so", p)), None)
    return ctypes.CDLL(path) if path else None


def test_pool_threads_take_one_openmp_thread_before_the_build(monkeypatch):
    """A split call made before the library was built (prefill's first product on the tiles) still runs its chunks
    on one OpenMP thread in every pool thread: a tile's BLAS product there started a team of its own (twice the CPU
    time)."""
    runtime = openmp_runtime()
    if runtime is None or (os.cpu_count() or 1) < 2:
        pytest.skip("needs torch's OpenMP runtime and two CPUs")
    monkeypatch.setattr(kernels, "_lib", False)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before = torch.get_num_threads()
    seen = []
    try:
        kernels.set_threads(2)
        kernels.split(lambda start, stop: seen.append(runtime.omp_get_max_threads()) and None, 8, 8)
    finally:
        kernels.set_threads(before)
        kernels._pool_threads = 0
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("op", ("sparse_attention", "sparse_attention_torch", "index_scores"))
def test_prefill_row_chunks_are_the_decode_rows(op, monkeypatch):
    """Above SMALL_M queries these ops run chunks of SMALL_M across the pool (attention's torch path: without the
    glue kernel; SPLIT_WORK lowered so that these small calls split): close to the reference, every row its 1-row
    call's bits, the same bits on 1, 2 and 3 threads."""
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the pool follows torch's thread count
    monkeypatch.setattr(kernels, "SPLIT_WORK", 0)
    if op.endswith("_torch"):
        op = op.removesuffix("_torch")
        monkeypatch.setattr(glue, "ready", lambda: False)
    (args, one_row_args), before = CASES[op](40, 3), torch.get_num_threads()
    fn = implementations(op)["cpu"].fn
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(fn(*args))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    torch.testing.assert_close(outs[0], reference(op).fn(*args), rtol=1e-5, atol=1e-5)
    for m, row_args in enumerate(one_row_args):
        assert torch.equal(outs[0][m:m + 1], fn(*row_args)), m


@pytest.mark.parametrize("op", ("sparse_attention_torch", "index_scores"))
def test_row_chunks_split_from_split_work_on(op, monkeypatch):
    """row_chunks hands a call to the pool (CHUNKS_PER_THREAD parts a thread) only from SPLIT_WORK multiply-adds on;
    below, its chunks run on the calling thread (`split` with one part)."""
    monkeypatch.setattr(kernels, "_pool_threads", 2)
    monkeypatch.setattr(glue, "ready", lambda: False)
    parts = []
    monkeypatch.setattr(kernels, "split", lambda fn, n, p: parts.append(p) or fn(0, n))
    (args, _), fn = CASES[op.removesuffix("_torch")](40, 3), implementations(op.removesuffix("_torch"))["cpu"].fn
    want = fn(*args)
    for threshold, expected in ((1 << 40, 1), (0, kernels.CHUNKS_PER_THREAD * 2)):
        monkeypatch.setattr(kernels, "SPLIT_WORK", threshold)
        parts.clear()
        assert torch.equal(fn(*args), want) and parts == [expected], (threshold, parts)


def test_quantizer_is_qdot8s():
    """qgemm8.c's activation rounding (vectorized on AVX-512) gives qdot8.c's Q8_0 blocks byte for byte, on exact
    halves (scale 1: every x.5 rounds away from zero), zeros and random rows."""
    g = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randint(-254, 255, (3, 256), generator=g) / 2, torch.randn(3, 256, generator=g),
                   torch.zeros(1, 256)])
    x[:3, ::32] = 127.0     # each block's largest magnitude: d = 1
    k = kernels.lib()
    xq = torch.empty(7 * 8 * kernels.Q8_ACTIVATION[1][1], dtype=torch.uint8)
    packed = torch.empty(k.qgemm8_packed_bytes(7, 256), dtype=torch.uint8)
    assert k.qgemm8_quantize(x.data_ptr(), 7, 256, xq.data_ptr(), packed.data_ptr()) == 0
    assert torch.equal(xq, kernels.q8_quantize(x, "Q8_0"))


@pytest.mark.parametrize("qtype", ("FP8_E4M3", "I32"))
def test_reference_tiles_are_the_same_bits_on_any_thread_count(qtype, monkeypatch):
    """A prefill product of a type the kernels do not read (dequantized one tile at a time, the tiles taken in turn
    by the kernel pool's threads) gives the same bits on 1, 2 and 3 threads, within float32 rounding of the
    dequantized weight times x (BLAS's summation order differs by CPU)."""
    monkeypatch.setattr("backends.cpu.qmatmul.TILE_BYTES", 4 * 256 * 5)    # 10 tiles, a ragged last one
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    g = torch.Generator().manual_seed(4)
    values = torch.randn(48, 256, generator=g) / 16 if qtype == "FP8_E4M3" else torch.randint(-9, 9, (48, 256))
    w, x = QTensor.quantize(values.float(), qtype, "w"), torch.randn(40, 256, generator=g)
    before, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            kernels.set_threads(threads)
            outs.append(qmatmul(x, w))
    finally:
        kernels.set_threads(before)
        kernels._pool_threads = 0
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    within_rounding(outs[0], x, w.dequantize())
