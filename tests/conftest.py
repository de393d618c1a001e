"""Test setup: Triton kernels run under the interpreter on CPU, so it must be on before any import."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
