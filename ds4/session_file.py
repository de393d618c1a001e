"""Session files: a session's whole state on disk, so a sequence outlives its process (`Session.save`/`load`).

A session file is a safetensors file: the tensors (tokens, last logits, kept output states, and per layer the
raw window ring, the compressed rows written so far, the compressor and indexer rings) plus one JSON header in
the safetensors metadata under `ds4py.session` (format version, the model's layout, ctx, prefill chunk,
positions and counters, and a SHA-256 over the header and every tensor). The rings are stored whole, so a
loaded session continues bit for bit like the one saved; only the compressed rows beyond those written are
left out, which makes the file grow with the tokens held rather than with the context (docs/api.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from backends.cpu.repack import REPACKED, layout_of
from ds4.errors import SessionFileError, UsageError
from ds4.formats.gguf import _raise_on_termination, remove_stale_temps
from ops.quants import QTensor

FORMAT = "ds4py-session"
VERSION = 1
METADATA_KEY = "ds4py.session"
CACHE_FIELDS = ("comp_kv", "comp_score", "index_kv", "index_score")  # rings stored whole
HEADER_FIELDS = {"layout": dict, "model_id": str | None, "ctx": int, "prefill_chunk": int, "n_tokens": int,
                 "mtp_from": int, "high_water": int, "n_drafted": int, "counters": dict, "recent": dict}


def tensor_types(root: Any) -> str:
    """SHA-256 of every quantized weight's name, quant type and shape reachable from a model or MTP head; a weight
    repacked at load (backends/cpu/repack.py: the stored bytes in another layout) counts as its stored type, so a
    session saved under `--weights memory --cpu-dot q8` loads in a mapped or exact run and the other way round."""
    seen, found, todo = set(), [], [vars(root)]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, QTensor):
            found.append(f"{item.name}:{item.qtype.name}:{tuple(item.shape)}")
        elif type(item) in REPACKED:
            found.append(f"{item.name}:{layout_of(item).qtype}:{tuple(item.shape)}")
        elif isinstance(item, dict):
            todo.extend(v for k, v in item.items() if k not in ("trunk", "ops"))
        elif isinstance(item, list | tuple):
            todo.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            todo.extend(getattr(item, f.name) for f in dataclasses.fields(item))
    return hashlib.sha256("\n".join(sorted(found)).encode()).hexdigest()


def layout(model, mtp) -> dict[str, Any]:
    """The model layout a file is valid for: every hyperparameter and switch, and the tensor-type fingerprints."""
    return {"args": json.loads(json.dumps(dataclasses.asdict(model.args))),
            "tensor_types": tensor_types(model), "mtp_tensor_types": tensor_types(mtp) if mtp else None}


@dataclass
class SavedSession:
    """A session file read and verified: its JSON header and its tensors (on the host)."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def n_tokens(self) -> int:
        """Tokens the saved session held."""
        return self.header["n_tokens"]

    def check(self, model, mtp, ctx: int, prefill_chunk: int, model_id: str | None, path: str) -> None:
        """SessionFileError when this file cannot continue on `model`/`mtp` with this context and chunk."""
        theirs, ours = self.header["layout"], layout(model, mtp)
        for key in sorted(theirs["args"].keys() | ours["args"].keys()):
            if theirs["args"].get(key) != ours["args"].get(key):
                raise SessionFileError(f"{path}: saved for another model layout ({key} = "
                                       f"{theirs['args'].get(key)!r}, this model has {ours['args'].get(key)!r})")
        if theirs["tensor_types"] != ours["tensor_types"]:
            raise SessionFileError(f"{path}: saved for a model with other tensor types (fingerprint "
                                   f"{theirs['tensor_types'][:12]}, this model {ours['tensor_types'][:12]})")
        if mtp and theirs["mtp_tensor_types"] not in (None, ours["mtp_tensor_types"]):
            raise SessionFileError(f"{path}: saved with another MTP head (fingerprint "
                                   f"{theirs['mtp_tensor_types'][:12]}, this one {ours['mtp_tensor_types'][:12]})")
        saved_id = self.header["model_id"]
        if saved_id and model_id and saved_id != model_id:
            raise SessionFileError(f"{path}: saved from another model file (id {saved_id[:12]}, "
                                   f"this model {model_id[:12]})")
        if ctx <= self.n_tokens:
            raise SessionFileError(f"{path}: holds {self.n_tokens} tokens, more than a context of {ctx} can "
                                   "continue; load it with a larger ctx (--ctx)")
        if prefill_chunk != self.header["prefill_chunk"]:
            raise SessionFileError(f"{path}: saved with prefill chunk {self.header['prefill_chunk']}, this session "
                                   f"uses {prefill_chunk}; the rings are laid out per chunk (--prefill-chunk)")

    def apply(self, session) -> None:
        """Put the saved state into a fresh `session` of the layout `check` accepted."""
        h, t, ops = self.header, self.tensors, session.model.ops
        session.tokens = t["tokens"].tolist()
        session.high_water, session.n_drafted = h["high_water"], h["n_drafted"]
        session.counters = Counter(h["counters"])
        session.trunk_tail = ops.array(t["trunk_tail"], "float32") if "trunk_tail" in t else None
        session.logits_at = {session.pos - 1: t["logits"]} if "logits" in t else {}
        session.recent = {kind: (h["recent"][kind], ops.array(t[f"recent.{kind}"], "float32"))
                          if h["recent"].get(kind) is not None else None for kind in ("trunk", "mtp")}
        for i, cache in enumerate(session.caches):
            self._fill(f"blk.{i}", cache, session.pos, ops)
        if session.mtp is None:
            return
        if h["layout"]["mtp_tensor_types"] is None:  # saved without an MTP head: its window restarts here
            session.mtp_from, session.mtp_tail, session.recent["mtp"] = session.pos, None, None
            return
        session.mtp_from = h["mtp_from"]
        session.mtp_tail = ops.array(t["mtp_tail"], "float32") if "mtp_tail" in t else None
        self._fill("mtp", session.mtp_cache, session.pos, ops)

    def _fill(self, name: str, cache, pos: int, ops) -> None:
        """One layer's cache: the raw ring and the rings whole, the compressed rows written so far."""
        t = self.tensors
        rows = ops.to_torch(cache.rows).detach().cpu().clone()
        self._place(rows, 0, t[f"{name}.raw"], name)
        if cache.ratio:
            self._place(rows, cache.raw_cap, t[f"{name}.comp"], name)
        cache.rows = ops.array(rows, "float32")
        if cache.index_rows is not None:
            index = ops.to_torch(cache.index_rows).detach().cpu().clone()
            self._place(index, 0, t[f"{name}.index_comp"], name)
            cache.index_rows = ops.array(index, "float32")
        for field in CACHE_FIELDS:
            if getattr(cache, field) is not None:
                ring = t[f"{name}.{field}"]
                if tuple(ring.shape) != tuple(getattr(cache, field).shape):
                    raise SessionFileError(f"{name}.{field}: shape {tuple(ring.shape)}, expected "
                                           f"{tuple(getattr(cache, field).shape)}")
                setattr(cache, field, ops.array(ring, "float32"))

    @staticmethod
    def _place(target: torch.Tensor, at: int, rows: torch.Tensor, name: str) -> None:
        """Copy `rows` into `target` from row `at`, refusing a shape that does not fit."""
        if rows.dim() != 2 or rows.shape[1] != target.shape[1] or at + rows.shape[0] > target.shape[0]:
            raise SessionFileError(f"{name}: saved rows of shape {tuple(rows.shape)} do not fit the cache "
                                   f"{tuple(target.shape)}")
        target[at:at + rows.shape[0]] = rows


def checksum(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the header (without its checksum) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def state(session, model_id: str | None) -> SavedSession:
    """The header and host tensors of `session` (copies: the session may go on), ready to `write`."""
    ops, pos = session.model.ops, session.pos

    def host(x) -> torch.Tensor:  # an own copy: safetensors refuses tensors that share memory
        return ops.to_torch(x).detach().to("cpu", torch.float32).clone()

    tensors = {"tokens": torch.tensor(session.tokens, dtype=torch.int64)}
    logits = session.last_logits
    if logits is not None:
        tensors["logits"] = host(logits)
    for kind in ("trunk", "mtp"):
        tail = session.trunk_tail if kind == "trunk" else session.mtp_tail
        if tail is not None:
            tensors[f"{kind}_tail"] = host(tail)
        if session.recent[kind] is not None:
            tensors[f"recent.{kind}"] = host(session.recent[kind][1])
    caches = [(f"blk.{i}", c) for i, c in enumerate(session.caches)]
    for name, cache in caches + ([("mtp", session.mtp_cache)] if session.mtp else []):
        tensors[f"{name}.raw"] = host(cache.rows[:cache.raw_cap])
        if cache.ratio:
            tensors[f"{name}.comp"] = host(cache.rows[cache.raw_cap:cache.raw_cap + pos // cache.ratio])
        if cache.index_rows is not None:
            tensors[f"{name}.index_comp"] = host(cache.index_rows[:pos // cache.ratio])
        for field in CACHE_FIELDS:
            if getattr(cache, field) is not None:
                tensors[f"{name}.{field}"] = host(getattr(cache, field))
    header = {"format": FORMAT, "version": VERSION, "layout": layout(session.model, session.mtp),
              "model_id": model_id, "ctx": session.ctx, "prefill_chunk": session.prefill_chunk, "n_tokens": pos,
              "mtp_from": session.mtp_from, "high_water": session.high_water, "n_drafted": session.n_drafted,
              "counters": dict(session.counters),
              "recent": {k: v[0] if v is not None else None for k, v in session.recent.items()}}
    header["checksum"] = checksum(header, tensors)
    return SavedSession(header, tensors)


def save(session, path: str | os.PathLike[str], model_id: str | None = None) -> Path:
    """Write `session` to `path` atomically (see `write`). Returns the path."""
    return write(path, state(session, model_id))


def write(path: str | os.PathLike[str], saved: SavedSession) -> Path:
    """Write a session's `state` to `path` atomically (temp file in the same folder + rename; SIGTERM/SIGHUP
    remove the temp file); an unwritable place raises OSError for the caller to report. Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; give a file path to save the session to")
    remove_stale_temps(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    restore = _raise_on_termination()
    try:
        safetensors.torch.save_file(saved.tensors, tmp, metadata={METADATA_KEY: json.dumps(saved.header)})
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        restore()
    return path


def read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a session file, without reading its tensors or checking them (see `read`)."""
    try:
        with safetensors.safe_open(path, "pt") as f:
            header = json.loads((f.metadata() or {})[METADATA_KEY])
    except (safetensors.SafetensorError, OSError, ValueError, KeyError, RuntimeError) as e:
        raise SessionFileError(f"{path}: not a readable session file ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{path}: not a ds4py session file")
    return header


def read(path: str | os.PathLike[str]) -> SavedSession:
    """A session file read and verified (format, version, checksum), else one SessionFileError naming it."""
    if not Path(path).is_file():
        raise SessionFileError(f"{path}: no such session file")
    try:
        with safetensors.safe_open(path, "pt") as f:
            text = (f.metadata() or {}).get(METADATA_KEY)
        tensors = safetensors.torch.load_file(path)
    except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SessionFileError(f"{path}: not a readable session file, truncated or damaged "
                               f"({str(e).splitlines()[0][:100]})") from None
    if text is None:
        raise SessionFileError(f"{path}: a safetensors file without a ds4py session header")
    try:
        header = json.loads(text)
    except json.JSONDecodeError:
        raise SessionFileError(f"{path}: the session header is not valid JSON (damaged)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SessionFileError(f"{path}: not a ds4py session file")
    if header.get("version") != VERSION:
        raise SessionFileError(f"{path}: session file version {header.get('version')!r}, this ds4py reads "
                               f"version {VERSION}")
    if header.get("checksum") != checksum(header, tensors):
        raise SessionFileError(f"{path}: checksum mismatch: the file is damaged")
    for name, kind in HEADER_FIELDS.items():
        if not isinstance(header.get(name), kind) or isinstance(header.get(name), bool):
            raise SessionFileError(f"{path}: header field {name!r} is missing or not {kind}")
    tokens = tensors.get("tokens")
    if tokens is None or tokens.dtype != torch.int64 or tuple(tokens.shape) != (header["n_tokens"],):
        raise SessionFileError(f"{path}: the tokens tensor is missing or does not hold n_tokens ids")
    return SavedSession(header, tensors)
