"""Quant types: bit-exact dequantize against gguf-py, GGUF round trips, quantize error bounds, FP8/FP4 values."""
import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from backends.registry import OpSet, backend_status, format_quant_support, implementations, quant_support
from ds4.errors import BackendUnavailable
from ds4.formats import gguf as ds4_gguf
from ds4.formats.llamacpp_mix import NEEDS_IMATRIX
from ds4.formats.requantize import takes_weights
from ops import quants
from ops.quants import QTensor
from ops.quants.fp8_e4m3 import round_e4m3
from ops.quants.mxfp4 import E2M1, round_e2m1

ALL = list(quants.TYPES.values())
GGUF_TYPES = [t for t in ALL if t.ggml_type is not None]

# gguf-py dequantizers ds4py does not port (NVFP4: no V4 file uses it).
NOT_PORTED = {"NVFP4"}
# gguf-py quantizers ds4py does not match bit for bit (MXFP4: ds4py rounds as DeepSeek's fp4 quantizer does).
OWN_QUANTIZER = {"MXFP4"}


def random_blocks(qt: quants.QuantType, n: int, seed: int = 0) -> np.ndarray:
    """`n` blocks of random bytes: float fields hold any value, NaN, infinity and subnormals included."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, qt.block_bytes), dtype=np.uint8)


def gguf_dequantize(blocks: np.ndarray, qt: quants.QuantType) -> np.ndarray:
    """gguf-py's dequantization of raw blocks (I32: a plain int32 view, gguf-py has no dequantizer for it)."""
    if qt.name == "I32":
        return blocks.view(np.int32).astype(np.float32)
    with np.errstate(all="ignore"):  # NaN and inf scales propagate, in gguf-py as in ds4py
        return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qt.ggml_type))


def same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    """Float32 arrays equal bit for bit, a NaN matching any NaN (its payload is not part of the format)."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    same = (a.view(np.int32) == b.view(np.int32)) | (np.isnan(a) & np.isnan(b))
    return a.shape == b.shape and bool(same.all())


def rel_rms(y: torch.Tensor, x: torch.Tensor) -> float:
    """Relative RMS error of `y` as an approximation of `x`."""
    return ((y - x).pow(2).mean() / x.pow(2).mean()).sqrt().item()


def gaussian(rows: int = 16, cols: int = 1024, seed: int = 0) -> torch.Tensor:
    """Gaussian weights, sigma 1000."""
    return 1000 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_registry_covers_every_type_gguf_py_dequantizes():
    dequantizable = {t.name for t in gguf.quants._type_traits}
    assert dequantizable - set(quants.TYPES) == NOT_PORTED
    for t in GGUF_TYPES:
        ggml = gguf.GGMLQuantizationType(t.ggml_type)
        assert ggml.name == t.name and (t.block_size, t.block_bytes) == gguf.GGML_QUANT_SIZES[ggml], t.name
    assert quants.BY_GGML == {t.ggml_type: t for t in GGUF_TYPES}


@pytest.mark.parametrize("qt", GGUF_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py_bit_for_bit(qt):
    blocks = random_blocks(qt, 4096)
    ours = qt.dequantize(torch.from_numpy(blocks))
    assert ours.dtype == torch.float32 and ours.shape == (4096, qt.block_size)
    assert same_bits(ours, gguf_dequantize(blocks, qt).reshape(4096, qt.block_size))
    # leading dims are kept
    assert same_bits(qt.dequantize(torch.from_numpy(blocks).reshape(4, 1024, -1)).reshape(4096, -1), ours)


def test_gguf_file_round_trip(tmp_path):
    path = tmp_path / "quants.gguf"
    weights = {t.name: QTensor.quantize(gaussian(4, 512, seed=i), t) for i, t in enumerate(GGUF_TYPES)}
    writer = gguf.GGUFWriter(path, "test")
    for name, q in weights.items():
        writer.add_tensor(name, q.data.numpy(), raw_dtype=gguf.GGMLQuantizationType(q.qtype.ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(path)
    ours = ds4_gguf.open(path)
    assert {t.name for t in reader.tensors} == set(weights)
    for t in reader.tensors:
        q = weights[t.name]
        stored = np.asarray(t.data).view(np.uint8).reshape(q.data.shape)
        assert np.array_equal(stored, q.data.numpy()), t.name
        assert [int(d) for d in reversed(t.shape.tolist())] == list(q.shape), t.name
        expected = q.dequantize()
        assert same_bits(gguf_dequantize(stored, q.qtype).reshape(q.shape), expected), t.name
        raw = ours.raw(t.name)
        assert raw.qtype is q.qtype and raw.shape == q.shape and torch.equal(raw.data, q.data), t.name
        assert same_bits(ours.dequantize(t.name), expected), t.name


def gguf_py_quantizes(qt: quants.QuantType) -> bool:
    """Whether gguf-py has a quantizer for `qt` (its class overrides the abstract quantize_blocks)."""
    cls = gguf.quants._type_traits.get(gguf.GGMLQuantizationType(qt.ggml_type))
    return cls is not None and not getattr(cls.quantize_blocks, "__isabstractmethod__", False)


@pytest.mark.parametrize("qt", [t for t in GGUF_TYPES if gguf_py_quantizes(t) and t.name not in OWN_QUANTIZER],
                         ids=lambda t: t.name)
def test_quantize_matches_gguf_py_where_it_has_a_quantizer(qt):
    want = gguf.quants.quantize(gaussian(4, 512).numpy(), gguf.GGMLQuantizationType(qt.ggml_type))
    assert np.array_equal(QTensor.quantize(gaussian(4, 512), qt).data.numpy(), want.reshape(4, -1))


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_quantize_error_bound(qt):
    x = gaussian()
    y = QTensor.quantize(x, qt).dequantize()
    bound = qt.error_bound
    assert rel_rms(y, x) <= bound
    # the bound catches a quantizer that puts values in the wrong places
    assert not rel_rms(y, x.roll(1, -1)) <= bound


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_quantize_is_deterministic_and_shape_generic(qt):
    x = gaussian(6, 512, seed=1)
    a = QTensor.quantize(x, qt)
    b = QTensor.quantize(x.clone(), qt.name)
    assert a.data.dtype == torch.uint8 and a.data.shape == (6, qt.row_bytes(512))
    assert torch.equal(a.data, b.data)
    stacked = QTensor.quantize(x.reshape(2, 3, 512), qt)  # e.g. experts stacked on a leading dim
    assert stacked.data.shape == (2, 3, qt.row_bytes(512)) and torch.equal(stacked.data.reshape(6, -1), a.data)


@pytest.mark.parametrize("qt", ALL, ids=lambda t: t.name)
def test_zero_and_tiny_blocks(qt):
    x = torch.zeros(2, 256)
    x[1] = 1e-3 * torch.randn(256, generator=torch.Generator().manual_seed(2))
    y = QTensor.quantize(x, qt).dequantize()
    assert torch.equal(y[0], torch.zeros(256))
    assert torch.isfinite(y).all()
    if qt.name != "I32":  # integers cannot hold 1e-3
        assert rel_rms(y[1], x[1]) <= qt.error_bound


WEIGHTED = [t for t in ALL if takes_weights(t)]  # the types scripts/quantize.py --imatrix weights
# sha256 (first 16 hex digits) of each importance-taking quantizer's bytes for gaussian() without weights, as
# they were before the quantizer took weights: adding weights= must not change them
UNWEIGHTED_SHA256 = {"Q2_K": "03d9de3739935b81", "Q3_K": "94671840f1134c23", "Q4_K": "25c73e390b9a1583",
                     "Q5_K": "fca8f4abe779ca3f", "Q6_K": "8020e869c10f488e",
                     "IQ2_XXS": "1513a9f23b8a69bc", "IQ2_XS": "6ff01b8d7785ac9c", "IQ2_S": "45d0c699e4d86a92",
                     "IQ3_XXS": "22ab30ff54dc4898", "IQ3_S": "a12a887ce131ad77", "IQ1_S": "d4c0c2ad94eea16d",
                     "IQ1_M": "cb6432d7e0c71266", "IQ4_NL": "43eabd2ce4cb26a7", "IQ4_XS": "d08f1a869343bfc3"}


def test_quantizers_taking_importance_weights():
    assert set(UNWEIGHTED_SHA256) <= {t.name for t in WEIGHTED}
    assert NEEDS_IMATRIX <= {t.name for t in WEIGHTED}  # a type quantize.py refuses without an imatrix uses it


@pytest.mark.parametrize("qt", WEIGHTED, ids=lambda t: t.name)
def test_importance_weights_lower_the_weighted_error(qt):
    x = gaussian()
    imp = torch.exp(2 * torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(7))).expand_as(x)
    plain = QTensor.quantize(x, qt)
    assert torch.equal(qt.quantize(x.reshape(-1, qt.block_size), weights=None), plain.data.reshape(-1, qt.block_bytes))
    if qt.name in UNWEIGHTED_SHA256:
        assert hashlib.sha256(plain.data.numpy().tobytes()).hexdigest()[:16] == UNWEIGHTED_SHA256[qt.name]
    weighted = qt.dequantize(qt.quantize(x.reshape(-1, qt.block_size), weights=imp.reshape(-1, qt.block_size)))
    weighted = weighted.reshape(x.shape)
    err = ((weighted - x) ** 2 * imp).sum() / ((plain.dequantize() - x) ** 2 * imp).sum()
    assert err < 0.8  # measured 0.34 (IQ3_S) to 0.65 (IQ4_XS)
    assert rel_rms(weighted, x) <= 1.5 * qt.error_bound  # the unweighted error stays of the same order
    # importance 0 (an imatrix column no activation reached, e.g. an expert never routed), and zero weights
    blocks = x.reshape(-1, qt.block_size)
    unseen = qt.dequantize(qt.quantize(blocks, weights=torch.zeros_like(blocks)))
    assert torch.isfinite(unseen).all() and rel_rms(unseen.reshape(x.shape), x) <= 1.5 * qt.error_bound
    zero = torch.zeros(2, qt.block_size)
    assert torch.equal(qt.dequantize(qt.quantize(zero, weights=torch.ones_like(zero))), zero)
    if qt.name.startswith("IQ"):
        with pytest.raises(ValueError, match="weights have 255 values for 256"):
            qt.quantize(x[0, :256], weights=imp[0, :255])


# --- E2M1 (MXFP4) ---------------------------------------------------------------------------------

def test_e2m1_grid_from_mxfp4_blocks():
    codes = torch.arange(32) % 16
    block = torch.cat([torch.tensor([127]), codes[:16] | (codes[16:] << 4)]).to(torch.uint8)  # scale 2**0
    grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    expected = torch.tensor(grid + [-v for v in grid], dtype=torch.float32).repeat(2)
    assert same_bits(quants.get("MXFP4").dequantize(block), expected)
    block[0] = 130  # scale 2**3
    assert same_bits(quants.get("MXFP4").dequantize(block), 8 * expected)


def test_round_e2m1_ties_to_even_code_and_clamps():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 2.6, 5.1, 7.0, 1e9, -0.25, -3.5, -5.0, -1e9])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 6.0, 6.0, 6.0, -0.0, -4.0, -4.0, -6.0])
    assert same_bits(round_e2m1(x), want)
    assert same_bits(round_e2m1(E2M1), E2M1)


def test_mxfp4_round_trip_of_representable_values():
    codes = torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(3))
    codes[:, 5] = 7  # amax 6 sets the scale exactly
    x = E2M1[codes] * torch.tensor([2.0**-3, 1.0, 2.0**4, 2.0**-20])[:, None]
    blocks = quants.get("MXFP4").quantize(x)
    assert blocks[:, 0].tolist() == [124, 127, 131, 107]
    assert same_bits(quants.get("MXFP4").dequantize(blocks), x)


def test_mxfp4_from_official_hand_built():
    # official layout: two codes per byte, element 2i in the low nibble; one e8m0 scale per 32 along K
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    packed[0, 0] = 0x71  # elements 0, 1 = codes 1 (0.5) and 7 (6)
    packed[1, 16] = 0xA3  # elements 32, 33 = codes 3 (1.5) and 10 (-1)
    scale = torch.tensor([[128, 127], [127, 125]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2, 1; 1, 1/4
    q = quants.mxfp4.from_official(packed.view(torch.int8), scale, name="w")
    expected = torch.zeros(2, 64)
    expected[0, 0], expected[0, 1] = 1.0, 12.0
    expected[1, 32], expected[1, 33] = 0.375, -0.25
    assert q.qtype.name == "MXFP4" and q.shape == (2, 64) and q.name == "w"
    assert same_bits(q.dequantize(), expected)
    # the same weight decoded the official way: table[low], table[high] interleaved, times the scale
    u = torch.randint(0, 256, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    s = torch.randint(110, 140, (3, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    official = torch.stack([E2M1[(u & 15).long()], E2M1[(u >> 4).long()]], -1).reshape(3, 128)
    official = official * s.view(torch.float8_e8m0fnu).float().repeat_interleave(32, 1)
    assert same_bits(quants.mxfp4.from_official(u, s).dequantize(), official)
    with pytest.raises(ValueError, match="w2"):
        quants.mxfp4.from_official(u, s[:, :3], name="w2")


# --- E4M3 (FP8) -----------------------------------------------------------------------------------

def test_round_e4m3_max_ties_and_clamp():
    x = torch.tensor([448.0, 449.0, 464.0, 1e6, float("inf"), -1e6, 432.0, 1 + 1 / 16, 1 + 3 / 16,
                      2.0**-10, 3 * 2.0**-10, 1.01])
    want = torch.tensor([448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0, 1.0, 1.25,
                         0.0, 2.0**-8, 1.0])
    assert same_bits(round_e4m3(x), want)


def test_round_e4m3_keeps_every_representable_value():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but NaN
    values = codes.view(torch.float8_e4m3fn).float()
    assert values.abs().max() == 448
    assert same_bits(round_e4m3(values), values)


def test_fp8_round_trip_of_representable_values():
    codes = torch.randint(0, 256, (3, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    codes[:, 7] = 0x7E  # 448 sets the scale exactly
    x = codes.view(torch.float8_e4m3fn).float() * torch.tensor([2.0**-9, 1.0, 2.0**5])[:, None]
    blocks = quants.get("FP8_E4M3").quantize(x)
    assert blocks[:, :4].contiguous().view(torch.float32).flatten().tolist() == [2.0**-9, 1.0, 2.0**5]
    assert same_bits(quants.get("FP8_E4M3").dequantize(blocks), x)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_fp8_from_official_hand_built(scale_dtype):
    weight = torch.zeros(130, 256, dtype=torch.uint8)
    weight[0, 0] = 0x38  # 1.0
    weight[129, 200] = 0xC4  # -3.0 (sign, exponent 8 -> 2**1, mantissa 4/8)
    scale = torch.tensor([[2.0, 0.5], [4.0, 0.25]]).to(scale_dtype)
    q = quants.fp8_e4m3.from_official(weight.view(torch.float8_e4m3fn), scale, name="w")
    expected = torch.zeros(130, 256)
    expected[0, 0], expected[129, 200] = 2.0, -0.75
    assert q.qtype.name == "FP8_E4M3" and q.shape == (130, 256) and q.data.shape == (130, 2 * 132)
    assert same_bits(q.dequantize(), expected)
    # random weights: equal to the official block-scaled dequantization
    w = torch.randn(130, 256, generator=torch.Generator().manual_seed(7)).to(torch.float8_e4m3fn)
    official = w.float() * scale.float().repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    assert same_bits(quants.fp8_e4m3.from_official(w, scale).dequantize(), official)
    with pytest.raises(ValueError, match="w3"):
        quants.fp8_e4m3.from_official(w[:, :200], scale, name="w3")


# --- one registration point: every backend declares every type --------------------------------------

@pytest.mark.parametrize("backend", ["triton", "cpu", "mlx"])
def test_every_backend_declares_every_quant_type(backend):
    """A registered type is served by each backend or declared unsupported there: never silently missing."""
    ok, why = backend_status(backend)
    if not ok:
        pytest.skip(why)
    assert set(quant_support(backend)) == set(quants.TYPES)


def test_the_op_report_lists_how_each_type_is_served():
    ops = OpSet(backend="cpu")
    ops.qmatmul(torch.randn(1, 256), QTensor.quantize(torch.randn(4, 256), "Q6_K"))
    lines = {line.split(":")[0]: line.split(":")[1].split() for line in ops.format_report().splitlines()
             if line.startswith("cpu ")}
    assert {"Q6_K", "Q8_0", "F16", "TQ2_0", "IQ1_S"} <= set(lines["cpu fused kernel (qgemv.c)"])
    assert {"FP8_E4M3", "I32"} <= set(lines["cpu reference dequantize per tile"])
    assert sorted(sum(lines.values(), [])) == sorted(quants.TYPES)
    assert format_quant_support("triton").splitlines()[-1] == "triton unsupported here: I32"


def test_an_unsupported_type_is_a_clear_error_on_triton():
    from backends.triton.quants import UNSUPPORTED
    name = sorted(UNSUPPORTED)[0]
    w = QTensor.quantize(torch.randn(2, 256), name, "w.odd")
    with pytest.raises(BackendUnavailable, match=f"triton qmatmul has no kernel for quant type {name} \\(tensor w.odd"):
        implementations("qmatmul")["triton"].fn(torch.randn(1, 256), w)


def test_the_docs_type_table_lists_every_registered_type():
    """docs/model.md §4 has a row per registered type, with its GGUF id and block size (the docs cannot drift)."""
    text = (Path(__file__).parents[1] / "docs" / "model.md").read_text()
    table = text.split("## §4")[1].split("| type | GGUF id |")[1].split("\n\n")[0]
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in table.splitlines() if line.startswith("| ")}
    for t in ALL:
        assert t.name in rows, f"docs/model.md §4 has no row for {t.name}"
        ggml, sizes = (c.strip() for c in rows[t.name])
        assert ggml == (str(t.ggml_type) if t.ggml_type is not None else "none (ds4py only)"), t.name
        assert sizes == f"{t.block_size} / {t.block_bytes}", t.name
