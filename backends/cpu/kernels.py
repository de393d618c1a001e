"""The CPU kernel library: the fused dequantize-and-multiply kernel and its block dequantizer (qgemv.c), the
8-bit-activation kernel (qdot8.c), prefill's routed experts in one call (qgemm.c), the hyper-connection
Sinkhorn (sinkhorn.c) and the decode step's bound products, indexer simulation, top-k and greedy choice (step.c),
compiled once per machine with the system C compiler and loaded with ctypes.
`built()` and `available()` are False (and the callers take their torch paths: the
reference's dequantization one tile at a time, the Sinkhorn as torch ops) when the library cannot be built
(the first use warns with the compiler's error, and the op report says `cpu kernels unavailable: <reason>`)
or `DS4_CPU_KERNELS=0` (the only silent way off).

The shared library is cached under $DS4_CACHE (default ~/.cache/ds4py) keyed by the sources' hash.
Large weights are split by output rows into chunks that `threads()` threads take in turn (each output's
arithmetic does not depend on the split): the library's own pool (pool.c) for the kernels and prefill's dense
products and routed experts, and through `split` (the same pool calling back into Python) for prefill attention's
chunks and the FP8/I32 tiles (ctypes releases the GIL during a call).
`set_threads(N)` gives the pool N threads and torch's own ops one (`--threads N`).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import operator
import os
import shutil
import subprocess
import tempfile
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backends.registry import add_note
from ops.quants import QTensor, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs

SOURCES = tuple(Path(__file__).with_name(name) for name in ("qgemv.c", "sinkhorn.c", "qdot8.c", "qgemm8.c", "qgemm.c",
                                                             "pool.c", "qdot8amx.c", "glue.c",
                                                             "step.c", "q4krepack.c", "q2krepack.c", "q8repack.c",
                                                             "iq2repack.c", "q4kexact.c", "iq2exact.c"))
HEADERS = tuple(Path(__file__).with_name(name)     # included by SOURCES
                for name in ("iq2_xxs_groups.h", "half.h", "repack.h", "lanes.h", "zen.h"))
GGML_TYPE = {"F32": 0, "F16": 1, "Q8_0": 8, "Q4_K": 12, "Q2_K": 10, "IQ2_XXS": 16,  # the types qgemv.c reads
             "Q6_K": 14, "Q5_K": 13, "Q3_K": 11, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "IQ4_NL": 20, "IQ4_XS": 23,
             "IQ3_XXS": 18, "IQ3_S": 21, "IQ2_XS": 17, "IQ2_S": 22, "IQ1_S": 19, "IQ1_M": 29, "TQ1_0": 34, "TQ2_0": 35,
             "MXFP4": 39, "BF16": 30}
ROW_MULTIPLE = {"F32": 64, "F16": 32, "BF16": 32}   # qgemv.c takes F32, F16 and BF16 rows this many values at a time
MAX_ROWS = 16
SPLIT_BYTES = 1 << 20   # weights at least this large are split across threads, in chunks at least this large
SPLIT_WORK = 1 << 27    # multiply-adds below which `rows.row_chunks` keeps a call on its thread: each chunk's Python
#                         holds the GIL (docs/cpu.md "Threads at full width: the small ops and attention")
_RANGE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)  # pool_range's chunk
FLAGS = (("-O3", "-march=native", "-ffp-contract=off"), ("-O3", "-ffp-contract=off"))

_lib: ctypes.CDLL | None | bool = False      # False: not tried yet
_failure: str | None = None     # why the build failed
_pool_threads = 0   # set_threads(n); 0: torch.get_num_threads()
CHUNKS_PER_THREAD = 4   # torch work or attention split by `split` or pool_rows: this many chunks per thread
WEIGHT_CHUNKS_PER_THREAD = 8    # a split weight's rows: this many chunks per thread (pool.c claims runs of them)


class BuildFailed(Exception):
    """The kernel library could not be built or loaded; the message says why."""


def _compile(cc: str, target: Path) -> None:
    """Compile the sources into `target` (with -march=native, else without); BuildFailed with the compiler's
    last error where neither works."""
    errors = []
    for flags in FLAGS:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([cc, *flags, "-shared", "-fPIC", "-pthread", "-o", str(out), *map(str, SOURCES)],
                                  capture_output=True, text=True, check=False)
            if done.returncode == 0:
                os.replace(out, target)     # atomic: concurrent builders race harmlessly
                return
            errors.append((done.stderr or done.stdout).strip()[-2000:])
    raise BuildFailed(f"{cc} failed: {errors[-1] or 'no message'}")


def _build() -> ctypes.CDLL:
    """Compile (once per source hash) and load the library; BuildFailed says why it cannot be."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise BuildFailed("no C compiler found (set CC, or install gcc or clang)")
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS)).hexdigest()[:16]
    cache = Path(os.environ.get("DS4_CACHE", Path.home() / ".cache" / "ds4py"))
    target = cache / f"cpu-kernels-{digest}.so"
    try:
        if not target.exists():
            cache.mkdir(parents=True, exist_ok=True)
            _compile(cc, target)
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise BuildFailed(f"{target}: {e}") from e
    lib.qgemv.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.qgemv.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64]
    lib.dequantize.restype = ctypes.c_int
    lib.dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    lib.sinkhorn.restype = None
    lib.pool_rows.restype = ctypes.c_int
    lib.pool_rows.argtypes = [ptr, ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, ctypes.c_int]
    lib.sinkhorn.argtypes = [ptr, ptr, i64, i64, i64, ctypes.c_float]
    lib.pool_range.restype = ctypes.c_int
    lib.pool_range.argtypes = [_RANGE_FN, ptr, i64, i64, ctypes.c_int]
    grid, ksigns = iq2_xxs.GRID.contiguous(), iq2_xxs.KSIGNS.to(torch.int64).contiguous()
    lib.qgemv_set_iq2_xxs(ctypes.c_void_p(grid.data_ptr()), ctypes.c_void_p(ksigns.data_ptr()))
    _set_codebooks(lib, ksigns)
    _bind_q8(lib)
    _bind_gemm8(lib)
    _bind_amx_rows(lib)
    _bind_prefill(lib)
    _bind_step(lib)
    _bind_repacked(lib)
    return lib


def _set_codebooks(lib: ctypes.CDLL, ksigns: torch.Tensor) -> None:
    """Hand the other IQ types' grids (ops/quants/<type>.py) and the sign patterns to qgemv.c; BuildFailed where a
    grid does not fit the kernel's byte tables."""
    lib.qgemv_set_iq_signs(ctypes.c_void_p(ksigns.data_ptr()))
    for module in (iq3_xxs, iq3_s, iq2_xs, iq2_s, iq1_s):
        setter = getattr(lib, f"qgemv_set_{module.QTYPE.name.lower()}")
        setter.restype = ctypes.c_int
        grid = module.GRID.to(torch.float32).contiguous()
        if setter(ctypes.c_void_p(grid.data_ptr())):
            raise BuildFailed(f"the {module.QTYPE.name} grid has values that are not small integers")


def lib() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None where it cannot be built (the first call then
    warns once with the reason) or `DS4_CPU_KERNELS=0` turns it off (silently)."""
    global _lib, _failure
    if _lib is False:
        _lib, _failure = None, None
        if os.environ.get("DS4_CPU_KERNELS", "1") != "0":
            try:
                _lib = _build()
            except BuildFailed as e:
                _failure = str(e)
                warnings.warn(f"cpu kernels unavailable: {_failure}\n(the cpu backend runs its slower torch paths; "
                              "DS4_CPU_KERNELS=0 turns the kernels off without this warning)", RuntimeWarning,
                              stacklevel=2)
        if _lib is None and _pool_threads:      # set_threads: torch's ops take the threads the kernels cannot
            torch.set_num_threads(_pool_threads)
    return _lib


def unavailable_note() -> str | None:
    """`cpu kernels unavailable: <reason>` when the library was wanted but could not be built, else None."""
    return f"cpu kernels unavailable: {_failure}" if _lib is None and _failure else None


add_note("cpu", unavailable_note)


def built() -> bool:
    """Whether the kernel library could be built and loaded here (a compiled step asks once, while tracing: the
    OpSet's compile marks it `assume_constant_result`, which imports dynamo, ~1 s an eager process does without)."""
    return lib() is not None


def available(qtype: str, k: int = 0) -> bool:
    """Whether the fused kernel serves weights of `qtype` with rows of `k` values."""
    return qtype in GGML_TYPE and k % ROW_MULTIPLE.get(qtype, 1) == 0 and built()


def set_threads(n: int) -> None:
    """Run the kernels on `n` threads and torch's own ops on one (on `n` once the library turns out not to build):
    torch's threads slow the small ops of a step down (docs/cpu.md, "Threads")."""
    global _pool_threads
    if n < 1:
        raise ValueError(f"set_threads: need at least 1 thread, got {n}")
    _pool_threads = n
    torch.set_num_threads(n if _lib is None else 1)     # _lib False: not built yet (lib() gives n back on failure)


def threads() -> int:
    """The kernel pool's thread count: `set_threads`' value, else torch's."""
    return _pool_threads or torch.get_num_threads()


def split(fn: Callable[[int, int], int | None], n: int, parts: int) -> int:
    """fn(start, stop) over [0, n) cut into `parts` even chunks, taken in turn by the caller and `threads() - 1`
    threads of the kernel pool (pool.c's `pool_range` calling back into Python: a chunk holds the GIL for its
    Python and torch's kernels release it), else on the calling thread (parts <= 1, one thread, no library, or a
    call from inside a chunk). The chunk threads run torch's ops on one thread after `set_threads` and in the
    caller's grad and inference modes. Returns the lowest return code (kernel calls return 0, or a negative
    error; fn returning None counts as 0); an exception in a chunk is raised once every chunk has run."""
    parts = max(1, min(parts, n))
    if parts == 1 or threads() == 1 or lib() is None:
        return fn(0, n) or 0
    errors: list[BaseException] = []
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def chunk(_context: int | None, start: int, stop: int) -> int:
        try:
            if _pool_threads and torch.get_num_threads() != 1:   # a pool thread's first torch call: one thread
                torch.set_num_threads(1)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return fn(start, stop) or 0
        except BaseException as e:  # noqa: BLE001 (raised by the caller)
            errors.append(e)
            return 0

    callback = _RANGE_FN(chunk)     # alive until the call returns
    rc = lib().pool_range(callback, None, n, parts, threads())
    if errors:
        raise errors[0]
    return rc


def qgemv(x: torch.Tensor, w: QTensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T` for M <= MAX_ROWS; with `experts` [M] int64, row m uses expert experts[m] of a
    stacked [E, N, K] weight. Float32 [M, N]."""
    op = torch.ops.ds4.qgemv if torch.compiler.is_compiling() else qgemv_op  # eager: no dispatcher (~5-10 us a call)
    return op(x, w.data, GGML_TYPE[w.qtype.name], w.shape[-2], experts)


def type_name(ggml_type: int) -> str:
    """The quant type name of a GGUF type number the library reads (the number itself if it reads none)."""
    return next((t for t, g in GGML_TYPE.items() if g == ggml_type), str(ggml_type))


def sinkhorn(p: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The Sinkhorn rounds of ops/hc_pre.py on row-softmaxed float32 matrices `p` [M, S, S]."""
    return sinkhorn_op(p, iters, eps)  # eager only (hc.sinkhorn): no dispatcher


def dequantize(w: QTensor) -> torch.Tensor:
    """Float32 [N, K] of a 2-D weight of a quantized type `available()` serves (bit-identical to the reference)."""
    return torch.ops.ds4.dequantize(w.data, GGML_TYPE[w.qtype.name], w.shape[0], w.shape[1])


# The ops torch.compile calls as they are (a ctypes call cannot be traced): a plain schema with a CPU kernel,
# ~5 us of dispatch per call where torch.library.custom_op's wrapper costs ~25 us (a step makes ~50 calls).
_ops = torch.library.Library("ds4", "DEF")
_ops.define("qgemv(Tensor x, Tensor data, int ggml_type, int n, Tensor? experts) -> Tensor")
_ops.define("dequantize(Tensor data, int ggml_type, int n, int k) -> Tensor")
_ops.define("sinkhorn(Tensor p, int iters, float eps) -> Tensor")


def pool_parts(weight_bytes: int) -> int:
    """Chunks the pool cuts a call reading `weight_bytes` of weight into: WEIGHT_CHUNKS_PER_THREAD per thread, each of
    SPLIT_BYTES or more (pool.c runs a call of one chunk or fewer on the caller alone, and its threads claim runs of
    consecutive chunks, shorter towards the end of the call)."""
    return min(WEIGHT_CHUNKS_PER_THREAD * threads(), weight_bytes // SPLIT_BYTES)


def split_rows(kernel: ctypes._CFuncPtr, ggml_type: int, data: torch.Tensor, n: int, experts: torch.Tensor | None,
               x: torch.Tensor, m: int, k: int) -> tuple[int, torch.Tensor]:
    """Run `kernel` (the library's qgemv or qdot8) on the `n` output rows of raw blocks `data` with the prepared
    contiguous activations `x` (`m` rows of `k` values, float32 or qdot8's rounded blocks), the rows split across
    `threads()` threads by the library's own pool (pool.c) in chunks of SPLIT_BYTES or more of weight; its return
    code and float32 y [m, n]."""
    data = data.contiguous()
    expert_bytes = data[0].numel() if experts is not None else 0
    ids = experts.to(torch.int64).contiguous() if experts is not None else None
    y = torch.empty((m, n), dtype=torch.float32)
    weight_bytes = expert_bytes if experts is not None else data.numel()
    parts = pool_parts(weight_bytes)
    rc = lib().pool_rows(ctypes.cast(kernel, ctypes.c_void_p), ggml_type, data.data_ptr(), expert_bytes,
                         0 if ids is None else ids.data_ptr(), n, k, x.data_ptr(), m, y.data_ptr(), n, parts, threads())
    return rc, y


def qgemv_op(x: torch.Tensor, data: torch.Tensor, ggml_type: int, n: int, experts: torch.Tensor | None) -> torch.Tensor:
    """qgemv on raw blocks `data` of type `ggml_type` with `n` output rows."""
    x = x.to(torch.float32).contiguous()
    M, K = x.shape
    rc, y = split_rows(lib().qgemv, ggml_type, data, n, experts, x, M, K)
    if rc == -2:
        raise MemoryError(f"qgemv: no memory for the group sums of {M} rows of {K} values")
    if rc:
        raise ValueError(f"qgemv: unsupported call ({type_name(ggml_type)}, M={M})")
    return y


_ops.impl("qgemv", qgemv_op, "CPU")


@torch.library.register_fake("ds4::qgemv")
def _(x: torch.Tensor, data: torch.Tensor, ggml_type: int, n: int, experts: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


def dequantize_op(data: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    """`n` rows of `k` values from raw blocks `data` of type `ggml_type`, as float32 [n, k]."""
    data = data.contiguous()
    out = torch.empty((n, k), dtype=torch.float32)
    if lib().dequantize(ggml_type, data.data_ptr(), n, k, out.data_ptr()):
        raise ValueError(f"dequantize: unsupported call ({type_name(ggml_type)}, K={k})")
    return out


_ops.impl("dequantize", dequantize_op, "CPU")


@torch.library.register_fake("ds4::dequantize")
def _(data: torch.Tensor, ggml_type: int, n: int, k: int) -> torch.Tensor:
    return data.new_empty((n, k), dtype=torch.float32)


def sinkhorn_op(p: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """sinkhorn.c on float32 [M, S, S]."""
    p = p.to(torch.float32).contiguous()
    c = torch.empty_like(p)
    lib().sinkhorn(p.data_ptr(), c.data_ptr(), p.shape[0], p.shape[-1], iters, eps)
    return c


_ops.impl("sinkhorn", sinkhorn_op, "CPU")


@torch.library.register_fake("ds4::sinkhorn")
def _(p: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return torch.empty_like(p, dtype=torch.float32)


# The opt-in 8-bit-activation dot product (`--cpu-dot q8`, qdot8.c; numerics and reference: ops/q8_activations.py).
Q8_TYPES = {"IQ2_XXS": 0, "Q2_K": 0, "Q4_K": 0, "Q8_0": 1,    # the types qdot8.c reads -> activation kind
            "Q3_K": 0, "Q5_K": 0, "Q6_K": 0, "IQ4_XS": 0, "Q4_0": 1, "Q5_0": 1, "IQ4_NL": 1, "MXFP4": 1, "F16": 2,
            "Q4_1": 3, "Q5_1": 3, "IQ3_XXS": 0, "IQ3_S": 0, "IQ2_XS": 0, "IQ2_S": 0, "TQ2_0": 0, "TQ1_0": 0,
            "IQ1_S": 0, "IQ1_M": 0, "BF16": 4}
# Per activation kind (0 Q8_K, 1 Q8_0, 2 the f16-rounded floats of F16 weights, 3 Q8_1, 4 the bf16-rounded floats
# of BF16 weights): values and bytes of a block.
Q8_ACTIVATION = ((256, 320), (32, 36), (32, 128), (32, 40), (32, 128))


def _bind_q8(k: ctypes.CDLL) -> None:
    """Declare qdot8.c's entry points and hand it the IQ2_XXS tables and the other IQ types' grids."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    k.q8_quantize.restype = ctypes.c_int
    k.q8_quantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    k.qdot8.restype = ctypes.c_int
    k.qdot8.argtypes = [ctypes.c_int, ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64]
    k.qdot8_rows.restype = ctypes.c_int
    k.qdot8_rows.argtypes = k.qdot8.argtypes
    grid = iq2_xxs.GRID.to(torch.uint8).contiguous()
    ksigns = iq2_xxs.KSIGNS.to(torch.int64).contiguous()
    k.qdot8_set_iq2_xxs(ctypes.c_void_p(grid.data_ptr()), ctypes.c_void_p(ksigns.data_ptr()))
    k.qdot8_set_grid.restype = ctypes.c_int
    k.qdot8_set_grid.argtypes = [ctypes.c_int, ptr, i64]
    for module in (iq3_xxs, iq3_s, iq2_xs, iq2_s, iq1_s):      # the points' values as bytes (IQ1_S's as int8)
        values = module.GRID.to(torch.int8 if module is iq1_s else torch.uint8).contiguous()
        if k.qdot8_set_grid(module.QTYPE.ggml_type, values.data_ptr(), values.numel()):
            raise BuildFailed(f"qdot8.c: the {module.QTYPE.name} grid does not fit its table")


def q8_available(qtype: str, k: int = 0) -> bool:
    """Whether the 8-bit-activation kernel serves weights of `qtype` with rows of `k` values."""
    return qtype in Q8_TYPES and k % Q8_ACTIVATION[Q8_TYPES[qtype]][0] == 0 and built()


def qdot8(x: torch.Tensor, w: QTensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T` with x rounded to 8 bits per block (ops/q8_activations.py), M <= MAX_ROWS; `experts`
    as in `qgemv`. Float32 [M, N]."""
    op = torch.ops.ds4.qdot8 if torch.compiler.is_compiling() else qdot8_op  # eager: no dispatcher (as qgemv)
    return op(x, w.data, GGML_TYPE[w.qtype.name], w.shape[-2], experts)


def q8_quantize(x: torch.Tensor, qtype: str) -> torch.Tensor:
    """Rows of float32 `x` [M, K] rounded by qdot8.c for weights of `qtype`, as raw bytes per block: Q8_K the
    256 int8 quants, float32 d, 16 int16 sums of 16 quants and padding to 320 bytes; Q8_0 float32 d, 32 int8; Q8_1
    float32 d and s, 32 int8; for F16 (BF16) weights each value rounded to the nearest f16 (bf16), as float32."""
    kind = Q8_TYPES[qtype]
    M, K = x.shape
    out = torch.empty(M * q8_row_bytes(kind, K), dtype=torch.uint8)
    if lib().q8_quantize(kind, x.data_ptr(), M, K, out.data_ptr()):
        raise ValueError(f"q8_quantize: rows of {K} values are not whole blocks of {Q8_ACTIVATION[kind][0]}")
    return out


def q8_row_bytes(kind: int, k: int) -> int:
    """Bytes of one row of `k` values rounded by qdot8.c as activation `kind` (whole blocks)."""
    block, block_bytes = Q8_ACTIVATION[kind]
    return k // block * block_bytes


_ops.define("qdot8(Tensor x, Tensor data, int ggml_type, int n, Tensor? experts) -> Tensor")


def qdot8_op(x: torch.Tensor, data: torch.Tensor, ggml_type: int, n: int, experts: torch.Tensor | None) -> torch.Tensor:
    """qdot8.c on raw blocks `data` of type `ggml_type` with `n` output rows."""
    x = x.to(torch.float32).contiguous()
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"qdot8: at most {MAX_ROWS} rows, got {M}")
    xq = q8_quantize(x, type_name(ggml_type))
    rc, y = split_rows(lib().qdot8_rows, ggml_type, data, n, experts, xq, M, K)
    if rc:
        raise ValueError(f"qdot8: unsupported call ({type_name(ggml_type)}, M={M}, K={K})")
    return y


_ops.impl("qdot8", qdot8_op, "CPU")


@torch.library.register_fake("ds4::qdot8")
def _(x: torch.Tensor, data: torch.Tensor, ggml_type: int, n: int, experts: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


# Prefill's 8-bit GEMM for Q8_0 weights (`--cpu-dot q8`, M > SMALL_M; qgemm8.c, reference ops/q8_activations.qgemm8).
GEMM8_TILE = 16     # qgemm8.c takes output rows 16 at a time (one AMX tile); the pool's chunks are whole tiles


def _bind_gemm8(k: ctypes.CDLL) -> None:
    """Declare qgemm8.c's entry points and ask once for the AMX tile state (where the CPU has it)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    k.qgemm8_amx.restype = ctypes.c_int
    k.qgemm8_amx.argtypes = [ctypes.c_int]
    k.qgemm8_packed_bytes.restype = i64
    k.qgemm8_packed_bytes.argtypes = [i64, i64]
    k.qgemm8_quantize.restype = ctypes.c_int
    k.qgemm8_quantize.argtypes = [ptr, i64, i64, ptr, ptr]
    k.qgemm8.restype = ctypes.c_int
    k.qgemm8.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64]
    k.qgemm8_path.restype = ctypes.c_int
    k.qgemm8_amx(-1)


# qgemm8.c's paths (`qgemm8_path`), all the same bits; the plain C one measured slower than the exact tiles.
GEMM8_PATHS = ("plain C", "AVX2", "AVX-512 VNNI", "AMX")
GEMM8_FAST = frozenset({"AVX2", "AVX-512 VNNI", "AMX"})     # faster than the exact tiles at prefill (docs/cpu.md)


def gemm8_path() -> str | None:
    """The path qgemm8 takes here (one of GEMM8_PATHS), None without the library."""
    k = lib()
    return None if k is None else GEMM8_PATHS[k.qgemm8_path()]


def gemm8_available(qtype: str, k: int = 0) -> bool:
    """Whether prefill's q8 products of 2-D weights of `qtype` with rows of `k` values take the 8-bit GEMM: Q8_0,
    where its path is one of GEMM8_FAST (AMX tiles, AVX-512 VNNI or AVX2; not the plain C one)."""
    return qtype == "Q8_0" and k % 32 == 0 and gemm8_path() in GEMM8_FAST


def amx(on: bool | None = None) -> bool:
    """Whether qgemm8 takes the AMX tiles (the library is built, the CPU has AMX-INT8 and the build targets it);
    `on` False/True turns them off and back on (the other paths give the same bits: tests compare them)."""
    k = lib()
    return k is not None and bool(k.qgemm8_amx(-1 if on is None else int(on)))


def qgemm8(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """`x [M, K] @ W.T` for a 2-D Q8_0 weight with x rounded to Q8_0 blocks, blocks added in order
    (ops/q8_activations.qgemm8); any M. Float32 [M, N]; output rows split across the library's pool (pool.c) in
    whole tiles."""
    x = x.to(torch.float32).contiguous()
    (M, K), (N, _) = x.shape, w.shape
    k = lib()
    if K % 32:
        raise ValueError(f"qgemm8: rows of {K} values are not whole Q8_0 blocks")
    xq = torch.empty(M * K // 32 * Q8_ACTIVATION[1][1], dtype=torch.uint8)
    packed = torch.empty(k.qgemm8_packed_bytes(M, K), dtype=torch.uint8)
    k.qgemm8_quantize(x.data_ptr(), M, K, xq.data_ptr(), packed.data_ptr())
    data = w.data.contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    acts = (ctypes.c_void_p * 2)(xq.data_ptr(), packed.data_ptr())
    parts = pool_parts(data.numel())
    if k.pool_rows(ctypes.cast(k.qgemm8_tiles, ctypes.c_void_p), 0, data.data_ptr(), 0, None, N, K,
                   ctypes.addressof(acts), M, y.data_ptr(), -(-N // GEMM8_TILE), parts, threads()):
        raise ValueError(f"qgemm8: unsupported call (M={M}, K={K})")
    return y


def experts_product(x: torch.Tensor, w: QTensor, ids: torch.Tensor, first: torch.Tensor,
                    dot: str = "exact") -> torch.Tensor:
    """Prefill's routed experts in one library call (qgemm.c): float32 [P, N] products of rows x [P, K], sorted by
    expert, rows first[g]:first[g + 1] with expert ids[g] of the stacked [E, N, K] weight `w` (ids [G] and first
    [G + 1] int64); `dot="q8"` rounds the rows to 8 bits (qdot8.c; where `q8_available`). Whole experts are split
    across the kernel pool, so the result is the same bits for any thread count."""
    q8 = dot == "q8" and q8_available(w.qtype.name, w.shape[-1])
    x = x.to(torch.float32).contiguous()
    P, K = x.shape
    rows = q8_quantize(x, w.qtype.name) if q8 else x
    data, ids, first = w.data.contiguous(), ids.to(torch.int64).contiguous(), first.to(torch.int64).contiguous()
    y = torch.empty((P, w.shape[-2]), dtype=torch.float32)
    rc = lib().experts_gemm_pool(int(q8), GGML_TYPE[w.qtype.name], data.data_ptr(), data[0].numel(), ids.data_ptr(),
                                 first.data_ptr(), w.shape[-2], K, rows.data_ptr(),
                                 rows.numel() * rows.element_size() // max(P, 1), y.data_ptr(), ids.shape[0], threads())
    if rc:
        raise ValueError(f"experts_product: unsupported call ({w.qtype.name}, K={K}, dot={dot})")
    return y


# q8's several rows (M = 2..16) of Q8_0, Q4_K, Q2_K and IQ2_XXS weights on AMX tiles (qdot8amx.c, the same bits as
# qdot8_rows' other paths). DS4_CPU_AMX=0 turns off every AMX path of the library (these and qgemm8's).
def _bind_amx_rows(k: ctypes.CDLL) -> None:
    """Declare qdot8amx.c's switch, build its IQ2_XXS tables from qdot8.c's grid (set by _bind_q8) and apply
    DS4_CPU_AMX=0."""
    k.qdot8amx_on.restype = ctypes.c_int
    k.qdot8amx_on.argtypes = [ctypes.c_int]
    k.qdot8amx_set_iq2_xxs.restype = ctypes.c_int
    if k.qdot8amx_set_iq2_xxs():
        raise BuildFailed("qdot8amx.c: the IQ2_XXS grid has values other than 8, 25 and 43")
    if os.environ.get("DS4_CPU_AMX") == "0":
        k.qgemm8_amx(0)
        k.qdot8amx_on(0)


def amx_rows(on: bool | None = None, every_m: bool = False) -> bool:
    """Whether q8's products of several rows take the AMX tiles (the library is built, the CPU has AMX-INT8, the
    build targets it and neither DS4_CPU_AMX=0 nor `amx(False)` turned the tiles off); `on` False/True turns them
    off and back on, for the row counts where they are faster or (`every_m`, tests) for every M from 2."""
    k = lib()
    mode = -1 if on is None else 2 if on and every_m else int(on)
    return k is not None and bool(k.qdot8amx_on(mode))


# Prefill's exact dense products (M > SMALL_M; qgemm.c's dense_gemm): dequantized tiles times every row, in C.
def _bind_prefill(k: ctypes.CDLL) -> None:
    """Declare qgemm.c's pool entry points: the dense tiles' product and the routed experts' groups."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    k.dense_gemm.restype = ctypes.c_int
    k.dense_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    k.experts_gemm_pool.restype = ctypes.c_int
    k.experts_gemm_pool.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, i64,
                                    ctypes.c_int]


def dense_product(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """`x [M, K] @ W.T` for a 2-D weight of a type `available()` serves (K a multiple of 16), in one library call:
    tiles of output rows dequantized (the reference's values) and multiplied by every row in 16 lanes with fused
    multiply-adds, the rows split across the kernel pool. Each output depends only on its row of x and of W: the
    same bits for any M and thread count. Float32 [M, N]."""
    x = x.to(torch.float32).contiguous()
    (M, K), N = x.shape, w.shape[0]
    data = w.data.contiguous()
    y = torch.empty((M, N), dtype=torch.float32)
    parts = pool_parts(data.numel())
    if lib().dense_gemm(GGML_TYPE[w.qtype.name], data.data_ptr(), data.numel() // max(N, 1), N, K, x.data_ptr(), M,
                        y.data_ptr(), parts, threads()):
        raise ValueError(f"dense_product: unsupported call ({w.qtype.name}, K={K})")
    return y


# The decode step's calls with fewer ctypes calls (step.c): a weight's row-kernel arguments bound once, and the
# indexer's Hadamard transform and FP4 simulation.
class BoundArgs(ctypes.Structure):
    """step.c's bound_t: one weight's arguments of its row kernel (qgemv, or qdot8_rows with the rounding kind)."""

    _fields_ = [("fn", ctypes.c_void_p), ("type", ctypes.c_int64), ("w", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64), ("q8_kind", ctypes.c_int64), ("q8_row_bytes", ctypes.c_int64),
                ("expert_bytes", ctypes.c_int64)]


@dataclass(frozen=True)
class Bound:
    """A weight bound to its row kernel (2-D, or a stack of experts): `bound_product` runs it on a few float32 rows in
    one ctypes call."""

    lib: ctypes.CDLL        # the library whose kernels `args` names
    args: BoundArgs
    address: int            # of `args`, handed to the library
    data: torch.Tensor      # the contiguous raw blocks `args` points into (kept alive)
    n: int
    k: int
    read: int               # weight bytes a row reads (one expert's of a stack)


def _bind_step(k: ctypes.CDLL) -> None:
    """Declare step.c's entry points."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    k.bound_product.restype = ctypes.c_int
    k.bound_product.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    k.index_sim.restype = None
    k.index_sim.argtypes = [ptr, i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_int, ptr]
    k.verify_argmax.restype = None
    k.verify_argmax.argtypes = [ptr, i64, i64, ptr, ptr]
    k.indexer_topk.restype = ctypes.c_int
    k.indexer_topk.argtypes = [ptr, i64, i64, i64, ptr, ptr]


def bind(w: QTensor, q8: bool) -> Bound:
    """The product of `w` (2-D, or a stack [E, N, K] of experts) with up to MAX_ROWS rows bound once: the fused kernel
    (qgemv.c, where `available`) or, `q8`, the 8-bit one (qdot8.c, where `q8_available`) with its rounding of the
    rows."""
    if len(w.shape) not in (2, 3) or not (q8_available if q8 else available)(w.qtype.name, w.shape[-1]):
        raise ValueError(f"bind: no {'8-bit ' if q8 else ''}kernel for {w.qtype.name} {tuple(w.shape)}")
    return bound(row_kernel(q8), GGML_TYPE[w.qtype.name], w.data, w.shape, Q8_TYPES[w.qtype.name] if q8 else -1)


def bound(kernel: int, type_code: int, data: torch.Tensor, shape: tuple[int, ...], kind: int) -> Bound:
    """The raw blocks `data` of a weight of `shape` (2-D, or a stack of experts) bound to the row kernel at address
    `kernel` taking type `type_code`, its rows rounded as activation `kind` (-1: float32 rows)."""
    data, K = data.contiguous(), shape[-1]
    expert_bytes = data[0].numel() if len(shape) == 3 else 0
    args = BoundArgs(kernel, type_code, data.data_ptr(), shape[-2], K, kind, q8_row_bytes(kind, K) if kind >= 0 else 0,
                     expert_bytes)
    return Bound(lib(), args, ctypes.addressof(args), data, shape[-2], K, expert_bytes or data.numel())


def row_kernel(q8: bool) -> int:
    """The address of the row kernel a product takes: qdot8_rows (`q8`) or qgemv."""
    k = lib()
    return ctypes.cast(k.qdot8_rows if q8 else k.qgemv, ctypes.c_void_p).value


DATA = operator.attrgetter("data")


class PerWeight:
    """Values made once per set of weights (a weight's bound call, `Bound`, or glue.py's bound expert call), kept as
    long as the first weight lives and used only while every weight holds the same data and the library loaded now is
    the one they were made with (a test may turn the library off or rebuild it)."""

    def __init__(self):
        self.entries: dict[tuple, tuple[weakref.ref, tuple[torch.Tensor, ...], Any, Any]] = {}

    def value(self, weights: tuple[QTensor, ...], key: tuple, make: Callable[[], Any]) -> Any:
        """The value of `weights` under `key`, made by `make()` on first use or when stale."""
        full = (*map(id, weights), *key)
        entry = self.entries.get(full)
        if (entry is not None and entry[0]() is weights[0] and entry[2] is _lib
                and all(map(operator.is_, entry[1], map(DATA, weights)))):
            return entry[3]
        value = make()      # may load the library
        self.entries[full] = (weakref.ref(weights[0], lambda _, full=full: self.entries.pop(full, None)),
                              tuple(w.data for w in weights), _lib, value)
        return value


def bound_product(b: Bound, x: torch.Tensor, experts: torch.Tensor | None = None,
                  parts: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T` for contiguous float32 x [M, K] (M <= MAX_ROWS) with the weight `b` binds (row m with expert experts[m]
    of a stack: contiguous int64 [M]), the output rows cut into `parts` chunks (default: as `qgemv`/`qdot8` cut them)
    on the pool: their bits. Float32 [M, N]; given contiguous float32 `out` of at least M * N values, written into its
    first M * N values, and `out` is returned."""
    M = x.shape[0]
    y = torch.empty((M, b.n), dtype=torch.float32) if out is None else out
    rc = b.lib.bound_product(b.address, x.data_ptr(), M, None if experts is None else experts.data_ptr(), y.data_ptr(),
                             pool_parts(b.read) if parts is None else parts, threads())
    if rc == -2:
        raise MemoryError(f"qmatmul: no memory for {M} rows of {b.k} values")
    if rc:
        raise ValueError(f"qmatmul: unsupported call ({type_name(b.args.type)}, M={M}, K={b.k})")
    return y


def index_sim(x: torch.Tensor, hadamard: bool, fp4: bool) -> torch.Tensor:
    """ops.fp4_sim.fp4_sim(ops.hadamard.hadamard(x))'s bits for float32 x [..., n] (either step may be left out):
    the last dim a power of two for `hadamard`, a multiple of 32 for `fp4`."""
    n = x.shape[-1]
    if hadamard and n & (n - 1) or fp4 and n % 32:
        raise ValueError(f"index_sim: {n} values a row are not a power of two (hadamard) or whole blocks of 32")
    x = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    lib().index_sim(x.data_ptr(), x.numel() // n if n else 0, n, int(hadamard), math.sqrt(n), int(fp4),
                    out.data_ptr())
    return out


def verify_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.verify_argmax's result for logits [M, V] (V >= 2) in one pass over each row: top-1 [M] int64 (the lowest
    index on ties) and the top-1 minus top-2 logit [M] float32."""
    x = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.to(torch.float32).contiguous()
    M, V = x.shape
    top1, margin = torch.empty(M, dtype=torch.int64), torch.empty(M, dtype=torch.float32)
    lib().verify_argmax(x.data_ptr(), M, V, top1.data_ptr(), margin.data_ptr())
    return top1, margin


def indexer_topk(scores: torch.Tensor, k: int, visible: torch.Tensor) -> torch.Tensor:
    """ops.indexer_topk's result for scores [M, n] and visible counts [M]: each row's visible columns by descending
    score (a NaN first, ties to the lower column) in one C call, -1 padded; int64 [M, k]."""
    x = scores if scores.dtype == torch.float32 and scores.is_contiguous() else scores.to(torch.float32).contiguous()
    seen = visible.to(torch.int64).contiguous()
    M, n = x.shape
    out = torch.empty((M, k), dtype=torch.int64)
    if lib().indexer_topk(x.data_ptr(), M, n, k, seen.data_ptr(), out.data_ptr()):
        raise MemoryError(f"indexer_topk: no memory to rank {n} columns")
    return out


# The layouts repacked at load for `--cpu-dot q8` (backends/cpu/repack.py; docs/cpu.md, "Q4_K repacked at load
# (session 13)", "Several rows within 1.3x: ... (session 14)"): their type codes in the library (no GGUF type: qgemv
# and dequantize refuse them) and the prefixes of their entry points.
Q4KR_TYPE = 1012    # Q4_K repacked (q4krepack.c)
Q2KR_TYPE = 1010    # Q2_K repacked (q2krepack.c)
Q8R_TYPE = 1008     # Q8_0 repacked (q8repack.c)
IQ2R_TYPE = 1016    # IQ2_XXS repacked (iq2repack.c)


def _bind_repacked(k: ctypes.CDLL) -> None:
    """Declare q4krepack.c's, q2krepack.c's, q8repack.c's and iq2repack.c's entry points."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for prefix in ("q4kr", "q2kr", "q8r", "iq2r"):
        getattr(k, f"{prefix}_repack").restype = ctypes.c_int
        getattr(k, f"{prefix}_repack").argtypes = [ptr, i64, i64, ctypes.c_int]
        getattr(k, f"{prefix}_rows").restype = ctypes.c_int
        getattr(k, f"{prefix}_rows").argtypes = k.qdot8.argtypes
        getattr(k, f"{prefix}_amx_from").restype = ctypes.c_int
        getattr(k, f"{prefix}_amx_from").argtypes = [ctypes.c_int]
        getattr(k, f"{prefix}_vector").restype = ctypes.c_int
    k.q8r_gemm.restype = ctypes.c_int       # q8repack.c: a repacked Q8_0 weight times any number of rows (prefill)
    k.q8r_gemm.argtypes = k.qdot8.argtypes
