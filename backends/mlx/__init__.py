"""MLX implementations of every op (docs/mlx.md); importing this package registers them."""
from . import attention, fused, hc, linear, pointwise, select  # noqa: F401
