"""Test setup: the test device (tests/devices.py: CUDA natively when present, else the CPU with Triton's
interpreter) is chosen before any import of Triton; the markers that place or skip tests by device."""
import pytest
import torch

from tests.devices import DEVICE, DEVICE_ERROR, NATIVE, FactoriesOn  # sets TRITON_INTERPRET before any Triton import

torch.set_num_threads(1)  # tiny shapes: one thread is 5-10x faster than two on a shared 2-core machine

MARKERS = {
    "on_device": "runs on the test device (DS4_TEST_DEVICE; CUDA when present): factory calls land there",
    "native_only": "needs compiled kernels on a GPU (real dtypes, V4 Flash shapes): skipped under the interpreter",
    "interpreter_only": "checks what only holds without a GPU: skipped on CUDA",
}


def pytest_configure(config) -> None:
    """Register the device markers; a device asked for that cannot be had stops the run with one message."""
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if DEVICE_ERROR:
        raise pytest.UsageError(DEVICE_ERROR)


def pytest_report_header(config) -> str:
    """The device line at the top of the run."""
    where = f"{torch.cuda.get_device_name()}, compiled Triton kernels" if NATIVE else "Triton interpreter"
    return f"ds4 test device: {DEVICE} ({where}; DS4_TEST_DEVICE=cpu|cuda forces it)"


def pytest_collection_modifyitems(config, items) -> None:
    """Skip, with the reason, tests whose device marker does not fit this run."""
    for item in items:
        if not NATIVE and item.get_closest_marker("native_only"):
            item.add_marker(pytest.mark.skip(reason="native GPU variant: needs DS4_TEST_DEVICE=cuda on a CUDA GPU"))
        if NATIVE and item.get_closest_marker("interpreter_only"):
            reason = item.get_closest_marker("interpreter_only").kwargs.get("reason", "checks the CPU-only path")
            item.add_marker(pytest.mark.skip(reason=f"interpreter only: {reason}"))


@pytest.fixture
def device() -> str:
    """The test device: "cuda" or "cpu"."""
    return DEVICE


@pytest.fixture(autouse=True)
def factories_on_test_device(request):
    """Inside `on_device` tests on CUDA, torch factory calls without a device make CUDA tensors."""
    if not NATIVE or request.node.get_closest_marker("on_device") is None:
        yield
        return
    with FactoriesOn(DEVICE):
        yield


@pytest.fixture
def pool_threads(monkeypatch):
    """The cpu kernel pool follows torch's thread count during the test; restores torch's count after it."""
    from backends.cpu import kernels

    before = torch.get_num_threads()
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple[str, str]:
    """Paths of a tiny random base GGUF and its MTP GGUF, written once per test run."""
    from ds4.tiny.build import write_tiny
    d = tmp_path_factory.mktemp("tiny")
    base, mtp = str(d / "tiny.gguf"), str(d / "tiny-mtp.gguf")
    write_tiny(base, mtp, mix="f32", seed=0)
    return base, mtp
