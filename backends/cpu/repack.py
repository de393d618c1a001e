"""Q4_K and Q8_0 weights repacked at load for `--cpu-dot q8` (backends/cpu/q4krepack.c, q8repack.c; docs/cpu.md,
"Q4_K repacked at load (session 13)", "Several rows within 1.3x: Q4_K and Q8_0 (session 14)"): the whole groups of 16
rows rewritten in place, the same bytes in a layout the 8-bit kernels take 16 rows at a time. A repacked weight is a
`RepackedQ4K` or `RepackedQ8_0`, not a QTensor, so nothing that reads stored blocks (the exact kernels, dequantize,
the reference backend) can be handed one by mistake: it has no `qtype`."""
from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

import torch

from ops.moe import Experts
from ops.quants import QTensor, get

from . import kernels

GROUP = 16      # weight rows repacked together (rows past the last whole group keep the stored layout)


@dataclass(frozen=True)
class RepackedQ4K:
    """A Q4_K weight, 2-D [N, K] or a stack of experts [E, N, K], whose bytes `data` (uint8 [..., N, row_bytes]) hold
    its whole groups of 16 rows in q4krepack.c's layout; only `product` and `bind` read it."""

    shape: tuple[int, ...]
    data: torch.Tensor
    name: str = ""


@dataclass(frozen=True)
class RepackedQ8_0:
    """A Q8_0 weight [N, K] whose bytes `data` (uint8 [N, row_bytes]) hold its whole groups of 16 rows in
    q8repack.c's layout; only `product` reads it."""

    shape: tuple[int, ...]
    data: torch.Tensor
    name: str = ""


def repackable(w: object) -> bool:
    """Whether `w` is a Q4_K QTensor (2-D or a stack) with whole blocks that the library here can repack."""
    return (type(w) is QTensor and w.qtype.name == "Q4_K" and len(w.shape) in (2, 3) and w.shape[-1] % 256 == 0
            and w.shape[-2] >= GROUP and kernels.built())


def repack(w: QTensor) -> RepackedQ4K:
    """`w` repacked in place (its data must be writable memory of this process, e.g. `--weights memory`'s copy): `w`
    itself must not be used afterwards."""
    if not repackable(w):
        raise ValueError(f"repack: not a repackable Q4_K weight: {getattr(w, 'qtype', type(w).__name__)} "
                         f"{tuple(getattr(w, 'shape', ()))}")
    _rewrite(w.data, w.shape, back=False)
    return RepackedQ4K(w.shape, w.data, w.name)


def q8_0_repackable(w: object) -> bool:
    """Whether `w` is a 2-D Q8_0 QTensor with whole blocks and at least one group of rows that the library here can
    repack."""
    return (type(w) is QTensor and w.qtype.name == "Q8_0" and len(w.shape) == 2 and w.shape[-1] % 32 == 0
            and w.shape[-2] >= GROUP and kernels.built())


def repack_q8_0(w: QTensor) -> RepackedQ8_0:
    """`w` repacked in place as `repack` does a Q4_K weight (q8repack.c's layout): `w` must not be used afterwards."""
    if not q8_0_repackable(w):
        raise ValueError(f"repack: not a repackable Q8_0 weight: {getattr(w, 'qtype', type(w).__name__)} "
                         f"{tuple(getattr(w, 'shape', ()))}")
    _rewrite(w.data, w.shape, back=False, q8_0=True)
    return RepackedQ8_0(w.shape, w.data, w.name)


def unpack(w: RepackedQ4K | RepackedQ8_0) -> QTensor:
    """`w` rewritten in place back into the stored Q4_K or Q8_0 blocks (`w` must not be used afterwards)."""
    q8_0 = type(w) is RepackedQ8_0
    _rewrite(w.data, w.shape, back=True, q8_0=q8_0)
    return QTensor(get("Q8_0" if q8_0 else "Q4_K"), w.shape, w.data, w.name)


def _rewrite(data: torch.Tensor, shape: tuple[int, ...], back: bool, q8_0: bool = False) -> None:
    """q4kr_repack (q8r_repack) on every 2-D weight of `data` (one, or each expert of a stack)."""
    if not data.is_contiguous():
        raise ValueError("repack: the weight's bytes are not contiguous")
    n, k = shape[-2], shape[-1]
    rewrite = kernels.lib().q8r_repack if q8_0 else kernels.lib().q4kr_repack
    for matrix in data.reshape(-1, n, data.shape[-1]):
        rc = rewrite(matrix.data_ptr(), n, k, int(back))
        if rc:
            raise MemoryError(f"repack: no memory for a group of 16 rows of {k} values") if rc == -2 else \
                ValueError(f"repack: rows of {k} values are not whole {'Q8_0' if q8_0 else 'Q4_K'} blocks")


def product(x: torch.Tensor, w: RepackedQ4K | RepackedQ8_0, experts: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T` with x rounded to 8 bits (M <= MAX_ROWS; `experts` as in kernels.qdot8, Q4_K stacks only):
    kernels.qdot8's bits on the stored weight. Float32 [M, N]."""
    x = x.to(torch.float32).contiguous()
    M, K = x.shape
    if M > kernels.MAX_ROWS or K != w.shape[-1]:
        raise ValueError(f"repacked product: need at most {kernels.MAX_ROWS} rows of {w.shape[-1]} values, got {M}x{K}")
    q8_0 = type(w) is RepackedQ8_0
    if q8_0 and experts is not None:
        raise ValueError("repacked product: a repacked Q8_0 weight is a single matrix, it takes no experts")
    xq = kernels.q8_quantize(x, "Q8_0" if q8_0 else "Q4_K")
    rc, y = kernels.split_rows(kernels.lib().q8r_rows if q8_0 else kernel(), kernels.Q8R_TYPE if q8_0 else
                               kernels.Q4KR_TYPE, w.data, w.shape[-2], experts, xq, M, K)
    if rc:
        raise MemoryError(f"repacked product: no memory for {M} rows") if rc == -2 else \
            ValueError(f"repacked product: unsupported call (M={M}, K={K})")
    return y


def experts_product(x: torch.Tensor, w: RepackedQ4K, ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Prefill's routed experts of a repacked stack in one library call, as `kernels.experts_product(..., "q8")` on
    the stored stack (the same bits)."""
    x = x.to(torch.float32).contiguous()
    P, K = x.shape
    rows = kernels.q8_quantize(x, "Q4_K")
    data, ids, first = w.data.contiguous(), ids.to(torch.int64).contiguous(), first.to(torch.int64).contiguous()
    y = torch.empty((P, w.shape[-2]), dtype=torch.float32)
    rc = kernels.lib().experts_gemm_pool(1, kernels.Q4KR_TYPE, data.data_ptr(), data[0].numel(), ids.data_ptr(),
                                         first.data_ptr(), w.shape[-2], K, rows.data_ptr(),
                                         rows.numel() // max(P, 1), y.data_ptr(), ids.shape[0], kernels.threads())
    if rc:
        raise ValueError(f"repacked experts_product: unsupported call (K={K}, rc={rc})")
    return y


def kernel() -> ctypes._CFuncPtr:
    """The library's row kernel of repacked weights (q4kr_rows: qdot8_rows' arguments)."""
    return kernels.lib().q4kr_rows


def require_q8(dot: str) -> None:
    """ValueError off q8: a repacked weight has only the 8-bit kernels (the exact ones read the stored layout)."""
    if dot != "q8":
        raise ValueError(f"a repacked Q4_K weight is multiplied under --cpu-dot q8 only, not {dot!r}")


def repacked_rows(dot: str) -> tuple[int, int]:
    """The address of the repacked row kernel and its type code (`require_q8`)."""
    require_q8(dot)
    return ctypes.cast(kernel(), ctypes.c_void_p).value, kernels.Q4KR_TYPE


def bind(w: RepackedQ4K) -> kernels.Bound:
    """The product of `w` with up to MAX_ROWS rows bound once (kernels.bind's record, q4kr_rows its kernel)."""
    return kernels.bound(*repacked_rows("q8"), w.data, w.shape, kernels.Q8_TYPES["Q4_K"])


def amx_from(rows: int | None = None, q8_0: bool = False) -> int:
    """The fewest rows a repacked Q4_K (`q8_0`: Q8_0) weight's product takes on the AMX tiles (where the CPU has
    them); `rows` sets it (17: never)."""
    return (kernels.lib().q8r_amx_from if q8_0 else kernels.lib().q4kr_amx_from)(rows or 0)


def worthwhile(q8_0: bool = False) -> bool:
    """Whether repacking Q4_K (`q8_0`: Q8_0) pays here: the library is built with its vector kernels (AVX-512
    VNNI)."""
    return kernels.built() and bool((kernels.lib().q8r_vector if q8_0 else kernels.lib().q4kr_vector)())


def repack_experts(experts: Experts) -> Experts:
    """`experts` with its Q4_K stacks repacked in place (`repack`; the other stacks as they are)."""
    stacks = {name: getattr(experts, name) for name in ("gate", "up", "down")}
    new = {name: repack(w) for name, w in stacks.items() if repackable(w) and len(w.shape) == 3}
    return dataclasses.replace(experts, **new) if new else experts
