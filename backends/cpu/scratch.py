"""Per-thread scratch memory for the temporaries of one C call (the products' outputs and rounded rows inside a fused
op, docs/cpu.md "The 89M step's Python and scratch"): addresses into a buffer kept per thread, handed out for the
length of a `with` block, so a decode step allocates no tensor for what its C calls use and drop.

Nothing the caller keeps can alias them: the regions are never tensors (only addresses go to C), the regions of one
block are disjoint, and a second block opened on the same thread before the first is closed raises instead of
handing out the same memory again."""
from __future__ import annotations

import threading

import torch

ALIGN = 64      # bytes: each region starts on a cache line
MAX_LAYOUTS = 256   # layouts remembered per thread (prefill's row counts vary; a decode step uses a few dozen)


class Scratch(threading.local):
    """The calling thread's scratch buffer: `with SCRATCH(n0, n1, ...) as (a0, a1, ...):` gives the addresses of
    disjoint regions of n0, n1, ... bytes, valid inside the block."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.base = self.size = 0
        self.busy = False
        self.addresses: list[int] = []
        self.layouts: dict[tuple[int, ...], list[int]] = {}     # the addresses of each layout used with this buffer

    def __call__(self, *sizes: int) -> Scratch:
        """Lay out regions of `sizes` bytes (each rounded up to ALIGN) for the next `with`."""
        if self.busy:
            raise RuntimeError("scratch: a region is already in use on this thread (one C call's block at a time)")
        known = self.layouts.get(sizes)
        if known is not None:       # a decode step's calls repeat their layouts step after step
            self.addresses = known
            return self
        offsets, total = [], 0
        for n in sizes:
            if n < 0:
                raise ValueError(f"scratch: a region of {n} bytes")
            offsets.append(total)
            total += -(-n // ALIGN) * ALIGN
        if total > self.size:
            self.size = max(total, 2 * self.size)
            self.buffer = torch.empty(self.size + ALIGN, dtype=torch.uint8)
            self.base = -(-self.buffer.data_ptr() // ALIGN) * ALIGN
            self.layouts.clear()
        if len(self.layouts) >= MAX_LAYOUTS:
            self.layouts.clear()
        self.addresses = self.layouts[sizes] = [self.base + o for o in offsets]
        return self

    def __enter__(self) -> list[int]:
        self.busy = True
        return self.addresses

    def __exit__(self, *exc) -> None:
        self.busy = False


SCRATCH = Scratch()
