"""Traffic meter: under TRITON_INTERPRET=1, count the bytes every tl.load / tl.store of every kernel launch
touches, per tensor argument.

`with TrafficMeter() as meter: ...` wraps the interpreter's masked load and store (plain loads and stores go
through them) and its grid executor; each launch inside becomes a `Launch` whose `ArgTraffic` records hold,
for loads and stores apart:
- lane bytes: unmasked lanes x element size, summed over every executed load/store;
- requested bytes: each executed load/store counts the distinct bytes its unmasked lanes touch (lanes of one
  instruction reading one address count once, as a GPU broadcasts them); re-reads across instructions,
  loop iterations and programs all count again. This is the "moved" figure the traffic bench reports;
- distinct bytes: bytes of the argument touched at least once by the whole launch.
An address is charged to the first pointer argument (in signature order) whose view spans it; an address
no argument spans is counted as `unmapped` (a kernel reading outside its arguments' views).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

LOAD, STORE = 0, 1


@dataclass
class ArgTraffic:
    """Bytes one pointer argument of a launch gave to loads and stores ([load, store] pairs)."""

    name: str
    span: int  # bytes of the argument's view
    lane: list[int] = field(default_factory=lambda: [0, 0])
    requested: list[int] = field(default_factory=lambda: [0, 0])
    touched: list[np.ndarray | None] = field(default_factory=lambda: [None, None])  # byte bitmaps while open
    distinct_bytes: list[int] = field(default_factory=lambda: [0, 0])  # filled when the launch ends

    def distinct(self, kind: int) -> int:
        """Bytes of the view touched at least once by loads (LOAD) or stores (STORE)."""
        bitmap = self.touched[kind]
        return self.distinct_bytes[kind] if bitmap is None else int(np.count_nonzero(bitmap))

    def close(self) -> None:
        """Keep the distinct counts and drop the bitmaps."""
        self.distinct_bytes = [self.distinct(LOAD), self.distinct(STORE)]
        self.touched = [None, None]


@dataclass
class Launch:
    """One kernel launch: its name, grid and the traffic of each pointer argument."""

    kernel: str
    grid: tuple[int, int, int] = (1, 1, 1)
    args: list[ArgTraffic] = field(default_factory=list)
    regions: list[tuple[int, int, ArgTraffic]] = field(default_factory=list)  # (start, end, record)
    unmapped: int = 0

    def total(self, measure: str) -> int:
        """Loads plus stores over all arguments: measure 'lane', 'requested' or 'distinct'."""
        if measure == "distinct":
            return sum(a.distinct(LOAD) + a.distinct(STORE) for a in self.args)
        return sum(sum(getattr(a, measure)) for a in self.args)

    def arg(self, name: str) -> ArgTraffic:
        """The record of pointer argument `name`."""
        return next(a for a in self.args if a.name == name)

    def record(self, kind: int, ptrs: np.ndarray, mask: np.ndarray, size: int) -> None:
        """Charge the unmasked lanes of one load/store of `size`-byte elements to the arguments."""
        addrs = np.asarray(ptrs, dtype=np.uint64)
        addrs = addrs[np.broadcast_to(np.asarray(mask, dtype=bool), addrs.shape)]
        for start, end, rec in self.regions:
            if not addrs.size:
                return
            inside = (addrs >= start) & (addrs < end)
            if not inside.any():
                continue
            offsets = (addrs[inside] - np.uint64(start)).astype(np.int64)
            addrs = addrs[~inside]
            rec.lane[kind] += offsets.size * size
            unique = np.unique(offsets)
            rec.requested[kind] += unique.size * size
            if rec.touched[kind] is None:
                rec.touched[kind] = np.zeros(rec.span, dtype=bool)
            rec.touched[kind][np.minimum((unique[:, None] + np.arange(size)).ravel(), rec.span - 1)] = True
        self.unmapped += addrs.size * size


def view_span(t) -> int:
    """Bytes from a tensor's first element to the end of its last one (0 when empty)."""
    if t.numel() == 0:
        return 0
    return t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)))


class TrafficMeter:
    """Context manager recording a `Launch` per interpreted kernel launch into `launches`."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._current: Launch | None = None
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> TrafficMeter:
        from triton.runtime import interpreter

        meter = self
        builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
        load, store = builder.create_masked_load, builder.create_masked_store
        init_args, set_grid = executor._init_args_hst, builder.set_grid_dim
        run = executor.__call__

        def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
            meter._charge(LOAD, ptrs, mask, interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize)
            return load(self, ptrs, mask, other, cache_policy, is_volatile)

        def create_masked_store(self, ptrs, value, mask, cache_policy):
            meter._charge(STORE, ptrs, mask, interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize)
            return store(self, ptrs, value, mask, cache_policy)

        def init_args_hst(self, args_dev, kwargs):
            args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
            if meter._current is not None:
                meter._bind(self.fn, args_hst, kwargs_hst)
            return args_hst, kwargs_hst

        def set_grid_dim(self, nx, ny, nz):
            if meter._current is not None:
                meter._current.grid = (nx, ny, nz)
            return set_grid(self, nx, ny, nz)

        def call(self, *args, **kwargs):
            meter._current = Launch(self.fn.__name__)
            try:
                return run(self, *args, **kwargs)
            finally:
                for rec in meter._current.args:
                    rec.close()
                meter._current.regions.clear()
                meter.launches.append(meter._current)
                meter._current = None

        for owner, name, fn in ((builder, "create_masked_load", create_masked_load),
                                (builder, "create_masked_store", create_masked_store),
                                (builder, "set_grid_dim", set_grid_dim),
                                (executor, "_init_args_hst", init_args_hst), (executor, "__call__", call)):
            self._saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, fn)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def _bind(self, fn, args_hst, kwargs_hst) -> None:
        """Map the launch's tensor arguments (host copies, as the interpreter reads them) to address ranges."""
        bound = inspect.signature(fn).bind_partial(*args_hst, **kwargs_hst).arguments
        launch = self._current
        for name, value in bound.items():
            if hasattr(value, "data_ptr") and hasattr(value, "stride"):
                rec = ArgTraffic(name, view_span(value))
                launch.args.append(rec)
                launch.regions.append((value.data_ptr(), value.data_ptr() + rec.span, rec))

    def _charge(self, kind: int, ptrs, mask, size: int) -> None:
        if self._current is None:
            raise RuntimeError("traffic meter: a load or store outside any kernel launch")
        self._current.record(kind, ptrs.data, mask.data, size)
