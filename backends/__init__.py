"""Backends: the registry plus Triton (CUDA) and MLX (Apple silicon) implementations of ops."""
