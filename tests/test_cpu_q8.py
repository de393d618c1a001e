"""The opt-in 8-bit-activation dot product (`--cpu-dot q8`): the reference (ops/q8_activations.py) against
llama.cpp's formulas (quantize_row_q8_K_ref, quantize_row_q8_0_ref and the generic ggml_vec_dot_<type>_q8_K,
written out here as loops), the C kernel (backends/cpu/qdot8.c) bit for bit against the reference (AVX-512, AVX2
and plain C builds), its batch invariance, thread splits and experts addressing, and the switch: refused under
--strict and off the cpu backend, shown in the op report, taken by scripts/generate.py."""
from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.cpu import kernels
from backends.registry import OpSet
from ds4.errors import BackendUnavailable, UsageError
from ops import q8_activations as ref
from ops.quants import QTensor
from ops.quants.iq2_xxs import GRID, KSIGNS
from tests.script_modules import script

F32 = np.float32


def weight(qtype: str, *shape: int, seed: int = 0) -> QTensor:
    """A random weight of `qtype`."""
    return QTensor.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / 16, qtype, "w")


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """Random rows with the cases the rounding rule must get right: an all-zero block, a block whose largest
    magnitude appears twice with both signs (the first wins), and a block of exact halves after scaling."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0
    if M > 1:
        x[1, :256] = torch.linspace(-1, 1, 256)
        x[1, 7], x[1, 9] = -3.0, 3.0
    if M > 2:
        x[2, :256] = (torch.arange(256) % 5 - 2).float()    # peak -2: the values +-1 scale to +-63.5
    return x


# llama.cpp's formulas as loops (the names and steps of ggml-quants.c and ggml-cpu/quants.c).
def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2^23 in float32 and read the low mantissa bits."""
    return ((v.astype(F32) + F32(12582912.0)).view(np.int32) & 0x007FFFFF) - 0x00400000


def quantize_row_q8_k_ref(x: np.ndarray) -> list[tuple]:
    """Per 256 values: (d, qs, bsums) as llama.cpp's quantize_row_q8_K_ref."""
    out = []
    for blk in x.reshape(-1, 256):
        amax, peak = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, peak = abs(v), v
        if not amax:
            out.append((F32(0), np.zeros(256, np.int32), np.zeros(16, np.int32)))
            continue
        iscale = F32(-127.0) / peak
        qs = np.minimum(127, nearest_int(iscale * blk))
        out.append((F32(1) / iscale, qs, qs.reshape(16, 16).sum(1)))
    return out


def quantize_row_q8_0_ref(x: np.ndarray) -> list[tuple]:
    """Per 32 values: (d as f16, qs) as llama.cpp's quantize_row_q8_0_ref (roundf: halves away from zero)."""
    out = []
    for blk in x.reshape(-1, 32):
        d = np.abs(blk).max() / F32(127)
        inverse = F32(1) / d if d else F32(0)
        v = (blk * inverse).astype(np.float64)
        out.append((F32(np.float16(d)), (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int32)))
    return out


def f16(b: np.ndarray, at: int) -> np.float32:
    """The f16 at byte `at` of block `b`."""
    return F32(b[at:at + 2].view(np.float16)[0])


def vec_dot_iq2_xxs_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_iq2_xxs_q8_K_generic on one row."""
    grid, ksigns = GRID.numpy().astype(np.int32), KSIGNS.numpy()
    sumf = F32(0)
    for b, (yd, q8, _) in zip(w.reshape(-1, 66), y, strict=True):
        d = f16(b, 0) * yd
        bsum = 0
        for ib32 in range(8):
            aux = b[2 + 8 * ib32:10 + 8 * ib32]
            aux1 = int(aux[4:].view(np.uint32)[0])
            ls = 2 * (aux1 >> 28) + 1
            sumi = 0
            for ll in range(4):
                signs = int(ksigns[(aux1 >> (7 * ll)) & 127])
                sign = np.where([(signs >> j) & 1 for j in range(8)], -1, 1)
                sumi += int((grid[aux[ll]] * q8[32 * ib32 + 8 * ll:32 * ib32 + 8 * ll + 8] * sign).sum())
            bsum += sumi * ls
        sumf += d * F32(bsum)
    return F32(0.125) * sumf


def vec_dot_q2_k_q8_k(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_q2_K_q8_K_generic on one row."""
    sumf = F32(0)
    for b, (yd, q8, bsums) in zip(w.reshape(-1, 84), y, strict=True):
        sc, q2 = b[:16].astype(np.int32), b[16:80].astype(np.int32)
        summs = int((bsums * (sc >> 4)).sum())
        dall, dmin = yd * f16(b, 80), yd * f16(b, 82)
        isum, is_ = 0, 0
        for k in range(2):
            for j in range(4):
                for half in range(2):
                    part = slice(16 * half, 16 * half + 16)
                    q = (q2[32 * k:][part] >> 2 * j) & 3
                    isum += int(sc[is_] & 15) * int((q8[128 * k + 32 * j:][part] * q).sum())
                    is_ += 1
        sumf += dall * F32(isum) - dmin * F32(summs)
    return sumf


def vec_dot_q4_k_q8_k(w: np.ndarray, y: list[tuple]) -> tuple[list[int], list[int]]:
    """The integer sums of ggml_vec_dot_q4_K_q8_K_generic per block: (sum of its 8 aux32 lanes, sumi)."""
    isums, msums = [], []
    for b, (_, q8, bsums) in zip(w.reshape(-1, 144), y, strict=True):
        s = b[4:16].astype(np.int32)
        scales = [s[j] & 63 for j in range(4)] + [(s[8 + j] & 15) | ((s[j] >> 6) << 4) for j in range(4)]
        mins = [s[4 + j] & 63 for j in range(4)] + [(s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4) for j in range(4)]
        q4 = b[16:].astype(np.int32).reshape(4, 32)
        a = np.concatenate([np.concatenate([c & 15, c >> 4]) for c in q4])
        msums.append(sum(int(bsums[j]) * int(mins[j // 2]) for j in range(16)))
        dots = (q8 * a).reshape(8, 32).sum(1)
        isums.append(sum(int(scales[j]) * int(dots[j]) for j in range(8)))
    return isums, msums


def vec_dot_q8_0_q8_0(w: np.ndarray, y: list[tuple]) -> np.float32:
    """ggml_vec_dot_q8_0_q8_0_generic on one row."""
    sumf = F32(0)
    for b, (yd, q8) in zip(w.reshape(-1, 34), y, strict=True):
        sumi = int((b[2:].view(np.int8).astype(np.int32) * q8).sum())
        sumf += F32(sumi) * (f16(b, 0) * yd)
    return sumf


def test_q8_k_rounding_is_llama_cpps():
    """Q8_K and Q8_0 of random rows (with a zero block, a tied peak and exact halves): the reference and the C
    kernel's rounding give llama.cpp's d, quants and sums."""
    x = activations(3, 512)
    mine = ref.quantize_q8_k(x)
    raw = kernels.q8_quantize(x, "Q2_K").reshape(3, 2, 320)
    for m in range(3):
        for b, (d, qs, bsums) in enumerate(quantize_row_q8_k_ref(x[m].numpy())):
            assert mine.d[m, b].item() == d and np.array_equal(mine.q[m, b].numpy(), qs)
            assert np.array_equal(mine.bsums[m, b].numpy(), bsums)
            blk = raw[m, b]
            assert blk[256:260].view(torch.float32).item() == d
            assert np.array_equal(blk[:256].view(torch.int8).numpy(), qs)
            assert np.array_equal(blk[260:292].view(torch.int16).numpy(), bsums)
    mine0 = ref.quantize_q8_0(x)
    raw0 = kernels.q8_quantize(x, "Q8_0").reshape(3, 16, 36)
    for m in range(3):
        for b, (d, qs) in enumerate(quantize_row_q8_0_ref(x[m].numpy())):
            assert mine0.d[m, b].item() == d and np.array_equal(mine0.q[m, b].numpy(), qs)
            assert raw0[m, b, :4].view(torch.float32).item() == d
            assert np.array_equal(raw0[m, b, 4:].view(torch.int8).numpy(), qs)


@pytest.mark.parametrize("qtype", ref.TYPES)
def test_reference_dot_is_llama_cpps(qtype):
    """Each output of the reference equals llama.cpp's generic dot product of the same blocks (IQ2_XXS, Q2_K:
    the same float steps, bit for bit; Q4_K: llama.cpp adds its float terms in 8 lanes, so its per-block integer
    sums give the reference's float result; Q8_0: ours adds 8 lanes, the generic one a scalar: within rounding)."""
    w, x = weight(qtype, 4, 512), activations(2, 512)
    out = ref.qdot8(x, w)
    for m in range(2):
        xq = quantize_row_q8_0_ref(x[m].numpy()) if qtype == "Q8_0" else quantize_row_q8_k_ref(x[m].numpy())
        for n in range(4):
            row = w.data[n].numpy()
            if qtype == "Q4_K":
                isums, msums = vec_dot_q4_k_q8_k(row, xq)
                d = torch.tensor([f16(b, 0) * xd for b, (xd, _, _) in zip(row.reshape(-1, 144), xq, strict=True)])
                dmin = torch.tensor([f16(b, 2) * xd for b, (xd, _, _) in zip(row.reshape(-1, 144), xq, strict=True)])
                terms = d * torch.tensor(isums, dtype=torch.float32) - dmin * torch.tensor(msums, dtype=torch.float32)
                assert out[m, n].item() == (terms[0] + terms[1]).item()
                continue
            if qtype == "Q8_0":     # 8 lanes (as llama.cpp's AVX2 kernel) against the generic scalar sum
                assert out[m, n].item() == pytest.approx(vec_dot_q8_0_q8_0(row, xq), rel=1e-5, abs=1e-6)
                continue
            llama = {"IQ2_XXS": vec_dot_iq2_xxs_q8_k, "Q2_K": vec_dot_q2_k_q8_k}[qtype]
            assert out[m, n].item() == llama(row, xq), (qtype, m, n)


@pytest.mark.parametrize("qtype", ref.TYPES)
def test_kernel_equals_reference_rows_threads_experts(qtype, monkeypatch):
    """The C kernel equals the reference bit for bit, plain and by expert (an expert -1 gives 0), for every
    M in 1..16 (row m the same bits as the 1-row call) and split across 1, 2 or 3 threads."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)     # split even these small weights
    monkeypatch.setattr(kernels, "_pool_threads", 0)     # the pool follows torch's thread count
    before = torch.get_num_threads()
    w, stacked = weight(qtype, 40, 512), weight(qtype, 3, 40, 512, seed=2)
    x = activations(16, 512)
    ids = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(4))
    ids[5] = -1
    expected, expected_experts = ref.qdot8(x, w), ref.qdot8(x, stacked, ids)
    assert torch.equal(expected_experts[5], torch.zeros(40))
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for M in (1, 2, 3, 7, 16) if threads > 1 else range(1, 17):
                assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (threads, M)
                assert torch.equal(kernels.qdot8(x[:M], stacked, ids[:M]), expected_experts[:M]), (threads, M)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("flags", ("-mno-avx512f", "-mno-avx512f -mno-avx2"))
def test_avx2_and_plain_c_builds_equal_reference(flags, tmp_path, monkeypatch):
    """The AVX2 build (what an AVX2-only machine compiles) and the plain C build give the same bits, for every
    M in 1..16 (qdot8_rows' shared-block paths of AVX2 and the plain per-row loop)."""
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nexec gcc "$@" {flags}\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("DS4_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_lib", False)
    monkeypatch.setattr(kernels, "_failure", None)
    x = activations(16, 512)
    for qtype in ref.TYPES:
        w = weight(qtype, 8, 512)
        expected = ref.qdot8(x, w)
        for M in range(1, 17):
            assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (flags, qtype, M)


def test_switch_refusals_and_report(monkeypatch):
    """q8 is refused off the cpu backend, without the kernel library, for an unknown name, under
    --strict-backend and on a strict generation; on the cpu backend the op report shows it."""
    with monkeypatch.context() as m:
        m.setattr(kernels, "_lib", None)
        m.setattr(kernels, "_failure", "cc failed on purpose")
        with pytest.raises(BackendUnavailable, match="cannot be built here .*cc failed on purpose"):
            OpSet("cpu", cpu_dot="q8")
    with pytest.raises(BackendUnavailable, match="--cpu-dot q8 needs the cpu backend"):
        OpSet("torch", cpu_dot="q8")
    with pytest.raises(BackendUnavailable, match="needs the cpu backend.*qmatmul on torch"):
        OpSet("auto", {"qmatmul": "torch"}, cpu_dot="q8")
    with pytest.raises(BackendUnavailable, match="unknown cpu dot 'q4'"):
        OpSet("cpu", cpu_dot="q4")
    import ds4
    with pytest.raises(UsageError, match="--strict-backend"):
        ds4.load(strict_backend=True, cpu_dot="q8")
    engine = ds4.load(cpu_dot="q8")
    with pytest.raises(UsageError, match="--strict promises the reference's tokens"):
        engine.generate("def f():", max_tokens=2, raw=True, strict=True)
    tokens = [t.id for t in engine.generate("def f():", max_tokens=4, raw=True, mtp_draft=0)]
    assert len(tokens) == 4
    report = engine.ops.format_report()
    assert "auto; --cpu-dot q8" in report and "cpu dot q8: activations rounded to 8 bits" in report


def test_q8_speculation_is_exact_against_q8_decoding():
    """On the default model (IQ2_XXS, Q2_K and Q8_0 weights) q8 is batch-invariant end to end: strict
    speculative decoding (depth 2, batched verify) commits plain q8 greedy decoding's tokens."""
    from ds4.engine import default_model_paths, open_model, open_mtp
    from ds4.sampling import Sampler, SamplingParams
    from ds4.session import Session
    from ds4.speculative import generate_ids
    path, mtp_path = default_model_paths()
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = []
    for draft in (None, 2):
        trunk = open_model(path, OpSet("auto", cpu_dot="q8"))
        session = Session(trunk, 128, 16, open_mtp(trunk, mtp_path))
        runs.append(list(generate_ids(session, prompt, max_tokens=12, sampler=Sampler(SamplingParams(temperature=0.0)),
                                      eos_id=None, draft=draft, strict=draft is not None)))
    assert runs[0] == runs[1] and len(runs[0]) == 12


def test_generate_cli_flag(capsys):
    """scripts/generate.py --cpu-dot q8 runs and reports it; with --strict it stops before loading; the server
    passes the flag to the load, which refuses it on the torch backend."""
    generate = script("generate")
    before = torch.get_num_threads()
    assert generate.main(["-n", "3", "--cpu-dot", "q8", "--mtp-draft", "0", "--explain-backends"]) == 0
    assert "--cpu-dot q8" in capsys.readouterr().err
    assert generate.main(["-n", "3", "--cpu-dot", "q8", "--strict"]) == 2
    assert "--strict promises the reference's tokens" in capsys.readouterr().err
    torch.set_num_threads(before)
    from ds4.server.app import main as serve
    assert serve(["--cpu-dot", "q8", "--backend", "torch", "--threads", "1"]) == 2      # refused before serving
    assert "--cpu-dot q8 needs the cpu backend" in capsys.readouterr().err
    torch.set_num_threads(before)


def test_bench_flags(tmp_path, capsys, monkeypatch):
    """`bench.py cpu --full-layers` times ds4py once per --cpu-dot given (smoke size, no llama-bench)."""
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # tiny rows fall back to F16 with a warning each
        script("bench").main(["cpu", "--full-layers", "2", "--full-tiny", "--full-mixes", "q2", "--threads", "1",
                              "--rounds", "1", "--prompt", "4", "--tokens", "2", "--workdir", str(tmp_path),
                              "--cpu-dot", "exact", "q8"])
    out = capsys.readouterr().out
    assert "ds4py --cpu-dot q8" in out and "decode_tok_s" in out


# llama.cpp's own CPU kernels (the SIMD ones this machine runs), through a small C program linked against the
# static ggml libraries of a llama.cpp build: LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin.
HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-cpu.h"
int main(void) {   /* stdin: type M N K, weight rows, float32 x [M, K]; stdout: activation blocks, y [M, N] */
    int type; long M, N, K;
    if (fread(&type, 4, 1, stdin) != 1 || fread(&M, 8, 1, stdin) != 1 || fread(&N, 8, 1, stdin) != 1
        || fread(&K, 8, 1, stdin) != 1) return 1;
    ggml_cpu_init();
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu(type);
    size_t wrow = ggml_row_size(type, K), xrow = ggml_row_size(t->vec_dot_type, K);
    char *w = malloc(N * wrow), *xq = malloc(M * xrow);
    float *x = malloc(M * K * 4);
    if (fread(w, wrow, N, stdin) != (size_t)N || fread(x, 4 * K, M, stdin) != (size_t)M) return 1;
    for (long m = 0; m < M; m++) ggml_get_type_traits_cpu(t->vec_dot_type)->from_float(x + m * K, xq + m * xrow, K);
    fwrite(xq, xrow, M, stdout);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float y;
            t->vec_dot(K, &y, 0, w + n * wrow, 0, xq + m * xrow, 0, 1);
            fwrite(&y, 4, 1, stdout);
        }
    return 0;
}
"""


@pytest.fixture(scope="module")
def ggml_harness(tmp_path_factory) -> Path:
    """The harness built against $LLAMA_CPP_BIN/../ (skips when LLAMA_CPP_BIN is unset)."""
    binary = os.environ.get("LLAMA_CPP_BIN")
    if not binary:
        pytest.skip("LLAMA_CPP_BIN (a llama.cpp build/bin directory) is not set")
    build = Path(binary).resolve().parent
    source = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", (build / "CMakeCache.txt").read_text(), re.M)[1]
    out = tmp_path_factory.mktemp("ggml")
    (out / "harness.c").write_text(HARNESS)
    libs = [str(build / "ggml" / "src" / f"libggml-{name}.a") for name in ("cpu", "base")]
    subprocess.run(["g++", "-x", "c", str(out / "harness.c"), "-x", "none", f"-I{source}/ggml/include", *libs,
                    "-fopenmp", "-lm", "-lpthread", "-o", str(out / "harness")], check=True)
    return out / "harness"


@pytest.mark.parametrize("qtype", ref.TYPES)
def test_against_ggml_itself(qtype, ggml_harness):
    """llama.cpp's from_float and vec_dot on the same weight and rows: Q8_K activations identical to the
    reference's (d, quants, sums), Q8_0 quants within one step where its AVX rounding differs from its own
    reference quantizer, and every output within float32 rounding of the reference (llama.cpp adds the same
    block terms in SIMD lanes)."""
    w, x = weight(qtype, 24, 512), activations(4, 512)
    header = np.array([w.qtype.ggml_type], np.int32).tobytes() + np.array([4, 24, 512], np.int64).tobytes()
    done = subprocess.run([str(ggml_harness)], input=header + w.data.numpy().tobytes() + x.numpy().tobytes(),
                          capture_output=True, check=True)
    mine = ref.quantize_activations(x, qtype)
    if qtype == "Q8_0":
        blocks = np.frombuffer(done.stdout[:4 * 16 * 34], np.uint8).reshape(4, 16, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        assert np.array_equal(d, mine.d.numpy())
        assert np.abs(blocks[..., 2:].view(np.int8) - mine.q.numpy()).max() <= 1
        y = np.frombuffer(done.stdout[4 * 16 * 34:], np.float32).reshape(4, 24)
    else:
        blocks = np.frombuffer(done.stdout[:4 * 2 * 292], np.uint8).reshape(4, 2, 292)
        assert np.array_equal(blocks[..., :4].copy().view(np.float32)[..., 0], mine.d.numpy())
        assert np.array_equal(blocks[..., 4:260].view(np.int8), mine.q.numpy())
        assert np.array_equal(blocks[..., 260:].copy().view(np.int16), mine.bsums.numpy())
        y = np.frombuffer(done.stdout[4 * 2 * 292:], np.float32).reshape(4, 24)
    assert np.allclose(y, ref.qdot8(x, w).numpy(), rtol=1e-5, atol=1e-6 * np.abs(y).max())


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ2_XXS"])
def test_prefill_routed_experts_take_q8(qtype):
    """A prefill (M > 16) under q8: each expert's few rows go through qdot8, so every row equals that row's
    1-row q8 call (within float rounding of the SwiGLU) and not the exact kernel's."""
    from backends.cpu import ffn
    from ops.moe import Experts
    E, D, inter, g = 8, 256, 256, torch.Generator().manual_seed(11)

    def stack(*shape):
        return QTensor.quantize(torch.randn(E, *shape, generator=g) * 0.3, qtype, "stack")
    ex = Experts(router=QTensor.quantize(torch.randn(E, D, generator=g), "F32", "router"),
                 bias=torch.randn(E, generator=g) * 0.1, tid2eid=None, gate=stack(inter, D), up=stack(inter, D),
                 down=stack(D, inter), top_k=2, route_scale=1.5, normalize=True, clamp=10.0)
    x, ids = torch.randn(20, D, generator=g), torch.zeros(20, dtype=torch.int64)
    prefill = ffn.moe(x, ids, ex, "q8")
    rows = torch.cat([ffn.moe(x[m:m + 1], ids[m:m + 1], ex, "q8") for m in range(20)])
    tol = 1e-5 * prefill.abs().max().item()
    torch.testing.assert_close(prefill, rows, rtol=0, atol=tol)
    assert (prefill - ffn.moe(x, ids, ex)).abs().max() > 100 * tol     # the exact kernel's differ


@pytest.mark.parametrize("dot", ("exact", "q8"))
def test_prefill_routed_experts_in_one_call_equal_the_per_expert_loop(dot):
    """ffn.grouped (every expert of the layer in one kernel call per projection) gives the bits of the loop over
    experts (ffn.grouped_loop) where no expert gets more than 16 rows, with all experts and with a rank's share."""
    from backends.cpu import ffn
    from ops.moe import Experts
    E, D, inter, g = 8, 256, 256, torch.Generator().manual_seed(12)

    def stack(n, *shape):
        return QTensor.quantize(torch.randn(n, *shape, generator=g) * 0.3, "Q4_K", "stack")
    x, ids = torch.randn(24, D, generator=g), torch.zeros(24, dtype=torch.int64)
    for first, n in ((0, E), (3, 4)):
        ex = Experts(router=QTensor.quantize(torch.randn(E, D, generator=g), "F32", "router"),
                     bias=torch.randn(E, generator=g) * 0.1, tid2eid=None, gate=stack(n, inter, D),
                     up=stack(n, inter, D), down=stack(n, D, inter), top_k=2, route_scale=1.5, normalize=True,
                     clamp=10.0, first=first)
        chosen, w = ffn.route(x, ids, ex, dot)
        assert torch.bincount(chosen.reshape(-1)).max() <= 16
        assert torch.equal(ffn.grouped(x, chosen, w, ex, dot), ffn.grouped_loop(x, chosen, w, ex, dot)), (dot, first)
