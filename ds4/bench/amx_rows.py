"""`bench.py amx-rows`: `--cpu-dot q8`'s several-row products (backends/cpu/qdot8amx.c) of a routed expert's and the
attention's weights, M = 1..16 rows, with the AMX tiles off (qdot8_rows' AVX-512 path), on from the break-even
row count (the default) and on for every M from 2, the three interleaved call by call; for the Q4_K, Q2_K, Q8_0 and
IQ2_XXS weights also `repacked`: a copy repacked as `--weights memory` would hold it (backends/cpu/repack.py, its own
VNNI and AMX paths; docs/cpu.md, "Several rows within 1.3x: Q4_K and Q8_0 (session 14)", "The repacked Q8_0 in the
model (session 15)" and "IQ2_XXS at several rows (session 15)").

Each time is the minimum over `--rounds` calls of the calling thread's CPU time, one thread, with the weight
evicted before every call (a buffer larger than the last-level cache summed, as `bench.py cpu --gemv`); `x_M1`
is the time over the same setting's time at the first `--rows` count (M = 1 by default; the issue's goal: within
1.3x for M = 2..16). On a CPU or build without AMX the three settings take the same path (`amx` False).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from backends.cpu import kernels, repack
from ds4.bench.cpu_gemv import EVICT_BYTES, weight
from ds4.errors import BackendUnavailable, UsageError

SHAPES = (  # (type, N, K, what V4 Flash stores in it)
    ("Q8_0", 1024, 4096, "attention q_a"),
    ("Q8_0", 32768, 1024, "attention q_b"),
    ("Q4_K", 2048, 4096, "routed gate/up (q4)"),
    ("Q4_K", 4096, 2048, "routed down (q4)"),
    ("Q2_K", 4096, 2048, "routed down (q2)"),
    ("IQ2_XXS", 2048, 4096, "routed gate/up (q2)"),
    ("Q2_K", 24576, 2048, "bench.py cpu --gemv's Q2_K"),
)
SETTINGS = {"off": (False, False), "default": (True, False), "every_m": (True, True)}   # amx_rows(on, every_m)


def time_rows(w, x: torch.Tensor, rounds: int, evict: np.ndarray,
              repacked: repack.Repacked | None) -> dict[str, float]:
    """Minimum thread CPU seconds of `kernels.qdot8(x, w)` per setting (and of `repack.product(x, repacked)`),
    interleaved, each call after an eviction."""
    best = dict.fromkeys([*SETTINGS, *(["repacked"] if repacked is not None else [])], float("inf"))
    for timed in (False, *[True] * rounds):     # a first, untimed round warms up
        for name in best:
            on, every_m = SETTINGS.get(name, (True, False))
            kernels.amx_rows(on, every_m)
            evict.sum()
            t0 = time.thread_time()
            kernels.qdot8(x, w) if repacked is None or name != "repacked" else repack.product(x, repacked)
            if timed:
                best[name] = min(best[name], time.thread_time() - t0)
    kernels.amx_rows(True)
    return best


def repacked_copy(qtype: str, shape: tuple[int, ...],
                  seed_rows: int) -> repack.Repacked | None:
    """The bench weight of `qtype` and `shape` repacked (a fresh copy), None for the types without a repack."""
    w = weight(qtype, *shape, seed_rows)
    return repack.repack(w) if repack.repackable(w) else None


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One row per (weight, M): ms and time over M = 1 for each setting."""
    if not kernels.built():
        raise BackendUnavailable("bench.py amx-rows needs the cpu kernel library (it could not be built here)")
    if not all(1 <= M <= kernels.MAX_ROWS for M in args.rows) or args.rounds < 1:
        raise UsageError(f"--rows must be in 1..{kernels.MAX_ROWS} and --rounds >= 1")
    before, pool_before = torch.get_num_threads(), kernels.threads()
    kernels.set_threads(1)
    evict = np.ones((1 << 20 if args.smoke else EVICT_BYTES) // 8)
    out = []
    try:
        for qtype, n, k, what in SHAPES:
            w = weight(qtype, 32 if args.smoke else n, k, 8 if args.smoke else 64)
            r = repacked_copy(qtype, w.shape, 8 if args.smoke else 64)
            x = torch.randn(16, k, generator=torch.Generator().manual_seed(1))
            first: dict[str, float] = {}
            for M in args.rows:
                best = time_rows(w, x[:M], args.rounds, evict, r)
                first = first or best
                row = {"type": qtype, "shape": f"{w.shape[0]}x{k}", "weight": what, "M": M, "amx": kernels.amx_rows()}
                for name in (*SETTINGS, "repacked"):
                    seconds = best.get(name)
                    row[f"{name}_ms"] = "-" if seconds is None else f"{1e3 * seconds:.3f}"
                    row[f"{name}_x_M1"] = "-" if seconds is None else f"{seconds / first[name]:.2f}"
                out.append(row)
    finally:
        kernels.set_threads(pool_before)
        torch.set_num_threads(before)
    return out


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the AMX several-row benchmark."""
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16], help="row counts M (first: the base)")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per setting and M (minimum kept)")
    p.add_argument("--smoke", action="store_true", help="32 weight rows, a small eviction (tests)")
