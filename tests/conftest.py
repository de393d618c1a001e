"""Test setup: Triton kernels run under the interpreter on CPU, so it must be on before any import."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)  # tiny shapes: one thread is 5-10x faster than two on a shared 2-core machine

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple[str, str]:
    """Paths of a tiny random base GGUF and its MTP GGUF, written once per test run."""
    from ds4.tiny.build import write_tiny
    d = tmp_path_factory.mktemp("tiny")
    base, mtp = str(d / "tiny.gguf"), str(d / "tiny-mtp.gguf")
    write_tiny(base, mtp, mix="f32", seed=0)
    return base, mtp
