"""Reading a whole model file into private anonymous memory with transparent huge pages (`--weights memory`), on
several threads (docs/cpu.md "Weights in memory"): most of the time goes into the kernel finding free 2 MB pages,
which each thread does for its own chunks in parallel."""
from __future__ import annotations

import builtins
import ctypes
import itertools
import mmap
import os
import sys
import threading
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ds4.errors import ModelFileError, UsageError

# A writable private mapping of a file larger than RAM needs MAP_NORESERVE, or Linux refuses it (ENOMEM).
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
READ_CHUNK = 256 << 20   # bytes each thread claims at a time
READ_THREADS = 4         # at most this many readers, and no more than the CPUs this process may run on


def read_threads() -> int:
    """How many threads read a file: READ_THREADS, or fewer where the process may run on fewer CPUs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(READ_THREADS, cpus))


class _Chunks:
    """The READ_CHUNK pieces of one file read, claimed in turn by the reading threads; the failure of the first
    chunk that failed (in file order) is the one reported."""

    def __init__(self, fd: int, view: memoryview, size: int, path: Path, cached: np.ndarray | None, bar: tqdm):
        self.fd, self.view, self.size, self.path, self.cached, self.bar = fd, view, size, path, cached, bar
        self.starts = range(0, size, READ_CHUNK)
        self.order = itertools.count()      # next() on it is atomic under the GIL
        self.lock = threading.Lock()
        self.failures: list[tuple[int, BaseException]] = []

    def take(self) -> None:
        """Read chunks until none is left or one has failed."""
        while not self.failures and (i := next(self.order)) < len(self.starts):
            start = self.starts[i]
            end = min(start + READ_CHUNK, self.size)
            try:
                self.read(start, end)
                if self.cached is not None:
                    drop_cache(self.fd, start, end, self.cached)
            except BaseException as e:  # noqa: BLE001 (raised by read_into_memory)
                with self.lock:
                    self.failures.append((start, e))
                return
            with self.lock:
                self.bar.update(end - start)

    def read(self, start: int, end: int) -> None:
        """Bytes start:end of the file into the same bytes of the mapping (pread: the GIL is released meanwhile)."""
        pos = start
        while pos < end:
            part = self.view[pos:end]
            try:
                n = os.preadv(self.fd, [part], pos)
            except OSError as e:
                raise ModelFileError(f"{self.path}: cannot read at offset {pos}: {e}") from None
            finally:
                part.release()  # so that the mapping can be closed whatever the reader kept
            if not n:
                raise ModelFileError(f"{self.path}: the file ends at offset {pos}, but it had {self.size} bytes "
                                     "when loading began (truncated or changed while loading)")
            pos += n


def read_into_memory(fd: int, size: int, path: Path, progress: bool = False,
                     threads: int | None = None) -> tuple[mmap.mmap, bool]:
    """The whole file of descriptor `fd` in one private anonymous mapping (transparent huge pages advised) and
    whether the advice was taken. Read in READ_CHUNK chunks claimed in turn by `threads` threads (default
    `read_threads()`, the caller among them), each `pread`ing into its own part of the mapping; the page cache the
    read brings in is dropped behind each chunk, so the file is not held twice (pages cached before stay: another
    process may be using them). A read error or a file that ends early is a ModelFileError naming the offset
    (the first in the file where several chunks failed); nothing is kept then."""
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        raise UsageError(f"{path}: cannot allocate {size} bytes to read the file into ({e}); "
                         "map it instead (weights mmap)") from None
    huge = advise_huge_pages(buf)
    cached = cached_pages(fd, size)
    view = memoryview(buf)
    with tqdm(total=size, desc=f"reading {path.name}", unit="B", unit_scale=True, leave=False,
              disable=None if progress else True) as bar:
        chunks = _Chunks(fd, view, size, path, cached, bar)
        helpers = [threading.Thread(target=chunks.take, name=f"ds4-read-{i}", daemon=True)
                   for i in range(min(threads or read_threads(), len(chunks.starts)) - 1)]
        try:
            for helper in helpers:
                helper.start()
            chunks.take()
        finally:
            for helper in helpers:     # no thread writes into the mapping once it is closed
                helper.join()
    if chunks.failures:
        view.release()
        buf.close()
        raise min(chunks.failures, key=lambda failure: failure[0])[1]
    view.release()
    return buf, huge


def advise_huge_pages(buf: mmap.mmap, setting: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> bool:
    """Ask for transparent huge pages on `buf` (Linux); whether the kernel takes the advice (THP built in and not
    set to "never")."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        buf.madvise(advice)
        with builtins.open(setting) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def cached_pages(fd: int, size: int) -> np.ndarray | None:
    """Per page of the file, whether it is in the page cache now (Linux mincore); None where this cannot be
    asked or the cache cannot be dropped (posix_fadvise missing)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_fadvise"):
        return None
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vec = (ctypes.c_ubyte * (-(-size // mmap.PAGESIZE)))()
    probe = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE | MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        anchor = ctypes.c_char.from_buffer(probe)   # the mapping's address; released before it is closed
        try:
            failed = mincore(ctypes.addressof(anchor), size, vec)
        finally:
            del anchor
    finally:
        probe.close()
    return None if failed else np.frombuffer(vec, np.uint8) & 1 == 1


def drop_cache(fd: int, start: int, end: int, cached: np.ndarray) -> None:
    """Drop the page cache of bytes `start:end` of the file, except the runs of pages that were cached before."""
    page = mmap.PAGESIZE
    first, last = start // page, -(-end // page)
    was = np.concatenate(([True], cached[first:last], [True]))
    edges = np.flatnonzero(was[1:] != was[:-1])  # alternating starts and ends of runs not cached before
    for a, b in zip(edges[::2], edges[1::2], strict=True):
        os.posix_fadvise(fd, (first + a) * page, (b - a) * page, os.POSIX_FADV_DONTNEED)
