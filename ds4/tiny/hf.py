"""Tiny random transformers `DeepseekV4ForCausalLM` models for the converter and oracle tests."""
from __future__ import annotations

import math

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def tiny_config(**overrides) -> DeepseekV4Config:
    """Six layers [SWA, SWA, CSA r4, HCA r16, CSA, HCA], window 16, indexer top-4, 8 experts top-2, 3 hash layers.

    Everything that transformers would otherwise default to the V4-Pro pattern or plain RoPE is explicit
    (docs/switches.md D7): `layer_types`, `compress_rates`, `mlp_layer_types`, `qk_rope_head_dim` and YaRN.
    """
    n_layers = len(overrides.get("layer_types", [SWA, SWA, CSA, HCA, CSA, HCA]))
    args = dict(
        vocab_size=320, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=n_layers,
        num_attention_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4, index_head_dim=32, index_topk=4,
        sliding_window=16, layer_types=[SWA, SWA, CSA, HCA, CSA, HCA],
        mlp_layer_types=["hash_moe"] * min(3, n_layers) + ["moe"] * max(0, n_layers - 3),
        compress_rates={CSA: 4, HCA: 16},
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=16384, tie_word_embeddings=False,
    )
    args.update(overrides)
    return DeepseekV4Config(**args)


def tiny_model(cfg: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A float32 model whose weights give O(1) activations and logits of a few units (not transformers' 0.02 init).

    Projections are randn/sqrt(fan_in) (experts x3), embeddings unit variance, norm weights near 1,
    sinks/HC biases/compressor position biases O(0.5), router biases O(0.1), tid2eid random distinct experts.
    """
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * (3 if "experts" in name else 1))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        n_experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model
