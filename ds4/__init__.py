"""ds4py: DeepSeek V4 Flash inference in Python with JIT kernels and PyTorch references."""
