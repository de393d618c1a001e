"""Array primitives of the MLX family (device `mlx`, also `mlx:cpu` / `mlx:gpu`): allocation, index arrays,
concatenation, selection and weight placement on `mx.array`s, so the model runs on MLX end to end.

Index arrays the model asks for as "int64" are int32 on MLX (token ids, positions and row numbers all fit;
int32 is what Metal gathers natively). The only crossings between torch and MLX are `from_torch` (weights
and small tables at load time) and `to_torch` (the logits the decoder reads, once per forward);
tests/test_mlx_model.py counts them.
"""
from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import torch

from backends.mlx.quants import place as place_weight
from ds4.errors import BackendUnavailable
from ops.quants import QTensor

DTYPES = {"float32": mx.float32, "int64": mx.int32, "bool": mx.bool_}


def from_torch(t: torch.Tensor) -> mx.array:
    """A CPU copy of a torch tensor as an MLX array (load time only)."""
    return mx.array(t.detach().cpu().contiguous().numpy())


def to_torch(x: mx.array) -> torch.Tensor:
    """An MLX array as a torch tensor (evaluates it): the one crossing of a forward."""
    return torch.from_numpy(np.array(x, copy=True))


class MLXArrays:
    """MLX arrays on the default MLX device, or the one `mlx:cpu` / `mlx:gpu` names."""

    family = "mlx"
    rank, world = 0, 1  # one process: MLX runs no collectives here (parallel runs are the torch family's)

    def __init__(self, device: str = "mlx"):
        self.device = device
        kind = device.partition(":")[2]
        if kind:
            if kind not in ("cpu", "gpu"):
                raise BackendUnavailable(f"unknown MLX device {device!r}; use mlx, mlx:cpu or mlx:gpu")
            if not mx.is_available(mx.gpu if kind == "gpu" else mx.cpu):
                raise BackendUnavailable(f"device {device!r}: this MLX build has no {kind.upper()} "
                                         "(use mlx or mlx:cpu)")
            mx.set_default_device(mx.gpu if kind == "gpu" else mx.cpu)   # process-wide, as MLX devices are

    def zeros(self, *shape: int) -> mx.array:
        """A float32 array of zeros (cache allocation)."""
        return mx.zeros(shape, dtype=mx.float32)

    def array(self, values, dtype: str = "int64") -> mx.array:
        """An array from host values (nested lists of Python numbers), a torch tensor or an MLX array."""
        if isinstance(values, torch.Tensor):
            values = from_torch(values)
        if isinstance(values, mx.array):
            return values.astype(DTYPES[dtype])
        return mx.array(values, dtype=DTYPES[dtype])

    def cat(self, arrays: Sequence[mx.array], dim: int = 0) -> mx.array:
        """Concatenation along `dim`."""
        return mx.concatenate(list(arrays), axis=dim)

    def where(self, cond: mx.array, a, b) -> mx.array:
        """Elementwise `a` where `cond`, else `b` (either may be a Python scalar)."""
        return mx.where(cond, a, b)

    def place(self, w: QTensor) -> QTensor:
        """A quantized weight repacked once into its MLX format (backends/mlx/quants.py)."""
        return place_weight(w)

    def all_reduce(self, x: mx.array) -> mx.array:
        """`x` itself: an MLX model runs in one process (OpSet refuses a parallel MLX run)."""
        return x

    def all_gather(self, x: mx.array, dim: int = -1) -> mx.array:
        """`x` itself: an MLX model runs in one process (OpSet refuses a parallel MLX run)."""
        return x

    def to_torch(self, x) -> torch.Tensor:
        """`x` as a torch tensor for the decoder."""
        return x if isinstance(x, torch.Tensor) else to_torch(x)


    def compile(self, fn):
        """Compiled steps are not written for MLX (its lazy graph already batches the small ops)."""
        raise BackendUnavailable("compiled steps run on torch CPU tensors only; use --no-compile with MLX")
