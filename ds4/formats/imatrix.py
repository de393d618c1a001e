"""Importance-matrix files, as llama.cpp's `llama-imatrix` writes and `llama-quantize --imatrix` reads them.

The GGUF format (llama.cpp #9400, the default): `general.type = "imatrix"`, `imatrix.datasets` (strings),
`imatrix.chunk_count`, `imatrix.chunk_size`, and per weight `NAME.in_sum2` (F32 `[n_mat, n_in]`: the sum of
x*x over every row x fed to that matrix, one row of sums per expert for a stacked `[E, out, in]` weight) and
`NAME.counts` (F32 `[n_mat, 1]`: how many rows each matrix saw). The importance of column j is
`in_sum2 / counts`. The legacy `.dat` format (read here, not written) holds per entry a name, a call
count and the already averaged values scaled by that count.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

from ds4.errors import ModelFileError

_SUMS, _COUNTS = ".in_sum2", ".counts"


@dataclass
class Entry:
    """One weight's statistics: `sums` float64 `[n_mat, n_in]` of x*x and `counts` `[n_mat]` rows seen."""

    sums: torch.Tensor
    counts: torch.Tensor

    def importance(self) -> torch.Tensor:
        """Mean squared activation per input column, float32 `[n_mat, n_in]` (1 where a matrix saw no row)."""
        seen = self.counts[:, None] > 0
        mean = self.sums / self.counts.clamp(min=1)[:, None]
        return torch.where(seen, mean, torch.ones_like(mean)).to(torch.float32)


@dataclass
class Imatrix:
    """The entries by weight name, the datasets they came from, and the chunking of the run."""

    entries: dict[str, Entry] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def add(self, name: str, x: torch.Tensor, matrix: int = 0, n_mat: int = 1) -> None:
        """Accumulate rows `x` `[rows, n_in]` fed to matrix `matrix` of weight `name`, which has at least `n_mat`
        matrices (experts, or row groups fed different inputs; the entry grows to the largest seen)."""
        x = x.detach().to("cpu", torch.float64).reshape(-1, x.shape[-1])
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry(torch.zeros(0, x.shape[-1], dtype=torch.float64),
                                           torch.zeros(0, dtype=torch.int64))
        if e.sums.shape[1] != x.shape[-1]:
            raise ValueError(f"imatrix entry {name}: rows of {x.shape[-1]} values, the entry holds {e.sums.shape[1]}")
        grow = max(n_mat, matrix + 1) - e.sums.shape[0]
        if grow > 0:
            e.sums = torch.cat([e.sums, e.sums.new_zeros(grow, e.sums.shape[1])])
            e.counts = torch.cat([e.counts, e.counts.new_zeros(grow)])
        e.sums[matrix] += (x * x).sum(0)
        e.counts[matrix] += x.shape[0]

def write(path: str | os.PathLike[str], im: Imatrix) -> None:
    """Write `im` in llama.cpp's GGUF imatrix format, atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, "imatrix")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama-imatrix's files carry no architecture
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array(gguf.Keys.IMatrix.DATASETS, im.datasets)
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, im.chunk_count)
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, im.chunk_size)
    for name in sorted(im.entries):
        e = im.entries[name]
        writer.add_tensor(name + _SUMS, e.sums.to(torch.float32).numpy())
        writer.add_tensor(name + _COUNTS, e.counts.to(torch.float32).reshape(-1, 1).numpy())
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def read(path: str | os.PathLike[str]) -> Imatrix:
    """Read an imatrix file of either format (GGUF, or llama.cpp's legacy `.dat`); ModelFileError if neither."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot open the imatrix: {e}") from None
    try:
        return _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)
    except (ValueError, struct.error, IndexError, KeyError) as e:
        raise ModelFileError(f"{path}: not a readable imatrix file ({e})") from None


def _field(r: gguf.GGUFReader, key: str, default):
    f = r.get_field(key)
    return default if f is None else f.contents()


def _read_gguf(path: Path) -> Imatrix:
    r = gguf.GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}
    im = Imatrix(datasets=list(_field(r, gguf.Keys.IMatrix.DATASETS, [])),
                 chunk_count=int(_field(r, gguf.Keys.IMatrix.CHUNK_COUNT, 0)),
                 chunk_size=int(_field(r, gguf.Keys.IMatrix.CHUNK_SIZE, 0)))
    for tname, t in tensors.items():
        if not tname.endswith(_SUMS):
            continue
        name = tname.removesuffix(_SUMS)
        counts = tensors.get(name + _COUNTS)
        if counts is None:
            raise ModelFileError(f"{path}: {tname} has no {name + _COUNTS}")
        c = torch.from_numpy(np.array(counts.data, dtype=np.float32)).reshape(-1).round().to(torch.int64)
        sums = torch.from_numpy(np.array(t.data, dtype=np.float64)).reshape(len(c), -1)
        im.entries[name] = Entry(sums, c)
    if not im.entries:
        raise ModelFileError(f"{path}: an imatrix GGUF without any .in_sum2 tensor")
    return im


def _read_legacy(path: Path) -> Imatrix:
    buf = path.read_bytes()
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        out = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return out

    (n,) = take("<i")
    if n < 1:
        raise ValueError("no entries")
    im = Imatrix()
    for _ in range(n):
        (length,) = take("<i")
        name = buf[pos:pos + length].decode()
        pos += length
        ncall, nval = take("<ii")
        if nval < 1 or pos + 4 * nval > len(buf):
            raise ValueError(f"entry {name}: {nval} values")
        values = torch.from_numpy(np.frombuffer(buf, "<f4", nval, pos).astype(np.float64))
        pos += 4 * nval
        im.entries[name] = Entry(values.reshape(1, -1), torch.tensor([ncall]))
    if pos + 4 <= len(buf):
        (im.chunk_count,) = take("<i")
        if pos + 4 <= len(buf):
            (length,) = take("<i")
            im.datasets.append(buf[pos:pos + length].decode())
    return im
