"""Where kernel and model tests run, decided once before anything imports Triton (tests/conftest.py imports this).

`DS4_TEST_DEVICE=cpu|cuda` forces the device. Unset: CUDA, natively compiled, when torch sees a GPU and
`TRITON_INTERPRET=1` was not asked for; else the CPU, with Triton's interpreter on (`TRITON_INTERPRET=1`).
Tests marked `on_device` run with torch's factory calls placed on that device (`FactoriesOn`).
"""
from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

DEVICES = ("cpu", "cuda")


def choose_device(env: dict[str, str]) -> tuple[str, str | None]:
    """(device, error): the test device `env` asks for or implies, and why it cannot be had (None when it can)."""
    asked = env.get("DS4_TEST_DEVICE", "").strip().lower()
    if asked and asked not in DEVICES:
        return "cpu", f"DS4_TEST_DEVICE={asked!r}: use one of {', '.join(DEVICES)} (or leave it unset)"
    if asked == "cuda":
        if not torch.cuda.is_available():
            return "cpu", ("DS4_TEST_DEVICE=cuda, but torch sees no CUDA GPU (torch.cuda.is_available() is False; "
                           f"torch {torch.__version__}, CUDA build {torch.version.cuda}); unset it to test on the CPU")
        if env.get("TRITON_INTERPRET") == "1":
            return "cpu", "DS4_TEST_DEVICE=cuda runs the compiled kernels: unset TRITON_INTERPRET"
        return "cuda", None
    if asked == "cpu" or env.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "cpu", None
    return "cuda", None


DEVICE, DEVICE_ERROR = choose_device(dict(os.environ))
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton: kernels run on CPU tensors
NATIVE = DEVICE == "cuda"


class FactoriesOn(TorchFunctionMode):
    """Inside it, torch factory calls that name no device (`torch.randn`, `zeros`, `tensor`, `arange`, ...) make
    their tensor on `device`; a draw from a seeded CPU generator is made on the CPU and moved, so a test sees
    the same values on every device."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _device_constructors() and kwargs.get("device") is None:
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type != self.device.type:
                return func(*args, **kwargs).to(self.device)
            kwargs["device"] = self.device
        return func(*args, **kwargs)
