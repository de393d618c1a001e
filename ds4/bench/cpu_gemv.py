"""`bench.py cpu --gemv`: the fused CPU kernel (backends/cpu/qgemv.c) at V4 Flash's decode shapes, one thread,
and beside it the 8-bit-activation kernel of `--cpu-dot q8` (backends/cpu/qdot8.c) for the types it reads.

For each type a V4 mix stores large matrices in, a weight of distinct bytes (seed rows repeated, as
ds4/tiny/random_model.py) is multiplied by M = 1..16 rows; the table gives the weight bytes read per second
and that as a share of the one-thread copy bandwidth (bytes read + written per second of a large copy), and
the M-row time against the 1-row time (`x_M1`; `q8_x_M1` for the 8-bit kernel); at M = 1 also the reference's
way, the weight dequantized one ~1 MB tile at a time by ops/quants and multiplied (`ref_ms`: how the cpu backend
serves a type without a kernel), and that against the kernel (`x_ref`). Times are the minimum over `--rounds`
calls of the calling thread's CPU time (time.thread_time), so a busy shared machine inflates them less than wall
time would.

The weights live in anonymous memory that numpy asks huge pages for (so the kernel is timed, not TLB misses),
and before every timed call a buffer larger than the last-level cache is summed (so the weight comes from memory,
as in decode). Those sums give the read-only bandwidth (`read_GB_s`, and `pct_read`: the kernel's share of it);
at M = 1 the kernel also runs on 2 threads of the kernel pool (`GB_s_2t`, `pct_read_2t` against two threads
each summing half; wall time).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from backends.cpu import kernels
from backends.cpu.qmatmul import TILE_BYTES
from ops.quants import QTensor, get

SHAPES = {  # type: (N, K) of the matrix V4 Flash stores in it (6 routed experts stacked for the experts' types)
    "IQ2_XXS": (6 * 2048, 4096),    # routed gate/up (q2)
    "Q2_K": (6 * 4096, 2048),       # routed down (q2)
    "Q4_K": (6 * 2048, 4096),       # routed gate/up/down (q4)
    "Q8_0": (32768, 1024),          # attention q_b
    "F16": (4096, 4096),            # HC, compressor, router
    **dict.fromkeys(("IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4"),
                    (6 * 2048, 4096)),  # routed gate/up in llama.cpp's IQ, TQ and MXFP4_MOE mixes
    "BF16": (4096, 4096),           # as F16
    "Q3_K": (6 * 2048, 4096),       # routed gate/up (llama.cpp's Q3_K_M)
    "Q5_K": (6 * 2048, 4096),       # routed gate/up (Q5_K_M)
    "Q6_K": (6 * 4096, 2048),       # routed down (Q4_K_M / Q5_K_M, half the layers)
    **dict.fromkeys(("IQ4_XS", "Q4_0", "Q5_0", "IQ4_NL", "Q4_1", "Q5_1"), (6 * 2048, 4096)),   # gate/up in those mixes
}
ROWS = (1, 2, 4, 8, 16)
EVICT_BYTES = 768 << 20     # summed before each timed call: more than this machine's last-level cache (480 MiB)


def huge(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in anonymous memory numpy madvises huge pages for (arrays of 4 MB or more)."""
    return torch.from_numpy(np.ones(nbytes, dtype=np.uint8))


@dataclass
class Evictor:
    """A float64 buffer larger than the last-level cache; `read(threads)` sums it with numpy (evicting the weight),
    each of `threads` Python threads one share (numpy's sum releases the GIL), and keeps the fastest read of each
    thread count (torch's one-thread float32 `sum` read slower here: 6.9 against 9.1 GB/s, side by side)."""
    buf: np.ndarray
    best: dict[int, float]

    def read(self, threads: int = 1) -> None:
        """Sum the buffer on `threads` threads (wall time; the fastest kept)."""
        shares = np.array_split(self.buf, threads)
        workers = [threading.Thread(target=share.sum) for share in shares[1:]]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        shares[0].sum()
        for w in workers:
            w.join()
        self.best[threads] = min(self.best.get(threads, float("inf")), time.perf_counter() - t0)

    def gb_s(self, threads: int) -> float:
        """The fastest read-only bandwidth seen on `threads` threads, bytes per second."""
        return self.buf.nbytes / self.best[threads]


def weight(qtype: str, n: int, k: int, seed_rows: int = 64) -> QTensor:
    """An [n, k] weight of `qtype`: `seed_rows` quantized random rows repeated (every byte at its own address)."""
    g = torch.Generator().manual_seed(0)
    seed = QTensor.quantize(torch.randn(seed_rows, k, generator=g) / 16, qtype, "w").data
    data = huge(n * seed.shape[1]).view(n, seed.shape[1])
    data.copy_(seed.repeat((n + seed_rows - 1) // seed_rows, 1)[:n])
    return QTensor(get(qtype), (n, k), data)


def cpu_seconds(fn, rounds: int, evict: Evictor | None = None) -> float:
    """Minimum CPU time of the calling thread over `rounds` calls (after one untimed call), each after
    `evict.read()` where given."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        if evict is not None:
            evict.read()
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def wall_seconds_2t(fn, rounds: int, evict: Evictor) -> float:
    """Minimum wall time of `fn` on 2 kernel-pool threads over `rounds` calls, each after a 2-thread
    `evict.read`."""
    kernels.set_threads(2)
    try:
        fn()
        best = float("inf")
        for _ in range(rounds):
            evict.read(2)
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    finally:
        kernels.set_threads(1)
    return best


def reference_tiles(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """`x @ W.T` through the reference dequantizer, one tile of about TILE_BYTES of float32 at a time."""
    n, k = w.shape
    step = max(1, TILE_BYTES // (4 * k))
    return torch.cat([x @ QTensor(w.qtype, (min(n, i + step) - i, k), w.data[i:i + step]).dequantize().T
                      for i in range(0, n, step)], 1)


def rows(rounds: int, smoke: bool = False) -> list[dict]:
    """One row per (type, M): ms, GB/s, % of one-thread copy bandwidth, time against M = 1 (`smoke`: 256 rows)."""
    before, pool_before = torch.get_num_threads(), kernels.threads()
    kernels.set_threads(1)
    try:
        src = huge(1 << (16 if smoke else 26))
        dst = huge(src.numel())
        copy = 2 * src.numel() / cpu_seconds(lambda: dst.copy_(src), rounds)
        evict = Evictor(np.ones((1 << 20 if smoke else EVICT_BYTES) // 8), {})
        out = []
        for qtype, (n, k) in SHAPES.items():
            n = 256 if smoke else n
            w = weight(qtype, n, k, 8 if smoke else 64)    # the IQ quantizers take seconds per 1000 blocks
            one = one8 = None
            for m in ROWS:
                x = torch.randn(m, k)
                s = cpu_seconds(lambda: kernels.qgemv(x, w), rounds, evict)     # noqa: B023 (called at once)
                one = one or s
                gb_s = w.data.numel() / s
                row = {"type": qtype, "N": n, "K": k, "M": m, "ms": f"{1e3 * s:.2f}", "GB_s": f"{gb_s / 1e9:.2f}",
                       "pct_copy": f"{100 * gb_s / copy:.0f}", "pct_read": f"{100 * gb_s / evict.gb_s(1):.0f}",
                       "x_M1": f"{s / one:.2f}", "GB_s_2t": "", "pct_read_2t": "",
                       "q8_GB_s": "-", "q8_pct_copy": "-", "q8_pct_read": "-", "q8_x_exact": "-", "q8_x_M1": "-",
                       "q8_GB_s_2t": "", "copy_GB_s": f"{copy / 1e9:.1f}", "read_GB_s": f"{evict.gb_s(1) / 1e9:.1f}",
                       "ref_ms": "", "x_ref": ""}
                if m == 1:
                    s2 = wall_seconds_2t(lambda: kernels.qgemv(x, w), rounds, evict)     # noqa: B023
                    row.update(GB_s_2t=f"{w.data.numel() / s2 / 1e9:.2f}",
                               pct_read_2t=f"{100 * w.data.numel() / s2 / evict.gb_s(2):.0f}")
                if kernels.q8_available(qtype, k):
                    s8 = cpu_seconds(lambda: kernels.qdot8(x, w), rounds, evict)     # noqa: B023 (called at once)
                    one8 = one8 or s8
                    row.update(q8_GB_s=f"{w.data.numel() / s8 / 1e9:.2f}",
                               q8_pct_copy=f"{100 * w.data.numel() / s8 / copy:.0f}",
                               q8_pct_read=f"{100 * w.data.numel() / s8 / evict.gb_s(1):.0f}",
                               q8_x_exact=f"{s / s8:.2f}", q8_x_M1=f"{s8 / one8:.2f}")
                    if m == 1:
                        s82 = wall_seconds_2t(lambda: kernels.qdot8(x, w), rounds, evict)     # noqa: B023
                        row.update(q8_GB_s_2t=f"{w.data.numel() / s82 / 1e9:.2f}")
                if m == 1:
                    ref = cpu_seconds(lambda: reference_tiles(x, w), rounds)     # noqa: B023
                    row.update(ref_ms=f"{1e3 * ref:.1f}", x_ref=f"{ref / s:.1f}")
                out.append(row)
    finally:
        kernels.set_threads(pool_before)
        torch.set_num_threads(before)
    return out
