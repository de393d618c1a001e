"""MLX implementations; importing this package registers them."""
