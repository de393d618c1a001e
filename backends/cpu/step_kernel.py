"""ds4::qgemv's CPU kernel in C++ for compiled steps (qgemv_op.cpp; docs/cpu.md "The compiled step, session 15").

A compiled step (an AOTInductor package, backends/precompiled.py) calls the fused kernel's torch op `ds4::qgemv` ~100
times a step on the 89M model; through kernels.py's Python kernel each call costs the dispatcher's unboxing into Python
and the kernel's own Python, about three quarters of the step. Importing this module (precompiled.CUSTOM_OPS, before a
step is loaded) loads a C++ kernel for the op over the Python one: the same library call on the same chunks (the same
bits), no Python. It is built once per source and torch version with torch's C++ extension builder, kept in $DS4_CACHE
beside the kernel library (~40 s of CPU), and loaded in milliseconds after. Without the kernel library the Python
kernel stays (it raises by name when called)."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from backends.cpu import kernels

SOURCE = Path(__file__).with_name("qgemv_op.cpp")
_threads: ctypes.c_int | None = None     # the C++ kernel's thread count, set before each step (sync_threads)
_names: ctypes.Array | None = None       # the type names the C++ kernel's errors print, by GGUF type number


def library_path() -> Path:
    """Where the built kernel is kept: beside the kernel library (kernels.py), named by a hash of its source and
    torch's version."""
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    return Path(os.environ.get("DS4_CACHE", Path.home() / ".cache" / "ds4py")) / f"qgemv-op-{key}.so"


def build(path: Path) -> None:
    """Compile qgemv_op.cpp into `path` with torch's C++ extension builder (in a scratch directory, then moved)."""
    from torch.utils import cpp_extension
    with tempfile.TemporaryDirectory() as scratch:
        name = f"ds4_qgemv_op_{path.stem[-16:]}"
        cpp_extension.load(name, [str(SOURCE)], extra_cflags=["-O2"], build_directory=scratch,
                           is_python_module=False, verbose=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy(Path(scratch) / f"{name}.so", temporary)
        temporary.replace(path)


def load() -> bool:
    """Build (once) and load the C++ kernel over ds4::qgemv's Python one; False without the kernel library."""
    global _threads, _names
    if _threads is not None:
        return True
    library = kernels.lib()
    if library is None:
        return False
    path = library_path()
    if not path.exists():
        with quiet_stderr():     # the builder loads what it built too (a failed build raises with its log)
            build(path)
    with quiet_stderr():     # the dispatcher's note, printed by C++, that the Python kernel is overridden
        torch.ops.load_library(str(path))
    cpp = ctypes.CDLL(str(path))
    _names = (ctypes.c_char_p * 256)(*(kernels.type_name(t).encode() if kernels.type_name(t) != str(t) else None
                                      for t in range(256)))
    cpp.ds4_qgemv_setup.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    if cpp.ds4_qgemv_setup(library._name.encode(), kernels.WEIGHT_CHUNKS_PER_THREAD, kernels.SPLIT_BYTES, _names, 256):
        raise RuntimeError(f"{path}: the kernel library {library._name} lacks pool_rows or qgemv")
    _threads = ctypes.c_int.in_dll(cpp, "ds4_qgemv_threads")
    sync_threads()
    return True


@contextmanager
def quiet_stderr():
    """File descriptor 2 sent to /dev/null for the block (a failed load still raises)."""
    kept, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(null)


def sync_threads() -> None:
    """Give the C++ kernel the kernel pool's thread count (`kernels.threads()`, which --threads sets)."""
    if _threads is not None:
        _threads.value = kernels.threads()
