"""The cpu backend's per-thread scratch (backends/cpu/scratch.py) and the bound fused calls that use it: regions are
disjoint and aligned, a second block on the same thread while one is open raises, each thread has its own buffer,
and what a fused op returns is never scratch (a later call leaves an earlier output as it was)."""
from __future__ import annotations

import threading

import pytest
import torch

from backends.cpu import glue, kernels
from backends.cpu.scratch import ALIGN, SCRATCH, Scratch
from ops.quants import QTensor
from ops.rope_tail import rope_freqs


def test_regions_are_disjoint_aligned_and_one_block_at_a_time():
    scratch = Scratch()
    sizes = (3, 0, 100, 4096, 1)
    with scratch(*sizes) as addresses:
        assert all(a % ALIGN == 0 for a in addresses)
        ends = [a + n for a, n in zip(addresses, sizes, strict=True)]
        assert all(end <= nxt for end, nxt in zip(ends[:-1], addresses[1:], strict=True))
        with pytest.raises(RuntimeError, match="already in use"):
            scratch(8)
    with scratch(1 << 20) as (big,):      # grows after the block closed
        assert big % ALIGN == 0 and scratch.size >= 1 << 20
    with pytest.raises(ValueError, match="-1 bytes"):
        scratch(-1)


def test_a_repeated_layout_is_remembered_until_the_buffer_grows():
    """A layout used before gets its remembered addresses; once the buffer grew they are the new buffer's, never the
    freed one's."""
    scratch = Scratch()
    with scratch(100, 200) as first:
        first = list(first)
    with scratch(8):
        pass
    with scratch(100, 200) as again:
        assert list(again) == first
    with scratch(1 << 20):      # grows: a new buffer
        pass
    with scratch(100, 200) as moved:
        base = scratch.base
        assert moved[0] == base and base <= moved[1] < base + scratch.size


def test_each_thread_has_its_own_buffer():
    seen = {}

    def take(name):
        with SCRATCH(256) as (address,):
            seen[name] = (address, SCRATCH.buffer.data_ptr())
    with SCRATCH(256):
        worker = threading.Thread(target=take, args=("worker",))     # opens its block while this one is open
        worker.start()
        worker.join()
    take("main")
    assert seen["worker"][1] != seen["main"][1]


@pytest.mark.skipif(not kernels.built(), reason="needs the kernel library")
@pytest.mark.parametrize("dot", ("exact", "q8"))
def test_fused_outputs_are_not_scratch(dot):
    """Two calls of each fused op on different rows: the first call's outputs keep their values (outputs are new
    tensors; only temporaries live in the scratch), and equal a fresh call's."""
    g = torch.Generator().manual_seed(3)
    w = QTensor.quantize(torch.randn(256, 256, generator=g) * 0.1, "Q8_0")
    norm = torch.rand(64, generator=g) + 0.5
    freqs = rope_freqs(16, 10000.0, None)
    angles = (torch.cos(torch.outer(torch.tensor([5.0, 9.0]), freqs)), torch.sin(torch.outer(torch.tensor([5.0, 9.0]),
                                                                                              freqs)))
    x1, x2 = torch.randn(2, 256, generator=g), torch.randn(2, 256, generator=g)
    first = glue.qmatmul_norm_rope(x1, w, norm, 1e-6, 64, angles, dot)
    kept = first.clone()
    second = glue.qmatmul_norm_rope(x2, w, norm, 1e-6, 64, angles, dot)
    assert torch.equal(first, kept) and not torch.equal(first, second)
    assert torch.equal(glue.qmatmul_norm_rope(x1, w, norm, 1e-6, 64, angles, dot), kept)
    shared = [QTensor.quantize(torch.randn(*shape, generator=g) * 0.1, "Q4_K") for shape in ((256, 256),) * 3]
    first = glue.moe_rows(x1, *shared, None, None, None, dot)
    kept = first.clone()
    glue.moe_rows(x2, *shared, None, None, None, dot)
    assert torch.equal(first, kept)
