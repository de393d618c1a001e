"""llama.cpp's named quantization mixes (`llama-quantize ... Q4_K_M`), as its per-tensor choice works out for
DeepSeek V4's tensors (src/llama-quant.cpp, `llama_tensor_get_type`; llama.cpp #4773 gave the K-mixes their
per-role bumps).

What it amounts to for this architecture, in our words:

* Only 2-D and 3-D `*.weight` tensors are requantized; norms, the router `ffn_gate_inp` and the `tid2eid`
  table keep their stored type. Everything else (attention projections, HC mixing matrices, compressors,
  indexer, the embedding, shared and routed experts) starts from the mix's default type.
* V4 has none of the roles llama.cpp treats specially in attention (`attn_v`, `attn_qkv`, `attn_kv_b`,
  `attn_k`, `attn_q`, `attn_output`), so they all take the default type.
* `output` (the LM head) gets Q6_K in every K/IQ mix, Q5_K in the IQ1/IQ2/IQ3_XXS mixes, Q8_0 in Q8_0 and
  MXFP4_MOE, and Q8_0 when its rows do not split into the default type's blocks.
* `token_embd` is Q2_K in IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS, IQ3_S in IQ2_S/IQ2_M/IQ3_XXS, Q4_K in TQ1_0/TQ2_0,
  else the default type.
* `ffn_down` (routed and shared) of layer i of n gets more bits in the first and last eighth and every
  third layer between (`more_bits`): Q6_K in Q4_K_M and Q5_K_M there; Q3_K_M: Q5_K in the first 1/16,
  else Q4_K; Q3_K_L: Q5_K; Q4_K_S: Q5_K in the first eighth; Q2_K: Q3_K; Q2_K_S: Q4_K in the first
  eighth; IQ4_XS/IQ4_NL without an imatrix: Q5_K in the first eighth; IQ3_XXS without an imatrix: Q4_K in
  the first eighth, else Q3_K; IQ3_M: Q4_K in the first eighth (and, with exactly 8 experts, in the
  `more_bits` layers); the IQ1/IQ2 mixes: Q2_K (IQ3_S for IQ2_S/IQ2_M) for the first eighth of
  the `ffn_down` tensors in file order; Q4_0/Q5_0 with an imatrix: Q4_1/Q5_1 in the first eighth.
* `ffn_gate` / `ffn_up` go to IQ3_XXS in IQ3_XS's middle three quarters of the layers.
* MXFP4_MOE: routed experts (3-D) MXFP4, every other quantized tensor Q8_0.
"""
from __future__ import annotations

import re

import gguf

# mix name -> default tensor type (llama_ftype_get_default_type)
DEFAULT_TYPE = {
    "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q8_0": "Q8_0",
    "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
    "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS",
    "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0", "MXFP4_MOE": "MXFP4",
}
MIXES = tuple(DEFAULT_TYPE)
_LOW_IQ = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M"}
# types whose quantizer llama.cpp refuses to run without an importance matrix (tensor_requires_imatrix)
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
# when a row does not split into the chosen type's blocks (tensor_type_fallback); then F16 if still not
FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
            "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
            "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_LAYER = re.compile(r"^blk\.(\d+)\.")
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight")


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize requantizes tensor `name` at all (2-D/3-D `.weight`, not a norm, router or table)."""
    return len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NOT_QUANTIZED)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layer_of(name: str, n_layer: int) -> int:
    """The layer index in `blk.N.` (an `mtp.N.` tensor counts as the last layer)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else n_layer - 1


def _ffn_down(mix: str, i: int, n: int, down_index: int, has_imatrix: bool, default: str, n_expert: int) -> str:
    """The type of a `ffn_down` tensor of layer i of n (down_index: its rank among ffn_down tensors)."""
    first_eighth = i < n // 8
    if mix in _LOW_IQ:
        return ("IQ3_S" if mix in ("IQ2_S", "IQ2_M") else "Q2_K") if down_index < n // 8 else default
    choices = {
        "Q2_K": "Q3_K",
        "Q2_K_S": "Q4_K" if first_eighth else default,
        "IQ3_XXS": default if has_imatrix else ("Q4_K" if first_eighth else "Q3_K"),
        "Q3_K_M": "Q5_K" if i < n // 16 else "Q4_K",
        "IQ3_M": "Q4_K" if first_eighth or (n_expert == 8 and more_bits(i, n)) else default,
        "Q3_K_L": "Q5_K",
        "Q4_K_M": "Q6_K" if more_bits(i, n) else default,
        "IQ4_NL": "Q5_K" if first_eighth and not has_imatrix else default,
        "IQ4_XS": "Q5_K" if first_eighth and not has_imatrix else default,
        "Q5_K_M": "Q6_K" if more_bits(i, n) else default,
        "Q4_K_S": "Q5_K" if first_eighth else default,
        "Q4_0": "Q4_1" if first_eighth and has_imatrix else default,
        "Q5_0": "Q5_1" if first_eighth and has_imatrix else default,
    }
    return choices.get(mix, default)


def tensor_type(name: str, shape: tuple[int, ...], mix: str, *, n_layer: int, down_index: int,
                has_imatrix: bool, n_expert: int = 0) -> str:
    """The type llama-quantize's mix `mix` picks for quantizable tensor `name` (row length `shape[-1]`), before
    the block-size fallback; `down_index` counts the `ffn_down` tensors before this one in file order and
    `n_expert` is the routed expert count (llama.cpp special-cases exactly 8)."""
    default = DEFAULT_TYPE[mix]
    if name == "output.weight":
        if mix == "MXFP4_MOE" or shape[-1] % _block(default):
            return "Q8_0"
        if mix in _LOW_IQ | {"IQ3_XXS"}:
            return "Q5_K"
        return "Q8_0" if default == "Q8_0" else "Q6_K"
    if mix == "MXFP4_MOE":
        return "MXFP4" if len(shape) == 3 else "Q8_0"
    if name == "token_embd.weight":
        if mix in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return "Q2_K"
        if mix in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S"
        return "Q4_K" if mix in ("TQ1_0", "TQ2_0") else default
    i = layer_of(name, n_layer)
    if "ffn_down" in name:
        return _ffn_down(mix, i, n_layer, down_index, has_imatrix, default, n_expert)
    if ("ffn_up" in name or "ffn_gate" in name) and mix == "IQ3_XS" and n_layer // 8 <= i < 7 * n_layer // 8:
        return "IQ3_XXS"
    return default


def _block(type_name: str) -> int:
    """Values per block of a ggml type (by gguf-py's table, so unregistered types work too)."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def fallback(type_name: str, row: int) -> tuple[str, str]:
    """(type, note) for a row of `row` values: `type_name` when its block divides the row, else llama.cpp's
    fallback (F16 when that does not divide it either), with a note saying so."""
    if row % _block(type_name) == 0:
        return type_name, ""
    alt = FALLBACK.get(type_name, type_name)
    if row % _block(alt):
        alt = "F16"
    return alt, f"row length {row} is not a multiple of the {type_name} block ({_block(type_name)}): {alt}"
