"""`--weights` / `ds4.load(weights=...)` / `gguf.open(path, weights=...)`: a model read into anonymous memory
computes what the mapped one does, its tensors live in the copy (not the file), the auto policy, bad values, and a
file cut short while it is read."""
from __future__ import annotations

import errno
import mmap
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ds4
from ds4 import weights
from ds4.engine import default_model_paths
from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf, readin
from tests.script_modules import script

GB = 10**9


def greedy(engine: ds4.Engine) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy ids and the logits behind each, for a short code prompt."""
    logits: list[torch.Tensor] = []
    ids = [t.id for t in engine.generate("def f(x):\n", raw=True, max_tokens=6, on_logits=logits.append)
           if t.id >= 0]
    return ids, logits


def test_memory_and_mmap_compute_the_same(capsys):
    mapped, copied = ds4.load(weights="mmap"), ds4.load(weights="memory")
    assert (mapped.weights.plan.mode, copied.weights.plan.mode) == ("mmap", "memory")
    err = capsys.readouterr().err      # asked for explicitly: one line each, even for a small file
    assert "weights: mapped from the file" in err and "weights: read into memory" in err
    ids, logits = greedy(mapped)
    ids2, logits2 = greedy(copied)
    assert ids == ids2 and len(ids) == 6
    assert all(torch.equal(a, b) for a, b in zip(logits, logits2, strict=True))


def test_tensors_live_in_the_copy_not_in_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    shutil.copy(default_model_paths()[0], path)
    mapped, copied = gguf.open(path, "mmap"), gguf.open(path, weights="memory")
    assert copied.weights == "memory" and mapped.weights == "mmap"
    name = "output.weight"
    info, before = copied.tensors[name], copied.raw(name).data.clone()
    assert torch.equal(before, mapped.raw(name).data)
    with open(path, "r+b") as f:         # change the tensor's bytes in the file after loading
        f.seek(info.offset)
        flipped = bytes(255 - b for b in f.read(info.nbytes))
        f.seek(info.offset)
        f.write(flipped)
    assert torch.equal(copied.raw(name).data, before)        # the copy in memory did not move
    assert not torch.equal(mapped.raw(name).data, before)    # the mapping sees the file (Linux: pages not written)


def test_auto_policy():
    plan = weights.plan
    assert plan("auto", 5 * GB, "cpu", None, 20 * GB).mode == "memory"
    assert plan("auto", 5 * GB, "cpu", None, 6 * GB).mode == "mmap"            # 2 GB must stay available
    assert plan("auto", 26 * GB, "cpu", None, 30 * GB).mode == "memory"
    assert plan("auto", 28 * GB, "cpu", None, 30 * GB).mode == "mmap"          # and 10% of what is available
    assert plan("auto", 28 * GB, "cpu", None, 30 * GB).reason == \
        "files 28.0 GB > 27.0 GB available with 3.0 GB to spare"
    assert plan("auto", 1 * GB, "cpu", None, None).mode == "mmap"              # no /proc/meminfo: map
    assert plan("auto", 1 * GB, "cuda:0", None, 20 * GB).mode == "mmap"
    assert plan("auto", 1 * GB, "mlx", None, 20 * GB).mode == "mmap"
    assert plan("auto", 1 * GB, "cpu", "ep", 20 * GB).mode == "mmap"
    assert plan("memory", 1 * GB, "cuda:0", None, 20 * GB).mode == "memory"    # asked for: done where it fits
    assert plan("mmap", 1 * GB, "cpu", None, 20 * GB).mode == "mmap"
    with pytest.raises(UsageError, match="do not fit in the 6.0 GB available"):
        plan("memory", 5 * GB, "cpu", None, 6 * GB)
    with pytest.raises(UsageError, match="every rank"):
        plan("memory", 1 * GB, "cpu", "tp", 20 * GB)
    with pytest.raises(UsageError, match="--weights must be one of auto, mmap, memory, got 'ram'"):
        plan("ram", 1 * GB, "cpu", None, 20 * GB)


def test_mem_available_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   12345678 kB\n")
    assert weights.mem_available(str(meminfo)) == 12345678 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert weights.mem_available(str(meminfo)) is None
    assert weights.mem_available(str(tmp_path / "missing")) is None


def test_load_follows_the_available_memory(monkeypatch, capsys):
    monkeypatch.setattr("ds4.engine.mem_available", lambda: 100 * GB)
    assert ds4.load().weights.plan.mode == "memory"
    assert capsys.readouterr().err == ""        # auto on a small file: the choice is in engine.weights, unprinted
    monkeypatch.setattr("ds4.engine.mem_available", lambda: GB)
    assert ds4.load().weights.plan.mode == "mmap"

    def no_reading(*args, **kwargs):
        raise AssertionError("nothing may be read when memory was asked for and does not fit")
    monkeypatch.setattr(gguf, "read_into_memory", no_reading)
    with pytest.raises(UsageError, match="--weights memory: the model files"):
        ds4.load(weights="memory")


def test_bad_values():
    path = default_model_paths()[0]
    with pytest.raises(UsageError, match="weights='ram'"):
        gguf.open(path, weights="ram")
    with pytest.raises(UsageError, match="--weights must be one of"):
        ds4.load(weights="ram")
    for name in ("generate", "perplexity"):
        with pytest.raises(SystemExit):
            script(name).main(["--weights", "ram"] if name == "generate" else ["m.gguf", "t.txt", "--weights", "ram"])
    from ds4.server.app import parse_args
    assert parse_args(["--weights", "memory"]).weights == "memory"
    with pytest.raises(SystemExit):
        parse_args(["--weights", "ram"])


def read_file(path: Path, threads: int, preadv) -> bytes:
    """The file as read_into_memory reads it on `threads` threads in 4 KB chunks, `os.preadv` replaced by `preadv`."""
    real = os.preadv
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readin, "READ_CHUNK", 4096)
        patch.setattr(os, "preadv", lambda fd, buffers, offset: preadv(real, fd, buffers, offset))
        with open(path, "rb", buffering=0) as fh:
            buf, _ = readin.read_into_memory(fh.fileno(), os.path.getsize(path), path, threads=threads)
    data = bytes(buf)
    buf.close()
    return data


def test_the_threads_read_every_byte():
    """1, 2 and 3 reading threads (the chunks claimed in turn) and reads that return less than asked for all give
    the file's bytes."""
    path = Path(default_model_paths()[0])
    expected, calls = path.read_bytes(), []

    def short_reads(real, fd, buffers, offset):
        calls.append(offset)
        return real(fd, [buffers[0][:1000]], offset)
    for threads in (1, 2, 3):
        assert read_file(path, threads, lambda real, *args: real(*args)) == expected
    assert read_file(path, 2, short_reads) == expected and len(calls) > len(expected) // 1000


@pytest.mark.parametrize("threads", (1, 2))
def test_a_file_cut_short_while_loading_names_file_and_offset(tmp_path, threads):
    """Another process truncates the file to 8192 bytes right after the first read: the error names the file and
    the offset (on several threads, the first chunk in the file that failed; it may start later than 8192)."""
    path = tmp_path / "tiny.gguf"
    shutil.copy(default_model_paths()[0], path)
    size = path.stat().st_size

    def shrinking(real, fd, buffers, offset):
        n = real(fd, buffers, offset)
        os.truncate(path, 8192)
        return n
    with pytest.raises(ModelFileError) as e:
        read_file(path, threads, shrinking)
    offset = "8192" if threads == 1 else r"\d+"
    assert re.match(f"{re.escape(str(path))}: the file ends at offset {offset}, but it had {size} bytes", str(e.value))


@pytest.mark.parametrize("threads", (1, 2))
def test_a_read_error_names_file_and_offset(threads):
    """The third read fails (a disk error): the error names the file and the offset of the read that failed."""
    path, reads = Path(default_model_paths()[0]), []

    def failing(real, fd, buffers, offset):
        reads.append(offset)
        if len(reads) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)
    offset = "8192" if threads == 1 else r"\d+"
    with pytest.raises(ModelFileError, match=f"tiny.gguf: cannot read at offset {offset}: .*output"):
        read_file(path, threads, failing)


def test_only_the_pages_the_read_brought_in_are_dropped(monkeypatch):
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, n, advice: dropped.append((offset, n)), raising=False)
    page = mmap.PAGESIZE
    cached = np.array([1, 1, 0, 0, 1, 0, 0, 0, 1, 0], dtype=bool)     # pages cached before the read
    readin.drop_cache(3, 0, 10 * page, cached)
    assert dropped == [(2 * page, 2 * page), (5 * page, 3 * page), (9 * page, page)]
    dropped.clear()
    readin.drop_cache(3, 5 * page, 7 * page + 1, cached)                # a chunk: its own pages only
    assert dropped == [(5 * page, 3 * page)]
