"""The fused ops on Triton (contracts: ops/hc_pre_norm.py, ops/hc_post_pre_norm.py, ops/qmatmul_norm_rope.py,
ops/attention_output.py, ops/compressor_store.py, ops/attention_input.py, ops/indexer_query.py, ops/ffn.py): each
sequence made of this backend's own kernels (rms_norm, qmatmul, grouped_qmatmul, hc_pre, hc_post, rope_tail,
store_rows, hadamard, fp4_sim, moe, shared_expert), one op call instead of two to seven. Batch-invariant as those
kernels are."""
from __future__ import annotations

from backends.registry import register
from ops.attention_input import attention_input_of
from ops.attention_output import attention_output_of
from ops.compressor_store import compressor_store_of
from ops.ffn import ffn_of
from ops.hc_post_pre_norm import hc_post_pre_norm_of
from ops.hc_pre_norm import hc_pre_norm_of
from ops.indexer_query import indexer_query_of
from ops.qmatmul_norm_rope import qmatmul_norm_rope_of

from .cache import store_rows
from .hyper import hc_post, hc_pre
from .moe import moe, shared_expert
from .norms import rms_norm, rope_tail
from .qmatmul import grouped_qmatmul, qmatmul
from .sims import fp4_sim, hadamard

hc_pre_norm = register("hc_pre_norm", "triton", batch_invariant=True)(hc_pre_norm_of(rms_norm, qmatmul, hc_pre))
qmatmul_norm_rope = register("qmatmul_norm_rope", "triton", batch_invariant=True)(
    qmatmul_norm_rope_of(qmatmul, rms_norm, rope_tail))
attention_output = register("attention_output", "triton", batch_invariant=True)(
    attention_output_of(rope_tail, grouped_qmatmul, qmatmul))
compressor_store = register("compressor_store", "triton", batch_invariant=True)(
    compressor_store_of(qmatmul, store_rows))
hc_post_pre_norm = register("hc_post_pre_norm", "triton", batch_invariant=True)(
    hc_post_pre_norm_of(hc_post, hc_pre_norm))
attention_input = register("attention_input", "triton", batch_invariant=True)(
    attention_input_of(qmatmul_norm_rope, store_rows))
indexer_query = register("indexer_query", "triton", batch_invariant=True)(
    indexer_query_of(qmatmul, rope_tail, hadamard, fp4_sim))
ffn = register("ffn", "triton", batch_invariant=True)(ffn_of(moe, shared_expert))
