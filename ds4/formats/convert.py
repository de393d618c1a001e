"""Hugging Face DeepSeek V4 checkpoints -> ds4-layout GGUF tensors and `deepseek4.*` metadata.

Two source namings are understood, tensor by tensor (a `model.` prefix is ignored):
- the official `inference/` naming (`layers.N.attn.wq_a.weight`, FP8 e4m3 weights with a 128x128
  block `.scale`, FP4 experts packed two e2m1 per byte with an e8m0 `.scale` per 32 inputs, `mtp.0.*`);
- HF transformers `deepseek_v4` naming (`model.layers.N.self_attn.q_a_proj.weight`, fused
  `mlp.experts.gate_up_proj [E, 2I, D]`, `mlp.experts.down_proj [E, D, I]`, int64 `tid2eid`).
Conversion streams: each GGUF tensor is a `gguf.LazyTensor` that reads its source (one expert at a time
for expert stacks), quantizes it to the type of a `ds4.formats.quant_mix` mix and is dropped once written, so
peak memory is about one output tensor, not the model.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf, layouts
from ds4.formats.quant_mix import MIXES, tensor_type
from ds4.formats.vocab import TOKEN_NORMAL, metadata_from_hf
from ops.quants import QTensor, fp8_e4m3, mxfp4


class Part(NamedTuple):
    """One source slice: tensor `name`, its expert `index` along dim 0 of a fused stack, `half` of a fused gate/up."""

    name: str
    index: int | None = None
    half: int | None = None


_PACKED_FP4 = ("I8", "U8")  # safetensors dtypes of official FP4 weights, two values a byte (F4 counts values)

_GLOBAL = {  # ds4 name -> (official name, transformers name, ...): the first one present is read
    "token_embd.weight": ("embed.weight", "embed_tokens.weight"),
    "output.weight": ("head.weight", "lm_head.weight"),
    "output_norm.weight": ("norm.weight", "norm.weight"),
    "output_hc_fn.weight": ("hc_head_fn", "hc_head.hc_fn"),
    "output_hc_scale.weight": ("hc_head_scale", "hc_head.hc_scale"),
    "output_hc_base.weight": ("hc_head_base", "hc_head.hc_base"),
}
_BLOCK = {  # ds4 role -> (official name, transformers name), relative to the layer prefix
    "hc_attn_fn.weight": ("hc_attn_fn", "attn_hc.fn"),
    "hc_attn_scale.weight": ("hc_attn_scale", "attn_hc.scale"),
    "hc_attn_base.weight": ("hc_attn_base", "attn_hc.base"),
    "hc_ffn_fn.weight": ("hc_ffn_fn", "ffn_hc.fn"),
    "hc_ffn_scale.weight": ("hc_ffn_scale", "ffn_hc.scale"),
    "hc_ffn_base.weight": ("hc_ffn_base", "ffn_hc.base"),
    "attn_norm.weight": ("attn_norm.weight", "input_layernorm.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "attn_q_a.weight": ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    "attn_q_a_norm.weight": ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    "attn_q_b.weight": ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    "attn_kv.weight": ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    # transformers' save_pretrained writes the official names, but kv_norm as `attn.norm`
    "attn_kv_a_norm.weight": ("attn.kv_norm.weight", "self_attn.kv_norm.weight", "attn.norm.weight"),
    "attn_sinks.weight": ("attn.attn_sink", "self_attn.sinks"),
    "attn_output_a.weight": ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    "attn_output_b.weight": ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    "ffn_gate_inp.weight": ("ffn.gate.weight", "mlp.gate.weight"),
    "ffn_gate_shexp.weight": ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    "ffn_up_shexp.weight": ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    "ffn_down_shexp.weight": ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
}
_COMPRESSOR = {  # layers with compress ratio != 0
    "attn_compressor_kv.weight": ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    "attn_compressor_gate.weight": ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    "attn_compressor_ape.weight": ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    "attn_compressor_norm.weight": ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
}
_INDEXER = {  # ratio-4 layers
    "indexer.attn_q_b.weight": ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    "indexer.proj.weight": ("attn.indexer.weights_proj.weight",
                            "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    "indexer_compressor_kv.weight": ("attn.indexer.compressor.wkv.weight",
                                     "self_attn.compressor.indexer.kv_proj.weight"),
    "indexer_compressor_gate.weight": ("attn.indexer.compressor.wgate.weight",
                                       "self_attn.compressor.indexer.gate_proj.weight"),
    "indexer_compressor_ape.weight": ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    "indexer_compressor_norm.weight": ("attn.indexer.compressor.norm.weight",
                                       "self_attn.compressor.indexer.kv_norm.weight"),
}
_HASH = {"ffn_gate_tid2eid.weight": ("ffn.gate.tid2eid", "mlp.gate.tid2eid")}
_BIASED = {"exp_probs_b.bias": ("ffn.gate.bias", "mlp.gate.e_score_correction_bias")}
_MTP_ONLY = {
    "e_proj.weight": ("e_proj.weight",), "h_proj.weight": ("h_proj.weight",),
    "enorm.weight": ("enorm.weight",), "hnorm.weight": ("hnorm.weight",), "norm.weight": ("norm.weight",),
    "hc_head_fn.weight": ("hc_head_fn",), "hc_head_scale.weight": ("hc_head_scale",),
    "hc_head_base.weight": ("hc_head_base",),
}
_EXPERTS = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
_MTP_SHARED = (".emb.", ".head.weight")  # the MTP reuses the base embedding and LM head


class Checkpoint:
    """The safetensors files of a directory, read lazily; names are kept without a `model.` prefix."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{self.dir}: no *.safetensors files")
        self._handles = {}
        self._where: dict[str, tuple[Path, str]] = {}
        for path in files:
            try:
                handle = safe_open(path, "pt")
            except (OSError, SafetensorError) as e:
                raise ModelFileError(f"{path}: not a readable safetensors file: {e}") from None
            self._handles[path] = handle
            for name in handle.keys():
                self._where[name.removeprefix("model.")] = (path, name)

    def names(self) -> set[str]:
        """Every tensor name (without `model.`)."""
        return set(self._where)

    def raw(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name` as stored, or only its entry `index` along dim 0 (read without the rest)."""
        path, stored = self._where[name]
        if index is None:
            return self._handles[path].get_tensor(stored)
        return self._handles[path].get_slice(stored)[index]

    def weight(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name` (or entry `index`) as float32 (official FP8/FP4 dequantized by `.scale`), ints as int32."""
        t = self.raw(name, index)
        if not t.dtype.is_floating_point and t.dtype not in (torch.int8, torch.uint8):
            return t.to(torch.int32)
        scale_name = name.removesuffix(".weight") + ".scale"
        if t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
            if scale_name not in self._where:
                raise ModelFileError(f"{self._where[name][0]}: {name} is {t.dtype} but has no {scale_name}")
            return _dequantize_official(name, t, self.raw(scale_name, index))
        return t.to(torch.float32)

    def load(self, part: Part) -> torch.Tensor:
        """The `weight` of one part."""
        w = self.weight(part.name, part.index)
        return w if part.half is None else w.chunk(2, dim=-2)[part.half]

    def shape(self, part: Part) -> tuple[int, ...]:
        """The shape `load(part)` will have, from the safetensors header alone."""
        path, stored = self._where[part.name]
        header = self._handles[path].get_slice(stored)
        shape = header.get_shape()[part.index is not None:]
        if header.get_dtype() in _PACKED_FP4 and shape:
            shape[-1] *= 2
        if part.half is not None and len(shape) >= 2:
            shape[-2] //= 2
        return tuple(shape)


def _dequantize_official(name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An official FP8 (128x128 block scales) or packed FP4 (e8m0 scale per 32 inputs) weight as float32."""
    try:
        if weight.dtype == torch.float8_e4m3fn:
            return fp8_e4m3.from_official(weight, scale, name).dequantize()
        return mxfp4.from_official(weight.view(torch.uint8), scale, name).dequantize()
    except ValueError as e:
        raise ModelFileError(str(e)) from None


def _pick(ckpt: Checkpoint, prefix: str, candidates: tuple[str, ...]) -> str | None:
    names = ckpt.names()
    return next((prefix + c for c in candidates if prefix + c in names), None)


def _required(ckpt: Checkpoint, prefix: str, role: str, candidates: tuple[str, ...]) -> str:
    name = _pick(ckpt, prefix, candidates)
    if name is None:
        raise ModelFileError(f"{ckpt.dir}: missing tensor for {role} (looked for "
                             f"{', '.join(prefix + c for c in candidates)})")
    return name


def _experts(ckpt: Checkpoint, prefix: str, w: str, n_experts: int) -> list[Part]:
    """Parts of one routed-expert tensor: per-expert official tensors, or a half of transformers' fused one."""
    if _pick(ckpt, prefix, (f"ffn.experts.0.{w}.weight",)):
        names = [f"{prefix}ffn.experts.{e}.{w}.weight" for e in range(n_experts)]
        missing = [n for n in names if n not in ckpt.names()]
        if missing:
            raise ModelFileError(f"{ckpt.dir}: missing expert tensor {missing[0]}")
        return [Part(n) for n in names]
    if w == "w2":
        fused = _required(ckpt, prefix, "ffn_down_exps", ("mlp.experts.down_proj", "ffn.experts.down_proj"))
        half = None
    else:
        fused = _required(ckpt, prefix, f"ffn_{'gate' if w == 'w1' else 'up'}_exps",
                          ("mlp.experts.gate_up_proj", "ffn.experts.gate_up_proj"))
        half = 0 if w == "w1" else 1
    shape = ckpt.shape(Part(fused))
    if len(shape) != 3 or shape[0] != n_experts:
        raise ModelFileError(f"{ckpt.dir}: {fused} has shape {shape}, expected [{n_experts} experts, out, in]")
    return [Part(fused, e, half) for e in range(n_experts)]


def _block_plan(ckpt: Checkpoint, prefix: str, out_prefix: str, ratio: int, hashed: bool,
                n_experts: int) -> dict[str, list[Part]]:
    """Parts of one decoder block's ds4 tensors (`layers.N.` or `mtp.0.` source prefix)."""
    table = dict(_BLOCK)
    if ratio:
        table |= _COMPRESSOR
    if ratio == 4:
        table |= _INDEXER
    table |= _HASH if hashed else _BIASED
    plan = {out_prefix + role: [Part(_required(ckpt, prefix, role, cands))] for role, cands in table.items()}
    for role, w in _EXPERTS.items():
        plan[out_prefix + role] = _experts(ckpt, prefix, w, n_experts)
    return plan


def plan_tensors(ckpt: Checkpoint, meta: dict[str, Any], mtp: bool) -> tuple[dict, dict]:
    """(base, mtp) plans: ds4 tensor name -> the source parts stacked along a new first dim (one = no stack)."""
    ratios = meta["deepseek4.attention.compress_ratios"]
    n_hash, n_experts = meta["deepseek4.hash_layer_count"], meta["deepseek4.expert_count"]
    base = {name: [Part(_required(ckpt, "", name, cands))] for name, cands in _GLOBAL.items()}
    for i in range(meta["deepseek4.block_count"]):
        base |= _block_plan(ckpt, f"layers.{i}.", f"blk.{i}.", ratios[i], i < n_hash, n_experts)
    mtp_plan = {}
    if mtp:
        mtp_plan = {f"mtp.0.{role}": [Part(_required(ckpt, "mtp.0.", role, cands))]
                    for role, cands in _MTP_ONLY.items()}
        mtp_plan |= _block_plan(ckpt, "mtp.0.", "mtp.0.", 0, False, n_experts)
    return base, mtp_plan


def unrecognized(ckpt: Checkpoint, plans: list[dict[str, list[Part]]], mtp: bool) -> list[str]:
    """Source tensors no plan reads (scales of read weights, and `mtp.*` unless converted, excepted)."""
    read = {part.name for plan in plans for parts in plan.values() for part in parts}
    read |= {n.removesuffix(".weight") + ".scale" for n in read}
    return sorted(n for n in ckpt.names() - read
                  if not (n.startswith("mtp.") and (not mtp or any(s in n for s in _MTP_SHARED))))


def _store(w: torch.Tensor, ggml_type: str, name: str) -> QTensor | torch.Tensor:
    """A float or int weight in GGUF type `ggml_type`."""
    if ggml_type == "I32":
        return w.to(torch.int32)
    if ggml_type in ("F32", "F16"):
        return w.to(torch.float32 if ggml_type == "F32" else torch.float16)
    return QTensor.quantize(w, ggml_type, name)


def encode(ckpt: Checkpoint, name: str, parts: list[Part], ggml_type: str) -> QTensor | torch.Tensor:
    """Load `parts` one at a time, store each as `ggml_type`, and stack them along a new first dim if several."""
    if len(parts) == 1:
        return _store(ckpt.load(parts[0]), ggml_type, name)
    stack = None
    for i, part in enumerate(parts):
        one = _store(ckpt.load(part), ggml_type, name)
        data = one.data if isinstance(one, QTensor) else one
        if stack is None:
            stack = data.new_empty((len(parts), *data.shape))
        elif data.shape != stack.shape[1:]:
            raise ModelFileError(f"{ckpt.dir}: {part.name} gives {name} part {i} of shape {tuple(one.shape)}, "
                                 f"unlike part 0")
        stack[i] = data
    return QTensor(one.qtype, (len(parts), *one.shape), stack, name) if isinstance(one, QTensor) else stack


def lazy_tensor(ckpt: Checkpoint, name: str, parts: list[Part], mix: str) -> gguf.LazyTensor:
    """Tensor `name` of the mix's type and shape, read, quantized and stacked only when it is written."""
    shape = ckpt.shape(parts[0])
    if len(parts) > 1:
        shape = (len(parts), *shape)
    ggml_type = tensor_type(name, shape, mix)
    return gguf.LazyTensor(ggml_type, shape, partial(encode, ckpt, name, parts, ggml_type))


def read_config(hf_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json."""
    path = Path(hf_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"{path}: missing (the checkpoint's config.json is needed)") from None
    except json.JSONDecodeError as e:
        raise ModelFileError(f"{path}: not valid JSON: {e}") from None


def _compress_ratios(cfg: dict[str, Any], n_layers: int, path: str) -> list[int]:
    """Per-layer compress ratio from `compress_ratios`, or from transformers' `layer_types` + `compress_rates`."""
    ratios = cfg.get("compress_ratios")
    if ratios is None and cfg.get("layer_types") is not None:
        rates = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates |= cfg.get("compress_rates") or {}
        for key, layer_type in (("compress_rate_csa", "compressed_sparse_attention"),
                                ("compress_rate_hca", "heavily_compressed_attention")):
            rates[layer_type] = cfg.get(key, rates[layer_type])
        unknown = sorted(set(cfg["layer_types"]) - set(rates))
        if unknown:
            raise ModelFileError(f"{path}: unknown layer_types {unknown}")
        ratios = [rates[t] for t in cfg["layer_types"]]
    if ratios is None:
        raise ModelFileError(f"{path}: neither compress_ratios nor layer_types is given")
    if len(ratios) < n_layers:
        raise ModelFileError(f"{path}: {len(ratios)} compress ratios for {n_layers} layers")
    bad = sorted({r for r in ratios[:n_layers] if r not in (0, 4) and (r < 8 or r & (r - 1))})
    if bad:
        raise ModelFileError(f"{path}: unsupported compress ratios {bad} (0, 4 or a power of two >= 8)")
    return [int(r) for r in ratios[:n_layers]]


def _hash_layers(cfg: dict[str, Any], path: str) -> int:
    """Number of leading hash-routed layers (`num_hash_layers` or transformers' `mlp_layer_types`)."""
    if cfg.get("mlp_layer_types") is not None:
        types = cfg["mlp_layer_types"]
        n = sum(t == "hash_moe" for t in types)
        if types[:n] != ["hash_moe"] * n:
            raise ModelFileError(f"{path}: hash_moe layers must come first in mlp_layer_types")
        return n
    return int(cfg.get("num_hash_layers", cfg.get("n_hash_layers", 3)))


def _rope(cfg: dict[str, Any]) -> tuple[float, float, dict[str, Any]]:
    """(main theta, compressed theta, YaRN parameters of the compressed layers or {})."""
    params = cfg.get("rope_parameters") or {}
    main = params.get("main") if isinstance(params.get("main"), dict) else {}
    compress = params.get("compress") if isinstance(params.get("compress"), dict) else None
    if compress is None:
        compress = params or cfg.get("rope_scaling") or {}
    theta = main.get("rope_theta", cfg.get("rope_theta", 10000.0))
    compress_theta = compress.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))
    is_yarn = compress.get("rope_type", compress.get("type")) == "yarn"
    return float(theta), float(compress_theta), compress if is_yarn else {}


def metadata_from_config(cfg: dict[str, Any], path: str = "config.json") -> dict[str, Any]:
    """The `deepseek4.*` GGUF metadata (docs/model.md §1) of a transformers-style DeepSeek V4 config.json."""

    def need(*keys: str) -> Any:
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        raise ModelFileError(f"{path}: missing key {keys[0]}")

    n_layers, head_dim = int(need("num_hidden_layers")), int(need("head_dim"))
    if cfg.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ModelFileError(f"{path}: scoring_func {cfg['scoring_func']!r} is not sqrtsoftplus")
    if cfg.get("num_key_value_heads", 1) != 1 or cfg.get("n_shared_experts", 1) != 1:
        raise ModelFileError(f"{path}: DeepSeek V4 has one KV head and one shared expert")
    if cfg.get("n_group") not in (None, 0, 1):
        raise ModelFileError(f"{path}: group-limited routing (n_group={cfg['n_group']}) is not supported")
    rope_dim = cfg.get("qk_rope_head_dim") or round(head_dim * (cfg.get("partial_rotary_factor") or 64 / 512))
    theta, compress_theta, yarn = _rope(cfg)
    max_pos = int(cfg.get("max_position_embeddings", 1 << 20))
    p = "deepseek4."
    return layouts.dual_metadata({
        "general.name": str(cfg.get("_name_or_path") or Path(path).parent.name or "DeepSeek V4"),
        p + "block_count": n_layers,
        p + "embedding_length": int(need("hidden_size")),
        p + "vocab_size": int(need("vocab_size")),
        p + "attention.head_count": int(need("num_attention_heads")),
        p + "attention.head_count_kv": 1,
        p + "attention.key_length": head_dim,
        p + "attention.value_length": head_dim,
        p + "rope.dimension_count": int(rope_dim),
        p + "attention.q_lora_rank": int(need("q_lora_rank")),
        p + "attention.output_lora_rank": int(need("o_lora_rank")),
        p + "attention.output_group_count": int(need("o_groups")),
        p + "expert_count": int(need("n_routed_experts")),
        p + "expert_used_count": int(need("num_experts_per_tok")),
        p + "expert_shared_count": 1,
        p + "expert_feed_forward_length": int(need("moe_intermediate_size")),
        p + "hash_layer_count": _hash_layers(cfg, path),
        p + "expert_weights_scale": float(cfg.get("routed_scaling_factor", 1.5)),
        p + "expert_weights_norm": bool(cfg.get("norm_topk_prob", True)),
        p + "swiglu_clamp_exp": [float(cfg.get("swiglu_limit", 10.0))] * n_layers,
        p + "attention.sliding_window": int(need("sliding_window")),
        p + "attention.indexer.head_count": int(need("index_n_heads")),
        p + "attention.indexer.key_length": int(need("index_head_dim")),
        p + "attention.indexer.top_k": int(need("index_topk")),
        p + "hyper_connection.count": int(cfg.get("hc_mult", 4)),
        p + "hyper_connection.sinkhorn_iterations": int(cfg.get("hc_sinkhorn_iters", 20)),
        p + "hyper_connection.epsilon": float(cfg.get("hc_eps", 1e-6)),
        p + "attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        p + "rope.freq_base": theta,
        p + "attention.compress_rope_freq_base": compress_theta,
        # Without YaRN in the config the compressed layers use plain RoPE, which is YaRN with factor 1.
        p + "rope.scaling.factor": float(yarn.get("factor", 1.0)),
        p + "rope.scaling.yarn_beta_fast": float(yarn.get("beta_fast") or 32.0),
        p + "rope.scaling.yarn_beta_slow": float(yarn.get("beta_slow") or 1.0),
        p + "rope.scaling.original_context_length": int(yarn.get("original_max_position_embeddings", max_pos)),
        p + "attention.compress_ratios": _compress_ratios(cfg, n_layers, path),
        p + "context_length": max_pos,  # llama.cpp requires it; ds4 ignores it
    })  # + llama.cpp's expert_gating_func and rope.scaling.type: a file both load


def tokenizer_metadata(hf_dir: str | Path, vocab_size: int) -> dict[str, Any]:
    """The GGUF tokenizer keys built from the checkpoint's tokenizer.json, padded with `[PADi]` tokens up to
    the model's vocab_size (embedding rows past the tokenizer, as checkpoints often have), so every id the
    model can produce decodes."""
    path = Path(hf_dir) / "tokenizer.json"
    if not path.exists():
        raise ModelFileError(f"{path}: missing (pass tokenizer=False / --no-tokenizer to convert without one)")
    meta = metadata_from_hf(path)
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    if n_tokens > vocab_size:
        raise ModelFileError(f"{path}: {n_tokens} tokens, more than the model's vocab_size {vocab_size}")
    pad = range(n_tokens, vocab_size)
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + [f"[PAD{i}]" for i in pad]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [TOKEN_NORMAL] * len(pad)
    return meta


def check_outputs(hf_dir: str | Path, out: str | Path, mtp_out: str | Path | None) -> None:
    """Before any work: refuse an output that is a directory, one of the checkpoint's files, or the other
    output (the write would replace an input or itself)."""
    outs = [Path(p) for p in (out, mtp_out) if p is not None]
    for p in outs:
        if p.is_dir():
            raise UsageError(f"{p}: is a directory; give the GGUF file path to write")
    if len(outs) == 2 and outs[0].resolve() == outs[1].resolve():
        raise UsageError(f"{out}: the base and MTP outputs are the same file")
    folder = Path(hf_dir)
    inputs = [q for q in folder.iterdir() if q.is_file()] if folder.is_dir() else []
    for p in outs:
        if p.exists() and any(os.path.samefile(p, q) for q in inputs):
            raise UsageError(f"{p}: is one of the checkpoint's input files in {hf_dir}; choose another output")


def convert(hf_dir: str | Path, out: str | Path, mtp_out: str | Path | None = None, outtype: str = "q2",
            tokenizer: bool = True, progress: Callable[[Iterable], Iterable] = lambda items: items,
            mtp_layout: str = "ds4") -> None:
    """Convert checkpoint `hf_dir` into a base GGUF at `out` (and the MTP GGUF at `mtp_out`) with mix `outtype`.

    The base GGUF loads in ds4py, antirez/ds4 and llama.cpp; the MTP GGUF has `mtp_layout`: "ds4"
    (`mtp.0.*`) or "llama.cpp" (`blk.L.nextn.*`, eh_proj = [e_proj | h_proj], see ds4/formats/layouts.py).

    Tensors are converted one at a time as they are written; `progress` wraps the (name, tensor) items
    as they are, e.g. with tqdm.
    """
    if mtp_layout not in layouts.LAYOUTS:
        raise UsageError(f"unknown MTP layout {mtp_layout!r}; choose one of {', '.join(layouts.LAYOUTS)}")
    if outtype not in MIXES:
        raise UsageError(f"unknown tensor-type mix {outtype!r}; choose one of {', '.join(MIXES)}")
    for path in (out, mtp_out):
        if path is not None and not Path(path).parent.is_dir():
            raise UsageError(f"{path}: the output directory does not exist")
    check_outputs(hf_dir, out, mtp_out)
    meta = metadata_from_config(read_config(hf_dir), str(Path(hf_dir) / "config.json"))
    ckpt = Checkpoint(hf_dir)
    base, mtp = plan_tensors(ckpt, meta, mtp_out is not None)
    unknown = unrecognized(ckpt, [base, mtp], mtp_out is not None)
    if unknown:
        raise ModelFileError(f"{hf_dir}: {len(unknown)} tensors of unknown naming, e.g. {', '.join(unknown[:5])}")
    tok = tokenizer_metadata(hf_dir, meta["deepseek4.vocab_size"]) if tokenizer else {}
    base_tensors = {name: lazy_tensor(ckpt, name, parts, outtype) for name, parts in base.items()}
    gguf.write(out, {**meta, **tok}, base_tensors, progress=progress)
    if mtp_out is not None:
        tensors = {name: lazy_tensor(ckpt, name, parts, outtype) for name, parts in mtp.items()}
        mtp_meta = layouts.ds4_mtp_metadata(meta)
        if mtp_layout == "llama.cpp":
            tensors = layouts.llamacpp_mtp_tensors(tensors, base_tensors, meta["deepseek4.block_count"])
            mtp_meta = layouts.llamacpp_metadata(mtp_meta, mtp=True) | tok
        gguf.write(mtp_out, mtp_meta, tensors, progress=progress)
