"""Q4_K, Q2_K, Q8_0 and IQ2_XXS weights repacked at load for `--cpu-dot q8` (backends/cpu/q4krepack.c, q2krepack.c,
q8repack.c, iq2repack.c; docs/cpu.md, "Q4_K repacked at load (session 13)", the two "Several rows within 1.3x"
sections of session 14, "IQ2_XXS at several rows (session 15)" and "The repacked Q8_0 in the model (session 15)"): the
whole groups of 16 rows rewritten in place, the same bytes in a layout the 8-bit kernels take 16 rows at a time. A
repacked weight is a `RepackedQ4K`, `RepackedQ2K`, `RepackedQ8_0` or `RepackedIQ2XXS`, not a QTensor, so nothing that
reads stored blocks (the exact kernels, dequantize, the reference backend) can be handed one by mistake: it has no
`qtype`. The load repacks the routed experts' Q4_K, Q2_K and IQ2_XXS stacks and the trunk's 2-D Q8_0 weights."""
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
class _Repacked:
    """The fields of a repacked weight: its shape, 2-D [N, K] or (Q4_K, Q2_K) a stack of experts [E, N, K], and its
    bytes `data` (uint8 [..., N, row_bytes]) holding its whole groups of 16 rows in its layout; one distinct type per
    layout below, so nothing takes one layout's bytes for another's; only `product` and `bind` read them."""

    shape: tuple[int, ...]
    data: torch.Tensor
    name: str = ""


class RepackedQ4K(_Repacked):
    """A Q4_K weight in q4krepack.c's layout."""


class RepackedQ2K(_Repacked):
    """A Q2_K weight in q2krepack.c's layout."""


class RepackedQ8_0(_Repacked):
    """A Q8_0 weight [N, K] in q8repack.c's layout (or a view of its groups of rows as a stack, `groups_of`)."""


class RepackedIQ2XXS(_Repacked):
    """An IQ2_XXS weight in iq2repack.c's layout."""


def repackable(w: object) -> bool:
    """Whether `w` is a QTensor of a type with a layout (Q4_K, Q2_K, IQ2_XXS: 2-D or a stack; Q8_0: 2-D) with whole
    blocks that the library here can repack."""
    layout = LAYOUTS.get(w.qtype.name) if type(w) is QTensor else None
    return (layout is not None and len(w.shape) in ((2, 3) if layout.stacks else (2,))
            and w.shape[-1] % w.qtype.block_size == 0 and w.shape[-2] >= GROUP and kernels.built())


def repack(w: QTensor) -> Repacked:
    """`w` repacked in place (its data must be writable memory of this process, e.g. `--weights memory`'s copy): `w`
    itself must not be used afterwards."""
    if not repackable(w):
        raise ValueError(f"repack: not a repackable Q4_K, Q2_K, IQ2_XXS or Q8_0 weight: "
                         f"{getattr(w, 'qtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    layout = LAYOUTS[w.qtype.name]
    _rewrite(w.data, w.shape, back=False, layout=layout)
    return layout.record(w.shape, w.data, w.name)


def unpack(w: Repacked) -> QTensor:
    """`w` rewritten in place back into the stored blocks (`w` must not be used afterwards)."""
    layout = layout_of(w)
    _rewrite(w.data, w.shape, back=True, layout=layout)
    return QTensor(get(layout.qtype), w.shape, w.data, w.name)


def _rewrite(data: torch.Tensor, shape: tuple[int, ...], back: bool, layout: Layout) -> None:
    """The layout's repack (`<prefix>_repack`) on every 2-D weight of `data` (one, or each expert of a
    stack)."""
    if not data.is_contiguous():
        raise ValueError("repack: the weight's bytes are not contiguous")
    n, k = shape[-2], shape[-1]
    for matrix in data.reshape(-1, n, data.shape[-1]):
        rc = getattr(kernels.lib(), f"{layout.prefix}_repack")(matrix.data_ptr(), n, k, int(back))
        if rc:
            raise MemoryError(f"repack: no memory for a group of 16 rows of {k} values") if rc == -2 else \
                ValueError(f"repack: rows of {k} values are not whole {layout.qtype} blocks")


def product(x: torch.Tensor, w: Repacked, experts: torch.Tensor | None = None) -> torch.Tensor:
    """`x [M, K] @ W.T` with x rounded to 8 bits (M <= MAX_ROWS; `experts` as in kernels.qdot8, stacks only):
    kernels.qdot8's bits on the stored weight. Float32 [M, N]."""
    x = x.to(torch.float32).contiguous()
    M, K = x.shape
    if M > kernels.MAX_ROWS or K != w.shape[-1]:
        raise ValueError(f"repacked product: need at most {kernels.MAX_ROWS} rows of {w.shape[-1]} values, got {M}x{K}")
    layout = layout_of(w)
    if experts is not None and len(w.shape) != 3:
        raise ValueError(f"repacked product: a 2-D repacked {layout.qtype} weight takes no experts")
    xq = kernels.q8_quantize(x, layout.qtype)
    rc, y = kernels.split_rows(kernel(w), layout.code, w.data, w.shape[-2], experts, xq, M, K)
    if rc:
        raise MemoryError(f"repacked product: no memory for {M} rows") if rc == -2 else \
            ValueError(f"repacked product: unsupported call (M={M}, K={K})")
    return y


def experts_product(x: torch.Tensor, w: Repacked, ids: torch.Tensor,
                    first: torch.Tensor) -> torch.Tensor:
    """Prefill's routed experts of a repacked stack in one library call, as `kernels.experts_product(..., "q8")` on
    the stored stack (the same bits)."""
    x = x.to(torch.float32).contiguous()
    P, K = x.shape
    rows = kernels.q8_quantize(x, layout_of(w).qtype)
    data, ids, first = w.data.contiguous(), ids.to(torch.int64).contiguous(), first.to(torch.int64).contiguous()
    y = torch.empty((P, w.shape[-2]), dtype=torch.float32)
    rc = kernels.lib().experts_gemm_pool(1, layout_of(w).code, data.data_ptr(), data[0].numel(), ids.data_ptr(),
                                         first.data_ptr(), w.shape[-2], K, rows.data_ptr(),
                                         rows.numel() // max(P, 1), y.data_ptr(), ids.shape[0], kernels.threads())
    if rc:
        raise ValueError(f"repacked experts_product: unsupported call (K={K}, rc={rc})")
    return y


def kernel(w: Repacked) -> ctypes._CFuncPtr:
    """The library's row kernel of repacked weights like `w` (`<prefix>_rows`: qdot8_rows' arguments)."""
    return getattr(kernels.lib(), f"{layout_of(w).prefix}_rows")


def groups_of(w: RepackedQ8_0, groups: int) -> RepackedQ8_0 | None:
    """A 2-D repacked Q8_0 weight's `groups` groups of rows as a stack [groups, N / groups, K] (the same bytes: the
    grouped output projection's, multiplied as a stack of experts), or None where a group is not whole groups of 16
    rows."""
    N, K = w.shape
    n = N // groups
    if groups < 1 or N % groups or n % GROUP:
        return None
    return RepackedQ8_0((groups, n, K), w.data.reshape(groups, n, -1), w.name)


def group_rows(w: RepackedQ8_0, g: int, groups: int) -> RepackedQ8_0:
    """Group `g` of a repacked weight's `groups_of` (a 2-D repacked weight of its rows)."""
    stack = groups_of(w, groups)
    if stack is None:
        raise ValueError(f"repacked {w.name or 'weight'} {tuple(w.shape)}: {groups} groups are not whole groups of "
                         f"{GROUP} rows")
    return RepackedQ8_0(stack.shape[1:], stack.data[g], f"{w.name}[{g * stack.shape[1]}:{(g + 1) * stack.shape[1]}]")


def require_q8(dot: str) -> None:
    """ValueError off q8: a repacked weight has only the 8-bit kernels (the exact ones read the stored layout)."""
    if dot != "q8":
        raise ValueError(f"a repacked weight is multiplied under --cpu-dot q8 only, not {dot!r}")


def repacked_rows(dot: str, w: Repacked) -> tuple[int, int]:
    """The address of the row kernel of repacked weights like `w` and its type code (`require_q8`)."""
    require_q8(dot)
    return ctypes.cast(kernel(w), ctypes.c_void_p).value, layout_of(w).code


def bind(w: Repacked) -> kernels.Bound:
    """The product of `w` with up to MAX_ROWS rows bound once (kernels.bind's record, its repacked row kernel)."""
    return kernels.bound(*repacked_rows("q8", w), w.data, w.shape, kernels.Q8_TYPES[layout_of(w).qtype])


def amx_from(qtype: str, rows: int | None = None) -> int:
    """The fewest rows a repacked `qtype` weight's product takes on the AMX tiles (where the CPU has them); `rows` sets
    it (17: never)."""
    return getattr(kernels.lib(), f"{LAYOUTS[qtype].prefix}_amx_from")(rows or 0)


def worthwhile() -> bool:
    """Whether repacking pays here: the library is built with its layouts' vector kernels (AVX-512 VNNI)."""
    return kernels.built() and all(getattr(kernels.lib(), f"{layout.prefix}_vector")() for layout in LAYOUTS.values())


def repack_experts(experts: Experts) -> Experts:
    """`experts` with its stacks of a layout that takes stacks (Q4_K, Q2_K, IQ2_XXS) repacked in place (`repack`; the
    other stacks as they are)."""
    stacks = {name: getattr(experts, name) for name in ("gate", "up", "down")}
    new = {name: repack(w) for name, w in stacks.items() if repackable(w) and len(w.shape) == 3}
    return dataclasses.replace(experts, **new) if new else experts


@dataclass(frozen=True)
class Layout:
    """A repacked layout: the stored type it holds, its record, its type code, the prefix of its library functions
    (`<prefix>_repack`, `_rows`, `_amx_from`, `_vector`) and whether it takes stacks of experts."""

    qtype: str
    record: type
    code: int
    prefix: str
    stacks: bool


LAYOUTS = {"Q4_K": Layout("Q4_K", RepackedQ4K, kernels.Q4KR_TYPE, "q4kr", stacks=True),
           "Q2_K": Layout("Q2_K", RepackedQ2K, kernels.Q2KR_TYPE, "q2kr", stacks=True),
           "Q8_0": Layout("Q8_0", RepackedQ8_0, kernels.Q8R_TYPE, "q8r", stacks=False),
           "IQ2_XXS": Layout("IQ2_XXS", RepackedIQ2XXS, kernels.IQ2R_TYPE, "iq2r", stacks=True)}
REPACKED = (RepackedQ4K, RepackedQ2K, RepackedQ8_0, RepackedIQ2XXS)       # the records a repacked weight can be
Repacked = RepackedQ4K | RepackedQ2K | RepackedQ8_0 | RepackedIQ2XXS


def layout_of(w: Repacked) -> Layout:
    """The layout of a repacked weight (TypeError for anything else)."""
    for layout in LAYOUTS.values():
        if type(w) is layout.record:
            return layout
    raise TypeError(f"not a repacked weight: {type(w).__name__}")
