"""DeepSeek V4 Flash, eager, written against registry ops (model-spec.md is the spec).

`ModelArgs.from_metadata(md)` reads every dimension from GGUF `deepseek4.*` keys, so a tiny config runs
the same code as the 43-layer model. `DeepseekV4(args, weights)` takes GGUF-named QTensors (model-spec
§2) and never dequantizes a large weight: matmuls go through `ops.qmatmul` on the stored blocks.
The KV state lives in `LayerCache` objects that the caller (ds4.session) owns; `forward` runs a
contiguous block of tokens layer-major, writing their rows into those caches.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from backends.registry import OpSet
from ds4.errors import ModelFileError
from ops.hc_pre import sigmoid_rows
from ops.qmatmul import SMALL_M
from ops.quants import QTensor
from ops.rope_tail import rope_freqs

PREFIX = "deepseek4."
INDEXER_QUERY_BLOCK = 128

# ModelArgs field -> GGUF key (without the `deepseek4.` prefix).
METADATA_KEYS = {
    "n_layers": "block_count", "dim": "embedding_length", "vocab_size": "vocab_size",
    "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "v_head_dim": "attention.value_length",
    "rope_dim": "rope.dimension_count", "q_lora_rank": "attention.q_lora_rank",
    "o_lora_rank": "attention.output_lora_rank", "o_groups": "attention.output_group_count",
    "n_experts": "expert_count", "n_experts_used": "expert_used_count",
    "n_shared_experts": "expert_shared_count", "moe_inter_dim": "expert_feed_forward_length",
    "n_hash_layers": "hash_layer_count", "route_scale": "expert_weights_scale",
    "norm_topk_prob": "expert_weights_norm", "swiglu_limits": "swiglu_clamp_exp",
    "window": "attention.sliding_window", "index_n_heads": "attention.indexer.head_count",
    "index_head_dim": "attention.indexer.key_length", "index_topk": "attention.indexer.top_k",
    "hc_mult": "hyper_connection.count", "hc_sinkhorn_iters": "hyper_connection.sinkhorn_iterations",
    "hc_eps": "hyper_connection.epsilon", "rms_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base", "compress_rope_theta": "attention.compress_rope_freq_base",
    "rope_factor": "rope.scaling.factor", "beta_fast": "rope.scaling.yarn_beta_fast",
    "beta_slow": "rope.scaling.yarn_beta_slow", "original_ctx": "rope.scaling.original_context_length",
    "compress_ratios": "attention.compress_ratios",
}
MTP_PAIRINGS = ("official", "ds4")


@dataclass
class ModelArgs:
    """Hyperparameters (from GGUF metadata) and the semantic switches of semantics.md §6."""

    n_layers: int
    dim: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_experts: int
    n_experts_used: int
    n_shared_experts: int
    moe_inter_dim: int
    n_hash_layers: int
    route_scale: float
    norm_topk_prob: bool
    swiglu_limits: list[float]
    window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    beta_fast: float
    beta_slow: float
    original_ctx: int
    compress_ratios: list[int]
    # switches (semantics.md §6): defaults follow ds4 and the later official revision
    indexer_fp4_sim: bool = True   # D1: Hadamard + FP4 on indexer queries and keys
    kv_fp8_sim: bool = True        # D2: e4m3 simulation of the KV no-RoPE dims
    shared_swiglu_clamp: bool = True  # D3: clamp the shared expert's SwiGLU like the routed ones
    mtp_pairing: str = "official"  # D6: "official" = (H_i, t_{i+1}) -> t_{i+2}; "ds4" = (H_i, t_i) -> t_{i+1}
    f16_cache: bool = False        # round stored KV/indexer rows to F16 as ds4's CPU path does

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any], **switches: Any) -> ModelArgs:
        """Build from GGUF metadata; a missing or inconsistent key raises ModelFileError naming it."""
        values = {}
        for name, key in METADATA_KEYS.items():
            if PREFIX + key not in md:
                raise ModelFileError(f"GGUF metadata key {PREFIX + key} is missing")
            values[name] = md[PREFIX + key]
        for name in ("swiglu_limits", "compress_ratios"):
            values[name] = [v for v in (values[name].tolist() if hasattr(values[name], "tolist") else values[name])]
        for f in fields(cls):
            if f.name in values and f.type in ("int", "float", "bool"):
                values[f.name] = {"int": int, "float": float, "bool": bool}[f.type](values[f.name])
        values["swiglu_limits"] = [float(v) for v in values["swiglu_limits"]]
        values["compress_ratios"] = [int(v) for v in values["compress_ratios"]]
        groups = md.get(PREFIX + "expert_group_count", 0)
        if int(groups or 0) not in (0, 1):
            raise ModelFileError(f"GGUF metadata key {PREFIX}expert_group_count = {groups}: "
                                 "group-limited routing is not part of DeepSeek V4")
        args = cls(**values, **switches)
        args.validate()
        return args

    def validate(self) -> None:
        """Raise ModelFileError naming the first metadata key whose value the model cannot run."""
        def bad(key: str, why: str) -> None:
            raise ModelFileError(f"GGUF metadata key {PREFIX}{METADATA_KEYS.get(key, key)}: {why}")

        if self.n_kv_heads != 1:
            bad("n_kv_heads", f"{self.n_kv_heads} KV heads; DeepSeek V4 shares one KV head")
        if self.v_head_dim != self.head_dim:
            bad("v_head_dim", f"value length {self.v_head_dim} differs from key length {self.head_dim}")
        if self.rope_dim % 2 or not 0 < self.rope_dim < self.head_dim or (self.head_dim - self.rope_dim) % 64:
            bad("rope_dim", f"{self.rope_dim} RoPE dims of {self.head_dim}: the rest must be a multiple of 64")
        if self.index_head_dim & (self.index_head_dim - 1) or self.index_head_dim % 32 \
                or self.index_head_dim <= self.rope_dim:
            bad("index_head_dim", f"{self.index_head_dim} must be a power of two >= 32 above the RoPE dims")
        if self.n_heads % self.o_groups:
            bad("o_groups", f"{self.o_groups} groups do not divide {self.n_heads} heads")
        for key in ("compress_ratios", "swiglu_limits"):
            if len(getattr(self, key)) < self.n_layers:
                bad(key, f"{len(getattr(self, key))} entries for {self.n_layers} layers")
        if any(r < 0 for r in self.compress_ratios[:self.n_layers]):
            bad("compress_ratios", "negative ratio")
        if not 0 < self.n_experts_used <= self.n_experts:
            bad("n_experts_used", f"{self.n_experts_used} of {self.n_experts} experts")
        if self.mtp_pairing not in MTP_PAIRINGS:
            raise ModelFileError(f"mtp_pairing must be one of {MTP_PAIRINGS}, got {self.mtp_pairing!r}")

    def ratio(self, layer: int) -> int:
        """Compression ratio of `layer` (0 = raw window only; 4 = overlapping, with the indexer)."""
        return self.compress_ratios[layer]

    def clamp(self, layer: int) -> float:
        """SwiGLU clamp of `layer` (the MTP block uses entry n_layers when present, else the last)."""
        return self.swiglu_limits[min(layer, len(self.swiglu_limits) - 1)]


def block_shapes(args: ModelArgs, prefix: str, ratio: int, hashed: bool) -> dict[str, tuple[int, ...]]:
    """PyTorch-order shapes of one decoder block's tensors (names with `prefix`, e.g. `blk.3.`)."""
    D, H, hd, S = args.dim, args.n_heads, args.head_dim, args.hc_mult
    E, ffn, mix = args.n_experts, args.moe_inter_dim, (2 + S) * S
    shapes = {}
    for hc in ("hc_attn", "hc_ffn"):
        shapes |= {f"{hc}_fn.weight": (mix, S * D), f"{hc}_scale.weight": (3,), f"{hc}_base.weight": (mix,)}
    shapes |= {
        "attn_norm.weight": (D,), "ffn_norm.weight": (D,),
        "attn_q_a.weight": (args.q_lora_rank, D), "attn_q_a_norm.weight": (args.q_lora_rank,),
        "attn_q_b.weight": (H * hd, args.q_lora_rank),
        "attn_kv.weight": (hd, D), "attn_kv_a_norm.weight": (hd,), "attn_sinks.weight": (H,),
        "attn_output_a.weight": (args.o_groups * args.o_lora_rank, H * hd // args.o_groups),
        "attn_output_b.weight": (D, args.o_groups * args.o_lora_rank),
        "ffn_gate_inp.weight": (E, D),
        "ffn_gate_exps.weight": (E, ffn, D), "ffn_up_exps.weight": (E, ffn, D), "ffn_down_exps.weight": (E, D, ffn),
        "ffn_gate_shexp.weight": (ffn * args.n_shared_experts, D),
        "ffn_up_shexp.weight": (ffn * args.n_shared_experts, D),
        "ffn_down_shexp.weight": (D, ffn * args.n_shared_experts),
    }
    if hashed:
        shapes["ffn_gate_tid2eid.weight"] = (args.vocab_size, args.n_experts_used)
    else:
        shapes["exp_probs_b.bias"] = (E,)
    if ratio:
        W = (2 if ratio == 4 else 1) * hd
        shapes |= {"attn_compressor_kv.weight": (W, D), "attn_compressor_gate.weight": (W, D),
                   "attn_compressor_ape.weight": (ratio, W), "attn_compressor_norm.weight": (hd,)}
    if ratio == 4:
        di, Hi = args.index_head_dim, args.index_n_heads
        shapes |= {"indexer.attn_q_b.weight": (Hi * di, args.q_lora_rank), "indexer.proj.weight": (Hi, D),
                   "indexer_compressor_kv.weight": (2 * di, D), "indexer_compressor_gate.weight": (2 * di, D),
                   "indexer_compressor_ape.weight": (4, 2 * di), "indexer_compressor_norm.weight": (di,)}
    return {prefix + k: v for k, v in shapes.items()}


def model_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every base-model tensor name (model-spec §2) and its PyTorch-order shape."""
    D, S = args.dim, args.hc_mult
    shapes = {"token_embd.weight": (args.vocab_size, D), "output_hc_fn.weight": (S, S * D),
              "output_hc_scale.weight": (1,), "output_hc_base.weight": (S,), "output_norm.weight": (D,),
              "output.weight": (args.vocab_size, D)}
    for i in range(args.n_layers):
        shapes |= block_shapes(args, f"blk.{i}.", args.ratio(i), i < args.n_hash_layers)
    return shapes


OPTIONAL = ("exp_probs_b.bias",)  # the selection bias may be absent on the base model (model-spec §2)
SMALL = ("norm.weight", "_scale.weight", "_base.weight", "attn_sinks.weight", "_ape.weight", ".bias",
         "tid2eid.weight")  # tensors kept dequantized (vectors and tiny tables)


def bind(weights: Mapping[str, QTensor], shapes: dict[str, tuple[int, ...]], prefix: str,
         optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check names/shapes and return {name without prefix: QTensor, or float tensor for SMALL ones}."""
    bound = {}
    for name, shape in shapes.items():
        if name not in weights:
            if name.endswith(optional):
                continue
            raise ModelFileError(f"tensor {name} is missing")
        t = weights[name]
        if tuple(t.shape) != shape:
            raise ModelFileError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        short = name.removeprefix(prefix)
        bound[short] = t.dequantize() if name.endswith(SMALL) else t
    return bound


def score_block(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores [M, n] = Σ_h w_h · relu(q_h · key) for queries q [M, Hi, di], keys [n, di]."""
    return (torch.einsum("mhd,nd->mhn", q, keys).relu() * w[:, :, None]).sum(1)


def index_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Scores [M, n] of the keys each query sees (columns >= visible[m] are left for indexer_topk to mask)."""
    M = q.shape[0]
    if M > SMALL_M:  # prefill: blocks of queries over all n keys (rounding may depend on M)
        B = INDEXER_QUERY_BLOCK
        return torch.cat([score_block(q[s:s + B], keys, w[s:s + B]) for s in range(0, M, B)])
    scores = torch.full((M, keys.shape[0]), float("-inf"), device=q.device)
    for r, n in enumerate(visible.tolist()):  # batch-invariant: each row alone over its visible keys
        scores[r, :n] = score_block(q[r:r + 1], keys[:n], w[r:r + 1])[0]
    return scores


def rows_of(w: QTensor, start: int, stop: int) -> QTensor:
    """Zero-copy view of output rows [start, stop) of a 2-D QTensor."""
    return QTensor(w.qtype, (stop - start, w.shape[1]), w.data[start:stop], f"{w.name}[{start}:{stop}]")


@dataclass
class LayerCache:
    """KV state of one layer, indexed by absolute position so rollback is a position change.

    `rows` holds the raw window ring (`raw_cap` slots, position p at p % raw_cap) followed by the
    compressed rows (row c at raw_cap + c, append-only). `comp_kv`/`comp_score` keep each token's
    compressor inputs in a ring of `comp_cap` slots; `index_*` are the indexer's equivalents.
    """

    ratio: int
    raw_cap: int
    rows: torch.Tensor
    comp_cap: int = 0
    comp_kv: torch.Tensor | None = None
    comp_score: torch.Tensor | None = None
    index_rows: torch.Tensor | None = None
    index_kv: torch.Tensor | None = None
    index_score: torch.Tensor | None = None


class DeepseekV4:
    """The trunk: embedding, n_layers blocks with mHC, HC head, final norm and LM head."""

    def __init__(self, args: ModelArgs, weights: Mapping[str, QTensor], ops: OpSet | None = None):
        self.args, self.ops = args, ops or OpSet()
        g = bind(weights, {k: v for k, v in model_shapes(args).items() if not k.startswith("blk.")}, "")
        self.embedding, self.output = g["token_embd.weight"], g["output.weight"]
        self.head_weights = {"fn": g["output_hc_fn.weight"], "scale": g["output_hc_scale.weight"],
                             "base": g["output_hc_base.weight"], "norm": g["output_norm.weight"]}
        self.layers = []
        for i in range(args.n_layers):
            prefix = f"blk.{i}."
            shapes = block_shapes(args, prefix, args.ratio(i), i < args.n_hash_layers)
            self.layers.append(self.make_block(bind(weights, shapes, prefix, OPTIONAL), args.ratio(i),
                                               i < args.n_hash_layers, args.clamp(i)))

    @classmethod
    def from_gguf(cls, path: Any, ops: OpSet | None = None, **switches: Any) -> DeepseekV4:
        """Load from a ds4-layout GGUF path or an opened `ds4.gguf.GGUFFile` (memory-mapped; weights stay
        in their stored blocks)."""
        from ds4 import gguf
        f = path if isinstance(path, gguf.GGUFFile) else gguf.open(path)
        try:
            args = ModelArgs.from_metadata(f.metadata, **switches)
            return cls(args, {name: f.raw(name) for name in f.tensors}, ops)
        except ModelFileError as e:
            raise ModelFileError(f"{f.path}: {e}") from None

    def make_block(self, w: dict[str, Any], ratio: int, hashed: bool, clamp: float) -> dict[str, Any]:
        """Attach a block's derived constants (RoPE frequencies, output groups) to its weights."""
        a = self.args
        yarn = (a.rope_factor, a.beta_fast, a.beta_slow, a.original_ctx)
        w["ratio"], w["hashed"], w["clamp"] = ratio, hashed, clamp
        theta = a.compress_rope_theta if ratio else a.rope_theta
        w["freqs"] = rope_freqs(a.rope_dim, theta, yarn if ratio else None)
        r = a.o_lora_rank
        w["attn_output_a_groups"] = [rows_of(w["attn_output_a.weight"], g * r, (g + 1) * r) for g in range(a.o_groups)]
        if hashed:
            w["tid2eid"] = w.pop("ffn_gate_tid2eid.weight").to(torch.int64)
        return w

    # ---- caches -------------------------------------------------------------------------------

    def new_cache(self, ratio: int, ctx: int, chunk: int) -> LayerCache:
        """Empty state for a layer of compression `ratio`, for `ctx` tokens fed `chunk` at a time at most."""
        a, hd = self.args, self.args.head_dim
        raw_cap = a.window + chunk
        n_comp = ctx // ratio + 1 if ratio else 0
        cache = LayerCache(ratio, raw_cap, torch.zeros(raw_cap + n_comp, hd))
        if ratio:
            coff = 2 if ratio == 4 else 1
            cache.comp_cap = 2 * ratio + chunk
            cache.comp_kv = torch.zeros(cache.comp_cap, coff * hd)
            cache.comp_score = torch.zeros(cache.comp_cap, coff * hd)
        if ratio == 4:
            di = a.index_head_dim
            cache.index_rows = torch.zeros(n_comp, di)
            cache.index_kv = torch.zeros(cache.comp_cap, 2 * di)
            cache.index_score = torch.zeros(cache.comp_cap, 2 * di)
        return cache

    def new_caches(self, ctx: int, chunk: int) -> list[LayerCache]:
        """Empty state of every trunk layer."""
        return [self.new_cache(L["ratio"], ctx, chunk) for L in self.layers]

    # ---- forward ------------------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of `ids` [M] as float32 [M, D], dequantizing only those rows."""
        e = self.embedding
        return QTensor(e.qtype, (ids.shape[0], e.shape[1]), e.data[ids], e.name).dequantize()

    def forward(self, ids: torch.Tensor, start: int, caches: list[LayerCache],
                logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens `ids` [M] at positions start..start+M-1; returns the final HC states [M, S, D]
        and the logits of `logit_rows` (None: no LM head at all)."""
        pos = torch.arange(start, start + ids.shape[0])
        X = self.embed(ids)[:, None, :].repeat(1, self.args.hc_mult, 1)
        for L, cache in zip(self.layers, caches, strict=False):
            X = self.block(L, X, ids, pos, cache)
        logits = None if logit_rows is None else self.logits(X[logit_rows], self.head_weights)
        return X, logits

    def logits(self, X: torch.Tensor, head: dict[str, Any]) -> torch.Tensor:
        """HC collapse, final norm and the LM head on HC states [M, S, D] -> [M, vocab]."""
        a, ops = self.args, self.ops
        m = ops.qmatmul(ops.rms_norm(X.flatten(1), None, a.rms_eps), head["fn"])
        w = sigmoid_rows(m * head["scale"] + head["base"]) + a.hc_eps
        x = w[:, 0, None] * X[:, 0]
        for h in range(1, X.shape[1]):
            x = x + w[:, h, None] * X[:, h]
        return ops.qmatmul(ops.rms_norm(x, head["norm"], a.rms_eps), self.output)

    def block(self, L: dict[str, Any], X: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
              cache: LayerCache, valid_from: int = 0) -> torch.Tensor:
        """One decoder block (attention then FFN, each wrapped in HC pre/post); raw rows below
        position `valid_from` are not attended (the MTP cache may start late)."""
        x, post, comb = self.hc_pre(X, L, "hc_attn")
        X = self.ops.hc_post(X, self.attention(L, x, pos, cache, valid_from), post, comb)
        x, post, comb = self.hc_pre(X, L, "hc_ffn")
        return self.ops.hc_post(X, self.ffn(L, x, ids), post, comb)

    def hc_pre(self, X: torch.Tensor, L: dict[str, Any], hc: str):
        """HC pre step of sub-layer `hc`, returning the normed sub-layer input, post and comb."""
        a, ops = self.args, self.ops
        mixes = ops.qmatmul(ops.rms_norm(X.flatten(1), None, a.rms_eps), L[f"{hc}_fn.weight"])
        x, post, comb = ops.hc_pre(X, mixes, L[f"{hc}_scale.weight"], L[f"{hc}_base.weight"],
                                   a.hc_sinkhorn_iters, a.hc_eps)
        norm = L["attn_norm.weight" if hc == "hc_attn" else "ffn_norm.weight"]
        return ops.rms_norm(x, norm, a.rms_eps), post, comb

    def kv_store(self, kv: torch.Tensor) -> torch.Tensor:
        """A KV row as stored: FP8-simulated no-RoPE dims (switch kv_fp8_sim), optionally F16-rounded."""
        a = self.args
        if a.kv_fp8_sim:
            nope = a.head_dim - a.rope_dim
            kv = torch.cat((self.ops.fp8_sim(kv[..., :nope]), kv[..., nope:]), dim=-1)
        return kv.half().float() if a.f16_cache else kv

    def index_sim(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer query/key as scored: Hadamard + FP4 simulation (switch indexer_fp4_sim)."""
        return self.ops.fp4_sim(self.ops.hadamard(x)) if self.args.indexer_fp4_sim else x

    def index_store(self, k: torch.Tensor) -> torch.Tensor:
        """An indexer key row as stored: `index_sim`, optionally F16-rounded."""
        k = self.index_sim(k)
        return k.half().float() if self.args.f16_cache else k

    def attention(self, L: dict[str, Any], a_in: torch.Tensor, pos: torch.Tensor, cache: LayerCache,
                  valid_from: int = 0) -> torch.Tensor:
        """Attention sub-layer output [M, D] for normed inputs `a_in` [M, D] at positions `pos`."""
        args, ops = self.args, self.ops
        M, H, hd, eps, freqs = a_in.shape[0], args.n_heads, args.head_dim, args.rms_eps, L["freqs"]
        q_lat = ops.rms_norm(ops.qmatmul(a_in, L["attn_q_a.weight"]), L["attn_q_a_norm.weight"], eps)
        q = ops.rms_norm(ops.qmatmul(q_lat, L["attn_q_b.weight"]).view(M, H, hd), None, eps)
        q = ops.rope_tail(q, pos, freqs)
        kv = ops.rms_norm(ops.qmatmul(a_in, L["attn_kv.weight"]), L["attn_kv_a_norm.weight"], eps)
        cache.rows[pos % cache.raw_cap] = self.kv_store(ops.rope_tail(kv, pos, freqs))

        back = torch.arange(args.window)
        raw_pos = pos[:, None] - back[None, :]
        rows = torch.where(raw_pos >= valid_from, raw_pos % cache.raw_cap, -1)
        ratio = L["ratio"]
        if ratio:
            self.compressor(L, "attn_compressor", a_in, pos, cache.comp_kv, cache.comp_score,
                            cache.rows[cache.raw_cap:], hd, ratio, self.kv_store)
            visible = (pos + 1) // ratio
            if ratio == 4:
                self.compressor(L, "indexer_compressor", a_in, pos, cache.index_kv, cache.index_score,
                                cache.index_rows, args.index_head_dim, ratio, self.index_store)
                comp = self.indexer(L, a_in, q_lat, pos, cache, visible)
            else:
                c = torch.arange(int(visible.max()))
                comp = torch.where(c[None, :] < visible[:, None], c[None, :], -1)
            rows = torch.cat((rows, torch.where(comp >= 0, comp + cache.raw_cap, -1)), dim=1)

        o = ops.sparse_attention(q, cache.rows, rows, L["attn_sinks.weight"], 1 / math.sqrt(hd))
        o = ops.rope_tail(o, pos, freqs, inverse=True).reshape(M, args.o_groups, -1)
        u = torch.cat([ops.qmatmul(o[:, g], w) for g, w in enumerate(L["attn_output_a_groups"])], dim=1)
        return ops.qmatmul(u, L["attn_output_b.weight"])

    def compressor(self, L: dict[str, Any], name: str, a_in: torch.Tensor, pos: torch.Tensor,
                   kv_ring: torch.Tensor, score_ring: torch.Tensor, out_rows: torch.Tensor, d: int,
                   ratio: int, store) -> None:
        """Record each token's compressor inputs and emit the rows of the blocks these tokens complete."""
        ops, cap = self.ops, kv_ring.shape[0]
        kv_ring[pos % cap] = ops.qmatmul(a_in, L[f"{name}_kv.weight"])
        score_ring[pos % cap] = ops.qmatmul(a_in, L[f"{name}_gate.weight"]) + L[f"{name}_ape.weight"][pos % ratio]
        blocks = (pos[(pos + 1) % ratio == 0] + 1) // ratio - 1
        if blocks.numel() == 0:
            return
        tok = blocks[:, None] * ratio + torch.arange(ratio)[None, :]
        kv, score = kv_ring[tok % cap], score_ring[tok % cap]
        if ratio == 4:  # overlapping: previous block's lane 0, then this block's lane 1
            prev = tok - ratio
            prev_score = torch.where((prev >= 0)[..., None], score_ring[prev % cap][..., :d], float("-inf"))
            prev_kv = torch.where((prev >= 0)[..., None], kv_ring[prev % cap][..., :d], 0.0)
            kv = torch.cat((prev_kv, kv[..., d:]), dim=1)
            score = torch.cat((prev_score, score[..., d:]), dim=1)
        pooled = ops.rms_norm(ops.compress(kv, score), L[f"{name}_norm.weight"], self.args.rms_eps)
        out_rows[blocks] = store(ops.rope_tail(pooled, blocks * ratio, L["freqs"]))

    def indexer(self, L: dict[str, Any], a_in: torch.Tensor, q_lat: torch.Tensor, pos: torch.Tensor,
                cache: LayerCache, visible: torch.Tensor) -> torch.Tensor:
        """Compressed rows [M, top_k] each query attends to (−1 = none), chosen by the lightning indexer."""
        args, ops = self.args, self.ops
        M, Hi, di = a_in.shape[0], args.index_n_heads, args.index_head_dim
        q = ops.rope_tail(ops.qmatmul(q_lat, L["indexer.attn_q_b.weight"]).view(M, Hi, di), pos, L["freqs"])
        q = self.index_sim(q)
        w = ops.qmatmul(a_in, L["indexer.proj.weight"]) / math.sqrt(Hi * di)
        scores = index_scores(q, cache.index_rows[:int(visible.max())], w, visible)
        return ops.indexer_topk(scores, args.index_topk, visible)

    def ffn(self, L: dict[str, Any], x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts plus the shared expert for normed inputs `x` [M, D]."""
        a, ops, clamp = self.args, self.ops, L["clamp"]
        routed = ops.moe(x, L["ffn_gate_inp.weight"], L.get("exp_probs_b.bias"),
                         L["tid2eid"][ids] if L["hashed"] else None,
                         L["ffn_gate_exps.weight"], L["ffn_up_exps.weight"], L["ffn_down_exps.weight"],
                         a.n_experts_used, a.route_scale, a.norm_topk_prob, clamp, ops)
        g = ops.qmatmul(x, L["ffn_gate_shexp.weight"])
        u = ops.qmatmul(x, L["ffn_up_shexp.weight"])
        if a.shared_swiglu_clamp:
            g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
        return routed + ops.qmatmul(F.silu(g) * u, L["ffn_down_shexp.weight"])
