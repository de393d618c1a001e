"""GGUF layouts of DeepSeek V4: antirez/ds4's (ds4py's own) and llama.cpp's, read into and written from ds4's.

Both put the main model under the same tensor names (docs/model.md §2); they differ in metadata and in
the MTP file:

* **ds4** (antirez/ds4, ds4py): `deepseek4.vocab_size` is written, YaRN is implied (no
  `rope.scaling.type`), no `context_length` or `expert_gating_func`. The MTP head is a separate GGUF
  of `mtp.0.*` tensors with separate `e_proj` / `h_proj` and its own `hc_head_*`.
* **llama.cpp** (`convert_hf_to_gguf.py`, `deepseek4`; loader `src/models/deepseek4.cpp`): the loader
  requires `context_length`, `expert_gating_func` (4 = sqrt-softplus), reads `rope.scaling.type`
  (absent means *linear*), takes `n_vocab` from `token_embd`, and wants `swiglu_clamp_exp` with
  exactly `block_count` entries. Its MTP GGUF (`--mtp`) counts the MTP block in `block_count`
  (= layers + `nextn_predict_layers`), names it `blk.{L}.*` with `blk.{L}.nextn.{eh_proj,enorm,hnorm,
  shared_head_norm}`, stores `eh_proj` as one [D, 2D] matrix whose input columns are
  [embedding half | hidden half] (the graph concatenates `enorm(e)` then `hnorm(h)`), puts the MTP's
  own HC head in the root `output_hc_*` slot and repeats the root `token_embd` / `output` /
  `output_norm` the loader requires.

`ds4_metadata(f)` turns either spelling into ds4's (with a record of how each key was read or
derived), `mtp_weights(f)` maps either MTP layout onto `mtp.0.*` names without copying, and
`llamacpp_metadata` / `llamacpp_mtp_tensors` / `convert_files` write llama.cpp's layout. See
docs/gguf-layouts.md.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf
from models.args import METADATA_KEYS, MTP_PREFIX, PREFIX, ModelArgs, block_shapes, model_shapes
from ops import quants
from ops.quants import QTensor

P = PREFIX
LAYOUTS = ("ds4", "llama.cpp")
SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS, the only one its deepseek4 accepts
GATING_NAMES = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}
# keys llama.cpp's loader requires that ds4's spelling does not carry
LLAMACPP_KEYS = (P + "context_length", P + "expert_gating_func", P + "rope.scaling.type")
NEXTN = P + "nextn_predict_layers"
# llama.cpp's defaults when a YaRN key is absent (llama_hparams)
_YARN_DEFAULTS = {"rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0}
# MTP tensors that are not part of the block: ds4 name -> llama.cpp name ({L} = the MTP block's index)
_MTP_HEAD = {"enorm.weight": "blk.{L}.nextn.enorm.weight", "hnorm.weight": "blk.{L}.nextn.hnorm.weight",
             "norm.weight": "blk.{L}.nextn.shared_head_norm.weight",
             "hc_head_fn.weight": "output_hc_fn.weight", "hc_head_scale.weight": "output_hc_scale.weight",
             "hc_head_base.weight": "output_hc_base.weight"}
_EH_PROJ = "blk.{L}.nextn.eh_proj.weight"
# root tensors llama.cpp requires in an MTP-only file; they repeat the base model's
_MTP_REPEATS = ("token_embd.weight", "output.weight", "output_norm.weight")
_NEXTN_RE = re.compile(r"^blk\.(\d+)\.nextn\.eh_proj\.weight$")


@dataclass(frozen=True)
class KeyNote:
    """How one ds4 metadata key got its value: `how` is "read", "read from KEY", "derived: ..." or "default: ..."."""

    key: str
    value: Any
    how: str


@dataclass(frozen=True)
class Layout:
    """Which writer's layout a file has (`writer`: ds4 | llama.cpp) and what it holds (`kind`: base | mtp |
    base+mtp); `llamacpp_keys`: it carries the keys llama.cpp requires; `ds4_keys`: it carries ds4's."""

    writer: str
    kind: str
    llamacpp_keys: bool
    ds4_keys: bool
    mtp_block: int | None = None  # llama.cpp: index L of the nextn block

    def describe(self) -> str:
        spell = " + ".join(s for s, on in (("ds4 keys", self.ds4_keys), ("llama.cpp keys", self.llamacpp_keys)) if on)
        where = f", MTP block blk.{self.mtp_block}" if self.mtp_block is not None else ""
        return f"{self.writer} layout, {self.kind}{where} ({spell or 'neither key set complete'})"


def _nextn_block(tensors: Mapping[str, Any]) -> int | None:
    found = [int(m.group(1)) for n in tensors if (m := _NEXTN_RE.match(n))]
    return min(found) if found else None


def detect(md: Mapping[str, Any], tensors: Mapping[str, Any]) -> Layout:
    """The layout of a file with metadata `md` and tensor names `tensors` (see Layout)."""
    nextn = _nextn_block(tensors)
    has_mtp0 = any(n.startswith(MTP_PREFIX) for n in tensors)
    has_trunk = "blk.0.attn_norm.weight" in tensors
    llama_keys = all(k in md for k in LLAMACPP_KEYS[:2])
    ds4_keys = P + "vocab_size" in md
    if nextn is not None:
        return Layout("llama.cpp", "base+mtp" if has_trunk else "mtp", llama_keys, ds4_keys, nextn)
    kind = "mtp" if has_mtp0 and not has_trunk else "base"
    writer = "ds4" if ds4_keys or kind == "mtp" else "llama.cpp"
    return Layout(writer, kind, llama_keys, ds4_keys)


def _first_shape(tensors: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, tuple[int, ...]] | None:
    for n in names:
        if n in tensors:
            return n, tuple(tensors[n].shape)
    return None


def _int(md: Mapping[str, Any], key: str, default: int = 0) -> int:
    """`md[key]` as an int (default when absent); ModelFileError naming the key when it is not one."""
    v = md.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelFileError(f"GGUF metadata key {key} = {v!r}: expected an integer")
    return v


def ds4_metadata(md: Mapping[str, Any], tensors: Mapping[str, Any]) -> tuple[dict[str, Any], list[KeyNote]]:
    """Metadata in ds4's spelling from a file of either layout, and a note per ds4 key on how it was got.

    `tensors` maps names to anything with a `.shape` (TensorInfo, QTensor). Keys ds4 does not use are
    kept; llama.cpp's `nextn_predict_layers` is consumed (the MTP block is not a trunk layer); an MTP
    file keeps only `deepseek4.*` / `general.*` keys, as ds4's MTP files do. Raises ModelFileError on
    a value ds4py cannot run (a gating function other than sqrt-softplus, a RoPE scaling other than
    YaRN or none).
    """
    layout = detect(md, tensors)
    out = dict(md)
    notes: dict[str, KeyNote] = {}

    def note(key: str, how: str) -> None:
        notes[key] = KeyNote(key, out.get(key), how)

    for key in METADATA_KEYS.values():
        if P + key in md:
            note(P + key, "read")

    # block_count: llama.cpp counts the nextn block(s); its loader keeps them only when blk.{L}.nextn.eh_proj exists
    n_next = _int(md, NEXTN)
    if NEXTN in out:
        del out[NEXTN]
    if layout.mtp_block is not None and P + "block_count" in md:
        total = _int(md, P + "block_count")
        if n_next < 1 or layout.mtp_block != total - n_next:
            raise ModelFileError(f"{NEXTN} = {n_next} with block_count {total}, but the nextn block is "
                                 f"blk.{layout.mtp_block} (llama.cpp's MTP layout puts it at block_count - nextn)")
        if n_next != 1:
            raise ModelFileError(f"{NEXTN} = {n_next}: DeepSeek V4 has one MTP block")
        out[P + "block_count"] = total - n_next
        note(P + "block_count", f"derived: {P}block_count {total} minus {NEXTN} {n_next} (the MTP block)")
    elif n_next:
        notes[NEXTN] = KeyNote(NEXTN, n_next, "ignored: no blk.N.nextn.eh_proj tensor, so no MTP block here "
                                              "(llama.cpp's loader probes the same way)")

    # vocabulary: llama.cpp takes n_vocab from token_embd
    if P + "vocab_size" not in md:
        src = _first_shape(tensors, ("token_embd.weight", "output.weight"))
        if src is not None:
            out[P + "vocab_size"] = int(src[1][0])
            note(P + "vocab_size", f"derived: rows of {src[0]} {list(src[1])}")
        elif isinstance(md.get("tokenizer.ggml.tokens"), list):
            out[P + "vocab_size"] = len(md["tokenizer.ggml.tokens"])
            note(P + "vocab_size", "derived: length of tokenizer.ggml.tokens")

    # head sizes: DeepSeek V4 has one KV head of key_length = value_length = attn_kv rows
    if P + "attention.head_count_kv" not in md:
        out[P + "attention.head_count_kv"] = 1
        note(P + "attention.head_count_kv", "default: 1 (DeepSeek V4 shares one KV head)")
    kv = [n for n in tensors if n.endswith(".attn_kv.weight")]
    for key in ("attention.key_length", "attention.value_length"):
        if P + key not in md and kv:
            out[P + key] = int(tuple(tensors[kv[0]].shape)[0])
            note(P + key, f"derived: rows of {kv[0]} (one KV head of the full head size)")

    # gating function: llama.cpp's deepseek4 requires sqrt-softplus (4), which is the only one ds4 has
    if P + "expert_gating_func" in md:
        g = md[P + "expert_gating_func"]
        if g != SQRT_SOFTPLUS:
            name = GATING_NAMES.get(g, "unknown") if isinstance(g, int) else "unknown"
            raise ModelFileError(f"{P}expert_gating_func = {g} ({name}): DeepSeek V4 routes with "
                                 f"sqrt-softplus ({SQRT_SOFTPLUS})")
        note(P + "expert_gating_func", "read: sqrt_softplus, the only routing ds4py has (not a ds4 key)")

    # RoPE scaling: ds4 implies YaRN; llama.cpp reads rope.scaling.type and treats its absence as linear
    rtype = md.get(P + "rope.scaling.type")
    factor_key = P + "rope.scaling.factor"
    if rtype is not None:
        if rtype == "none":
            out[factor_key] = 1.0
            note(factor_key, f"derived: 1.0 because {P}rope.scaling.type is 'none' (YaRN with factor 1 = plain RoPE)")
        elif rtype != "yarn":
            raise ModelFileError(f"{P}rope.scaling.type = {rtype!r}: DeepSeek V4's compressed layers use YaRN "
                                 "('yarn'; 'none' for plain RoPE)")
        note(P + "rope.scaling.type", f"read: {rtype!r} (not a ds4 key; ds4 implies YaRN)")
    if factor_key not in out:
        if P + "rope.scale_linear" in md:  # llama.cpp's older spelling of the same factor
            out[factor_key] = md[P + "rope.scale_linear"]
            note(factor_key, f"read from {P}rope.scale_linear")
        elif rtype is not None:
            out[factor_key] = 1.0
            note(factor_key, "default: 1.0 (llama.cpp's default when the factor is absent)")
    for key, default in _YARN_DEFAULTS.items():
        if P + key not in md:
            out[P + key] = default
            note(P + key, f"default: {default} (llama.cpp's default)")
    orig = P + "rope.scaling.original_context_length"
    if orig not in md and P + "context_length" in md:
        out[orig] = _int(md, P + "context_length")
        note(orig, f"derived: {P}context_length (llama.cpp's default for the YaRN original context)")
    if P + "context_length" in md:
        note(P + "context_length", "read (not a ds4 key; ds4py takes the context from --ctx)")

    # per-layer arrays: llama.cpp accepts one value for all layers
    L = _int(out, P + "block_count")
    for key in ("swiglu_clamp_exp", "attention.compress_ratios"):
        v = out.get(P + key)
        if v is not None and not isinstance(v, list):
            total = L + (n_next if layout.mtp_block is not None else 0)  # the file's block_count
            out[P + key] = [v] * total
            note(P + key, f"derived: the single value {v} repeated for {total} blocks")

    if layout.kind == "mtp":
        out = {k: v for k, v in out.items() if k.startswith((P, "general."))}
    return out, [notes[k] if k in notes else KeyNote(k, out.get(k), "missing") for k in _note_order(out, notes)]


def _note_order(md: Mapping[str, Any], notes: Mapping[str, KeyNote]) -> list[str]:
    keys = [P + k for k in METADATA_KEYS.values()]
    return keys + [k for k in notes if k not in keys]


def llamacpp_keys(md: Mapping[str, Any]) -> dict[str, Any]:
    """The keys llama.cpp's deepseek4 loader requires that `md` (ds4 spelling) lacks, derived from it:
    context_length = YaRN original context x factor, expert_gating_func = sqrt-softplus, and
    rope.scaling.type = yarn (none when the factor is 1)."""
    out = {}
    factor = float(md.get(P + "rope.scaling.factor", 1.0))
    if P + "context_length" not in md:
        orig = int(md.get(P + "rope.scaling.original_context_length", 0) or 0)
        if orig:
            out[P + "context_length"] = int(round(orig * factor))
    if P + "expert_gating_func" not in md:
        out[P + "expert_gating_func"] = SQRT_SOFTPLUS
    if P + "rope.scaling.type" not in md:
        out[P + "rope.scaling.type"] = "yarn" if factor != 1.0 else "none"
    return out


def dual_metadata(md: Mapping[str, Any]) -> dict[str, Any]:
    """ds4-layout metadata that llama.cpp also loads: `md` plus `llamacpp_keys(md)`, with
    `swiglu_clamp_exp` cut to exactly block_count entries (llama.cpp checks the length; antirez/ds4
    needs at least block_count)."""
    out = dict(md) | llamacpp_keys(md)
    L, key = int(md[P + "block_count"]), P + "swiglu_clamp_exp"
    if isinstance(out.get(key), list) and len(out[key]) > L:
        out[key] = list(out[key])[:L]
    return out


def llamacpp_metadata(md: Mapping[str, Any], mtp: bool = False) -> dict[str, Any]:
    """Metadata in llama.cpp's spelling for a base (`mtp=False`) or MTP GGUF from ds4-spelled `md`.

    Drops `vocab_size` (llama.cpp takes it from `token_embd`), adds `llamacpp_keys`; the MTP file gets
    block_count = layers + 1, `nextn_predict_layers` = 1 and per-block arrays of layers + 1 entries
    (the MTP block's SwiGLU clamp is entry `layers`: the last one when `md` has only `layers`).
    """
    out = {k: v for k, v in md.items() if k != P + "vocab_size"} | llamacpp_keys(md)
    L = int(md[P + "block_count"])
    n = L + 1 if mtp else L
    sw = list(md[P + "swiglu_clamp_exp"])
    if len(sw) < L:
        raise UsageError(f"{P}swiglu_clamp_exp has {len(sw)} entries for {L} layers")
    out[P + "swiglu_clamp_exp"] = sw[:n] if len(sw) >= n else sw + [sw[-1]] * (n - len(sw))
    ratios = list(md[P + "attention.compress_ratios"])
    if len(ratios) < n:
        out[P + "attention.compress_ratios"] = ratios + [0] * (n - len(ratios))
    if mtp:
        out[P + "block_count"] = L + 1
        out[NEXTN] = 1
    return out


# keys src/models/deepseek4.cpp (and llama.cpp's generic loader: context_length, embedding_length, block_count,
# head_count) read as required
_LLAMACPP_REQUIRED = (
    "context_length", "embedding_length", "block_count", "attention.head_count", "attention.layer_norm_rms_epsilon",
    "attention.q_lora_rank", "attention.sliding_window", "expert_feed_forward_length", "expert_shared_count",
    "expert_weights_scale", "expert_weights_norm", "swiglu_clamp_exp", "attention.indexer.head_count",
    "attention.indexer.key_length", "attention.indexer.top_k", "attention.output_group_count",
    "attention.output_lora_rank", "attention.compress_rope_freq_base", "hyper_connection.count",
    "hyper_connection.sinkhorn_iterations", "hyper_connection.epsilon", "hash_layer_count",
    "attention.compress_ratios", "expert_gating_func")
_LLAMACPP_RATIOS = (0, 4, 128)  # "DeepSeek-V4 loader only supports compression ratios 0, 4, and 128"


def llamacpp_problems(md: Mapping[str, Any], tensors: Mapping[str, Any]) -> list[str]:
    """Why llama.cpp's deepseek4 loader would refuse (or misread) a file, by the rules of its source
    (src/models/deepseek4.cpp: keys, array lengths, ratios, HC streams, gating, required tensors and
    shapes); [] when it would load it. A check of the rules, not a run of llama.cpp."""
    if md.get("general.architecture", "deepseek4") != "deepseek4":
        return [f"general.architecture is {md.get('general.architecture')!r}, not 'deepseek4'"]
    missing = [P + k for k in _LLAMACPP_REQUIRED if P + k not in md]
    if missing:
        return [f"missing required keys: {', '.join(missing)}"]
    problems = []
    B, n_next = _int(md, P + "block_count"), _int(md, NEXTN)
    if n_next and f"blk.{B - n_next}.nextn.eh_proj.weight" not in tensors:
        n_next = 0  # the loader's probe: without the nextn tensors it loads the trunk only
    n_layer = B - n_next
    if md[P + "expert_gating_func"] != SQRT_SOFTPLUS:
        g = md[P + "expert_gating_func"]
        problems.append(f"{P}expert_gating_func is {g}, the loader expects 4 (sqrt-softplus)")
    sw = md[P + "swiglu_clamp_exp"]
    if isinstance(sw, list) and len(sw) != B:
        problems.append(f"{P}swiglu_clamp_exp has {len(sw)} entries; the loader wants exactly block_count = {B}")
    ratios = md[P + "attention.compress_ratios"]
    ratios = ratios if isinstance(ratios, list) else [ratios]
    if len(ratios) < B:
        problems.append(f"{P}attention.compress_ratios has {len(ratios)} entries, fewer than block_count = {B}")
    bad = sorted({r for r in ratios[:B] if r not in _LLAMACPP_RATIOS})
    if bad:
        problems.append(f"compress ratios {bad}: the loader supports only 0, 4 and 128")
    if md[P + "hyper_connection.count"] != 4:
        problems.append(f"{P}hyper_connection.count is {md[P + 'hyper_connection.count']}; the graph asserts 4")
    if md.get(P + "rope.scaling.type", "linear") != "yarn" and md.get(P + "rope.scaling.factor", 1.0) != 1.0:
        problems.append(f"{P}rope.scaling.type is {md.get(P + 'rope.scaling.type')!r}: the compressed layers' "
                        "YaRN would be read as linear scaling")
    try:
        ds4, _ = ds4_metadata(md, tensors)
        args = ModelArgs.from_metadata(ds4)
    except ModelFileError as e:
        return problems + [f"metadata: {e}"]
    mtp_only = n_next > 0 and "blk.0.attn_norm.weight" not in tensors
    want = {k: v for k, v in model_shapes(args).items() if not (mtp_only and k.startswith("blk."))}
    if args.n_hash_layers > n_layer and n_next:
        problems.append("the MTP block would be hash-routed, which the MTP graph does not support")
    if n_next:
        D = args.dim
        want |= block_shapes(args, f"blk.{n_layer}.", 0, False)
        want |= {_EH_PROJ.format(L=n_layer): (D, 2 * D), f"blk.{n_layer}.nextn.enorm.weight": (D,),
                 f"blk.{n_layer}.nextn.hnorm.weight": (D,)}
    absent = [n for n in want if n not in tensors]
    if absent:
        problems.append(f"missing tensors: {', '.join(absent[:5])}" + (f" and {len(absent) - 5} more"
                                                                         if len(absent) > 5 else ""))
    optional = {f"blk.{n_layer}.nextn.{k}.weight" for k in ("embed_tokens", "shared_head_head", "shared_head_norm")}
    unused = [n for n in tensors if n not in want and n not in optional]
    if unused:  # done_getting_tensors: the loader refuses a file whose tensor count differs from what it created
        problems.append(f"tensors the loader does not create: {', '.join(unused[:5])}"
                        + (f" and {len(unused) - 5} more" if len(unused) > 5 else ""))
    wrong = [f"{n} {tuple(tensors[n].shape)} (expected {s})" for n, s in want.items()
             if n in tensors and tuple(tensors[n].shape) != s]
    if wrong:
        problems.append(f"tensor shapes: {'; '.join(wrong[:3])}")
    return problems


def check_types(f: gguf.GGUFFile) -> None:
    """Raise ModelFileError naming every quant type in `f` that ds4py cannot read (with a tensor of each)."""
    bad: dict[str, list[str]] = {}
    for name, info in f.tensors.items():
        if info.type not in quants.TYPES:
            bad.setdefault(info.type, []).append(name)
    if bad:
        parts = [f"{t} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
                 for t, names in sorted(bad.items())]
        raise ModelFileError(f"{f.path}: quant types ds4py cannot read: {'; '.join(parts)}. ds4py reads "
                             f"{', '.join(t for t in quants.TYPES if quants.TYPES[t].ggml_type is not None)}; "
                             "requantize those tensors (e.g. llama-quantize --tensor-type) to one of them")


def _renamed(t: QTensor, name: str) -> QTensor:
    return dataclasses.replace(t, name=name)


def split_eh_proj(eh: QTensor, dim: int) -> tuple[QTensor, QTensor]:
    """(e_proj, h_proj) of a llama.cpp `eh_proj` [D, 2D]: input columns [0, D) act on `enorm(embedding)`,
    [D, 2D) on `hnorm(hidden)`. Each is a zero-copy strided view of the stored rows (split at byte
    row_bytes(D), a block boundary since D is a multiple of the block size)."""
    if tuple(eh.shape) != (dim, 2 * dim):
        raise ModelFileError(f"tensor {eh.name} has shape {tuple(eh.shape)}, expected {(dim, 2 * dim)}")
    cut = eh.qtype.row_bytes(dim)
    e = QTensor(eh.qtype, (dim, dim), eh.data[:, :cut], MTP_PREFIX + "e_proj.weight")
    h = QTensor(eh.qtype, (dim, dim), eh.data[:, cut:], MTP_PREFIX + "h_proj.weight")
    return e, h


def _type_name(t: Any) -> str:
    if isinstance(t, gguf.LazyTensor):
        return t.type
    return t.qtype.name if isinstance(t, QTensor) else str(t.dtype)


def join_eh_proj(e: Any, h: Any) -> Any:
    """llama.cpp's `eh_proj` from ds4's `e_proj` and `h_proj` (QTensors, torch tensors or gguf.LazyTensors):
    each row's blocks of e then of h, bit-exact."""
    if _type_name(e) != _type_name(h) or tuple(e.shape) != tuple(h.shape):
        raise UsageError(f"e_proj ({_type_name(e)} {tuple(e.shape)}) and h_proj ({_type_name(h)} {tuple(h.shape)}) "
                         "must share type and shape to form one eh_proj")
    rows, dim = e.shape
    if isinstance(e, gguf.LazyTensor) or isinstance(h, gguf.LazyTensor):
        def produce() -> Any:
            return join_eh_proj(*(t.produce() if isinstance(t, gguf.LazyTensor) else t for t in (e, h)))
        return gguf.LazyTensor(_type_name(e), (rows, 2 * dim), produce)
    if isinstance(e, torch.Tensor):
        return torch.cat([e, h], dim=-1)
    return QTensor(e.qtype, (rows, 2 * dim), torch.cat([e.data, h.data], dim=-1), "eh_proj")


def ds4_mtp_metadata(md: Mapping[str, Any]) -> dict[str, Any]:
    """ds4-layout MTP GGUF metadata from the base model's: its `deepseek4.*` / `general.*` keys, with the
    SwiGLU clamp array extended to the MTP block (entry block_count; the last one repeated)."""
    out = {k: v for k, v in md.items() if k.startswith((P, "general."))}
    sw, n = list(out[P + "swiglu_clamp_exp"]), int(out[P + "block_count"])
    out[P + "swiglu_clamp_exp"] = sw[:n + 1] if len(sw) > n else sw + [sw[-1]] * (n + 1 - len(sw))
    return out


def mtp_weights(f: gguf.GGUFFile, dim: int | None = None) -> tuple[dict[str, QTensor], list[tuple[str, str]]]:
    """The MTP head's tensors under ds4's `mtp.0.*` names from an MTP GGUF of either layout (or a llama.cpp
    base GGUF that carries its nextn block), zero-copy, and (ds4 name, where it came from) pairs.

    llama.cpp's root `token_embd` / `output` (and `nextn.embed_tokens` / `shared_head_head` when present)
    repeat the base model's and are not read: the head uses the trunk's embedding and LM head.
    """
    layout = detect(f.metadata, f.tensors)
    check_types(f)
    if layout.writer == "ds4" or layout.mtp_block is None:
        names = [n for n in f.tensors if n.startswith(MTP_PREFIX)]
        if not names:
            raise ModelFileError(f"{f.path}: no MTP tensors (neither mtp.0.* nor blk.N.nextn.*)")
        return {n: f.raw(n) for n in names}, [(n, n) for n in names]
    L = layout.mtp_block
    dim = dim or _int(f.metadata, P + "embedding_length") or f.tensors[_EH_PROJ.format(L=L)].shape[0]
    out, where = {}, []
    block = f"blk.{L}."
    for n in f.tensors:
        if n.startswith(block) and ".nextn." not in n:
            ds4 = MTP_PREFIX + n.removeprefix(block)
            out[ds4] = _renamed(f.raw(n), ds4)
            where.append((ds4, n))
    for ds4_short, src in _MTP_HEAD.items():
        src = src.format(L=L)
        if ds4_short == "norm.weight" and src not in f.tensors:
            src = "output_norm.weight"  # llama.cpp's loader falls back to the root norm the same way
        if src not in f.tensors:
            raise ModelFileError(f"{f.path}: llama.cpp MTP layout without {src}")
        out[MTP_PREFIX + ds4_short] = _renamed(f.raw(src), MTP_PREFIX + ds4_short)
        where.append((MTP_PREFIX + ds4_short, src))
    eh_name = _EH_PROJ.format(L=L)
    e, h = split_eh_proj(_renamed(f.raw(eh_name), eh_name), dim)
    out[e.name], out[h.name] = e, h
    cut = e.qtype.row_bytes(dim)
    where += [(e.name, f"{eh_name}[:, :{dim}] (bytes [0, {cut}) of each row, zero-copy view)"),
              (h.name, f"{eh_name}[:, {dim}:] (bytes [{cut}, {2 * cut}) of each row, zero-copy view)")]
    return out, where


def llamacpp_mtp_tensors(mtp: Mapping[str, Any], base: Mapping[str, Any], n_layers: int) -> dict[str, Any]:
    """llama.cpp's MTP-file tensors from ds4's `mtp.0.*` tensors and the base model's root tensors
    (QTensors, torch tensors or gguf.LazyTensors, as gguf.write takes)."""
    L = n_layers
    out: dict[str, Any] = {}
    for name in _MTP_REPEATS:
        if name not in base:
            raise UsageError(f"the base model has no {name}, which llama.cpp's MTP file repeats")
        out[name] = base[name]
    head = {MTP_PREFIX + k: v.format(L=L) for k, v in _MTP_HEAD.items()}
    for name, t in mtp.items():
        if name in head:
            out[head[name]] = t
        elif name not in (MTP_PREFIX + "e_proj.weight", MTP_PREFIX + "h_proj.weight"):
            out[f"blk.{L}." + name.removeprefix(MTP_PREFIX)] = t
    out[_EH_PROJ.format(L=L)] = join_eh_proj(mtp[MTP_PREFIX + "e_proj.weight"], mtp[MTP_PREFIX + "h_proj.weight"])
    return out


def _tensors(f: gguf.GGUFFile) -> dict[str, QTensor]:
    check_types(f)
    return {n: f.raw(n) for n in f.tensors}


def convert_files(base_in: str, base_out: str, mtp_in: str | None = None, mtp_out: str | None = None,
                  to: str = "llama.cpp") -> None:
    """Rewrite a base GGUF (and its MTP GGUF) of either layout into layout `to` (ds4 | llama.cpp).

    Tensor bytes are copied unchanged (eh_proj is joined from / split into e_proj and h_proj row by
    row); metadata is respelled with `llamacpp_metadata` / `ds4_metadata`.
    """
    if to not in LAYOUTS:
        raise UsageError(f"unknown layout {to!r}; choose one of {', '.join(LAYOUTS)}")
    if (mtp_in is None) != (mtp_out is None):
        raise UsageError("give both the MTP input and the MTP output, or neither")
    fb = gguf.open(base_in)
    md, _ = ds4_metadata(fb.metadata, fb.tensors)
    base = {n: t for n, t in _tensors(fb).items() if ".nextn." not in n and not n.startswith(
        f"blk.{md[P + 'block_count']}.")}
    if to == "llama.cpp":
        gguf.write(base_out, llamacpp_metadata(md), base)
    else:
        gguf.write(base_out, md, base)
    if mtp_in is None:
        return
    fm = gguf.open(mtp_in)
    mtp_md, _ = ds4_metadata(fm.metadata, fm.tensors)
    weights, _ = mtp_weights(fm, int(md[P + "embedding_length"]))
    if to == "llama.cpp":
        tok = {k: v for k, v in fb.metadata.items() if k.startswith("tokenizer.")}
        gguf.write(mtp_out, llamacpp_metadata(mtp_md, mtp=True) | tok,
                   llamacpp_mtp_tensors(weights, base, int(md[P + "block_count"])))
    else:
        gguf.write(mtp_out, mtp_md, dict(sorted(weights.items())))


def explain(path: str | Path) -> str:
    """A report of the file's layout and of how each ds4 metadata key was read or derived (and, for an
    MTP file, where each mtp.0.* tensor comes from)."""
    f = gguf.open(path)
    layout = detect(f.metadata, f.tensors)
    lines = [f"{f.path}: {layout.describe()}", f"{len(f.tensors)} tensors, {len(f.metadata)} metadata keys", ""]
    try:
        _, notes = ds4_metadata(f.metadata, f.tensors)
    except ModelFileError as e:
        return "\n".join(lines + [f"cannot be read by ds4py: {e}"])
    width = max(len(n.key) for n in notes)
    lines.append("ds4 metadata key".ljust(width) + "  value  <-  how")
    for n in notes:
        v = n.value
        if isinstance(v, list) and len(v) > 6:
            v = f"[{', '.join(map(str, v[:4]))}, ... {len(v)} entries]"
        lines.append(f"{n.key.ljust(width)}  {v}  <-  {n.how}")
    problems = llamacpp_problems(f.metadata, f.tensors)
    lines += ["", "llama.cpp's deepseek4 loader (by its source's rules): "
              + ("would load this file" if not problems else "would refuse or misread it:")]
    lines += [f"  - {p}" for p in problems]
    if layout.kind != "base":
        try:
            _, where = mtp_weights(f)
        except ModelFileError as e:
            lines += ["", f"MTP tensors cannot be read: {e}"]
        else:
            lines += ["", "MTP tensor  <-  stored as"] + [f"{a}  <-  {b}" for a, b in sorted(where)]
    try:
        check_types(f)
    except ModelFileError as e:
        lines += ["", str(e)]
    return "\n".join(lines)
