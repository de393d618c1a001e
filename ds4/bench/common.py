"""What every benchmark suite shares: the machine line, timing, copy bandwidth, tables, random quantized weights."""
from __future__ import annotations

import csv
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from ds4.errors import UsageError
from ds4.session import Session
from ds4.speculative import row_tops
from ops.quants import QTensor, get


def greedy(s: Session, logits: torch.Tensor) -> int:
    """The greedy token of a session's one logits row, through its backend's `row_tops` (on cpu one C pass)."""
    return row_tops(s.model.ops, logits[None])[0]


def machine(device: torch.device) -> str:
    """One line naming the device, driver and library versions."""
    try:
        import triton
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
    except ImportError:  # the torch reference needs no triton (e.g. on macOS)
        versions = f"torch {torch.__version__}, no triton"
    if device.type != "cuda":
        return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads), {versions}"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                check=False, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        driver = "unknown"
    return f"{torch.cuda.get_device_name(device)}, driver {driver}, CUDA {torch.version.cuda}, {versions}"


def seconds(calls: list[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Median time of one call.

    On CUDA all `calls` (the same work on distinct buffers, together larger than L2) are replayed
    in a CUDA graph, so neither Python launch overhead nor a warm L2 inflates the figure; if the
    work cannot be captured, triton's do_bench times the first call (it flushes L2 between calls).
    On CPU: one warm-up call, then `reps` timed calls of the first.
    """
    if device.type == "cuda":
        import triton.testing

        try:
            total = triton.testing.do_bench_cudagraph(lambda: [call() for call in calls], return_mode="median")
            return total / 1e3 / len(calls)
        except RuntimeError as e:
            print(f"# CUDA graph capture failed ({e}); timing with do_bench", file=sys.stderr)
            return triton.testing.do_bench(calls[0], return_mode="median") / 1e3
    calls[0]()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        calls[0]()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def l2_copies(nbytes: int, device: torch.device) -> int:
    """How many copies of an `nbytes` buffer it takes to exceed four times the L2 cache (1 on CPU)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return min(64, -(-4 * l2 // nbytes))


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes per second moved (read + written) by a device-to-device copy of a large buffer."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds([lambda: dst.copy_(src)], device, reps)


def emit(rows: list[dict], as_csv: bool) -> None:
    """Print rows as an aligned table, or as CSV (nothing for no rows: a parallel run's other ranks)."""
    if not rows:
        return
    if as_csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in rows[0]}
    print("  ".join(c.rjust(w) for c, w in widths.items()))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in widths.items()))


def fmt(value: float) -> str:
    """A figure with three significant digits at least, without exponent notation."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def parse_shape(text: str) -> tuple[int, int]:
    """'4096x2048' -> (4096, 2048), meaning N (out) x K (in)."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--shapes: {text!r} is not NxK (out x in), e.g. 4096x2048") from None
    if n < 1 or k < 1:
        raise UsageError(f"--shapes: {text!r} needs positive N and K")
    return n, k


def random_weight(qtype: str, n: int, k: int, device: torch.device) -> QTensor:
    """An [n, k] weight made of blocks drawn at random from a small pool of quantized random blocks."""
    try:
        qt = get(qtype)
    except KeyError as e:
        raise UsageError(f"--types: {e.args[0]}") from None
    if k % qt.block_size:
        raise UsageError(f"--shapes: K={k} is not a multiple of the {qtype} block size {qt.block_size}")
    g = torch.Generator().manual_seed(0)
    pool = qt.quantize(torch.randn(256, qt.block_size, generator=g))
    picks = torch.randint(len(pool), (n * (k // qt.block_size),), generator=g)
    data = pool[picks].reshape(n, qt.row_bytes(k)).to(device)
    return QTensor(qt, (n, k), data, name=f"bench.{qtype}.{n}x{k}")


def stacked_weight(qtype: str, e: int, n: int, k: int, device: torch.device) -> QTensor:
    """An expert stack [e, n, k] of random blocks (see random_weight)."""
    w = random_weight(qtype, e * n, k, device)
    return QTensor(w.qtype, (e, n, k), w.data.reshape(e, n, -1), name=f"bench.{qtype}.{e}x{n}x{k}")


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
