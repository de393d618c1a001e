"""Tensor-type mixes: which GGUF type each ds4-layout tensor gets when a model is written.

`q2` is the layout of ds4's published ~81 GB file (IQ2_XXS routed gate/up, Q2_K routed down),
`q4` puts every routed expert in Q4_K, and `f32` keeps every float tensor in F32 (for tests).
In all mixes the attention projections, shared experts, MTP projections and LM head are Q8_0;
HC control, compressor, indexer, router and embedding are F16; norms, sinks, biases and HC
scale/base are F32; `tid2eid` is I32.
"""
from __future__ import annotations

import re
import warnings

from ops.quants import get

MIXES = ("q2", "q4", "f32")

_ROUTED = {"q2": {"ffn_gate_exps": "IQ2_XXS", "ffn_up_exps": "IQ2_XXS", "ffn_down_exps": "Q2_K"},
           "q4": {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_K"}}

_Q8_0 = {"output", "attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b",
         "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "e_proj", "h_proj", "nextn.eh_proj"}
_F16 = {"token_embd", "output_hc_fn", "hc_attn_fn", "hc_ffn_fn", "hc_head_fn",
        "attn_compressor_kv", "attn_compressor_gate", "attn_compressor_ape",
        "indexer.attn_q_b", "indexer.proj",
        "indexer_compressor_kv", "indexer_compressor_gate", "indexer_compressor_ape", "ffn_gate_inp"}
_F32 = {"output_norm", "output_hc_scale", "output_hc_base", "hc_attn_scale", "hc_attn_base",
        "hc_ffn_scale", "hc_ffn_base", "hc_head_scale", "hc_head_base",
        "attn_norm", "ffn_norm", "attn_q_a_norm", "attn_kv_a_norm", "attn_sinks",
        "attn_compressor_norm", "indexer_compressor_norm", "exp_probs_b", "enorm", "hnorm", "norm",
        "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"}
_I32 = {"ffn_gate_tid2eid"}

_PREFIX = re.compile(r"^(blk\.\d+\.|mtp\.\d+\.)")
_SUFFIX = re.compile(r"\.(weight|bias)$")


def role(name: str) -> str:
    """The tensor's role: its ds4 name without the `blk.N.`/`mtp.N.` prefix and `.weight`/`.bias`."""
    return _SUFFIX.sub("", _PREFIX.sub("", name))


def tensor_type(name: str, shape: tuple, mix: str) -> str:
    """GGUF type name for ds4-layout tensor `name` of logical shape `shape` (last dim = row) under `mix`.

    A quantized type whose block does not divide the row length falls back to F16, with a warning
    naming the tensor.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown tensor-type mix {mix!r}; choose one of {', '.join(MIXES)}")
    r = role(name)
    if r in _I32:
        return "I32"
    if r in _F32 or mix == "f32":
        if r not in _F32 | _F16 | _Q8_0 | _ROUTED["q2"].keys():
            raise ValueError(f"tensor {name!r} is not part of the ds4 layout")
        return "F32"
    if r in _F16:
        return "F16"
    if r in _Q8_0:
        wanted = "Q8_0"
    elif r in _ROUTED[mix]:
        wanted = _ROUTED[mix][r]
    else:
        raise ValueError(f"tensor {name!r} is not part of the ds4 layout")
    row, block = shape[-1], get(wanted).block_size
    if row % block:
        warnings.warn(f"{name}: row length {row} is not a multiple of the {wanted} block "
                      f"({block}); writing it as F16", stacklevel=2)
        return "F16"
    return wanted
