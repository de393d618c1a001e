"""Triton kernels; importing this package registers them. Set TRITON_INTERPRET=1 before import to run on CPU."""
from . import (
    attention,  # noqa: F401
    cache,  # noqa: F401
    compress,  # noqa: F401
    fused,  # noqa: F401
    hyper,  # noqa: F401
    indexer,  # noqa: F401
    moe,  # noqa: F401
    norms,  # noqa: F401
    qmatmul,  # noqa: F401
    sims,  # noqa: F401
    verify_argmax,  # noqa: F401
)
