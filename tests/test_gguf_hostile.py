"""Hostile GGUF files: truncated, corrupted or absurdly declared input raises ModelFileError, fast."""
import random
import struct
import time

import gguf
import pytest
import torch

from ds4.errors import ModelFileError
from ds4.formats import gguf as ds4_gguf

SECONDS_PER_CASE = 1.0


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small valid file and the byte offsets of its sections and fields."""
    path = tmp_path_factory.mktemp("hostile") / "base.gguf"
    metadata = {
        "general.name": "tiny", "deepseek4.block_count": 2, "test.negative": -3, "test.big": 2**40,
        "deepseek4.expert_weights_scale": 1.5, "deepseek4.expert_weights_norm": True,
        "deepseek4.attention.compress_ratios": [0, 4], "deepseek4.swiglu_clamp_exp": [10.0, 10.0],
        "tokenizer.ggml.tokens": [f"tok{i}" for i in range(40)], "tokenizer.ggml.token_type": [1] * 40,
    }
    tensors = {"token_embd.weight": torch.ones(40, 32).half(), "output_norm.weight": torch.ones(32),
               "blk.0.ffn_gate_tid2eid.weight": torch.zeros(40, 6, dtype=torch.int32),
               "blk.0.ffn_up_exps.weight": torch.ones(4, 8, 32)}  # last: 4 KiB, so no padding after it
    ds4_gguf.write(path, metadata, tensors)
    reader = gguf.GGUFReader(path)
    fields = {k: f.offset for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    infos = {t.name: t.field.offset for t in reader.tensors}
    data = {t.name: (t.data_offset, t.n_bytes) for t in reader.tensors}
    end = max(o + n for o, n in data.values())
    assert end == path.stat().st_size
    return path, path.read_bytes(), fields, infos, data, reader.data_offset


def _expect_error(tmp_path, blob: bytes, *names: str) -> str:
    """Open `blob` as a file: it must raise ModelFileError naming the file and `names`, within the time limit."""
    path = tmp_path / "case.gguf"
    path.write_bytes(blob)
    start = time.perf_counter()
    with pytest.raises(ModelFileError) as err:
        ds4_gguf.open(path)
    assert time.perf_counter() - start < SECONDS_PER_CASE
    msg = str(err.value)
    assert str(path) in msg and all(n in msg for n in names), msg
    return msg


def _patch(blob: bytes, offset: int, fmt: str, value) -> bytes:
    return blob[:offset] + struct.pack(fmt, value) + blob[offset + struct.calcsize(fmt):]


def _value_offset(blob: bytes, field_offset: int) -> int:
    """Offset of a KV's value (after key length, key and value type)."""
    return field_offset + 8 + struct.unpack_from("<Q", blob, field_offset)[0] + 4


def _dims_offset(blob: bytes, info_offset: int) -> int:
    """Offset of a tensor info's n_dims field."""
    return info_offset + 8 + struct.unpack_from("<Q", blob, info_offset)[0]


def test_base_file_opens(base):
    f = ds4_gguf.open(base[0])
    assert f.metadata["tokenizer.ggml.tokens"][39] == "tok39" and len(f.tensors) == 4


def test_truncation_at_every_boundary(base, tmp_path):
    _, blob, fields, infos, data, data_start = base
    cuts = {0, 3, 4, 7, 8, 15, 16, 23, 24, data_start}
    for offset in [*fields.values(), *infos.values(), *(o for o, _ in data.values())]:
        cuts |= {offset - 1, offset, offset + 1, offset + 8, offset + 9}
    cuts |= {o + n - 1 for o, n in data.values()}
    for cut in sorted(c for c in cuts if 0 <= c < len(blob)):
        _expect_error(tmp_path, blob[:cut])


def test_truncation_at_random_points(base, tmp_path):
    blob, rng = base[1], random.Random(1)
    for cut in rng.sample(range(len(blob)), 300):
        _expect_error(tmp_path, blob[:cut])


def test_bad_header(base, tmp_path):
    blob = base[1]
    _expect_error(tmp_path, b"", "bad magic")
    _expect_error(tmp_path, b"GGML" + blob[4:], "bad magic")
    for version in (1, 4, 0x03000000, 2**32 - 1):
        _expect_error(tmp_path, _patch(blob, 4, "<I", version), f"version {version}")
    _expect_error(tmp_path, _patch(blob, 8, "<Q", 2**60), str(2**60), "tensors")
    _expect_error(tmp_path, _patch(blob, 16, "<Q", 2**60), str(2**60), "keys")
    _expect_error(tmp_path, _patch(blob, 16, "<Q", 2**64 - 1), "keys")


def test_huge_lengths_and_counts(base, tmp_path):
    _, blob, fields, infos, _, _ = base
    name, tokens = fields["general.name"], fields["tokenizer.ggml.tokens"]
    _expect_error(tmp_path, _patch(blob, name, "<Q", 2**50), "key #")
    _expect_error(tmp_path, _patch(blob, _value_offset(blob, name), "<Q", 2**50), "general.name")
    _expect_error(tmp_path, _patch(blob, _value_offset(blob, tokens) + 4, "<Q", 2**40), "tokenizer.ggml.tokens")
    _expect_error(tmp_path, _patch(blob, _value_offset(blob, tokens) + 12, "<Q", 2**50), "tokenizer.ggml.tokens[0]")
    ratios = _value_offset(blob, fields["deepseek4.attention.compress_ratios"])
    _expect_error(tmp_path, _patch(blob, ratios + 4, "<Q", 2**40), "compress_ratios")
    _expect_error(tmp_path, _patch(blob, infos["output_norm.weight"], "<Q", 2**50), "tensor #1")


@pytest.mark.parametrize("n_dims, dims, what", [
    (5, None, "5 dims"), (0, None, "0 dims"), (2**32 - 1, None, "dims"),
    (1, [0], "bad dims"), (1, [2**62], "past the end"), (1, [2**64 - 1], "past the end"),
])
def test_bad_dims(base, tmp_path, n_dims, dims, what):
    _, blob, _, infos, _, _ = base
    at = _dims_offset(blob, infos["output_norm.weight"])
    patched = _patch(blob, at, "<I", n_dims)
    if dims:
        patched = _patch(patched, at + 4, "<Q", dims[0])
    _expect_error(tmp_path, patched, "output_norm.weight", what)


def test_bad_types_offsets_and_names(base, tmp_path):
    _, blob, _, infos, _, _ = base
    embd = _dims_offset(blob, infos["token_embd.weight"]) + 4 + 2 * 8  # its type, then its offset
    for type_id in (4, 5, 99, 2**32 - 1):
        _expect_error(tmp_path, _patch(blob, embd, "<I", type_id), "token_embd.weight", f"type id {type_id}")
    _expect_error(tmp_path, _patch(blob, embd + 4, "<Q", 2**62), "token_embd.weight", "past the end")
    _expect_error(tmp_path, _patch(blob, embd + 4, "<Q", 8), "token_embd.weight", "alignment")
    norm = infos["output_norm.weight"]
    _expect_error(tmp_path, blob[:norm + 8] + b"\xff" + blob[norm + 9:], "tensor #1", "UTF-8")
    renamed = blob[:norm] + struct.pack("<Q", 17) + b"token_embd.weight" + blob[norm + 8 + 18:]
    _expect_error(tmp_path, renamed, "duplicate tensor token_embd.weight")


def test_bad_keys(base, tmp_path):
    _, blob, fields, _, _, _ = base
    block = fields["deepseek4.block_count"]
    vtype_at = _value_offset(blob, block) - 4
    _expect_error(tmp_path, _patch(blob, vtype_at, "<I", 13), "deepseek4.block_count", "value type 13")
    ratios = _value_offset(blob, fields["deepseek4.attention.compress_ratios"])
    _expect_error(tmp_path, _patch(blob, ratios, "<I", 9), "compress_ratios", "nested")
    _expect_error(tmp_path, _patch(blob, ratios, "<I", 77), "compress_ratios", "value type 77")
    renamed = blob[:block] + struct.pack("<Q", 12) + b"general.name" + blob[block + 8 + 21:]
    _expect_error(tmp_path, renamed, "duplicate key general.name")
    name = fields["general.name"]
    _expect_error(tmp_path, blob[:name + 8] + b"\xc3(" + blob[name + 10:], "key #", "UTF-8")
    string = _value_offset(blob, name) + 8
    _expect_error(tmp_path, blob[:string] + b"\xff" + blob[string + 1:], "general.name", "UTF-8")
    align = _value_offset(blob, fields["general.alignment"])
    for bad in (0, 3, 48):
        _expect_error(tmp_path, _patch(blob, align, "<I", bad), "general.alignment")
    _expect_error(tmp_path, _patch(blob, align, "<I", 2**31), "past the end")
    _expect_error(tmp_path, _patch(blob, align - 4, "<I", 5), "general.alignment")  # INT32 instead of UINT32


def test_wrong_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    ds4_gguf.write(path, {}, {"w": torch.zeros(4)}, architecture="qwen3")
    with pytest.raises(ModelFileError, match="general.architecture is 'qwen3'"):
        ds4_gguf.check_architecture(ds4_gguf.open(path))


def _mutate(blob: bytes, rng: random.Random, header_end: int) -> bytes:
    """One random corruption of the header/KV/tensor-info region, or a truncation."""
    kind = rng.randrange(4)
    at = rng.randrange(header_end)
    if kind == 0:  # flip bits in a few bytes
        out = bytearray(blob)
        for i in range(rng.randint(1, 4)):
            out[min(at + i, header_end - 1)] ^= 1 << rng.randrange(8)
        return bytes(out)
    if kind == 1:  # plant an extreme 64-bit or 32-bit value
        fmt = rng.choice(["<Q", "<I"])
        value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**40, 2**62, 2**64 - 1])
        at = min(at, header_end - struct.calcsize(fmt))
        return _patch(blob, at, fmt, value % 2 ** (8 * struct.calcsize(fmt)))
    if kind == 2:  # random bytes
        n = rng.randint(1, 16)
        return blob[:at] + rng.randbytes(n) + blob[at + n:]
    return blob[:rng.randrange(len(blob))]


def test_fuzz(base, tmp_path):
    """2,000 seeded corruptions: each opens fine or raises ModelFileError, within the time limit, never else."""
    _, blob, _, _, _, data_start = base
    rng, path, errors = random.Random(0), tmp_path / "fuzz.gguf", 0
    for case in range(2000):
        path.write_bytes(_mutate(blob, rng, data_start))
        start = time.perf_counter()
        try:
            f = ds4_gguf.open(path)
            for name in f.tensors:
                try:
                    f.raw(name)
                except ModelFileError:
                    pass
        except ModelFileError as e:
            assert str(path) in str(e)
            errors += 1
        assert time.perf_counter() - start < SECONDS_PER_CASE, case
    assert errors > 600  # most corruptions are caught, some (e.g. inside a string value) are harmless
