"""ds4/formats/gguf.py: write a small ds4-layout GGUF, read it back, and compare with gguf.GGUFReader."""
import os
import re
import warnings
import weakref

import gguf
import numpy as np
import pytest
import torch

from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf as ds4_gguf
from ops import quants
from ops.quants import QTensor

METADATA = {
    "general.name": "tiny ds4 ☃",
    "deepseek4.block_count": 3,
    "deepseek4.embedding_length": 64,
    "deepseek4.expert_weights_norm": True,
    "deepseek4.expert_weights_scale": 1.5,
    "deepseek4.rope.scaling.original_context_length": 2**33,
    "test.negative": -7,
    "test.very_negative": -(2**40),
    "deepseek4.attention.compress_ratios": [0, 0, 4],
    "deepseek4.swiglu_clamp_exp": [10.0, 10.0, 10.0],
    "test.signed_list": [-1, 2, 3],
    "test.bools": [True, False, True],
    "tokenizer.ggml.tokens": ["a", "b", "Ġthe", "<｜begin▁of▁sentence｜>"],
    "tokenizer.ggml.token_type": [1, 1, 1, 3],
}
VT = gguf.GGUFValueType
EXPECTED_TYPES = {  # how each key must be stored
    "general.name": [VT.STRING],
    "deepseek4.block_count": [VT.UINT32],
    "deepseek4.expert_weights_norm": [VT.BOOL],
    "deepseek4.expert_weights_scale": [VT.FLOAT32],
    "deepseek4.rope.scaling.original_context_length": [VT.UINT64],
    "test.negative": [VT.INT32],
    "test.very_negative": [VT.INT64],
    "deepseek4.attention.compress_ratios": [VT.ARRAY, VT.UINT32],
    "deepseek4.swiglu_clamp_exp": [VT.ARRAY, VT.FLOAT32],
    "test.signed_list": [VT.ARRAY, VT.INT32],
    "test.bools": [VT.ARRAY, VT.BOOL],
    "tokenizer.ggml.tokens": [VT.ARRAY, VT.STRING],
    "tokenizer.ggml.token_type": [VT.ARRAY, VT.INT32],
}
QUANT_SHAPES = {"Q8_0": (16, 64), "Q4_K": (2, 8, 256), "Q2_K": (2, 8, 256), "IQ2_XXS": (2, 8, 256), "MXFP4": (8, 64)}


def _tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {
        "output_norm.weight": torch.randn(64, generator=g),
        "token_embd.weight": torch.randn(40, 64, generator=g).half(),
        "blk.0.ffn_gate_tid2eid.weight": torch.randint(0, 8, (40, 6), generator=g, dtype=torch.int32),
        "blk.0.hc_attn_fn.weight": torch.randn(24, 256, generator=g).bfloat16(),
    }
    for name, shape in QUANT_SHAPES.items():
        if name in quants.TYPES:
            out[f"blk.0.{name.lower()}.weight"] = QTensor.quantize(torch.randn(shape, generator=g), name)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tensors = _tensors()
    ds4_gguf.write(path, METADATA, tensors)
    return path, tensors


def _as_float(value):
    return [_as_float(v) for v in value] if isinstance(value, list) else float(np.float32(value))


def test_metadata_round_trip(written):
    path, _ = written
    meta = ds4_gguf.open(path).metadata
    assert meta.pop("general.architecture") == "deepseek4" and meta.pop("general.alignment") == 32
    assert meta.keys() == METADATA.keys()
    for key, value in METADATA.items():
        if key in ("deepseek4.expert_weights_scale", "deepseek4.swiglu_clamp_exp"):
            assert meta[key] == _as_float(value), key
        else:
            assert meta[key] == value and type(meta[key]) is type(value), key


def test_metadata_types_on_disk(written):
    reader = gguf.GGUFReader(written[0])
    for key, types in EXPECTED_TYPES.items():
        assert reader.fields[key].types == types, key


def test_gguf_reader_agrees(written):
    path, tensors = written
    f = ds4_gguf.open(path)
    reader = gguf.GGUFReader(path)
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("GGUF.")}
    assert f.metadata == fields
    assert list(f.tensors) == list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(tensors[t.name].shape) == tuple(reversed(t.shape.tolist()))
        assert info.type == t.tensor_type.name and info.nbytes == t.n_bytes and info.offset == t.data_offset
        assert f._bytes[info.offset:info.offset + info.nbytes].numpy().tobytes() == t.data.tobytes()
    assert f.tensors["token_embd.weight"].shape == (40, 64)  # [out, in]: GGUF ne = [64, 40]
    assert f.tensors["blk.0.hc_attn_fn.weight"].type == "BF16"


def _source_bytes(t) -> torch.Tensor:
    return t.data if isinstance(t, QTensor) else t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("name", list(_tensors()))
def test_raw_and_dequantize_round_trip(written, name):
    path, tensors = written
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable array" warning
        f = ds4_gguf.open(path)
        q = f.raw(name)
    src = tensors[name]
    assert q.shape == tuple(src.shape) and q.qtype.name == f.tensors[name].type
    assert torch.equal(q.data, _source_bytes(src))
    want = src.dequantize() if isinstance(src, QTensor) else src.float()
    assert torch.equal(f.dequantize(name), want)
    base, size = f._bytes.data_ptr(), f._bytes.numel()  # zero-copy: the view lies inside the file mapping
    assert base <= q.data.data_ptr() and q.data.data_ptr() + q.data.numel() <= base + size
    assert q.data.data_ptr() - base == f.tensors[name].offset


def test_raw_views_are_copy_on_write(written):
    path, _ = written
    before = path.read_bytes()
    f = ds4_gguf.open(path)
    start = f.tensors["output_norm.weight"].offset
    f._bytes[start:start + 16] = 0xFF
    assert path.read_bytes() == before and ds4_gguf.open(path)._bytes[start] != 0xFF


def test_huge_sparse_file_opens_without_reading_it(tmp_path):
    """A 96 GiB sparse file maps without reserving memory (a copy-on-write np.memmap of it fails with ENOMEM)."""
    path, shape = tmp_path / "huge.gguf", (48, 2**15, 2**15)
    nbytes = int(np.prod(shape)) * 2
    writer = gguf.GGUFWriter(path, "deepseek4")
    writer.add_tensor_info("blk.0.ffn_up_exps.weight", shape, np.dtype(np.float16), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    os.truncate(path, -(-path.stat().st_size // 32) * 32 + nbytes)
    f = ds4_gguf.open(path)
    assert f.tensors["blk.0.ffn_up_exps.weight"].shape == shape and f.tensors["blk.0.ffn_up_exps.weight"].type == "F16"
    assert f._bytes.numel() == path.stat().st_size > 96 * 2**30


def test_check_architecture(written, tmp_path):
    f = ds4_gguf.open(written[0])
    with pytest.raises(ModelFileError, match="deepseek4.vocab_size"):
        ds4_gguf.check_architecture(f)  # the tiny file above lacks most DS4_KEYS
    ds4_gguf.check_architecture(f, keys=("deepseek4.block_count",))
    other = tmp_path / "llama.gguf"
    ds4_gguf.write(other, {}, {"w": torch.zeros(4)}, architecture="llama")
    with pytest.raises(ModelFileError, match=f"{other}.*'llama'.*'deepseek4'"):
        ds4_gguf.check_architecture(ds4_gguf.open(other))
    assert len(set(ds4_gguf.DS4_KEYS)) == len(ds4_gguf.DS4_KEYS) == 34


def test_missing_and_unsupported_tensors(tmp_path):
    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(path, "deepseek4")  # Q8_1: ggml's activation-only type, not a weight type ds4py reads
    writer.add_tensor("odd", np.zeros((4, 40), np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = ds4_gguf.open(path)
    assert f.tensors["odd"].shape == (4, 32) and f.tensors["odd"].type == "Q8_1"
    with pytest.raises(ModelFileError, match=f"{path}.*odd.*Q8_1"):
        f.raw("odd")
    with pytest.raises(ModelFileError, match=f"{path}.*no tensor named nope"):
        f.raw("nope")


def test_failed_write_keeps_the_old_file(written, tmp_path):
    path = tmp_path / "keep.gguf"
    ds4_gguf.write(path, {"a": 1}, {"w": torch.ones(4)})
    before = path.read_bytes()
    for meta, tensors in [({"a": 1}, {"w": torch.ones(4, dtype=torch.float64)}),
                          ({"a": []}, {}), ({"a": None}, {}), ({"a": [1, "x"]}, {}), ({"a": 2**64}, {})]:
        with pytest.raises(UsageError, match="w|a"):
            ds4_gguf.write(path, meta, tensors)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["keep.gguf"]
    (tmp_path / "plain").touch()
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode  # the umask applies as to any new file


def _lazy(tensors: dict) -> dict:
    """The same tensors as LazyTensors whose producers return them."""
    return {name: ds4_gguf.LazyTensor(*ds4_gguf._type_and_shape(name, t), lambda t=t: t) for name, t in tensors.items()}


def test_lazy_tensors_stream_one_at_a_time_into_the_same_bytes(written, tmp_path):
    """Each producer allocates a fresh 1 MiB tensor; the writer must drop it before producing the next one."""
    n, numel = 8, 2**18
    live, most_live, log = set(), [0], []

    def produce(i: int) -> torch.Tensor:
        t = torch.full((numel // 64, 64), float(i))
        live.add(i)
        weakref.finalize(t, live.discard, i)
        most_live[0] = max(most_live[0], len(live))
        log.append(i)
        return t

    lazy = {f"blk.{i}.w": ds4_gguf.LazyTensor("F32", (numel // 64, 64), lambda i=i: produce(i)) for i in range(n)}
    ds4_gguf.write(tmp_path / "lazy.gguf", METADATA, lazy)
    assert log == list(range(n)) and most_live[0] == 1 and not live
    ds4_gguf.write(tmp_path / "eager.gguf", METADATA, {f"blk.{i}.w": produce(i) for i in range(n)})
    assert most_live[0] == n  # the counter does see tensors that are kept alive
    assert (tmp_path / "lazy.gguf").read_bytes() == (tmp_path / "eager.gguf").read_bytes()
    ds4_gguf.write(tmp_path / "mixed.gguf", METADATA, _lazy(written[1]))  # every type, quantized ones included
    assert (tmp_path / "mixed.gguf").read_bytes() == written[0].read_bytes()


def test_progress_wraps_the_tensors_as_they_are_written(tmp_path):
    path, seen = tmp_path / "p.gguf", []

    def progress(items):
        for item in items:
            seen.append((item[0], [p.stat().st_size for p in tmp_path.glob(".p.gguf.*.tmp")]))
            yield item

    tensors = {f"w{i}": ds4_gguf.LazyTensor("F32", (64,), lambda: torch.ones(64)) for i in range(3)}
    ds4_gguf.write(path, {}, tensors, progress=progress)
    assert [name for name, _ in seen] == ["w0", "w1", "w2"]
    sizes = [size for _, (size,) in seen]  # the header is on disk before the first tensor is produced
    assert 0 < sizes[0] < sizes[1] < sizes[2] < path.stat().st_size


@pytest.mark.parametrize("produce, error", [
    (lambda: torch.ones(4, 8), "w: produced F32 (4, 8), declared F32 (8, 8)"),
    (lambda: torch.ones(8, 8).half(), "w: produced F16 (8, 8), declared F32 (8, 8)"),
    (lambda: torch.ones(8, 8).double(), "w: torch.float64 (8, 8) cannot be stored"),
    (lambda: QTensor(quants.get("F32"), (8, 8), torch.zeros(8, 16, dtype=torch.uint8)),
     "w: data is torch.uint8 (8, 16), expected uint8 (8, 32)"),
    (lambda: np.ones((8, 8), np.float32), "w: a ndarray is not a QTensor"),
    (lambda: ds4_gguf.LazyTensor("F32", (8, 8), lambda: torch.ones(8, 8)), "w: its producer returned a LazyTensor"),
])
def test_bad_producer_leaves_the_old_file(tmp_path, produce, error):
    path = tmp_path / "keep.gguf"
    ds4_gguf.write(path, {"a": 1}, {"w": torch.ones(4)})
    before = path.read_bytes()
    tensors = {"ok": torch.ones(4), "w": ds4_gguf.LazyTensor("F32", (8, 8), produce)}
    with pytest.raises(UsageError, match=re.escape(f"tensor {error}")):
        ds4_gguf.write(path, {"a": 2}, tensors)

    def fail():
        raise ModelFileError("unreadable shard")

    with pytest.raises(ModelFileError, match="unreadable shard"):
        ds4_gguf.write(path, {"a": 2}, tensors | {"w": ds4_gguf.LazyTensor("F32", (8, 8), fail)})
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["keep.gguf"]


@pytest.mark.parametrize("type_name, shape, error", [
    ("F32", (8, 0), r"w: shape \(8, 0\)"), ("F32", (1, 1, 1, 1, 1), r"w: shape \(1, 1, 1, 1, 1\)"),
    ("Q8_1", (8, 32), "w: quant type Q8_1 cannot be stored"), ("FP8_E4M3", (8, 128), "w: quant type FP8_E4M3"),
    ("Q8_0", (8, 31), "w: Q8_0: row length 31"),
])
def test_bad_lazy_declaration_fails_before_producing(tmp_path, type_name, shape, error):
    produced = []
    with pytest.raises(UsageError, match=error):
        ds4_gguf.write(tmp_path / "x.gguf", {}, {"w": ds4_gguf.LazyTensor(type_name, shape, produced.append)})
    assert not produced and not os.listdir(tmp_path)
