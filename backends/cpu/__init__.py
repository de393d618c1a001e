"""The CPU fast path (`cpu` backend, docs/cpu.md): batch-invariant ops without row-by-row loops and a
quantized matmul that dequantizes one weight tile at a time. Importing this package registers its ops;
`auto` uses them for CPU tensors, `--backend torch` still runs the pure references (the oracle)."""
import os

from . import attention, ffn, fused, hc, qmatmul, rowops  # noqa: F401  (registers the ops)

if os.environ.get("DS4_COMPILE_C_OPS") == "1":     # a compiled step calls the ops as they are (custom_ops.py)
    from . import custom_ops
    custom_ops.use_c_ops(True)
