"""The CPU fast path (`cpu` backend, docs/cpu.md): batch-invariant ops without row-by-row loops and a
quantized matmul that dequantizes one weight tile at a time. Importing this package registers its ops;
`auto` uses them for CPU tensors, `--backend torch` still runs the pure references (the oracle)."""
from . import attention, custom_ops, ffn, fused, hc, qmatmul, rowops  # noqa: F401  (registers the ops)

custom_ops.use_c_ops(custom_ops.WANTED)   # how a compiled step calls them (DS4_COMPILE_C_OPS=1: as they are)
