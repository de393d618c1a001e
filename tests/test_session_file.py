"""Session files: a loaded session continues bit for bit like the one saved; every bad file is one clear error."""
import json

import pytest
import safetensors.torch
import torch

from backends.registry import OpSet
from ds4 import session_file
from ds4.errors import SessionFileError, UsageError
from ds4.sampling import Sampler, SamplingParams
from ds4.session import Session
from ds4.speculative import SpecMetrics, generate_ids
from ds4.tiny.build import tiny_model_weights
from models.args import ModelArgs
from models.deepseek_v4 import DeepseekV4
from models.mtp import MTPHead
from ops.quants import QTensor

CTX, CHUNK = 96, 8
TORCH = OpSet("torch")


def build(mix: str = "f32", seed: int = 3, **switches):
    md, base, mtp = tiny_model_weights(mix, seed=seed)
    model = DeepseekV4(ModelArgs.from_metadata(md, **switches), base, TORCH)
    return model, MTPHead(model, mtp)


@pytest.fixture(scope="module")
def tiny():
    return build()


def prompt(n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(11)).tolist()


MODES = {  # name: (sampling, draft depth, strict)
    "greedy": (SamplingParams(), 2, False),
    "strict": (SamplingParams(), 3, True),
    "sampled": (SamplingParams(temperature=0.9, top_k=40, seed=5), 2, False),
}
# (mode, prompt tokens, generated tokens before the cut): cut inside the first ratio-4 block, before the window;
# inside a ratio-4 and a ratio-16 block past the 16-token window; far past it. Every cut follows rejected drafts.
CUTS = [("greedy", 3, 3), ("strict", 21, 8), ("sampled", 21, 8), ("greedy", 40, 17), ("sampled", 40, 17)]


def run(session, first: list[int], n: int, mode: str, seed: int) -> tuple[list[int], list[torch.Tensor]]:
    """Generated ids and the logits each was chosen from."""
    params, draft, strict = MODES[mode]
    params = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, seed)
    rows, metrics = [], SpecMetrics()
    ids = list(generate_ids(session, first, max_tokens=n, sampler=Sampler(params), eos_id=None, draft=draft,
                            strict=strict, on_logits=rows.append, metrics=metrics))
    assert metrics.num_accepted_tokens < metrics.num_draft_tokens  # some drafts were rolled back
    return ids, rows


def assert_same_state(a: Session, b: Session) -> None:
    sa, sb = a.state_tensors(), b.state_tensors()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert a.tokens == b.tokens and a.mtp_from == b.mtp_from and a.high_water == b.high_water


@pytest.mark.parametrize("mode,n_prompt,n_first", CUTS, ids=[f"{m}-cut{p + n - 1}" for m, p, n in CUTS])
def test_resume_from_file_equals_uninterrupted_run(tiny, tmp_path, mode, n_prompt, n_first):
    """Save mid-generation, load in a new session: both continue with the same ids and logits, bit for bit."""
    model, mtp = tiny
    a = Session(model, CTX, CHUNK, mtp)
    before, _ = run(a, prompt(n_prompt), n_first, mode, seed=1)
    assert a.pos == n_prompt + n_first - 1
    a.save(tmp_path / "s.ds4session")
    b = Session.load(tmp_path / "s.ds4session", model, mtp)
    assert_same_state(a, b)
    assert a.last_logits is not None and torch.equal(a.last_logits, b.last_logits)
    ids_a, logits_a = run(a, before[-1:], 8, mode, seed=2)
    ids_b, logits_b = run(b, before[-1:], 8, mode, seed=2)
    assert ids_a == ids_b
    assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b, strict=True))
    assert_same_state(a, b)
    if mode != "sampled":  # greedy: the split run is the uninterrupted one (same tokens, same logits)
        whole, whole_logits = run(Session(model, CTX, CHUNK, mtp), prompt(n_prompt), n_first + 8, mode, seed=0)
        assert whole == before + ids_a
        assert torch.equal(whole_logits[-1], logits_b[-1])


def test_rollback_after_load_is_exact(tiny, tmp_path):
    """The kept output states travel too: truncating a loaded session equals truncating the original."""
    model, mtp = tiny
    a = Session(model, CTX, CHUNK, mtp)
    a.prefill(prompt(30))
    a.save(tmp_path / "s")
    b = Session.load(tmp_path / "s", model, mtp)
    for s in (a, b):
        s.truncate(27)
        s.decode(9)
    assert_same_state(a, b)
    assert torch.equal(a.mtp_draft(3)[0], b.mtp_draft(3)[0])


def test_file_without_mtp_restarts_the_mtp_window(tiny, tmp_path):
    """A session saved without an MTP head loads with one: the MTP window restarts at the loaded position."""
    model, mtp = tiny
    a = Session(model, CTX, CHUNK)
    a.prefill(prompt(20))
    a.save(tmp_path / "s")
    b = Session.load(tmp_path / "s", model, mtp)
    assert b.pos == 20 and b.mtp_from == 20
    b.decode(4)
    assert b.mtp_draft(5)[0].shape == (512,)


def rewrite(path, tmp_path, change_header=None, change_tensors=None, keep_checksum=False):
    """A copy of the session file at `path` with its header or tensors changed (checksum recomputed unless kept)."""
    saved = session_file.read(path)
    header, tensors = dict(saved.header), dict(saved.tensors)
    if change_header:
        change_header(header)
    if change_tensors:
        change_tensors(tensors)
    if not keep_checksum:
        header["checksum"] = session_file.checksum(header, tensors)
    out = tmp_path / "changed"
    safetensors.torch.save_file(tensors, out, metadata={session_file.METADATA_KEY: json.dumps(header)})
    return out


def flip_byte(path, tmp_path, at: int):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    out = tmp_path / "flipped"
    out.write_bytes(bytes(data))
    return out


def cut_short(path, tmp_path):
    out = tmp_path / "short"
    out.write_bytes(path.read_bytes()[:-200])
    return out


def replace(name: str, *shape: int):
    return lambda tensors: tensors.update({name: torch.zeros(shape)})


def other_model(seed=3, mix="f32", **switches):
    return lambda: build(mix, seed, **switches)


BAD_FILES = {  # case: (make the file from a good one, loader (model, mtp) or None for the same, load kwargs, message)
    "missing": (lambda p, t: t / "nope", None, {}, "no such session file"),
    "truncated": (cut_short, None, {}, "truncated or damaged"),
    "random bytes": (lambda p, t: (t / "r").write_bytes(b"\x13" * 4096) and t / "r", None, {}, "truncated or damaged"),
    "tensor byte flipped": (lambda p, t: flip_byte(p, t, -300), None, {}, "checksum mismatch"),
    "header edited": (lambda p, t: rewrite(p, t, lambda h: h.update(n_drafted=1), keep_checksum=True), None, {},
                      "checksum mismatch"),
    "plain safetensors": (lambda p, t: safetensors.torch.save_file({"x": torch.zeros(2)}, t / "x") or t / "x",
                          None, {}, "without a ds4py session header"),
    "other format": (lambda p, t: rewrite(p, t, lambda h: h.update(format="other")), None, {}, "not a ds4py session"),
    "newer version": (lambda p, t: rewrite(p, t, lambda h: h.update(version=2)), None, {}, "version 2"),
    "other switch": (lambda p, t: p, other_model(kv_fp8_sim=False), {}, "another model layout \\(kv_fp8_sim"),
    "other tensor types": (lambda p, t: p, other_model(mix="q4"), {}, "other tensor types"),
    "other MTP head": (lambda p, t: rewrite(p, t, lambda h: h["layout"].update(mtp_tensor_types="0" * 64)), None, {},
                       "another MTP head"),
    "other model file": (lambda p, t: p, None, {"model_id": "b" * 64}, "another model file"),
    "context too small": (lambda p, t: p, None, {"ctx": 30}, "holds 30 tokens, more than a context of 30"),
    "other chunk": (lambda p, t: rewrite(p, t, lambda h: h.update(prefill_chunk=64)), None, {"ctx": 40},
                    "saved with prefill chunk 64, this session uses 40"),
    "bad ring shape": (lambda p, t: rewrite(p, t, change_tensors=replace("blk.2.comp_kv", 3, 3)), None, {},
                       "blk.2.comp_kv: shape"),
    "header field missing": (lambda p, t: rewrite(p, t, lambda h: h.pop("high_water")), None, {},
                             "header field 'high_water' is missing"),
    "tokens tensor wrong": (lambda p, t: rewrite(p, t, change_tensors=replace("tokens", 3)), None, {},
                            "the tokens tensor is missing"),
    "layer tensor missing": (lambda p, t: rewrite(p, t, change_tensors=lambda x: x.pop("blk.3.comp")), None, {},
                             "malformed session file \\(KeyError: 'blk.3.comp'"),
    "bad raw rows": (lambda p, t: rewrite(p, t, change_tensors=replace("blk.0.raw", 99, 80)), None, {}, "do not fit"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_session_file_is_one_clear_error(tiny, tmp_path, case):
    """Each damaged or mismatched file raises SessionFileError naming what is wrong, never another exception."""
    model, mtp = tiny
    make, loader, kwargs, message = BAD_FILES[case]
    good = Session(model, CTX, CHUNK, mtp, model_id="a" * 64)
    good.prefill(prompt(30))
    good.save(tmp_path / "good")
    path = make(tmp_path / "good", tmp_path)
    model, mtp = loader() if loader else (model, mtp)
    with pytest.raises(SessionFileError, match=message):
        Session.load(path, model, mtp, **kwargs)


def test_save_is_atomic_and_refuses_a_directory(tiny, tmp_path, monkeypatch):
    """A failing write leaves neither a partial file nor its temp file; a directory is a UsageError."""
    model, mtp = tiny
    s = Session(model, CTX, CHUNK, mtp)
    s.prefill(prompt(10))
    with pytest.raises(UsageError, match="is a directory"):
        s.save(tmp_path)

    def fail(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(session_file.safetensors.torch, "save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        s.save(tmp_path / "s")
    assert list(tmp_path.iterdir()) == []


def test_mlx_session_round_trip_and_portability(tiny_gguf, tmp_path):
    """An MLX session saves and loads like a torch one; the file itself names no backend (a torch engine of the
    same model loads it)."""
    pytest.importorskip("mlx.core")
    import ds4
    mlx = ds4.load(*tiny_gguf, backend="mlx", ctx=CTX, prefill_chunk=CHUNK)
    a = mlx.session()
    a.prefill(prompt(20))
    a.save(tmp_path / "s")
    b = mlx.session_from_file(tmp_path / "s")
    assert all(torch.equal(a.decode(t), b.decode(t)) for t in (5, 6, 7))
    assert_same_state(a, b)
    on_torch = ds4.load(*tiny_gguf, backend="torch", ctx=CTX, prefill_chunk=CHUNK).session_from_file(tmp_path / "s")
    assert on_torch.tokens == prompt(20)


@pytest.fixture(scope="module")
def q2_tiny(tmp_path_factory) -> str:
    """A tiny random model in ds4's q2 mix with rows of 256 values, so `--weights memory --cpu-dot q8` repacks its
    Q8_0 weights and Q2_K experts at load."""
    from ds4.tiny.build import write_tiny
    path = str(tmp_path_factory.mktemp("q2") / "tiny-q2.gguf")
    write_tiny(path, mix="q2", dim=256, moe_inter_dim=256, n_layers=2, n_hash_layers=1, compress_ratios=(0, 4))
    return path


def test_session_moves_between_repacked_and_stored_weights(q2_tiny, tmp_path):
    """A session saved with the weights repacked at load (`--weights memory --cpu-dot q8`) loads on the mapped exact
    model and the other way round (the fingerprint counts a repacked weight as its stored type); a model of other
    tensor types, repacked too, still refuses it."""
    import ds4
    from backends.cpu import repack
    repacked = ds4.load(q2_tiny, weights="memory", cpu_dot="q8", ctx=CTX, prefill_chunk=CHUNK)
    stored = ds4.load(q2_tiny, weights="mmap", ctx=CTX, prefill_chunk=CHUNK)
    experts = repacked.model.layers[1].experts
    assert (type(repacked.model.output), type(experts.down)) == ((repack.RepackedQ8_0, repack.RepackedQ2K)
                                                                  if repack.worthwhile() else (QTensor, QTensor))
    assert session_file.tensor_types(repacked.model) == session_file.tensor_types(stored.model)
    for saver, loader in ((repacked, stored), (stored, repacked)):
        a = saver.session()
        a.prefill(prompt(20))
        a.save(tmp_path / "s")
        b = loader.session_from_file(tmp_path / "s")
        assert b.tokens == prompt(20) and torch.equal(a.last_logits, b.last_logits)
        assert b.decode(7).shape == a.decode(7).shape and b.pos == a.pos == 21
    other = str(tmp_path / "tiny-q4.gguf")
    from ds4.tiny.build import write_tiny
    write_tiny(other, mix="q4", dim=256, moe_inter_dim=256, n_layers=2, n_hash_layers=1, compress_ratios=(0, 4))
    with pytest.raises(SessionFileError, match="other tensor types"):
        ds4.load(other, weights="memory", cpu_dot="q8", ctx=CTX, prefill_chunk=CHUNK).session_from_file(tmp_path / "s")
