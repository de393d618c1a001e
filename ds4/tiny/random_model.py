"""A DeepSeek V4 model with random weights built directly on a device from the shape schema, for
benchmarks at full size without an 81 GB file (`scripts/bench.py model`).

Every tensor gets the storage type the mix gives it (ds4/formats/quant_mix.py), so the bytes a pass reads are
exactly those of the real model. Small tensors (routers, norms, HC weights, biases: at most
`FULL_RANDOM` values) are random throughout, so routing and gates behave as with random weights;
a large tensor repeats the quantized blocks of `SEED_ROWS` random rows down its rows, generated once on
the host and copied on the device, which keeps generation to seconds while every byte still lives at
its own address (the same traffic as distinct values).
"""
from __future__ import annotations

import math

import torch

from backends.registry import OpSet
from ds4.formats.quant_mix import tensor_type
from ds4.tiny.build import FLASH_SIZES, TINY, random_tensor, tiny_metadata
from models.args import ModelArgs, model_shapes
from models.deepseek_v4 import ROUTED, DeepseekV4, owned_experts
from models.tensor_parallel import tensor_split
from ops.quants import QTensor, get

FULL_RANDOM = 1 << 22
SEED_ROWS = 64


def random_args(layers: int | None = None, tiny: bool = False, **sizes) -> ModelArgs:
    """ModelArgs of V4 Flash (or the tiny model) with the first `layers` layers and any size overridden."""
    s = {**(TINY if tiny else FLASH_SIZES), **sizes}
    if layers is not None:
        s["n_layers"] = layers
        s["n_hash_layers"] = min(s["n_hash_layers"], layers)
    return ModelArgs.from_metadata(tiny_metadata(**s))


def random_weight(name: str, shape: tuple[int, ...], args: ModelArgs, mix: str, device: torch.device,
                  g: torch.Generator, held: range | None = None) -> QTensor:
    """One weight in its stored type, on `device`; with `held` (the rows of a parallel rank's share, counting
    an expert stack's rows expert after expert) only those rows are written, so the others' pages are never
    touched (not resident on a CPU)."""
    qtype = tensor_type(name, shape, mix)
    rows, k = math.prod(shape[:-1]), shape[-1]
    if rows * k <= FULL_RANDOM:
        w = QTensor.quantize(random_tensor(name, shape, args, g), qtype, name)
        return QTensor(w.qtype, w.shape, w.data.to(device), name)
    seed = QTensor.quantize(random_tensor(name, (SEED_ROWS, k), args, g), qtype, name).data.to(device)
    data = torch.empty((rows, get(qtype).row_bytes(k)), dtype=torch.uint8, device=device)
    first, stop = (held.start, held.stop) if held is not None else (0, rows)
    for start in range(first, stop, SEED_ROWS):
        n = min(SEED_ROWS, stop - start)
        data[start:start + n] = seed[:n]
    return QTensor(get(qtype), shape, data.reshape(*shape[:-1], data.shape[-1]), name)


def random_model(args: ModelArgs, mix: str, ops: OpSet, seed: int = 0) -> DeepseekV4:
    """The trunk of `args` with random weights stored under `mix`, built on the OpSet's device."""
    g = torch.Generator().manual_seed(seed)
    device = torch.device(ops.device if ops.arrays.family == "torch" else "cpu")   # MLX: placed from the host
    owned = owned_experts(args.n_experts, ops.rank, ops.world) if ops.parallel else None
    split = tensor_split(args, ops.rank, ops.world) if ops.parallel == "tp" else None

    def held(name: str, shape: tuple[int, ...]) -> range | None:
        """The rows of `name` this rank holds (None: all of them)."""
        if owned is not None and name.endswith(ROUTED):
            per = math.prod(shape[1:-1])   # rows of one expert
            return range(owned.start * per, owned.stop * per)
        return split.rows(name, shape) if split else None

    weights = {name: random_weight(name, shape, args, mix, device, g, held(name, shape))
               for name, shape in model_shapes(args).items()}
    return DeepseekV4(args, weights, ops)
