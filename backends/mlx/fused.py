"""The fused ops on MLX (contracts: ops/hc_pre_norm.py, ops/hc_post_pre_norm.py, ops/qmatmul_norm_rope.py,
ops/attention_output.py, ops/compressor_store.py, ops/attention_input.py, ops/indexer_query.py, ops/ffn.py): each
sequence made of this backend's own ops (rms_norm, qmatmul, grouped_qmatmul, hc_pre, hc_post, rope_tail, store_rows,
hadamard, fp4_sim, moe, shared_expert), one op call instead of two to seven; MLX evaluates the whole step lazily, so
the calls saved are Python."""
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

from .attention import store_rows
from .hc import hc_post, hc_pre
from .linear import grouped_qmatmul, moe, qmatmul, shared_expert
from .pointwise import fp4_sim, hadamard, rms_norm, rope_tail

hc_pre_norm = register("hc_pre_norm", "mlx")(hc_pre_norm_of(rms_norm, qmatmul, hc_pre))
qmatmul_norm_rope = register("qmatmul_norm_rope", "mlx")(qmatmul_norm_rope_of(qmatmul, rms_norm, rope_tail))
attention_output = register("attention_output", "mlx")(attention_output_of(rope_tail, grouped_qmatmul, qmatmul))
compressor_store = register("compressor_store", "mlx")(compressor_store_of(qmatmul, store_rows))
hc_post_pre_norm = register("hc_post_pre_norm", "mlx")(hc_post_pre_norm_of(hc_post, hc_pre_norm))
attention_input = register("attention_input", "mlx")(attention_input_of(qmatmul_norm_rope, store_rows))
indexer_query = register("indexer_query", "mlx")(
    indexer_query_of(qmatmul, rope_tail, hadamard, fp4_sim))
ffn = register("ffn", "mlx")(ffn_of(moe, shared_expert))
