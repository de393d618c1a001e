"""The fused ops on Triton (contracts: ops/hc_pre_norm.py, ops/qmatmul_norm_rope.py): each sequence made of this
backend's own kernels (rms_norm, qmatmul, hc_pre, rope_tail), one op call instead of three or four. Batch-invariant as
those kernels are."""
from __future__ import annotations

from backends.registry import register
from ops.hc_pre_norm import hc_pre_norm_of
from ops.qmatmul_norm_rope import qmatmul_norm_rope_of

from .hyper import hc_pre
from .norms import rms_norm, rope_tail
from .qmatmul import qmatmul

hc_pre_norm = register("hc_pre_norm", "triton", batch_invariant=True)(hc_pre_norm_of(rms_norm, qmatmul, hc_pre))
qmatmul_norm_rope = register("qmatmul_norm_rope", "triton", batch_invariant=True)(
    qmatmul_norm_rope_of(qmatmul, rms_norm, rope_tail))
