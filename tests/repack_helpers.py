"""What the repacked-layout tests (test_cpu_q4k_repack.py, test_cpu_q2k_repack.py, test_cpu_q8_repack.py,
test_cpu_iq2_rows.py) share: a random weight of a type, activation rows with an all-zero block, a repacked copy, the
thread-split fixture, the AMX switch-over set for a test, the every-M product check and a q8 model run."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from backends.cpu import kernels, repack
from ops.quants import QTensor


def weight(qtype: str, *shape: int, seed: int = 0) -> QTensor:
    """A random weight of `qtype`."""
    return QTensor.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / 16, qtype, "w")


def activations(M: int, K: int, seed: int = 1, block: int = 256) -> torch.Tensor:
    """Random rows, an all-zero activation block (`block` values) among them."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[0, :block] = 0
    return x


def repacked(w: QTensor) -> repack.Repacked:
    """A repacked copy of `w` (w itself unchanged)."""
    return repack.repack(QTensor(w.qtype, w.shape, w.data.clone(), w.name))


@pytest.fixture
def threads_split(monkeypatch):
    """Every weight split into chunks (a chunk boundary inside a group of 16 rows); torch's thread count restored."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@contextmanager
def amx_from(qtype: str, rows: int) -> Iterator[None]:
    """The repacked `qtype`'s AMX tiles from `rows` rows (repack.amx_from) inside the block; the former value after."""
    before = repack.amx_from(qtype)
    repack.amx_from(qtype, rows)
    try:
        yield
    finally:
        repack.amx_from(qtype, before)


def assert_every_m(x: torch.Tensor, r: repack.Repacked, expected: torch.Tensor, thread_counts: tuple[int, ...],
                   label: tuple) -> None:
    """repack.product(x[:M], r) is expected[:M] bit for bit: every M = 1..16 on one thread, M = 1, 2, 5, 16 on more."""
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for M in range(1, 17) if threads == 1 else (1, 2, 5, 16):
            assert torch.equal(repack.product(x[:M], r), expected[:M]), (*label, threads, M)


def run(path: str, weights: str, prompt: int = 20, tokens: int = 5) -> tuple[list[int], list[torch.Tensor], object]:
    """Greedy ids of a q8 run, the logits behind each (a prompt prefilled in one chunk, then decode steps) and the
    engine."""
    import ds4
    engine = ds4.load(path, weights=weights, cpu_dot="q8", prefill_chunk=32)
    logits: list[torch.Tensor] = []
    ids = [t.id for t in engine.generate(list(range(3, 3 + prompt)), raw=True, max_tokens=tokens, mtp_draft=0,
                                         on_logits=logits.append) if t.id >= 0]
    return ids, logits, engine
