"""Tiny random DeepSeek V4 models with the real architecture: metadata, weights, base + MTP GGUFs.

Every size is a keyword of `tiny_metadata`; the defaults give 6 layers with ratios [0, 0, 4, 16, 4, 16]
(3 hash layers), hidden 128, 4 heads of 80 dims (16 RoPE), window 16, 8 experts top-2, an indexer of
4 heads x 32 dims choosing 4 rows, YaRN over an original context of 64 — small enough for CPU tests,
large enough that prompts cross window, compression and indexer boundaries.
"""
from __future__ import annotations

import math

import torch

from ds4.errors import UsageError
from ds4.formats import gguf, layouts
from ds4.formats.quant_mix import tensor_type
from ds4.tiny.vocab import tiny_vocab_metadata
from models.args import METADATA_KEYS, PREFIX, ModelArgs, model_shapes, mtp_shapes
from ops.quants import QTensor

TINY = {"n_layers": 6, "dim": 128, "vocab_size": 512, "n_heads": 4, "head_dim": 80, "rope_dim": 16,
        "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 2, "n_experts": 8, "n_experts_used": 2,
        "moe_inter_dim": 64, "n_hash_layers": 3, "window": 16, "index_n_heads": 4, "index_head_dim": 32,
        "index_topk": 4, "original_ctx": 64, "compress_ratios": (0, 0, 4, 16, 4, 16)}

# DeepSeek V4 Flash (docs/model.md §1): layers 0-1 ratio 0, then 4 on even and 128 on odd layers
FLASH_SIZES = {"n_layers": 43, "dim": 4096, "vocab_size": 129280, "n_heads": 64, "head_dim": 512,
               "rope_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "n_experts": 256,
               "n_experts_used": 6, "moe_inter_dim": 2048, "n_hash_layers": 3, "window": 128,
               "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "original_ctx": 65536,
               "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)]}


# Sizes and constants shared by every tiny model (DeepSeek V4's own values where they are not sizes).
FIXED = {"n_kv_heads": 1, "n_shared_experts": 1, "route_scale": 1.5, "norm_topk_prob": True, "hc_mult": 4,
         "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-6, "rope_theta": 10000.0,
         "compress_rope_theta": 160000.0, "rope_factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0}


def tiny_metadata(**sizes) -> dict:
    """GGUF metadata (deepseek4.* keys and a tiny tokenizer) for a tiny model; override any TINY size."""
    unknown = sorted(set(sizes) - set(TINY))
    if unknown:
        raise UsageError(f"unknown tiny model sizes {unknown}; known: {', '.join(TINY)}")
    s = {**TINY, **sizes}
    n = s["n_layers"]
    if "n_hash_layers" not in sizes:  # the default hash layers, as many as there are layers
        s["n_hash_layers"] = min(TINY["n_hash_layers"], n)
    ratios = list(s["compress_ratios"])[:n] + [0] * max(0, n - len(s["compress_ratios"]))
    values = FIXED | s | {"v_head_dim": s["head_dim"], "swiglu_limits": [10.0] * n,
                          "compress_ratios": ratios + [0]}
    md = {PREFIX + METADATA_KEYS[name]: value for name, value in values.items()}
    # the keys llama.cpp's deepseek4 loader also requires (context length, gating function, YaRN type)
    md = layouts.dual_metadata(md)
    return md | {"general.name": "ds4py tiny random DeepSeek V4"} | tiny_vocab_metadata(s["vocab_size"])


def mtp_metadata(md: dict) -> dict:
    """The ds4-layout MTP GGUF's metadata (see layouts.ds4_mtp_metadata)."""
    return layouts.ds4_mtp_metadata(md)


def random_tensor(name: str, shape: tuple[int, ...], args: ModelArgs, g: torch.Generator) -> torch.Tensor:
    """A random float weight with roughly the scale a trained model has in that role."""
    if name.endswith("tid2eid.weight"):
        return torch.randint(0, args.n_experts, shape, generator=g).float()
    randn = torch.randn(shape, generator=g)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * randn
    if name.endswith(("_scale.weight", "_base.weight", ".bias", "_ape.weight")):
        return 0.5 * randn
    if name.endswith("attn_sinks.weight"):
        return randn
    if name == "token_embd.weight":
        return randn
    scale = 1 / math.sqrt(shape[-1])
    return randn * scale * (3 if "_exps" in name else 1)


def random_weights(shapes: dict[str, tuple[int, ...]], args: ModelArgs, mix: str, seed: int) -> dict[str, QTensor]:
    """Random weights for `shapes`, each stored in the type `mix` gives its name."""
    g = torch.Generator().manual_seed(seed)
    return {name: QTensor.quantize(random_tensor(name, shape, args, g), tensor_type(name, shape, mix), name)
            for name, shape in shapes.items()}


def tiny_model_weights(mix: str = "f32", seed: int = 0, **sizes) -> tuple[dict, dict, dict]:
    """(metadata, base weights, MTP weights) of a tiny random model, all in memory."""
    md = tiny_metadata(**sizes)
    args = ModelArgs.from_metadata(md)
    base = random_weights(model_shapes(args), args, mix, seed)
    return md, base, random_weights(mtp_shapes(args), args, mix, seed + 1)


def write_tiny(out: str, mtp_out: str | None = None, mix: str = "f32", seed: int = 0, mtp_layout: str = "ds4",
               **sizes) -> None:
    """Write a tiny random base GGUF (and its MTP GGUF when `mtp_out` is given, in `mtp_layout` ds4 | llama.cpp).

    The base file carries ds4's keys and the ones llama.cpp requires; llama.cpp's loader accepts only
    compress ratios 0, 4 and 128 (pass compress_ratios=(0, 0, 4, 128, ...) for a file it loads).
    """
    if mtp_layout not in layouts.LAYOUTS:
        raise UsageError(f"unknown MTP layout {mtp_layout!r}; choose one of {', '.join(layouts.LAYOUTS)}")
    md, base, mtp = tiny_model_weights(mix, seed, **sizes)
    gguf.write(out, md, base)
    if mtp_out:
        mtp_md = mtp_metadata(md)
        if mtp_layout == "ds4":
            gguf.write(mtp_out, mtp_md, mtp)
        else:
            tok = {k: v for k, v in md.items() if k.startswith("tokenizer.")}
            gguf.write(mtp_out, layouts.llamacpp_metadata(mtp_md, mtp=True) | tok,
                       layouts.llamacpp_mtp_tensors(mtp, base, int(md[PREFIX + "block_count"])))
