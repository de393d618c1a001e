"""The fused ops on MLX (contracts: ops/hc_pre_norm.py, ops/qmatmul_norm_rope.py): each sequence made of this
backend's own ops (rms_norm, qmatmul, hc_pre, rope_tail), one op call instead of three or four; MLX evaluates the
whole step lazily, so the calls saved are Python."""
from __future__ import annotations

from backends.registry import register
from ops.hc_pre_norm import hc_pre_norm_of
from ops.qmatmul_norm_rope import qmatmul_norm_rope_of

from .hc import hc_pre
from .linear import qmatmul
from .pointwise import rms_norm, rope_tail

hc_pre_norm = register("hc_pre_norm", "mlx")(hc_pre_norm_of(rms_norm, qmatmul, hc_pre))
qmatmul_norm_rope = register("qmatmul_norm_rope", "mlx")(qmatmul_norm_rope_of(qmatmul, rms_norm, rope_tail))
