"""sparse_attention: the Triton kernel (interpreter) against the PyTorch reference.

Shapes: the tiny model's (4 heads of 80 dims, window lists of 16, 4 compressed rows) and odd ones
(3 heads of 33 dims, lists of 19 and 5), M = 1..17 and a 40-row prefill, with random valid counts per
query (zero included: the sink alone gives a zero output), −1 padding after the valid entries and −1
holes in a prefill's lists. Tolerance: 2e-5 absolute on unit-scale rows (float32 online softmax in
tiles against the reference's one-shot softmax). Batch invariance: row r of every M-row call,
M = 2..16, equals the 1-row call bit for bit.
"""
import pytest
import torch

from backends.registry import implementations
from ops.qmatmul import SMALL_M
from ops.sparse_attention import AttnRows

pytestmark = pytest.mark.on_device  # CUDA when present, else the interpreter (tests/devices.py)

TOL = {"rtol": 0, "atol": 2e-5}


def impl(backend: str):
    """The registered sparse_attention of backend."""
    return implementations("sparse_attention")[backend].fn


def lists(g: torch.Generator, m: int, width: int, n_rows: int, min_valid: int = 0) -> tuple[torch.Tensor, tuple]:
    """[m, width] distinct row indices < n_rows with a random number of valid leading entries, −1 after."""
    idx = torch.stack([torch.randperm(n_rows, generator=g)[:width] for _ in range(m)])
    counts = torch.randint(min_valid, width + 1, (m,), generator=g).tolist()
    for r, c in enumerate(counts):
        idx[r, c:] = -1
    return idx, tuple(counts)


def case(m: int, H: int, D: int, window: int, top_k: int | None, seed: int = 0):
    """Random (q, kv, rows, sinks) for m queries."""
    g = torch.Generator().manual_seed(seed)
    n_rows = window + 3 * (top_k or 0) + 7
    q = torch.randn(m, H, D, generator=g)
    kv = torch.randn(n_rows, D, generator=g)
    raw, n_raw = lists(g, m, window, n_rows)
    rows = AttnRows(raw, n_raw)
    if top_k is not None:
        comp, n_comp = lists(g, m, top_k, n_rows)
        rows = AttnRows(raw, n_raw, comp, n_comp)
    return q, kv, rows, torch.randn(H, generator=g) * 2, D ** -0.5


def sliced(rows: AttnRows, a: int, b: int) -> AttnRows:
    """Queries a..b-1 of rows."""
    comp = None if rows.comp is None else rows.comp[a:b]
    return AttnRows(rows.raw[a:b], rows.n_raw[a:b], comp, rows.n_comp[a:b])


@pytest.mark.parametrize("H,D,window,top_k,widths", [(4, 80, 16, 4, range(2, SMALL_M + 1)),
                                                      (3, 33, 19, 5, range(2, SMALL_M + 1)),
                                                      (4, 80, 16, None, (2, SMALL_M)), (17, 16, 3, 1, (5, SMALL_M))])
def test_decode_and_verify_match_reference_and_are_batch_invariant(H, D, window, top_k, widths):
    """M = 1..17 against the reference; rows of M-row calls (every M <= 16 for the first two shapes, two
    widths for the others, to keep the interpreter quick) equal the 1-row calls bitwise."""
    tri, ref = impl("triton"), impl("torch")
    q, kv, rows, sinks, scale = case(SMALL_M + 1, H, D, window, top_k, seed=H + D)
    single = torch.cat([tri(q[r:r + 1], kv, sliced(rows, r, r + 1), sinks, scale) for r in range(SMALL_M)])
    torch.testing.assert_close(single, ref(q[:SMALL_M], kv, sliced(rows, 0, SMALL_M), sinks, scale), **TOL)
    for m in widths:
        assert torch.equal(tri(q[:m], kv, sliced(rows, 0, m), sinks, scale), single[:m]), f"M={m}"
    torch.testing.assert_close(tri(q, kv, rows, sinks, scale), ref(q, kv, rows, sinks, scale), **TOL)


def test_prefill_with_holes_and_empty_lists():
    """40 queries (the reference's padded path), −1 holes inside the lists, and queries with no rows."""
    tri, ref = impl("triton"), impl("torch")
    q, kv, rows, sinks, scale = case(40, 4, 80, 16, 4, seed=7)
    raw = rows.raw.clone()
    raw[::3, 1] = -1                      # holes: the padded reference path masks every −1
    raw[5], rows.comp[5] = -1, -1         # a query that sees only its sink
    rows = AttnRows(raw, rows.n_raw, rows.comp, rows.n_comp)
    got = tri(q, kv, rows, sinks, scale)
    torch.testing.assert_close(got, ref(q, kv, rows, sinks, scale), **TOL)
    assert torch.equal(got[5], torch.zeros_like(got[5]))


def test_float16_query_and_cache():
    """float16 q and kv rows are read as float32 (output float32)."""
    tri, ref = impl("triton"), impl("torch")
    q, kv, rows, sinks, scale = case(3, 4, 80, 16, 4, seed=3)
    q, kv = q.half(), kv.half()
    got = tri(q, kv, rows, sinks, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref(q, kv, rows, sinks, scale), **TOL)
