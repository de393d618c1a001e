"""`--weights` / `ds4.load(weights=...)` / `gguf.open(path, weights=...)`: a model read into anonymous memory
computes what the mapped one does, its tensors live in the copy (not the file), the auto policy, bad values, and a
file cut short while it is read."""
from __future__ import annotations

import errno
import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ds4
from ds4 import weights
from ds4.engine import default_model_paths
from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf
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
    monkeypatch.setattr(gguf, "_read_into_memory", no_reading)
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


class Shrinking(io.FileIO):
    """A file that another process truncates to `keep` bytes right after the first read."""

    keep = 8192

    def readinto(self, buffer) -> int:
        n = super().readinto(buffer)
        os.truncate(self.name, self.keep)
        return n


def test_a_file_cut_short_while_loading_names_file_and_offset(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    shutil.copy(default_model_paths()[0], path)
    size = path.stat().st_size
    monkeypatch.setattr(gguf, "_READ_CHUNK", 4096)
    with Shrinking(path) as fh, pytest.raises(ModelFileError) as e:
        gguf._read_into_memory(fh, size, path)
    assert str(e.value).startswith(f"{path}: the file ends at offset 8192, but it had {size} bytes")


class Failing(io.FileIO):
    """A file whose third read fails (a disk error)."""

    reads = 0

    def readinto(self, buffer) -> int:
        self.reads += 1
        if self.reads == 3:
            raise OSError(errno.EIO, "Input/output error")
        return super().readinto(buffer)


def test_a_read_error_names_file_and_offset(monkeypatch):
    path = default_model_paths()[0]
    monkeypatch.setattr(gguf, "_READ_CHUNK", 4096)
    with Failing(path) as fh, pytest.raises(ModelFileError, match=r"tiny.gguf: cannot read at offset 8192: .*output"):
        gguf._read_into_memory(fh, os.path.getsize(path), Path(path))


def test_only_the_pages_the_read_brought_in_are_dropped(monkeypatch):
    dropped = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, n, advice: dropped.append((offset, n)), raising=False)
    page = gguf.mmap.PAGESIZE
    cached = np.array([1, 1, 0, 0, 1, 0, 0, 0, 1, 0], dtype=bool)     # pages cached before the read
    gguf._drop_cache(3, 0, 10 * page, cached)
    assert dropped == [(2 * page, 2 * page), (5 * page, 3 * page), (9 * page, page)]
    dropped.clear()
    gguf._drop_cache(3, 5 * page, 7 * page + 1, cached)                # a chunk: its own pages only
    assert dropped == [(5 * page, 3 * page)]
