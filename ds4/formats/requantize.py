"""Requantize a V4 GGUF of either layout into a tensor-type mix: llama.cpp's named mixes (Q4_K_M, Q8_0, ...),
ds4's (q2, q4, f32) or explicit rules (`ffn_down_exps=Q6_K,attn_*=Q8_0,*=Q4_K`), optionally guided by an
importance matrix. Names and metadata are kept, so the output has the input's layout. docs/quantization.md.
"""
from __future__ import annotations

import fnmatch
import inspect
import math
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import gguf as gguf_py
import torch

from ds4.errors import UsageError
from ds4.formats import gguf, imatrix, layouts, llamacpp_mix, quant_mix
from ops import quants
from ops.quants import QTensor

_GGML_NAMES = {t.name for t in gguf_py.GGMLQuantizationType}
_UNTOUCHED = ("token_embd.weight", "output.weight")  # llama.cpp never asks an imatrix for these


@dataclass(frozen=True)
class Mix:
    """A parsed `--mix`: `kind` llama.cpp | ds4 | rules, the mix `name` (the text for rules) and the rules."""

    kind: str
    name: str
    rules: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Choice:
    """What happens to one tensor: its stored type, the type written, and why it differs from the mix's pick."""

    name: str
    shape: tuple[int, ...]
    stored: str
    target: str
    note: str = ""


@dataclass(frozen=True)
class Result:
    """A written file: its tensors' bytes and values, bits per weight, and the per-tensor choices."""

    path: Path
    tensor_bytes: int
    n_values: int
    choices: tuple[Choice, ...]

    @property
    def bits_per_weight(self) -> float:
        """Tensor bytes x 8 / values, over every tensor of the file."""
        return 8 * self.tensor_bytes / max(self.n_values, 1)


def _type_name(text: str, where: str) -> str:
    name = text.strip().upper()
    if name not in _GGML_NAMES:
        raise UsageError(f"{where}: unknown tensor type {text.strip()!r}; "
                         f"ggml's types: {', '.join(sorted(_GGML_NAMES))}")
    return name


def parse_mix(spec: str) -> Mix:
    """`spec` as a Mix: a ds4 mix (q2, q4, f32), a llama.cpp mix name (any case), or `PATTERN=TYPE,...` rules."""
    spec = spec.strip()
    if "=" in spec:
        rules = []
        for item in spec.split(","):
            pattern, sep, type_text = item.partition("=")
            if not sep or not pattern.strip():
                raise UsageError(f"--mix rule {item!r}: expected PATTERN=TYPE, e.g. ffn_down_exps=Q6_K")
            rules.append((pattern.strip(), _type_name(type_text, f"--mix rule {item!r}")))
        return Mix("rules", spec, tuple(rules))
    if spec in quant_mix.MIXES:
        return Mix("ds4", spec)
    if spec.upper() in llamacpp_mix.MIXES:
        return Mix("llama.cpp", spec.upper())
    raise UsageError(f"unknown --mix {spec!r}: give a llama.cpp mix ({', '.join(llamacpp_mix.MIXES)}), "
                     f"a ds4 mix ({', '.join(quant_mix.MIXES)}) or rules like ffn_down_exps=Q6_K,*=Q4_K")


def _rule_type(mix: Mix, name: str) -> str | None:
    """The type of the first rule whose pattern matches the tensor's name, its name without `.weight`, or its role."""
    short = name.removesuffix(".weight")
    for pattern, type_name in mix.rules:
        if any(fnmatch.fnmatchcase(n, pattern) for n in (name, short, quant_mix.role(name))):
            return type_name
    return None


def _n_layer(f: gguf.GGUFFile) -> int:
    layers = [llamacpp_mix.layer_of(n, 0) for n in f.tensors if n.startswith("blk.")]
    return max(layers, default=-1) + 1


def _n_expert(f: gguf.GGUFFile) -> int:
    """The routed expert count (the first dimension of a `ffn_*_exps` tensor; 0 without one)."""
    return next((tuple(t.shape)[0] for n, t in f.tensors.items() if "_exps." in n and len(t.shape) == 3), 0)


def choose(f: gguf.GGUFFile, mix: Mix, has_imatrix: bool = False) -> list[Choice]:
    """Each tensor's stored type and the type `mix` writes it in (whether or not ds4py has that type yet)."""
    n_layer, n_expert, downs, out = _n_layer(f), _n_expert(f), 0, []
    for name, info in f.tensors.items():
        shape, note = tuple(info.shape), ""
        if mix.kind == "ds4":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                target = quant_mix.tensor_type(name, shape, mix.name)
            note = "; ".join(str(w.message) for w in caught)
        elif not llamacpp_mix.quantizable(name, shape):
            target = info.type
        else:
            if mix.kind == "rules":
                picked = _rule_type(mix, name) or info.type
            else:
                picked = llamacpp_mix.tensor_type(name, shape, mix.name, n_layer=n_layer, down_index=downs,
                                                  has_imatrix=has_imatrix, n_expert=n_expert)
                downs += "ffn_down" in name
            target, note = llamacpp_mix.fallback(picked, shape[-1])
        out.append(Choice(name, shape, info.type, target, note))
    return out


def plan(f: gguf.GGUFFile, mix: Mix, has_imatrix: bool = False) -> list[Choice]:
    """`choose`, checked: UsageError for a type ds4py cannot write yet, or a type llama.cpp quantizes only with
    an importance matrix when there is none."""
    choices = choose(f, mix, has_imatrix)
    for c in choices:
        if c.target not in quants.TYPES:
            why = f" ({c.note})" if c.note else ""
            raise UsageError(f"tensor {c.name}: type {c.target}{why} is not (yet) registered in ops.quants; ds4py "
                             f"writes {', '.join(t for t, q in quants.TYPES.items() if q.ggml_type is not None)}")
        needs = c.target in llamacpp_mix.NEEDS_IMATRIX or (c.target == "Q2_K" and mix.name == "Q2_K_S")
        if needs and not has_imatrix and c.name not in _UNTOUCHED and c.target != c.stored:
            raise UsageError(f"tensor {c.name}: {c.target} needs an importance matrix, as llama-quantize requires; "
                             "make one with scripts/imatrix.py and pass --imatrix FILE")
    return choices


def takes_weights(qtype: quants.QuantType) -> bool:
    """Whether the type's quantizer accepts importance weights (`quantize(x, weights=...)`)."""
    try:
        return "weights" in inspect.signature(qtype.quantize).parameters
    except (TypeError, ValueError):
        return False


def importance_for(im: imatrix.Imatrix | None, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The imatrix's importance for weight `name` broadcast to `shape` (float32), or None when it has none.

    An entry of k matrices (experts, or row groups fed different inputs) covers the rows in k equal runs.
    """
    entry = im.entries.get(name) if im else None
    if entry is None:
        return None
    flat, n_in, rows = entry.importance().reshape(-1), shape[-1], math.prod(shape[:-1])
    k = flat.numel() // n_in
    if flat.numel() % n_in or rows % k:
        raise UsageError(f"imatrix entry {name} has {flat.numel()} values, which do not split into matrices of "
                         f"{n_in} columns covering the {rows} rows of the tensor {shape}")
    if not torch.isfinite(flat).all():
        raise UsageError(f"imatrix entry {name} holds non-finite values")
    return flat.reshape(k, 1, n_in).expand(k, rows // k, n_in).reshape(shape)


def encode(src: QTensor, target: str, importance: torch.Tensor | None) -> QTensor:
    """`src` requantized to `target` (the stored bytes unchanged when the type already is `target`)."""
    if src.qtype.name == target:
        return src
    qt = quants.get(target)
    w = src.dequantize().contiguous()
    blocks = w.reshape(-1, qt.block_size)
    if importance is not None and takes_weights(qt):
        data = qt.quantize(blocks, weights=importance.reshape(-1, qt.block_size))
    else:
        data = qt.quantize(blocks)
    return QTensor(qt, tuple(w.shape), data.reshape(*w.shape[:-1], qt.row_bytes(w.shape[-1])), src.name)


def _metadata(f: gguf.GGUFFile, mix: Mix, im_path: str | None, im: imatrix.Imatrix | None) -> dict:
    md = {k: v for k, v in f.metadata.items() if not k.startswith("quantize.imatrix.")}
    md.pop("general.file_type", None)
    if mix.kind == "llama.cpp":
        md["general.file_type"] = int(gguf_py.LlamaFileType["MOSTLY_" + mix.name])
    if im is not None:
        md["quantize.imatrix.file"] = str(im_path)
        md["quantize.imatrix.entries_count"] = len(im.entries)
        md["quantize.imatrix.chunks_count"] = im.chunk_count
        if im.datasets:
            md["quantize.imatrix.dataset"] = im.datasets[0]
    return md


def requantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], mix: Mix | str, *,
               imatrix_path: str | os.PathLike[str] | None = None,
               progress: Callable[[Iterable], Iterable] = lambda items: items,
               report: Callable[[str], None] = lambda line: None) -> Result:
    """Write `src` requantized into `mix` as `dst` (atomic); `report` receives the fallbacks and notes."""
    mix = parse_mix(mix) if isinstance(mix, str) else mix
    src, dst = Path(src), Path(dst)
    f = gguf.open(src)
    if src.resolve() == dst.resolve() or (dst.exists() and os.path.samefile(src, dst)):
        raise UsageError(f"{dst}: is the input file; write the requantized model to another path")
    layouts.check_types(f)  # every stored type must be readable, to be dequantized or copied
    im = imatrix.read(imatrix_path) if imatrix_path else None
    choices = plan(f, mix, has_imatrix=im is not None)
    for c in choices:
        if c.note:
            report(f"{c.name}: {c.note}")
    tensors = {}
    for c in choices:
        def produce(c: Choice = c) -> QTensor:
            return encode(f.raw(c.name), c.target, importance_for(im, c.name, c.shape))
        tensors[c.name] = gguf.LazyTensor(c.target, c.shape, produce)
    gguf.write(dst, _metadata(f, mix, str(imatrix_path) if imatrix_path else None, im), tensors,
               alignment=int(f.metadata.get("general.alignment", 32)), progress=progress)
    out = gguf.open(dst)
    n_bytes = sum(t.nbytes for t in out.tensors.values())
    n_values = sum(torch.Size(t.shape).numel() for t in out.tensors.values())
    return Result(dst, n_bytes, n_values, tuple(choices))
