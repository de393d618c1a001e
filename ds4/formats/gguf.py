"""GGUF files: open (memory-mapped or read into memory, bounded parse, zero-copy QTensor views) and write (atomic,
via gguf.GGUFWriter)."""
from __future__ import annotations

import builtins
import glob
import math
import mmap
import os
import signal
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ds4.errors import ModelFileError, UsageError
from ds4.formats.readin import MAP_NORESERVE, read_into_memory
from models.args import METADATA_KEYS, PREFIX
from ops import quants
from ops.quants import QTensor

# The hyperparameter keys of the main model (docs/model.md §1); the model validates their values.
DS4_KEYS: tuple[str, ...] = tuple(PREFIX + key for key in METADATA_KEYS.values())
DS4_OPTIONAL_KEYS: tuple[str, ...] = ("deepseek4.expert_group_count", "deepseek4.expert_group_used_count")

VT = gguf.GGUFValueType
_NUMPY_TYPES = {VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4", VT.INT32: "<i4",
                VT.FLOAT32: "<f4", VT.UINT64: "<u8", VT.INT64: "<i8", VT.FLOAT64: "<f8", VT.BOOL: "?"}
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
# How `open` holds a file: "mmap" maps it (pages come from the shared page cache as they are touched); "memory"
# reads it into one private anonymous mapping with transparent huge pages, which this project's kernels read
# faster (docs/cpu.md "Weights in memory"; llama.cpp's --no-mmap).
WEIGHTS = ("mmap", "memory")
LARGE_FILE = 1 << 30  # reading a file this large into memory shows a progress bar (on a terminal)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: GGUF type name, PyTorch-order shape ([out, in]; experts (E, out, in)), bytes, file offset."""

    name: str
    type: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


class _Cursor:
    """Bounded little-endian reads over a buffer; every read checks the bytes left first."""

    def __init__(self, buf: Any, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, msg: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {msg}")

    def left(self) -> int:
        return self.size - self.pos

    def skip(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.fail(f"truncated: {what} needs {n} bytes at offset {self.pos}, only {self.left()} left")
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack_from(fmt, self.buf, self.skip(struct.calcsize(fmt), what))[0]

    def text(self, what: str) -> str:
        n = self.unpack("<Q", f"length of {what}")
        try:
            return self.buf[self.skip(n, what):self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def values(self, vtype: VT, n: int, what: str) -> list:
        dtype = np.dtype(_NUMPY_TYPES[vtype])
        return np.frombuffer(self.buf, dtype, n, self.skip(n * dtype.itemsize, what)).tolist()

    def value_type(self, what: str) -> VT:
        raw = self.unpack("<I", f"value type of {what}")
        try:
            return VT(raw)
        except ValueError:
            raise self.fail(f"{what}: unknown value type {raw}") from None


def _read_value(cur: _Cursor, key: str, vtype: VT) -> Any:
    """One KV value as a plain python value, every declared length checked against the bytes left."""
    if vtype == VT.STRING:
        return cur.text(f"value of {key}")
    if vtype != VT.ARRAY:
        return cur.values(vtype, 1, f"value of {key}")[0]
    itype = cur.value_type(f"elements of {key}")
    n = cur.unpack("<Q", f"length of {key}")
    if itype == VT.ARRAY:
        raise cur.fail(f"{key}: nested arrays are not supported")
    if n * (8 if itype == VT.STRING else np.dtype(_NUMPY_TYPES[itype]).itemsize) > cur.left():
        raise cur.fail(f"{key}: array of {n} elements cannot fit in the {cur.left()} bytes left")
    if itype == VT.STRING:
        return [cur.text(f"{key}[{i}]") for i in range(n)]
    return cur.values(itype, n, f"values of {key}")


def _parse(buf: Any, path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """Metadata and tensor table, bounding every count, length, dim and offset by the file size."""
    cur = _Cursor(buf, path)
    if cur.size < 4 or buf[:4] != b"GGUF":
        raise cur.fail("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise cur.fail(f"unsupported GGUF version {version} (little-endian version 2 or 3 expected)")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "key/value count")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > cur.left():
        raise cur.fail(f"declares {n_kv} keys and {n_tensors} tensors, more than the {cur.left()} bytes left hold")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.text(f"key #{i}")
        if key in metadata:
            raise cur.fail(f"duplicate key {key}")
        vtype = cur.value_type(key)
        value = metadata[key] = _read_value(cur, key, vtype)
        if key == "general.alignment" and (vtype != VT.UINT32 or not value or value & (value - 1)):
            raise cur.fail("general.alignment must be a non-zero power of two stored as UINT32")
    entries = {}
    for i in range(n_tensors):
        name = cur.text(f"name of tensor #{i}")
        if name in entries:
            raise cur.fail(f"duplicate tensor {name}")
        n_dims = cur.unpack("<I", f"dim count of tensor {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name}: {n_dims} dims (1 to {_MAX_DIMS} allowed)")
        dims = [cur.unpack("<Q", f"dims of tensor {name}") for _ in range(n_dims)]
        type_id = cur.unpack("<I", f"type of tensor {name}")
        entries[name] = (dims, type_id, cur.unpack("<Q", f"offset of tensor {name}"))
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, (dims, type_id, offset) in entries.items():
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name}: unknown quant type id {type_id}") from None
        if min(dims) < 1 or dims[0] % block_size:
            raise cur.fail(f"tensor {name}: bad dims {dims} (each >= 1, first a multiple of {block_size})")
        nbytes = math.prod(dims) // block_size * type_size
        if offset % alignment:
            raise cur.fail(f"tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > cur.size:
            raise cur.fail(f"tensor {name}: data ends at byte {data_start + offset + nbytes}, "
                           f"past the end of the file ({cur.size} bytes)")
        tensors[name] = TensorInfo(name, ggml_type.name, tuple(reversed(dims)), nbytes, data_start + offset)
    _check_overlaps(cur, tensors)
    return metadata, tensors


def _check_overlaps(cur: _Cursor, tensors: dict[str, TensorInfo]) -> None:
    """Refuse tensors whose data share bytes with another's (a crafted file could alias weights)."""
    spans = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:], strict=False):
        if b.offset < a.offset + a.nbytes:
            raise cur.fail(f"tensor {b.name}: data at byte {b.offset} overlaps tensor {a.name} "
                           f"(bytes {a.offset} to {a.offset + a.nbytes})")


class GGUFFile:
    """An open GGUF file: `metadata`, `tensors` (name -> TensorInfo) and zero-copy `raw` views of the blocks."""

    metadata: dict[str, Any]  # key -> int, float, bool, str or a list of them
    tensors: dict[str, TensorInfo]

    weights: str  # "mmap" or "memory" (WEIGHTS)
    huge_pages: bool  # read into memory with transparent huge pages advised (and accepted by the kernel)

    def __init__(self, path: str | os.PathLike[str], weights: str = "mmap"):
        if weights not in WEIGHTS:
            raise UsageError(f"weights={weights!r}: choose one of {', '.join(WEIGHTS)}")
        self.path, self.weights, self.huge_pages = Path(path), weights, False
        try:
            with builtins.open(self.path, "rb", buffering=0) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    raise ModelFileError(f"{self.path}: not a GGUF file (bad magic: the file is empty)")
                if weights == "memory":
                    self._map, self.huge_pages = read_into_memory(fh.fileno(), size, self.path, size >= LARGE_FILE)
                else:
                    self._map = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE | MAP_NORESERVE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open: {e}") from None
        self.metadata, self.tensors = _parse(self._map, self.path)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # writable private mapping: no copy, no warning

    @property
    def architecture(self) -> str | None:
        """The file's `general.architecture`, or None when it has none."""
        return self.metadata.get("general.architecture")

    def raw(self, name: str) -> QTensor:
        """Tensor `name` as a QTensor whose data is a zero-copy uint8 `[..., out, row_bytes]` view of the file's
        mapping or of its copy in memory."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: no tensor named {name}")
        qtype = quants.BY_GGML.get(int(gguf.GGMLQuantizationType[info.type]))
        if qtype is None:
            raise ModelFileError(f"{self.path}: tensor {name} has type {info.type}, which ds4py cannot read "
                                 f"(known: {', '.join(quants.TYPES) or 'none'})")
        data = self._bytes[info.offset:info.offset + info.nbytes]
        return QTensor(qtype, info.shape, data.view(*info.shape[:-1], qtype.row_bytes(info.shape[-1])), name)

    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor `name` as float32 with its PyTorch-order shape."""
        return self.raw(name).dequantize()


def open(path: str | os.PathLike[str], weights: str = "mmap") -> GGUFFile:
    """Open and validate a GGUF file, mapped (`weights="mmap"`) or read into anonymous memory ("memory");
    raises ModelFileError naming the file and the bad key/tensor."""
    return GGUFFile(path, weights)


def check_architecture(f: GGUFFile, expected: str = "deepseek4", keys: tuple[str, ...] = DS4_KEYS) -> None:
    """Raise ModelFileError unless `f` declares architecture `expected` and has every key in `keys`."""
    if f.architecture != expected:
        raise ModelFileError(f"{f.path}: general.architecture is {f.architecture!r}, expected {expected!r}")
    missing = [k for k in keys if k not in f.metadata]
    if missing:
        raise ModelFileError(f"{f.path}: missing metadata keys: {', '.join(missing)}")


def _int_type(values: list[int], key: str) -> VT:
    """UINT32 / INT32 when every value fits, else UINT64 / INT64."""
    lo, hi = min(values), max(values)
    if lo >= 0:
        if hi < 2**32:
            return VT.UINT32
        if hi < 2**64:
            return VT.UINT64
    elif -2**31 <= lo and hi < 2**31:
        return VT.INT32
    elif -2**63 <= lo and hi < 2**63:
        return VT.INT64
    raise UsageError(f"metadata {key}: integer out of the 64-bit range")


def _value_type(key: str, values: list[Any]) -> VT:
    """The GGUF scalar type for values that must all share one python type."""
    kinds = {type(v) for v in values}
    if kinds == {bool}:
        return VT.BOOL
    if kinds == {int}:
        return VT.INT32 if key == "tokenizer.ggml.token_type" else _int_type(values, key)
    if kinds <= {int, float} and float in kinds:
        return VT.FLOAT32
    if kinds == {str}:
        return VT.STRING
    raise UsageError(f"metadata {key}: unsupported value types {sorted(k.__name__ for k in kinds)}")


def _add_metadata(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        if not value:
            raise UsageError(f"metadata {key}: empty lists have no GGUF element type")
        sub = _value_type(key, list(value))
        values = [float(v) for v in value] if sub == VT.FLOAT32 else list(value)
        writer.add_key_value(key, values, VT.ARRAY, sub_type=sub)
    else:
        vtype = _value_type(key, [value])
        writer.add_key_value(key, float(value) if vtype == VT.FLOAT32 else value, vtype)


_TORCH_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32"}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor produced only when its turn to be written comes: GGUF type name, PyTorch-order shape, producer."""

    type: str
    shape: tuple[int, ...]
    produce: Callable[[], QTensor | torch.Tensor]


Tensor = QTensor | torch.Tensor | LazyTensor


def _type_and_shape(name: str, t: Any) -> tuple[str, tuple[int, ...]]:
    """The GGUF type name and shape a QTensor, torch tensor or LazyTensor declares."""
    if isinstance(t, LazyTensor):
        return t.type, tuple(t.shape)
    if isinstance(t, QTensor):
        return t.qtype.name, tuple(t.shape)
    if isinstance(t, torch.Tensor):
        if t.dtype not in _TORCH_TYPES or t.dim() == 0:
            raise UsageError(f"tensor {name}: {t.dtype} {tuple(t.shape)} cannot be stored "
                             "(F32/F16/BF16/I32 with at least one dim)")
        return _TORCH_TYPES[t.dtype], tuple(t.shape)
    raise UsageError(f"tensor {name}: a {type(t).__name__} is not a QTensor, torch.Tensor or LazyTensor")


def _layout(name: str, type_name: str, shape: tuple[int, ...]) -> tuple[gguf.GGMLQuantizationType, tuple[int, ...]]:
    """The GGUF type and the stored uint8 shape `[..., out, row_bytes]` of a tensor of `type_name` and `shape`."""
    qtype = quants.TYPES.get(type_name)
    if qtype is None or qtype.ggml_type is None:
        raise UsageError(f"tensor {name}: quant type {type_name} cannot be stored in a GGUF")
    if not 1 <= len(shape) <= _MAX_DIMS or min(shape) < 1:
        raise UsageError(f"tensor {name}: shape {shape} (1 to {_MAX_DIMS} dims, each >= 1)")
    try:
        row_bytes = qtype.row_bytes(shape[-1])
    except ValueError as e:
        raise UsageError(f"tensor {name}: {e}") from None
    return gguf.GGMLQuantizationType(qtype.ggml_type), (*shape[:-1], row_bytes)


def _as_blocks(name: str, t: Any, declared: tuple[str, tuple[int, ...]], byte_shape: tuple[int, ...]) -> np.ndarray:
    """The bytes to store of tensor `name`, checked against its declared type, shape and stored shape."""
    if isinstance(t, LazyTensor):
        raise UsageError(f"tensor {name}: its producer returned a LazyTensor, not a QTensor or torch.Tensor")
    got = _type_and_shape(name, t)
    if got != declared:
        raise UsageError(f"tensor {name}: produced {got[0]} {got[1]}, declared {declared[0]} {declared[1]}")
    data = t.data if isinstance(t, QTensor) else t.detach().contiguous().view(torch.uint8)
    if data.dtype != torch.uint8 or tuple(data.shape) != byte_shape:
        raise UsageError(f"tensor {name}: data is {data.dtype} {tuple(data.shape)}, expected uint8 {byte_shape}")
    return data.cpu().contiguous().numpy()


def _write_data(writer: gguf.GGUFWriter, name: str, t: Tensor, declared: tuple[str, tuple[int, ...]],
                byte_shape: tuple[int, ...]) -> None:
    """Produce tensor `name` if lazy and append its bytes; nothing of it stays referenced after the return."""
    writer.write_tensor_data(_as_blocks(name, t.produce() if isinstance(t, LazyTensor) else t, declared, byte_shape))


def write(path: str | os.PathLike[str], metadata: dict[str, Any], tensors: dict[str, Tensor], *,
          architecture: str = "deepseek4", alignment: int = 32,
          progress: Callable[[Iterable], Iterable] = lambda items: items) -> None:
    """Write a GGUF atomically (temp file + rename): QTensors as their raw blocks, torch tensors by dtype.

    A LazyTensor is produced only when its data is written and dropped right after, so with lazy tensors
    at most one tensor's data is in memory at a time. `progress` wraps the (name, tensor) items as they
    are written, e.g. with tqdm.
    """
    path = Path(path)
    meta = dict(metadata)
    if meta.pop("general.architecture", architecture) != architecture:
        raise UsageError(f"metadata general.architecture disagrees with architecture={architecture!r}")
    if meta.pop("general.alignment", alignment) != alignment:
        raise UsageError(f"metadata general.alignment disagrees with alignment={alignment}")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; give a file path to write")
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same folder, so the rename is atomic
    writer = gguf.GGUFWriter(tmp, architecture)
    restore = _raise_on_termination()
    try:
        try:
            writer.add_custom_alignment(alignment)
        except ValueError as e:
            raise UsageError(f"alignment={alignment}: {e}") from None
        for key, value in meta.items():
            _add_metadata(writer, key, value)
        layouts = {}
        for name, t in tensors.items():
            declared = _type_and_shape(name, t)
            ggml_type, byte_shape = _layout(name, *declared)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=ggml_type)
            layouts[name] = declared, byte_shape
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, t in progress(tensors.items()):
            _write_data(writer, name, t, *layouts[name])
        writer.close()
        with builtins.open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        restore()


_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def _raise_on_termination() -> Callable[[], None]:
    """While a write runs, SIGTERM/SIGHUP raise SystemExit(128 + signal) in the main thread, so the write's
    cleanup removes its temp file before the process ends. Returns the function restoring the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = {}
    for sig in _TERMINATING:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):  # keep a handler the application installed
            old[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, previous in old.items():
            signal.signal(sig, previous)
    return restore


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or not a pid we can test: leave its file alone
    return True


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove temp files `.NAME.PID.tmp` that a write of `path` by a process no longer alive left behind
    (a SIGKILL skips every cleanup); returns the removed paths."""
    removed = []
    prefix = f".{path.name}."
    try:
        candidates = list(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))
    except OSError:
        return removed
    for tmp in candidates:
        pid = tmp.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed
