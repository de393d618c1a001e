"""q8's several-row products on AMX tiles (backends/cpu/qdot8amx.c): Q8_0, Q4_K, Q2_K and IQ2_XXS bit for bit
against the reference (ops/q8_activations.py) for every M in 2..16, split across 1, 2 or 3 threads, through
prefill's routed experts and through strict speculative decoding's verify step; DS4_CPU_AMX=0 turns every AMX
path of the library off. Skipped where the CPU or the build has no AMX (the other paths: tests/test_cpu_q8.py)."""
from __future__ import annotations

import pytest
import torch

from backends.cpu import kernels
from ops import q8_activations as ref
from ops.quants import QTensor
from tests.test_cpu_q8 import q8_greedy_and_speculative

TYPES = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS")

pytestmark = pytest.mark.skipif(not kernels.amx_rows(), reason="no AMX-INT8 here (or the kernels are not built)")


@pytest.fixture
def every_m():
    """The tiles for every M from 2 (the default takes them only where they are faster); back to the default."""
    kernels.amx_rows(True, every_m=True)
    yield
    kernels.amx_rows(True)


def weight(qtype: str, *shape: int, seed: int = 0) -> QTensor:
    """A random weight of `qtype`."""
    return QTensor.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / 16, qtype, "w")


def activations(M: int, K: int, seed: int = 1) -> torch.Tensor:
    """Random rows, an all-zero block among them."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[0, :256] = 0
    return x


@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_equal_reference_for_every_m_and_thread_split(qtype, every_m, monkeypatch):
    """53 output rows (three whole tiles and a partial one: the last 5 rows go to qdot8_rows), 512 values: the
    reference's bits for M = 1..16, on 1 thread and split in chunks across 2 and 3 (a chunk's last tile reaches
    into the next chunk's rows, which it reads but does not store)."""
    monkeypatch.setattr(kernels, "SPLIT_BYTES", 1)
    monkeypatch.setattr(kernels, "_pool_threads", 0)
    before = torch.get_num_threads()
    w, x = weight(qtype, 53, 512), activations(16, 512)
    expected = ref.qdot8(x, w)
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for M in range(1, 17) if threads == 1 else (2, 3, 9, 16):
                assert torch.equal(kernels.qdot8(x[:M], w), expected[:M]), (qtype, threads, M)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", TYPES)
def test_tiles_equal_the_other_path_at_larger_k(qtype, every_m):
    """K = 8448 (33 blocks of 256: whole rows are unpacked up to 32 blocks, 16 for Q4_K, so a tile takes two or
    three units, the last of one block): the same bits with the tiles as without."""
    w, x = weight(qtype, 32, 8448, seed=3), activations(16, 8448, seed=4)
    tiles = kernels.qdot8(x, w)
    kernels.amx_rows(False)
    assert torch.equal(tiles, kernels.qdot8(x, w))
    assert torch.equal(tiles[:5], ref.qdot8(x[:5], w))


@pytest.mark.parametrize("qtype", TYPES)
def test_routed_experts_take_the_tiles(qtype, every_m):
    """Prefill's routed experts (qgemm.c, each expert's rows 16 at a time through qdot8_rows): 1, 3, 17 and 2 rows
    per expert, the same bits as each expert's rows through the reference."""
    g = torch.Generator().manual_seed(6)
    w = QTensor.quantize(torch.randn(5, 48, 512, generator=g) / 16, qtype, "w")
    ids, first = torch.tensor([0, 2, 3, 4]), torch.tensor([0, 1, 4, 21, 23])
    x = torch.randn(23, 512, generator=g)
    bounds = zip(ids.tolist(), first[:-1].tolist(), first[1:].tolist(), strict=True)
    expected = torch.cat([ref.qdot8(x[a:b], QTensor(w.qtype, (48, 512), w.data[e])) for e, a, b in bounds])
    assert torch.equal(kernels.experts_product(x, w, ids, first, "q8"), expected)


def test_default_takes_tiles_only_from_the_faster_row_counts():
    """By default the tiles serve Q2_K from 5 rows (the measured break-even), not below; the bits are the same."""
    w, x = weight("Q2_K", 32, 512), activations(8, 512)
    assert kernels.amx_rows(True) and torch.equal(kernels.qdot8(x, w), ref.qdot8(x, w))


def test_speculative_verify_on_tiles_commits_plain_decoding_tokens(every_m):
    """The default model (IQ2_XXS, Q2_K and Q8_0 weights) under q8: strict speculative decoding at depth 2, whose
    verify steps multiply 3 rows on the tiles, commits the tokens of plain decoding (1 row: no tiles)."""
    plain, speculative = q8_greedy_and_speculative(24, 2, 10)
    assert plain == speculative and len(plain) == 10


def test_environment_switch_turns_every_amx_path_off(monkeypatch):
    """DS4_CPU_AMX=0 at load: neither these tiles nor prefill's AMX GEMM (qgemm8.c) run, and q8 keeps its bits."""
    monkeypatch.setenv("DS4_CPU_AMX", "0")
    monkeypatch.setattr(kernels, "_lib", False)
    try:
        assert not kernels.amx_rows() and not kernels.amx()
        w, x = weight("Q4_K", 16, 512), activations(16, 512)
        assert torch.equal(kernels.qdot8(x, w), ref.qdot8(x, w))
    finally:
        kernels.amx(True)
        kernels.amx_rows(True)
