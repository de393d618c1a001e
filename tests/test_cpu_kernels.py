"""The CPU kernel library (backends/cpu/kernels.py, qgemv.c): every fused kernel bit-identical across thread
counts 1/2/3 and across M = 1..16 (each row equals its 1-row call), plain and by expert; and a library that
cannot be built fails loudly (a warning with the compiler's error, a line in the op report)."""
from __future__ import annotations

import ctypes
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from backends.cpu import kernels, qmatmul
from backends.registry import OpSet
from ops.quants import QTensor

QTYPES = tuple(kernels.GGML_TYPE)


def test_set_threads_gives_the_pool_n_threads_and_torch_one(pool_threads, monkeypatch):
    """`set_threads(n)`: the kernels split over n threads, torch's own ops run on one (on n where the library is
    off); n < 1 is refused."""
    kernels.set_threads(3)
    assert kernels.threads() == 3 and torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="at least 1 thread"):
        kernels.set_threads(0)
    monkeypatch.setenv("DS4_CPU_KERNELS", "0")         # no library: torch's ops take the threads back
    monkeypatch.setattr(kernels, "_lib", False)
    kernels.set_threads(2)
    assert kernels.lib() is None and torch.get_num_threads() == 2


@pytest.mark.parametrize("experts", (False, True))
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_is_identical_across_threads_and_row_counts(qtype, experts, pool_threads, monkeypatch):
    """Every output split across 1, 2 or 3 threads (uneven parts of 40 rows) and every M in 1..16: the
    same bits as the 1-thread call, and row m the same bits as the 1-row call on that row."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights, into the most chunks
    g = torch.Generator().manual_seed(3)
    shape = (3, 40, 512) if experts else (40, 512)
    w = QTensor.quantize(torch.randn(*shape, generator=g) / 16, qtype, "w")
    x = torch.randn(16, 512, generator=g)
    ids = torch.randint(0, 3, (16,), generator=g)
    torch.set_num_threads(1)
    single = torch.cat([kernels.qgemv(x[m:m + 1], w, ids[m:m + 1] if experts else None) for m in range(16)])
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        for M in range(1, 17):
            out = kernels.qgemv(x[:M], w, ids[:M] if experts else None)
            assert torch.equal(out, single[:M]), (qtype, experts, n, M)


@pytest.mark.parametrize("qtype", ("Q8_0", "Q4_K", "F16", "Q2_K"))
def test_prefill_tiles_are_identical_across_threads_and_row_counts(qtype, pool_threads, monkeypatch):
    """A prefill product (M > 16: qgemm.c's dequantized tiles, here two of 64 and 6 rows of 4096 values) split across
    1, 2 or 3 threads: the same bits, row m the same bits as a 1-row call of the same product (any M), and within
    float rounding of the dequantized weight's product."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # the most chunks: uneven row ranges across the tiles
    g = torch.Generator().manual_seed(5)
    w = QTensor.quantize(torch.randn(70, 4096, generator=g) / 16, qtype, "w")
    x = torch.randn(23, 4096, generator=g)
    outs = []
    for n in (1, 2, 3):
        kernels.set_threads(n)
        outs.append(qmatmul.qmatmul(x, w))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0][:17], qmatmul.qmatmul(x[:17], w))
    assert torch.equal(outs[0], torch.cat([kernels.dense_product(x[m:m + 1], w) for m in range(23)]))
    torch.testing.assert_close(outs[0], x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


def test_split_runs_every_chunk_once_and_raises_a_chunks_error(pool_threads):
    """`kernels.split` over 3 threads: every chunk of [0, 100) runs exactly once; an error in a chunk reaches the
    caller (after the chunks in flight), and so does a chunk's negative return code (a kernel's error)."""
    kernels.set_threads(3)
    seen = []
    assert kernels.split(lambda a, b: seen.extend(range(a, b)), 100, 12) == 0
    assert sorted(seen) == list(range(100))
    assert kernels.split(lambda a, b: -2 if a == 0 else 0, 100, 12) == -2

    def failing(a: int, b: int) -> None:
        if a >= 50:
            raise MemoryError("chunk failed")

    with pytest.raises(MemoryError, match="chunk failed"):
        kernels.split(failing, 100, 12)


def test_pool_claims_runs_of_chunks_shorter_towards_the_end(pool_threads):
    """pool.c's threads claim runs of consecutive even chunks, 1/(4 x threads) of those left and at least one: over 2
    threads, [0, 640) in 64 chunks of 10 is claimed as [0, 80) first and [630, 640) last, every range a run of whole
    chunks and each chunk in exactly one; chunks of 16 rows or more start on a multiple of 16."""
    kernels.set_threads(2)
    claims = []
    assert kernels.split(lambda a, b: claims.append((a, b)), 640, 64) == 0
    claims.sort()
    assert [a for a, _ in claims[1:]] == [b for _, b in claims[:-1]] and claims[0][0] == 0 and claims[-1][1] == 640
    assert all(a % 10 == 0 and b % 10 == 0 for a, b in claims)
    assert claims[0] == (0, 80) and claims[-1] == (630, 640) and len(claims) < 64
    claims.clear()      # a range of 16 rows or more a chunk: the bounds fall on multiples of 16
    assert kernels.split(lambda a, b: claims.append((a, b)), 2048, 28) == 0
    assert sorted(b - a for a, b in claims)[0] >= 16 and all(a % 16 == 0 for a, _ in claims)
    assert sum(b - a for a, b in claims) == 2048


FIRST_CALL = """
import threading
from backends.cpu import kernels
kernels.set_threads(2)
started, ran_on = threading.Event(), []
def chunk(start, stop):
    ran_on.append(threading.get_ident())
    if start == 0:
        started.wait(60)    # chunk 1 must run meanwhile on the worker that this call starts
    else:
        started.set()
kernels.split(chunk, 2, 2)
assert started.is_set() and len(set(ran_on)) == 2, ran_on
"""


def test_the_first_call_runs_on_the_worker_it_starts():
    """pool.c's workers start on a process's first pool call and take part in it (a worker that read the call's
    generation as already seen sat it out, and the caller ran every chunk alone)."""
    done = subprocess.run([sys.executable, "-c", FIRST_CALL], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-2000:]


def test_split_chunks_run_on_the_pool_in_the_callers_modes(pool_threads):
    """`kernels.split` runs its chunks on pool.c's threads (no Python pool), each in the caller's inference mode
    (an in-place write to an inference tensor elsewhere is an error), and a split inside a chunk runs alone."""
    kernels.set_threads(3)
    names, inner = set(), []
    with torch.inference_mode():
        out = torch.zeros(60)

        def fill(a: int, b: int) -> None:
            names.add(threading.current_thread().name)
            out[a:b] = torch.arange(a, b, dtype=torch.float32)
            inner.append(kernels.split(lambda c, d: None, 4, 4))

        assert kernels.split(fill, 60, 12) == 0
    assert torch.equal(out, torch.arange(60, dtype=torch.float32)) and inner == [0] * 12
    assert names and not any(name.startswith("ds4-cpu") for name in names)


def test_pool_serves_concurrent_callers_and_returns_a_kernels_error(pool_threads, monkeypatch):
    """pool.c: callers on several Python threads at once (one at a time in the pool, the others alone) all get the
    1-thread bits; a kernel's error code in its chunks reaches the caller."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    g = torch.Generator().manual_seed(7)
    w = QTensor.quantize(torch.randn(64, 512, generator=g) / 16, "Q8_0", "w")
    xs = [torch.randn(1 + i % 4, 512, generator=g) for i in range(8)]
    torch.set_num_threads(1)
    expected = [kernels.qgemv(x, w) for x in xs]
    torch.set_num_threads(3)
    results: dict[int, list[torch.Tensor]] = {}

    def call(i: int) -> None:
        results[i] = [kernels.qgemv(xs[i], w) for _ in range(20)]

    workers = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert all(torch.equal(out, expected[i]) for i, outs in results.items() for out in outs) and len(results) == 8
    y = torch.empty(1, 64)
    rc = kernels.lib().pool_rows(ctypes.cast(kernels.lib().qgemv, ctypes.c_void_p), kernels.GGML_TYPE["Q8_0"],
                                 w.data.data_ptr(), 0, None, 64, 500, xs[0].data_ptr(), 1, y.data_ptr(), 64, 12, 3)
    assert rc == -1     # 500 values are not whole Q8_0 blocks: every chunk refuses


def test_unbuildable_library_warns_with_the_compiler_error(tmp_path, monkeypatch):
    """A compiler that fails: the first use warns once with its error message, the kernels are off, and the
    op report of an OpSet that ran a cpu op says `cpu kernels unavailable: <reason>`."""
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'qgemv.c:1:1: error: this compiler is broken on purpose' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("DS4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_lib", False)
    monkeypatch.setattr(kernels, "_failure", None)
    with pytest.warns(RuntimeWarning, match="cpu kernels unavailable: .*broken on purpose"):
        assert kernels.lib() is None
    assert not kernels.available("Q8_0", 256)
    ops = OpSet("auto")
    w = QTensor.quantize(torch.randn(8, 256) / 16, "Q8_0", "w")
    ops.qmatmul(torch.randn(1, 256), w)
    assert "cpu kernels unavailable: " in ops.format_report()
    assert "broken on purpose" in ops.format_report()


def test_turned_off_library_is_silent(tmp_path, monkeypatch, recwarn):
    """DS4_CPU_KERNELS=0: no library, no warning, no report line."""
    monkeypatch.setenv("DS4_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_lib", False)
    monkeypatch.setattr(kernels, "_failure", None)
    assert kernels.lib() is None
    assert kernels.unavailable_note() is None and not recwarn.list


def test_library_that_does_not_load_says_why(tmp_path, monkeypatch):
    """A cached library file that is not a shared object: the loader's error is the reason."""
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_lib", False)
    monkeypatch.setattr(kernels, "_failure", None)

    def not_a_library(path):
        raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(ctypes, "CDLL", not_a_library)
    with pytest.warns(RuntimeWarning, match="invalid ELF header"):
        assert kernels.lib() is None


@pytest.mark.parametrize("dot", ("exact", "q8"))
@pytest.mark.parametrize("qtype", ("Q4_K", "Q2_K", "IQ2_XXS", "Q8_0", "F16"))
def test_experts_product_equals_each_experts_calls(qtype, dot, pool_threads):
    """Prefill's routed experts in one call (qgemm.c): each expert's rows (here 1, 3, 17 and 2: 17 is 16 + 1)
    the same bits as that expert's own qgemv / qdot8 calls of at most 16 rows, for 1, 2 or 3 threads."""
    g = torch.Generator().manual_seed(6)
    w = QTensor.quantize(torch.randn(5, 40, 512, generator=g) / 16, qtype, "w")
    ids, sizes = torch.tensor([0, 2, 3, 4]), [1, 3, 17, 2]
    first = torch.tensor([0, 1, 4, 21, 23])
    x = torch.randn(sum(sizes), 512, generator=g)
    call = kernels.qdot8 if dot == "q8" and kernels.q8_available(qtype, 512) else kernels.qgemv
    expected = torch.cat([call(x[r:min(r + 16, stop)], QTensor(w.qtype, (40, 512), w.data[e]))
                          for e, start, stop in zip(ids.tolist(), first[:-1].tolist(), first[1:].tolist(), strict=True)
                          for r in range(start, stop, 16)])
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        assert torch.equal(kernels.experts_product(x, w, ids, first, dot), expected), (qtype, dot, n)
