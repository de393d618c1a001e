"""Array primitives of the torch family (backends `torch` and `triton`): the few structural operations
the model needs besides its ops — allocation, index arrays, concatenation, selection, weight placement,
the collectives that sum or gather the ranks' partial results — all on one device, so the model itself never names a
framework, a device or a communication library."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from backends.precompiled import PrecompiledStep, compile_cache_dir, use_compile_cache
from ds4.errors import BackendUnavailable
from ops.quants import QTensor

DTYPES = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}
HOST_DTYPES = {"float32": np.float32, "int64": np.int64, "bool": np.bool_}


class TorchArrays:
    """Torch tensors on `device` (cpu, cuda, cuda:N)."""

    family = "torch"

    def __init__(self, device: str, distributed: bool = False):
        self.device = torch.device(device)
        self.rank, self.world = 0, 1
        if distributed:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()):
                raise BackendUnavailable("a parallel OpSet needs torch.distributed initialised first "
                                         "(ds4.distributed.start, under torchrun)")
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over every rank (torch.distributed: gloo on CPUs, NCCL on GPUs), summed in place on
        the device with no host read; `x` itself in a single process. Inside a compiled step it is the functional
        all_reduce, which torch.compile traces into the step's graph."""
        if self.world == 1:
            return x
        import torch.distributed as dist
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol
            return funcol.all_reduce(x, "sum", dist.group.WORLD)
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated in rank order along `dim` (a vocabulary-parallel LM head's logits), with
        no host read; `x` itself in a single process."""
        if self.world == 1:
            return x
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def zeros(self, *shape: int) -> torch.Tensor:
        """A float32 array of zeros (cache allocation)."""
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def array(self, values, dtype: str = "int64") -> torch.Tensor:
        """An array from host values (nested lists of Python numbers, or a CPU tensor)."""
        if isinstance(values, list):  # numpy reads nested lists several times faster than torch (a step's plan)
            values = torch.from_numpy(np.array(values, dtype=HOST_DTYPES[dtype]))
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
        """`fn` compiled with static shapes: one step per distinct input signature (a step per verify width),
        compiled on first use and replayed after. CPU only: on CUDA, steps are recorded in CUDA graphs instead
        (ds4/cuda_graphs.py). A single process's steps are AOTInductor packages saved on disk
        (`precompiled.compile_cache_dir`), so a later process with the same model shapes and code loads them without
        tracing or compiling; across ranks the step holds its all_reduces and each rank compiles it (torch.compile)."""
        if self.device.type != "cpu":
            raise BackendUnavailable(f"compiled steps run on the CPU only for now, not on {self.device}; "
                                     "use --no-compile")
        if self.world > 1:   # a step holding collectives is compiled in each process (its process group unsaved)
            from backends.cpu import kernels
            torch.compiler.assume_constant_result(kernels.built)   # traced as its value (ctypes is not traceable)
            use_compile_cache()     # inductor's FX-graph and AOTAutograd caches kept where a later process finds them
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # a graph per width
            return torch.compile(fn, dynamic=False, fullgraph=True)
        if not hasattr(torch._C, "_aoti"):
            raise BackendUnavailable(f"--compile saves its steps with AOTInductor, which this torch "
                                     f"({torch.__version__}) lacks; upgrade torch or use --no-compile")
        # each step exported and compiled by AOTInductor once per signature and saved; a warm start loads the package
        # with torch's C++ loader, importing neither dynamo nor inductor (backends/precompiled.py)
        cache = compile_cache_dir()
        return PrecompiledStep(fn, cache / "steps")


def best_device() -> str:
    """The fastest device this machine has for the torch family: the first CUDA GPU, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"
