"""Array primitives of the torch family (backends `torch` and `triton`): the few structural operations
the model needs besides its ops — allocation, index arrays, concatenation, selection, weight placement —
all on one device, so the model itself never names a framework or a device."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ds4.errors import BackendUnavailable
from ops.quants import QTensor

DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}


class TorchArrays:
    """Torch tensors on `device` (cpu, cuda, cuda:N)."""

    family = "torch"

    def __init__(self, device: str):
        self.device = torch.device(device)

    def zeros(self, *shape: int) -> torch.Tensor:
        """A float32 array of zeros (cache allocation)."""
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def array(self, values, dtype: str = "int64") -> torch.Tensor:
        """An array from host values (nested lists of Python numbers, or a CPU tensor)."""
        return torch.as_tensor(values, dtype=DTYPES[dtype], device=self.device)

    def cat(self, arrays: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Concatenation along `dim`."""
        return torch.cat(tuple(arrays), dim=dim)

    def where(self, cond: torch.Tensor, a, b) -> torch.Tensor:
        """Elementwise `a` where `cond`, else `b` (either may be a Python scalar)."""
        return torch.where(cond, a, b)

    def place(self, w: QTensor) -> QTensor:
        """A quantized weight with its raw blocks on this device (copied once; never dequantized)."""
        return w if w.data.device == self.device else QTensor(w.qtype, w.shape, w.data.to(self.device), w.name)

    def to_torch(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as a torch tensor for the decoder (already one: no copy)."""
        return x

    def compile(self, fn: Callable) -> Callable:
        """`fn` compiled by torch.compile (inductor) with static shapes: one graph per distinct input shape
        (a step per verify width), traced on first use and replayed after. CPU only: on CUDA, steps are
        recorded in CUDA graphs instead (ds4/cuda_graphs.py)."""
        if self.device.type != "cpu":
            raise BackendUnavailable(f"compiled steps run on the CPU only for now, not on {self.device}; "
                                     "use --no-compile")
        # one recompile per verify width (1..16) and per MTP row count; dynamo's default limit is 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(fn, dynamic=False, fullgraph=True)  # a graph break is an error, not a slow path


def best_device() -> str:
    """The fastest device this machine has for the torch family: the first CUDA GPU, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"
