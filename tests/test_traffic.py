"""The traffic meter counts interpreted loads and stores to the byte: a copy kernel, the project's GEMV at two
tile sizes (F32 and Q4_K, hand-computed), a re-reading variant, and the traffic bench at smoke size."""
import argparse

import pytest
import torch
import triton
import triton.language as tl

from backends.triton import qmatmul as tq
from backends.triton.traffic import LOAD, STORE, TrafficMeter
from ops.ideal_bytes import ideal_bytes
from ops.quants import TYPES, QTensor


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def broadcast_kernel(src, dst, BLOCK: tl.constexpr):
    """Every lane reads src[0]: BLOCK lanes, one distinct element."""
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs * 0))


@triton.jit
def two_pass_gemv_kernel(w, x, y, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = (W @ x) / max|W * x| per row, reading each weight row and x twice (a deliberately bad kernel)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    peak = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[:, None] * K + k[None, :], mask=(rows[:, None] < N) & (k[None, :] < K), other=0.0)
        peak = tl.maximum(peak, tl.max(tl.abs(tile * tl.load(x + k, mask=k < K, other=0.0)[None, :]), axis=1))
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        tile = tl.load(w + rows[:, None] * K + k[None, :], mask=(rows[:, None] < N) & (k[None, :] < K), other=0.0)
        acc += tl.sum(tile * tl.load(x + k, mask=k < K, other=0.0)[None, :], axis=1)
    tl.store(y + rows, acc / peak, mask=rows < N)


def test_copy_counts_each_byte_once():
    src, dst = torch.randn(1000), torch.empty(1000)
    with TrafficMeter() as meter:
        copy_kernel[(triton.cdiv(1000, 128),)](src, dst, 1000, BLOCK=128)
    (launch,) = meter.launches
    assert torch.equal(src, dst) and launch.kernel == "copy_kernel" and launch.grid == (8, 1, 1)
    s, d = launch.arg("src"), launch.arg("dst")
    assert (s.lane, s.requested, s.distinct_bytes) == ([4000, 0], [4000, 0], [4000, 0])
    assert (d.lane, d.requested, d.distinct_bytes) == ([0, 4000], [0, 4000], [0, 4000])
    assert launch.unmapped == 0 and launch.total("requested") == 8000


def test_lanes_of_one_address_are_one_request():
    src, dst = torch.randn(4), torch.empty(64)
    with TrafficMeter() as meter:
        broadcast_kernel[(3,)](src, dst, BLOCK=64)
    s = meter.launches[0].arg("src")
    assert s.lane[LOAD] == 3 * 64 * 4 and s.requested[LOAD] == 3 * 4 and s.distinct(LOAD) == 4


def test_meter_restores_the_interpreter():
    from triton.runtime import interpreter
    before = interpreter.InterpreterBuilder.create_masked_load
    with TrafficMeter():
        assert interpreter.InterpreterBuilder.create_masked_load is not before
    assert interpreter.InterpreterBuilder.create_masked_load is before


@pytest.mark.parametrize("qtype", ["F32", "Q4_K"])
@pytest.mark.parametrize("block_n, block_k, header_rereads", [(32, 64, 24), (16, 128, 16)])
def test_gemv_traffic_matches_hand_count(qtype, block_n, block_k, header_rereads):
    """qmatmul_kernel at two tiles: W once per byte, x once per N tile, the output once. A Q4_K tile reloads
    its block's header (d, dmin: 4 bytes; 3 scale loads of 1 byte per sub-block it covers): 4 tiles of 64
    load 4 x 10 header bytes against 16 (24 re-read per 144-byte block), 2 tiles of 128 load 2 x 16 (16)."""
    n, k, m = 40, 512, 3
    w = QTensor.quantize(torch.randn(n, k), qtype)
    x, out = torch.randn(m, k), torch.empty(m, n)
    with TrafficMeter() as meter:
        tq.qmatmul_kernel[(triton.cdiv(n, block_n), 1, 1)](x, w.data, out, w.data, w.data, m, n, k, k,
                                                            w.data.shape[1], k, QTYPE=qtype, BLOCK_M=16,
                                                            BLOCK_N=block_n, BLOCK_K=block_k)
    (launch,) = meter.launches
    torch.testing.assert_close(out, x @ w.dequantize().T, rtol=1e-4, atol=1e-4)
    blocks = w.data.numel() // w.qtype.block_bytes
    assert launch.arg("w_ptr").requested[LOAD] == w.data.numel() + blocks * header_rereads * (qtype == "Q4_K")
    assert launch.arg("w_ptr").distinct(LOAD) == w.data.numel()
    assert launch.arg("x_ptr").requested[LOAD] == triton.cdiv(n, block_n) * m * k * 4
    assert launch.arg("x_ptr").lane[LOAD] == triton.cdiv(n, block_n) * m * k * 4
    assert launch.arg("out_ptr").requested[STORE] == launch.arg("out_ptr").distinct(STORE) == m * n * 4
    assert launch.unmapped == 0


def test_rereading_kernel_shows_ratio_two():
    n, k = 64, 1024
    w, x, y = torch.randn(n, k), torch.randn(k), torch.empty(n)
    with TrafficMeter() as meter:
        two_pass_gemv_kernel[(triton.cdiv(n, 32),)](w, x, y, n, k, BLOCK_N=32, BLOCK_K=128)
    torch.testing.assert_close(y, (w @ x) / (w * x).abs().amax(1), rtol=1e-4, atol=1e-4)
    ideal = ideal_bytes("two_pass_gemv", y, w, x)
    assert ideal == (n * k + k + n) * 4
    (launch,) = meter.launches
    assert launch.total("requested") == (2 * n * k + 2 * 2 * k + n) * 4  # 2 programs read x twice each
    assert launch.total("requested") / ideal >= 2
    assert launch.total("distinct") == ideal


def test_traffic_bench_smoke():
    """`bench.py traffic --op qmatmul` at a small shape: a row per registry type Triton has, per shape class."""
    from backends.triton.quants import SUPPORTED
    from ds4.bench import traffic
    parser = argparse.ArgumentParser()
    traffic.add_args(parser, on_gpu=False)
    args = parser.parse_args(["--op", "qmatmul", "--shape", "32x256", "--prompt", "17"])
    rows = traffic.rows(args, torch.device("cpu"))
    types = [t for t in TYPES if t in SUPPORTED and 256 % TYPES[t].block_size == 0]
    assert len(rows) == 3 * len(types)
    f32 = {r["shape"]: r for r in rows if r["op"] == "qmatmul F32 32x256"}
    assert set(f32) == {"decode M=1", "verify M=8", "prefill M=17"}
    decode = f32["decode M=1"]
    assert decode["launches"] == 2   # the interpreter splits K in two for one N tile: the GEMV, then the sum
    assert 1.0 <= float(decode["distinct_x_ideal"]) < 1.05  # + the split partials, written and read back
    assert float(decode["ideal_MB"]) * 1e6 == pytest.approx(32 * 256 * 4 + 256 * 4 + 32 * 4, abs=50)  # 4 decimals of MB


def test_occupancy_follows_registers_and_shared_memory():
    from backends.triton.compile_report import ARCHS, Usage, failure, occupancy
    assert occupancy(ARCHS["sm_90a"], 228, 0, 4) == (2, 8)       # 228 regs -> 7424 per warp -> 8 warps
    assert occupancy(ARCHS["sm_89"], 127, 0, 8) == (2, 16)       # 4096 per warp -> 16 warps -> 2 blocks of 8
    assert occupancy(ARCHS["sm_80"], 32, 0, 4) == (16, 64)       # warp-limited: 64 warps
    assert occupancy(ARCHS["sm_80"], 32, 80 * 1024, 4) == (2, 8)  # 81 KB per block: 2 fit in 164 KB
    assert failure(Usage(40, 16, 0, 4, 16)).startswith("SPILLS")
    assert failure(Usage(255, 0, 0, 1, 4)).startswith("OCCUPANCY")
    assert failure(Usage(64, 0, 0, 8, 32)) == ""


def test_compile_report_compiles_offline():
    """scripts/compile_triton.py compiles a kernel for sm_90a without a GPU (outside the interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"no ptxas in the triton wheel ({ptxas}): offline compiles need it")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(root / "scripts" / "compile_triton.py"), "--arch", "sm_90a",
                           "--kernel", "hadamard", "--check"], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()
    assert header.split()[:3] == ["kernel", "shape", "arch"]
    fields = row.split()
    assert fields[0] == "hadamard_kernel" and "sm_90a" in fields and fields[-1] == "yes"
    assert int(fields[fields.index("sm_90a") + 1]) > 0  # registers


def test_bench_times_the_cpu_kernels(capsys):
    """`bench.py qmatmul --backend cpu` times the C kernel (not the reference) beside the copy bandwidth."""
    from script_modules import script

    from backends.registry import OpSet
    assert OpSet("cpu", strict=True).resolve("qmatmul")[0].backend == "cpu"
    script("bench").main(["qmatmul", "--csv", "--backend", "cpu", "--types", "Q8_0", "--shapes", "8x64", "--m", "1",
                          "--reps", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert "copy" in lines[1] and "backend cpu" in lines[1] and "need a GPU" not in lines[1]
    assert lines[3].split(",")[:5] == ["Q8_0", "8", "64", "1", "cpu"]
