"""Hostile files and misuse after the parser: every case ends in a Ds4Error subclass (API) or one `error:`
line with exit status 2 (CLI) within a few seconds, or runs correctly; never a traceback, a hang or exit 0
with garbage. CLI cases run in-process through `main(argv)`; only the signal tests need subprocesses."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch

import ds4
from backends.registry import OpSet
from ds4.errors import Ds4Error, ModelFileError, NonFiniteError, UsageError
from ds4.formats import gguf
from ds4.session import Session, state_bytes
from ds4.tiny.build import tiny_model_weights
from ds4.tiny.vocab import tiny_vocab_metadata
from models.args import METADATA_KEYS, PREFIX, SCHEMA, ModelArgs
from models.deepseek_v4 import DeepseekV4
from ops.quants import QTensor
from tests.script_modules import script

ROOT = Path(__file__).resolve().parents[1]
SECONDS = 10.0  # per case, generously: the CI machine is a shared 2-core CPU


generate, make_tiny, convert_hf, bench = (script(n) for n in ("generate", "make_tiny", "convert_hf", "bench"))


@pytest.fixture(scope="module")
def tiny():
    """In-memory tiny model: (metadata, base weights, MTP weights)."""
    return tiny_model_weights(mix="f32", seed=0)


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return ds4.load(*tiny_gguf, backend="torch", ctx=128, prefill_chunk=16)


def rewrite(path: Path, md: dict, tensors: dict, **kw) -> str:
    gguf.write(path, md, tensors, **kw)
    return str(path)


def cli(capsys, *argv: str, model: tuple[str, str] | None = None) -> tuple[int, str, str]:
    """generate.main in-process: (status, stdout, stderr); an exception escaping main fails the test."""
    if model:
        argv = ("--model", model[0], "--mtp", model[1], *argv)
    start = time.perf_counter()
    rc = generate.main(["--backend", "torch", *argv])
    assert time.perf_counter() - start < SECONDS, argv
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error_line(rc: int, err: str, *needles: str) -> None:
    """Exit status 2 and exactly one line, `error: ...`, containing every needle."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert all(n in lines[0] for n in needles), (needles, err)


# ---- metadata: every deepseek4.* value type- and range-checked, naming the key ----------------------

def mutations(value, rng: random.Random) -> list:
    """Wrong types and hostile values for a metadata value like `value`."""
    common = [str(value), None, [], {"a": 1}, True, False, -1, 0, 2**31, 2**63 - 1, -2**63, math.nan, math.inf,
              -math.inf, -0.5, 1e300, 1e-300, "nan"]
    if isinstance(value, list):
        common += [value[:1], value * 3, [str(v) for v in value], [math.nan] * len(value), [-1] * len(value),
                   [2**40] * len(value), [True] * len(value), [[v] for v in value], value[0]]
    elif isinstance(value, bool):
        common += [1, 0, 1.0, [value]]
    elif isinstance(value, int):
        common += [float(value), value + 0.5, [value], value * 2**20, -value, str(value)]
    else:
        common += [int(value) if math.isfinite(value) else 0, [value], -value, value * 1e30]
    rng.shuffle(common)
    return common


def test_metadata_fuzz_every_key(tiny):
    """Seeded fuzz over every deepseek4.* key: each mutation is refused naming a deepseek4 key, or the model
    still binds its tensors and runs (a forward gives finite logits or NonFiniteError), fast."""
    md, base, _ = tiny
    rng = random.Random(1234)
    refused = accepted = 0
    for key in METADATA_KEYS.values():
        for value in mutations(md[PREFIX + key], rng):
            bad = {**md, PREFIX + key: value}
            start = time.perf_counter()
            try:
                args = ModelArgs.from_metadata(bad)
            except ModelFileError as e:
                assert PREFIX in str(e), (key, value, e)
                refused += 1
                continue
            accepted += 1
            try:
                model = DeepseekV4(args, base, OpSet("torch"))
            except ModelFileError:
                continue
            try:
                Session(model, 32, 8).prefill([5, 6, 7, 8])
            except NonFiniteError:
                pass
            assert time.perf_counter() - start < SECONDS, (key, value)
    assert refused > 20 * len(METADATA_KEYS) and accepted < refused // 10, (refused, accepted)


@pytest.mark.parametrize("key, value, message", [
    ("hyper_connection.sinkhorn_iterations", 2**31, "sinkhorn_iterations: 2147483648 is outside"),
    ("hyper_connection.sinkhorn_iterations", 0, "sinkhorn_iterations"),
    ("attention.sliding_window", 0, "sliding_window"),
    ("attention.sliding_window", 2**40, "sliding_window"),
    ("attention.indexer.top_k", -4, "indexer.top_k"),
    ("attention.output_group_count", 0, "output_group_count"),
    ("rope.scaling.original_context_length", 0, "original_context_length"),
    ("hash_layer_count", 7, "hash_layer_count: 7 is outside [0, 6]"),
    ("attention.layer_norm_rms_epsilon", -1e-6, "layer_norm_rms_epsilon"),
    ("attention.layer_norm_rms_epsilon", math.nan, "not finite"),
    ("rope.freq_base", math.inf, "rope.freq_base"),
    ("rope.scaling.factor", 0.0, "rope.scaling.factor"),
    ("hyper_connection.epsilon", 0.0, "hyper_connection.epsilon"),
    ("expert_weights_scale", -1.5, "expert_weights_scale"),
    ("swiglu_clamp_exp", [10.0] * 6 + [math.nan], "swiglu_clamp_exp"),
    ("block_count", "6", "expected an int, got str"),
    ("block_count", 6.0, "expected an int, got float"),
    ("block_count", True, "expected an int, got bool"),
    ("block_count", [6], "expected an int, got list"),
    ("expert_weights_norm", 1, "expected a bool, got int"),
    ("attention.compress_ratios", [0, 0, 4, 16], "compress_ratios: 4 entries for 6 layers"),
    ("attention.compress_ratios", [0, 0, 4.0, 16, 4, 16, 0], "list of ints"),
    ("attention.compress_ratios", [0, 0, 1, 16, 4, 16, 0], "compress_ratios"),
    ("embedding_length", 0, "embedding_length"),
    ("vocab_size", 2**40, "vocab_size"),
])
def test_metadata_value_refused_naming_key(tiny, key, value, message):
    md = {**tiny[0], PREFIX + key: value}
    with pytest.raises(ModelFileError, match=None) as err:
        ModelArgs.from_metadata(md)
    assert PREFIX + key in str(err.value) and message in str(err.value), str(err.value)


@pytest.mark.parametrize("key, value", [
    ("hyper_connection.sinkhorn_iterations", 2**31), ("block_count", "6"), ("rope.freq_base", math.nan),
    ("attention.indexer.top_k", 0), ("expert_weights_norm", 1), ("attention.compress_ratios", [0, 4]),
])
def test_hostile_metadata_file_is_one_cli_line(tiny_gguf, tmp_path, capsys, key, value):
    f = gguf.open(tiny_gguf[0])
    md = {k: v for k, v in f.metadata.items() if k != "general.alignment"} | {PREFIX + key: value}
    path = rewrite(tmp_path / "bad.gguf", md, {n: f.raw(n) for n in f.tensors})
    rc, out, err = cli(capsys, "--model", path, "-n", "2")
    assert_error_line(rc, err, path, PREFIX + key)
    assert out == ""


def test_api_accepts_id_arrays(engine):
    ids = [t.id for t in engine.generate(np.array([5, 6, 7]), max_tokens=2)]
    assert ids == [t.id for t in engine.generate(torch.tensor([5, 6, 7]), max_tokens=2)] and len(ids) == 2
    with pytest.raises(UsageError, match="--mtp-draft"):
        engine.generate([5, 6], mtp_draft=True)


def test_schema_covers_every_key():
    assert SCHEMA.keys() == METADATA_KEYS.keys()


# ---- tensors: values of small tensors, token->expert tables, aliasing -------------------------------

def f32(values: torch.Tensor, name: str) -> QTensor:
    return QTensor.quantize(values.float(), "F32", name)


@pytest.mark.parametrize("name, edit, message", [
    ("output_norm.weight", lambda t: t.index_fill(0, torch.tensor([3]), math.nan), "non-finite"),
    ("blk.1.attn_sinks.weight", lambda t: t.index_fill(0, torch.tensor([0]), math.inf), "non-finite"),
    ("blk.0.hc_attn_scale.weight", lambda t: t * math.nan, "non-finite"),
    ("blk.4.exp_probs_b.bias", lambda t: t - math.inf, "non-finite"),
    ("blk.0.ffn_gate_tid2eid.weight", lambda t: t + 100, "expert ids in [0, 8)"),
    ("blk.1.ffn_gate_tid2eid.weight", lambda t: t - 1 - t.max(), "expert ids"),
    ("blk.2.ffn_gate_tid2eid.weight", lambda t: t + 0.5, "expert ids"),
])
def test_bad_small_tensor_values(tiny, name, edit, message):
    md, base, _ = tiny
    weights = {**base, name: f32(edit(base[name].dequantize()), name)}
    with pytest.raises(ModelFileError) as err:
        DeepseekV4(ModelArgs.from_metadata(md), weights, OpSet("torch"))
    assert name in str(err.value) and message in str(err.value), str(err.value)


def test_overlapping_tensor_data_refused(tmp_path):
    path = tmp_path / "alias.gguf"
    gguf.write(path, {"general.name": "x"}, {"a.weight": torch.ones(64, 32), "b.weight": torch.zeros(64, 32)})
    reader = gguf_py.GGUFReader(path)
    info = {t.name: t for t in reader.tensors}
    blob = bytearray(path.read_bytes())
    field = info["b.weight"].field
    offset_pos = field.offset + sum(p.nbytes for p in field.parts[:-1])  # the last part is the data offset
    struct.pack_into("<Q", blob, offset_pos, struct.unpack_from("<Q", blob, info["a.weight"].field.offset +
                     sum(p.nbytes for p in info["a.weight"].field.parts[:-1]))[0])
    path.write_bytes(bytes(blob))
    with pytest.raises(ModelFileError, match="overlaps tensor a.weight"):
        gguf.open(path)


def test_load_checks_architecture_and_tokenizer_size(tiny_gguf, tmp_path):
    f = gguf.open(tiny_gguf[0])
    tensors = {n: f.raw(n) for n in f.tensors}
    md = {k: v for k, v in f.metadata.items() if k not in ("general.architecture", "general.alignment")}
    llama = rewrite(tmp_path / "llama.gguf", md, tensors, architecture="llama")
    with pytest.raises(ModelFileError, match="general.architecture is 'llama'"):
        ds4.load(llama, backend="torch")
    small = {k: v for k, v in md.items() if not k.startswith("tokenizer.")} | tiny_vocab_metadata(300)
    short = rewrite(tmp_path / "short-vocab.gguf", small, tensors)
    with pytest.raises(ModelFileError, match=r"the tokenizer has \d+ tokens but the model's vocabulary"):
        ds4.load(short, backend="torch")


# ---- run time: non-finite values name the step ------------------------------------------------------

def test_nonfinite_logits_name_the_position(tiny, tiny_gguf, tmp_path, capsys):
    md, base, _ = tiny
    out = base["output.weight"].dequantize()
    out[7] = math.inf  # one vocab row: the LM head yields Inf/NaN logits at every position
    f = gguf.open(tiny_gguf[0])
    path = rewrite(tmp_path / "inf.gguf", {k: v for k, v in f.metadata.items() if k != "general.alignment"},
                   {n: f.raw(n) for n in f.tensors} | {"output.weight": f32(out, "output.weight")})
    rc, stdout, err = cli(capsys, "--model", path, "--prompt-ids", "5,6,7", "-n", "4")
    assert_error_line(rc, err, "non-finite logits at position 2")
    rc, stdout, err = cli(capsys, "--model", path, "--prompt-ids", "5,6,7", "--temp", "0.8", "--seed", "1")
    assert_error_line(rc, err, "non-finite logits at position 2")


# ---- CLI: never a traceback ---------------------------------------------------------------------------

CLI_ERRORS = [
    (["--ctx", str(10**12)], "needs"),
    (["--ctx", "0"], "--ctx"),
    (["--ctx", "1"], "--ctx"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--temp", "nan"], "--temp must be a finite number"),
    (["--temp", "inf"], "--temp must be a finite number"),
    (["--top-p", "nan"], "--top-p"),
    (["--min-p=-inf"], "--min-p"),
    (["--seed", str(2**70)], "--seed"),
    (["--seed", "-1"], "--seed"),
    (["--threads", str(10**9)], "--threads"),
    (["--threads", "-3"], "--threads"),
    (["-n", "-1"], "max_tokens"),
    (["--mtp-draft", "99"], "--mtp-draft"),
    (["--mtp-draft", "many"], "--mtp-draft"),
    (["--prompt-ids", "1,2,999999"], "outside the vocabulary"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt", "caf\udce9"], "not valid UTF-8"),
    (["--system", "\udcff"], "not valid UTF-8"),
    (["--prompt-file", "/dev/zero"], "longer than"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
    (["--prompt-file", "/"], "--prompt-file"),
    (["--dump-logits", "/nonexistent/dir/l.npy"], "--dump-logits"),
    (["--dump-logits", "/proc/l.npy"], "cannot be written"),
    (["--dump-logits", "/tmp"], "is a directory"),
    (["--model", "/nonexistent.gguf"], "not found"),
    (["--device", "foo"], "not a device"),
    (["--device", "cuda:99"], "no such CUDA device"),
    (["--device", "xla"], "--device"),
]


@pytest.mark.parametrize("argv, message", CLI_ERRORS, ids=[" ".join(a)[:40] for a, _ in CLI_ERRORS])
def test_cli_misuse_is_one_error_line(tiny_gguf, capsys, argv, message):
    rc, out, err = cli(capsys, "-n", "2", *argv, model=None if "--model" in argv else tiny_gguf)
    assert_error_line(rc, err, message)
    assert out == ""


def test_cli_ctx_error_says_how_much_memory(tiny_gguf, capsys):
    rc, _, err = cli(capsys, "--ctx", str(10**12), model=tiny_gguf)
    assert_error_line(rc, err, "GiB of KV state", "per 1024 tokens", "lower --ctx")


def test_bad_prompt_file_bytes(tiny_gguf, tmp_path, capsys):
    (tmp_path / "bin").write_bytes(bytes(range(256)))
    rc, _, err = cli(capsys, "--prompt-file", str(tmp_path / "bin"), model=tiny_gguf)
    assert_error_line(rc, err, "not UTF-8 text (invalid byte at offset 128)")
    (tmp_path / "nul").write_bytes(b"\x00\x01 binary but valid UTF-8 \x7f")
    rc, out, err = cli(capsys, "--prompt-file", str(tmp_path / "nul"), "-n", "2", "--json", model=tiny_gguf)
    assert rc == 0 and len(json.loads(out)["generated_ids"]) == 2, err


def test_cli_runs_correctly_at_the_edges(tiny_gguf, tmp_path, capsys):
    """Values that are extreme but meaningful run: a prefill chunk far beyond the context is clamped, a tiny
    temperature samples (no overflow), a huge -n stops at the context."""
    runs = [("--prefill-chunk", str(10**12)), ("--temp", "1e-300", "--seed", "7"), ("--seed", str(2**64 - 1)),
            ("-n", str(10**30), "--ctx", "40")]
    for argv in runs:
        rc, out, err = cli(capsys, "--prompt-ids", "5,6,7", "--json", *(argv if "-n" in argv else (*argv, "-n", "2")),
                           model=tiny_gguf)
        assert rc == 0, (argv, err)
        ids = json.loads(out)["generated_ids"]
        assert ids and all(0 <= i < 512 for i in ids), argv
    assert len(ids) == 38 or ids[-1] == 1  # 37 fed after the 3 prompt tokens fill the context of 40, or EOS


def test_dump_logits_writes_exactly_the_path(tiny_gguf, tmp_path, capsys):
    target = tmp_path / "logits.bin"
    rc, _, err = cli(capsys, "--prompt-ids", "5,6", "-n", "3", "--dump-logits", str(target), model=tiny_gguf)
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.bin"]
    assert np.load(target).shape == (3, 512)


def test_mtp_draft_zero_turns_speculation_off(tiny_gguf, capsys):
    rc, out, err = cli(capsys, "--prompt-ids", "5,6,7", "-n", "6", "--json", "--mtp-draft", "0", model=tiny_gguf)
    spec = json.loads(out)["speculative"]
    assert rc == 0 and spec["num_drafts"] == 0 and spec["mtp_passes"] == 0 and not spec["mtp_catch_up_rows"], err
    rc, out, err = cli(capsys, "--prompt-ids", "5,6,7", "-n", "6", "--json", model=tiny_gguf)
    assert json.loads(out)["speculative"]["num_drafts"] > 0  # the default with an MTP head drafts


def test_missing_and_truncated_default_model(tiny_gguf, tmp_path, monkeypatch, capsys):
    """A broken install (the packaged default model missing or cut short) says how to fix it."""
    from ds4 import engine
    monkeypatch.setattr(engine, "DEFAULT_MODEL_DIR", tmp_path)
    rc, _, err = cli(capsys, "-n", "1")
    assert_error_line(rc, err, "default model is missing", "reinstall")
    shutil.copy(tiny_gguf[1], tmp_path / "tiny-mtp.gguf")
    (tmp_path / "tiny.gguf").write_bytes(Path(tiny_gguf[0]).read_bytes()[:5000])
    rc, _, err = cli(capsys, "-n", "1")
    assert_error_line(rc, err, "damaged", "reinstall")


def test_ctrl_c_is_one_line(tiny_gguf, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(generate, "run", interrupted)
    assert generate.main(["-n", "1"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


# ---- API: as strict as the CLI, checked when called ---------------------------------------------------

API_ERRORS = [
    ({"prompt": [1.5, 2]}, "integers"),
    ({"prompt": [True, 2]}, "integers"),
    ({"prompt": ["5"]}, "integers"),
    ({"prompt": [5, 10**9]}, "outside the vocabulary"),
    ({"prompt": [-1]}, "outside the vocabulary"),
    ({"prompt": b"bytes"}, "str or a sequence"),
    ({"prompt": "x\udc80"}, "not valid UTF-8"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": "3"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"ctx": 0}, "ctx"),
    ({"ctx": 10**12}, "needs"),
    ({"prefill_chunk": 0}, "prefill_chunk"),
    ({"temperature": math.nan}, "--temp"),
    ({"temperature": "hot"}, "--temp"),
    ({"top_k": 1.5}, "--top-k"),
    ({"seed": 2**64}, "--seed"),
    ({"seed": 1.0}, "--seed"),
    ({"mtp_draft": 17}, "--mtp-draft"),
    ({"mtp_draft": "fast"}, "--mtp-draft"),
    ({"system": b"sys"}, "system prompt"),
    ({"on_logits": "file.npy"}, "on_logits"),
]


@pytest.mark.parametrize("kwargs, message", API_ERRORS, ids=[str(k)[:40] for k, _ in API_ERRORS])
def test_generate_checks_arguments_when_called(engine, kwargs, message):
    kwargs = {"prompt": [5, 6, 7]} | kwargs
    with pytest.raises(UsageError, match=None) as err:
        engine.generate(kwargs.pop("prompt"), **kwargs)  # no next(): the call itself refuses
    assert message in str(err.value), str(err.value)


def test_api_sessions_and_load(engine, tiny_gguf):
    with pytest.raises(UsageError, match="ctx"):
        engine.session(ctx=0)
    a, b = engine.session(), engine.session()
    a.prefill([5, 6, 7])
    with pytest.raises(UsageError, match="snapshot taken from this session"):
        b.restore(a.snapshot())
    with pytest.raises(UsageError, match="snapshot taken from this session"):
        b.restore("snapshot")
    a.restore(a.snapshot())
    with pytest.raises(UsageError, match="integers"):
        a.forward([5.0])
    with pytest.raises(UsageError, match="rollback point"):
        a.truncate(1.5)
    for bad in (5, "abc", [5, 512], [5, -1]):
        with pytest.raises(UsageError, match="token ids"):
            a.prefill(bad)
    for rows in ([3], [-1], "first", [0.0]):
        with pytest.raises(UsageError, match="logit_rows"):
            a.forward([5, 6], rows)
    with pytest.raises(UsageError, match="token ids"):
        a.mtp_draft(512)
    assert a.pos == 3  # nothing refused was fed
    for kwargs in ({"ctx": 0}, {"ctx": 2.5}, {"prefill_chunk": -1}, {"ctx": True}):
        with pytest.raises(UsageError):
            ds4.load(*tiny_gguf, backend="torch", **kwargs)
    assert list(t.id for t in engine.generate([5, 6, 7], max_tokens=0)) == []


def test_session_memory_is_bounded_and_reported(engine):
    model = engine.model
    need = state_bytes(model, 100, 16, engine.mtp)
    s = Session(model, 100, 16, engine.mtp)
    got = sum(t.numel() * 4 for c in [*s.caches, s.mtp_cache] for t in
              (c.rows, c.comp_kv, c.comp_score, c.index_rows, c.index_kv, c.index_score) if t is not None)
    assert got == need
    assert Session(model, 10, 10**15).prefill_chunk == 10  # the chunk is clamped to the context
    with pytest.raises(UsageError, match="GiB of KV state"):
        Session(model, 10**13, 16)


# ---- scripts: sizes, repetitions and outputs ----------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--dim", "0"], "--dim must be >= 1"),
    (["--n-layers", "-2"], "--n-layers must be >= 1"),
    (["--vocab-size", "0"], "--vocab-size"),
    (["--compress-ratios", "0,-4"], "--compress-ratios"),
    (["--n-layers", "2", "--n-hash-layers", "5"], "hash_layer_count"),
])
def test_make_tiny_rejects_bad_sizes(tmp_path, capsys, argv, message):
    assert make_tiny.main(["--out", str(tmp_path / "t.gguf"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("make_tiny: error: ") and message in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--reps", "0"], "--reps"), (["--reps", "-5"], "--reps"), (["--m", "0"], "--m"),
    (["--shapes", "0x64"], "--shapes"), (["--shapes=-8x64"], "--shapes"),
])
def test_bench_rejects_bad_repetitions_and_sizes(capsys, argv, message):
    assert bench.main(["qmatmul", "--types", "F16", "--shapes", "8x64", "--m", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("bench.py: error: ") and message in err, err


def test_bench_model_rejects_zero_sizes(capsys):
    for flag in ("--layers", "--prompt", "--decode"):
        assert bench.main(["model", "--tiny", flag, "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("bench.py: error: ") and flag in err, err


def test_convert_refuses_its_inputs_and_directories_as_outputs(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"not": "read"}')
    (hf / "model.safetensors").write_bytes(b"weights")
    for argv, message in ((["--out", str(hf / "config.json")], "input files"),
                          (["--out", str(hf / "model.safetensors")], "input files"),
                          (["--out", str(tmp_path / "b.gguf"), "--mtp-out", str(hf / "config.json")], "input files"),
                          (["--out", str(hf)], "is a directory"),
                          (["--out", str(tmp_path / "b.gguf"), "--mtp-out", str(tmp_path / "b.gguf")], "same file")):
        assert convert_hf.main([str(hf), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err
    assert (hf / "config.json").read_text() == '{"not": "read"}'
    assert (hf / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


# ---- signals: a killed write leaves the old output intact and no temp file behind ---------------------

WRITER = """
import signal, sys, time, torch
from ds4.formats import gguf
for sig in (signal.SIGTERM, signal.SIGHUP):   # as from a terminal, even if this test runs under nohup
    signal.signal(sig, signal.SIG_DFL)
def slow():
    print("writing", flush=True)
    time.sleep(60)
    return torch.zeros(4, 32)
gguf.write(sys.argv[1], {"general.name": "new"}, {"a.weight": torch.ones(4, 32),
           "b.weight": gguf.LazyTensor("F32", (4, 32), slow)})
"""


def temps(path: Path) -> list[Path]:
    return list(path.parent.glob(f".{path.name}.*.tmp"))


def test_killed_writes_leave_old_output_and_no_temp(tmp_path):
    old, handlers = {"general.name": "old"}, signal.getsignal(signal.SIGTERM)
    procs = {}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        out = tmp_path / f"{sig.name}.gguf"
        gguf.write(out, old, {"a.weight": torch.full((4, 32), 2.0)})
        procs[sig] = out, out.read_bytes(), subprocess.Popen(
            [sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    for sig, (out, before, proc) in procs.items():
        assert proc.stdout.readline().strip() == "writing"  # the temp file is open and half written
        assert len(temps(out)) == 1
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
        proc.stdout.close()
        assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), (sig, rc)
        assert out.read_bytes() == before and gguf.open(out).metadata["general.name"] == "old"
        if sig == signal.SIGKILL:  # nothing ran at the kill: the next write removes the dead process's temp
            assert len(temps(out)) == 1
            gguf.write(out, {"general.name": "next"}, {"a.weight": torch.zeros(4, 32)})
            assert gguf.open(out).metadata["general.name"] == "next"
        assert temps(out) == [], sig
    assert signal.getsignal(signal.SIGTERM) == handlers  # the write restored the handlers


def test_write_refuses_a_directory_and_keeps_live_temps(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        gguf.write(tmp_path, {"general.name": "x"}, {"a.weight": torch.ones(4, 32)})
    out = tmp_path / "m.gguf"
    live = tmp_path / f".m.gguf.{os.getppid()}.tmp"  # a running process's temp: not ours to remove
    live.write_bytes(b"partial")
    gguf.write(out, {"general.name": "x"}, {"a.weight": torch.ones(4, 32)})
    assert live.exists()


def test_every_error_is_a_ds4_error():
    for cls in (ModelFileError, UsageError, NonFiniteError):
        assert issubclass(cls, Ds4Error)
