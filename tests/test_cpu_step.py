"""The decode step's calls with less Python (backends/cpu/step.c): a weight's product bound once (the same bits as the
unbound kernel calls, for any thread count and M = 1..16, re-bound when the weight's data or the library changes,
bad input still refused by name), and the indexer's Hadamard transform and FP4 simulation in C (the references'
bits, the power-of-two edges of the FP4 scale included)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from backends.cpu import attention, glue, kernels, qmatmul, rowops
from ops.fp4_sim import fp4_sim
from ops.hadamard import hadamard
from ops.indexer_topk import indexer_topk
from ops.quants import QTensor
from ops.verify_argmax import verify_argmax

pytestmark = pytest.mark.skipif(not kernels.built(), reason="the cpu kernel library is off (DS4_CPU_KERNELS=0)")

BOUND_TYPES = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "F16", "Q6_K", "IQ3_XXS", "BF16")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where NaN (of any sign) and infinities of the same sign."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def unbound(x: torch.Tensor, w: QTensor, dot: str) -> torch.Tensor:
    """The product through the kernels' own calls (kernels.qdot8 / kernels.qgemv), not the bound one."""
    return kernels.qdot8(x, w) if dot == "q8" and kernels.q8_available(w.qtype.name, w.shape[1]) else \
        kernels.qgemv(x, w)


@pytest.mark.parametrize("dot", ("exact", "q8"))
def test_bound_product_is_the_kernel_call(dot, monkeypatch):
    """For each type (IQ3_XXS and BF16: exact under q8 too) the bound call gives the kernel call's bits for M = 1..16
    on 1, 2 and 3 threads, the output rows split into the most chunks."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 512, generator=g)
    try:
        for qtype in BOUND_TYPES:
            w = QTensor.quantize(torch.randn(40, 512, generator=g) / 16, qtype, "w")
            torch.set_num_threads(1)
            expected = unbound(x, w, dot)
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                for M in (1, 2, 5, 16):
                    assert qmatmul.BOUND.get(w, dot) is not None, qtype
                    assert torch.equal(qmatmul.qmatmul(x[:M], w, dot), expected[:M]), (qtype, threads, M)
    finally:
        torch.set_num_threads(before)


def test_binding_follows_the_weight_and_the_library(monkeypatch):
    """A weight given new data is bound afresh (never the old pointer); small F32 weights stay in BLAS (no binding);
    with the library turned off the torch path serves; bad input is refused as before."""
    g = torch.Generator().manual_seed(8)
    w = QTensor.quantize(torch.randn(24, 256, generator=g), "Q8_0", "w")
    x = torch.randn(1, 256, generator=g)
    first = qmatmul.qmatmul(x, w)
    w.data = QTensor.quantize(torch.randn(24, 256, generator=g), "Q8_0").data
    assert torch.equal(qmatmul.qmatmul(x, w), kernels.qgemv(x, w)) and not torch.equal(qmatmul.qmatmul(x, w), first)
    assert qmatmul.BOUND.get(QTensor.quantize(torch.randn(8, 64, generator=g), "F32"), "exact") is None
    with monkeypatch.context() as m:
        m.setattr(kernels, "_lib", None)
        assert qmatmul.BOUND.get(w, "exact") is None
        torch.testing.assert_close(qmatmul.qmatmul(x, w), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x has 128 columns"):
        qmatmul.qmatmul(torch.randn(1, 128), w)
    with pytest.raises(TypeError, match="x must be float32/float16"):
        qmatmul.qmatmul(torch.randn(1, 256, dtype=torch.float64), w)
    with pytest.raises(TypeError, match="must be a 2-D QTensor"):
        qmatmul.qmatmul(x, w.data)
    n_entries = len(qmatmul.BOUND.entries)
    del w
    assert len(qmatmul.BOUND.entries) < n_entries     # a dead weight's binding goes with it


def test_index_sim_is_the_references():
    """hadamard and fp4_sim (and the pair) on random rows over 80 orders of magnitude, float16 and strided input, and
    amax / 6 within 40 ulp of every power of two: the references' bits; other lengths take the references."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(400, 4, 128, generator=g) * torch.exp(torch.randn(400, 4, 1, generator=g) * 20)
    for rows in (x, x[:1, :1, :32], x[:, :, ::2], x[:3].to(torch.float16)):
        assert same(rowops.hadamard(rows), hadamard(rows))
        assert same(rowops.fp4_sim(rows), fp4_sim(rows))
        assert same(rowops.fp4_sim(rowops.hadamard(rows)), fp4_sim(hadamard(rows)))
    edges = []
    up = down = torch.tensor([6 * 2.0**k for k in range(-126, 126)])
    for _ in range(40):
        up, down = torch.nextafter(up, up * 2), torch.nextafter(down, down * 0)
        edges += [up, down]
    amax = torch.cat(edges)
    blocks = torch.rand(amax.numel(), 32, generator=g) * 2 - 1
    blocks = blocks * amax[:, None]
    blocks[:, 0] = amax
    assert same(rowops.fp4_sim(blocks), fp4_sim(blocks))
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.0, 6.0, 1.5, 0.25, 0.75,
                            2.5, 5.0, 7.0, 1e38, 3e38] * 2)
    for row in (special, special.flip(0), special[special.isfinite()].repeat(2)[:32], torch.zeros(32)):
        assert same(rowops.fp4_sim(row[None]), fp4_sim(row[None]))
    assert same(rowops.fp4_sim(x[:2, :, :96], block=16), fp4_sim(x[:2, :, :96], block=16))
    with pytest.raises(ValueError, match="power-of-two length"):
        rowops.hadamard(torch.randn(2, 48))


def test_verify_argmax_is_the_references():
    """Top-1 and margin of random rows, ties (the lower index, margin 0), NaN (the first one, margin NaN), infinities
    and float16 rows over the real vocabulary's width: the reference's values."""
    g = torch.Generator().manual_seed(10)
    for V in (2, 3, 129280):
        x = torch.randn(5, V, generator=g)
        nan = x.clone()
        nan[0, V // 2] = nan[1, -1] = nan[2, 0] = nan[2, 1] = float("nan")
        nan[3, 1], nan[4] = float("inf"), -float("inf")
        tie = x.clone()
        tie[:, -1] = tie.max(1).values
        for logits in (x, x.round(), tie, nan, torch.zeros(2, V), torch.full((2, V), float("inf")),
                       x.to(torch.float16), x.t().contiguous().t()):
            (top1, margin), (ref_top1, ref_margin) = rowops.verify_argmax(logits), verify_argmax(logits)
            assert torch.equal(top1, ref_top1) and same(margin, ref_margin), (V, logits)


def test_index_scores_heads_in_c_are_the_torch_loop(monkeypatch):
    """The indexer scores with the heads added in one C call (and no mask where every query sees every key) are the
    bits of the loop over heads with the mask, for a decode step and for verify rows that see different counts."""
    g = torch.Generator().manual_seed(11)
    q, keys, w = torch.randn(5, 8, 128, generator=g), torch.randn(40, 128, generator=g), torch.randn(5, 8, generator=g)
    cases = [(q[:1], w[:1], (33,)), (q, w, (30, 30, 31, 31, 32)), (q[:3], w[:3], (0, 7, 40))]
    fast = [attention.index_scores(qq, keys, ww, visible) for qq, ww, visible in cases]
    monkeypatch.setattr(glue, "ready", lambda: False)
    for (qq, ww, visible), scores in zip(cases, fast, strict=True):
        assert torch.equal(scores, attention.index_scores(qq, keys, ww, visible)), visible


@pytest.mark.parametrize("dot", ("exact", "q8"))
def test_bound_grouped_product_is_glue_products(dot, monkeypatch):
    """grouped_qmatmul through the bound stack of groups: the bits of `glue.products` (its path before), 8 groups,
    M = 1 and 2 (16 pairs), on 1 and 3 threads with the most chunks; more pairs (M = 3) and F32 weights take the old
    path."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(12)
    try:
        for qtype in ("Q8_0", "Q4_K", "F16", "F32"):
            w = QTensor.quantize(torch.randn(8 * 24, 256, generator=g) / 16, qtype, "w")
            for M in (1, 2, 3):
                x = torch.randn(M, 8, 256, generator=g)
                for threads in (1, 3):
                    torch.set_num_threads(threads)
                    got = qmatmul.grouped_qmatmul(x, w, dot)
                    with monkeypatch.context() as m:
                        m.setattr(qmatmul.BOUND, "get", lambda *_: None)
                        assert torch.equal(got, qmatmul.grouped_qmatmul(x, w, dot)), (qtype, M, threads)
            assert (qmatmul.BOUND.get(w, dot, 8) is None) == (qtype == "F32")
    finally:
        torch.set_num_threads(before)


def test_indexer_topk_is_the_references():
    """The top-k of rows with ties (rounded scores), -inf and NaN scores, visible counts of 0, below n, n and above,
    k above n: the reference's columns and padding."""
    g = torch.Generator().manual_seed(13)
    for n, k in ((1, 4), (9, 4), (40, 4), (300, 64), (5, 8)):
        scores = torch.randn(6, n, generator=g)
        special = scores.clone()
        special[0, ::3] = -float("inf")
        special[1, ::4] = float("nan")
        special[2] = 0.0
        for s in (scores, scores.round(), special, scores.to(torch.float16)):
            visible = torch.tensor([0, 1, n // 2, n, n + 3, max(0, n - 1)])
            assert torch.equal(attention.indexer_topk(s, k, visible), indexer_topk(s, k, visible)), (n, k)


@pytest.mark.parametrize("flags", ("-mno-avx512f", "-mno-avx512f -mno-avx2"))
def test_step_kernels_of_avx2_and_plain_c_builds(flags, tmp_path):
    """step.c built for AVX2 and for plain C (alone, with stubs for the product kernels it calls): its argmax, top-k
    and indexer simulation give the references' values too."""
    cc = shutil.which("gcc") or pytest.skip("no gcc")
    (tmp_path / "stubs.c").write_text("int pool_rows(void) { return -1; }\nint q8_quantize(void) { return -1; }\n")
    so = tmp_path / "step.so"
    subprocess.run([cc, "-O3", "-march=native", *flags.split(), "-ffp-contract=off", "-shared", "-fPIC", "-o", str(so),
                    str(Path(kernels.__file__).with_name("step.c")), str(tmp_path / "stubs.c")], check=True)
    lib, ptr, i64 = ctypes.CDLL(str(so)), ctypes.c_void_p, ctypes.c_int64
    lib.verify_argmax.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.indexer_topk.argtypes = [ptr, i64, i64, i64, ptr, ptr]
    lib.index_sim.argtypes = [ptr, i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_int, ptr]
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(4, 1003, generator=g)
    logits[1, 7], logits[2] = float("nan"), logits[2].round()
    top1, margin = torch.empty(4, dtype=torch.int64), torch.empty(4)
    lib.verify_argmax(logits.data_ptr(), 4, 1003, top1.data_ptr(), margin.data_ptr())
    ref_top1, ref_margin = verify_argmax(logits)
    assert torch.equal(top1, ref_top1) and same(margin, ref_margin)
    scores, visible, out = logits.round(), torch.tensor([0, 5, 1003, 500]), torch.empty((4, 64), dtype=torch.int64)
    assert lib.indexer_topk(scores.data_ptr(), 4, 1003, 64, visible.data_ptr(), out.data_ptr()) == 0
    assert torch.equal(out, indexer_topk(scores, 64, visible))
    x, sim = torch.randn(8, 128, generator=g) * 30, torch.empty(8, 128)
    lib.index_sim(x.data_ptr(), 8, 128, 1, 128 ** 0.5, 1, sim.data_ptr())
    assert same(sim, fp4_sim(hadamard(x)))
