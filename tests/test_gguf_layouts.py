"""GGUF layouts: files in antirez/ds4's and llama.cpp's layouts (built here by each format's rules) load with
logits identical to ds4py's own layout; ds4 -> llama.cpp -> ds4 is bit-exact; --explain says how keys were got.

llama.cpp's rules (convert_hf_to_gguf.py `deepseek4` + its `--mtp` export, src/models/deepseek4.cpp): no
`vocab_size` (n_vocab = rows of token_embd), `context_length`, `expert_gating_func` = 4 (sqrt-softplus),
`rope.scaling.type` = "yarn", `swiglu_clamp_exp` with exactly `block_count` entries, MXFP4 routed
experts; the MTP GGUF counts its block in `block_count` (+ `nextn_predict_layers` = 1), names it
`blk.L.*`, stores `blk.L.nextn.eh_proj` = [e_proj | h_proj] along the input (Q8_0), `nextn.enorm/hnorm/
shared_head_norm`, the MTP's HC head in the root `output_hc_*` and repeats token_embd/output/output_norm.
"""
import dataclasses

import gguf as gguf_py
import numpy as np
import pytest
import torch

from backends.registry import OpSet
from ds4.engine import open_model, open_mtp
from ds4.errors import ModelFileError
from ds4.formats import gguf, layouts
from ds4.formats.__main__ import main as formats_cli
from ds4.session import Session
from ds4.tiny.build import mtp_metadata, tiny_model_weights
from ops.quants import QTensor
from tests.script_modules import script

P = "deepseek4."
SIZES = {"n_layers": 4, "compress_ratios": (0, 0, 4, 16)}
L = SIZES["n_layers"]
TORCH = OpSet("torch")
PROMPT = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(3)).tolist()


def _llamacpp_types(name: str, t: QTensor) -> QTensor:
    """llama.cpp's converter types: MXFP4 routed experts, Q8_0 MTP projections (the rest stays F32 here)."""
    if "_exps." in name:
        return QTensor.quantize(t.dequantize(), "MXFP4", name)
    if name.endswith(("e_proj.weight", "h_proj.weight")):
        return QTensor.quantize(t.dequantize(), "Q8_0", name)
    return t


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("layouts")
    md, base, mtp = tiny_model_weights(seed=5, **SIZES)
    base = {n: _llamacpp_types(n, t) for n, t in base.items()}
    mtp = {n: _llamacpp_types(n, t) for n, t in mtp.items()}
    tok = {k: v for k, v in md.items() if k.startswith("tokenizer.")}
    paths = {k: str(d / f"{k}.gguf") for k in ("ds4", "ds4_mtp", "antirez", "llama", "llama_mtp", "bundled")}

    # ds4py's writer: ds4's keys plus llama.cpp's; MTP as mtp.0.*
    gguf.write(paths["ds4"], md, base)
    gguf.write(paths["ds4_mtp"], mtp_metadata(md), mtp)

    # antirez/ds4's spelling: only ds4's keys, SwiGLU clamps for every block and the MTP block
    antirez = {k: v for k, v in md.items() if k not in layouts.LLAMACPP_KEYS}
    antirez[P + "swiglu_clamp_exp"] = [10.0] * (L + 1)
    gguf.write(paths["antirez"], antirez, base)

    # llama.cpp's main-file spelling; keys it may leave out (defaults / derivable) are left out here
    llama = {k: v for k, v in md.items() if k not in (
        P + "vocab_size", P + "attention.head_count_kv", P + "attention.key_length", P + "attention.value_length",
        P + "rope.scaling.yarn_beta_fast", P + "rope.scaling.yarn_beta_slow")}
    llama |= {P + "context_length": 1024, P + "expert_gating_func": 4, P + "rope.scaling.type": "yarn",
              P + "swiglu_clamp_exp": 10.0,  # a single value for every layer (get_key_or_arr)
              P + "nextn_predict_layers": 1}  # written from the config even without the nextn block
    gguf.write(paths["llama"], llama, base)

    # llama.cpp's --mtp file, built by hand from the rules above
    mtp_md = {k: v for k, v in md.items() if k.startswith((P, "general.")) and k != P + "vocab_size"}
    mtp_md |= {P + "block_count": L + 1, P + "nextn_predict_layers": 1, P + "swiglu_clamp_exp": [10.0] * (L + 1)}
    e = mtp["mtp.0.e_proj.weight"].dequantize()
    h = mtp["mtp.0.h_proj.weight"].dequantize()
    nextn = {"token_embd.weight": base["token_embd.weight"], "output.weight": base["output.weight"],
             "output_norm.weight": base["output_norm.weight"],
             "output_hc_fn.weight": mtp["mtp.0.hc_head_fn.weight"],
             "output_hc_scale.weight": mtp["mtp.0.hc_head_scale.weight"],
             "output_hc_base.weight": mtp["mtp.0.hc_head_base.weight"],
             f"blk.{L}.nextn.eh_proj.weight": QTensor.quantize(torch.cat([e, h], dim=1), "Q8_0"),
             f"blk.{L}.nextn.enorm.weight": mtp["mtp.0.enorm.weight"],
             f"blk.{L}.nextn.hnorm.weight": mtp["mtp.0.hnorm.weight"],
             f"blk.{L}.nextn.shared_head_norm.weight": mtp["mtp.0.norm.weight"]}
    skip = {f"mtp.0.{k}.weight" for k in ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn",
                                          "hc_head_scale", "hc_head_base")}
    nextn |= {f"blk.{L}." + n.removeprefix("mtp.0."): t for n, t in mtp.items() if n not in skip}
    gguf.write(paths["llama_mtp"], mtp_md | tok, nextn)

    # llama.cpp's main file with its nextn block inside (the converter without --no-mtp)
    bundled = llama | {P + "block_count": L + 1, P + "swiglu_clamp_exp": [10.0] * (L + 1)}
    gguf.write(paths["bundled"], bundled, base | {n: t for n, t in nextn.items() if n.startswith(f"blk.{L}.")})
    return paths


def _run(base_path, mtp_path=None):
    model = open_model(base_path, TORCH)
    mtp = open_mtp(model, mtp_path) if mtp_path else None
    s = Session(model, 64, prefill_chunk=16, mtp=mtp)
    logits = s.forward(PROMPT)
    draft = s.mtp_draft(7)[0] if mtp else None
    return model.args, logits, draft


@pytest.fixture(scope="module")
def reference(files):
    return _run(files["ds4"], files["ds4_mtp"])


def test_layout_detection(files):
    got = {k: layouts.detect(f.metadata, f.tensors) for k, f in ((k, gguf.open(p)) for k, p in files.items())}
    assert {k: (v.writer, v.kind) for k, v in got.items()} == {
        "ds4": ("ds4", "base"), "ds4_mtp": ("ds4", "mtp"), "antirez": ("ds4", "base"),
        "llama": ("llama.cpp", "base"), "llama_mtp": ("llama.cpp", "mtp"), "bundled": ("llama.cpp", "base+mtp")}
    assert got["ds4"].llamacpp_keys and got["ds4"].ds4_keys and not got["antirez"].llamacpp_keys
    assert got["llama_mtp"].mtp_block == L and not got["llama"].ds4_keys


@pytest.mark.parametrize("name", ["antirez", "llama", "bundled"])
def test_base_files_give_identical_logits(files, reference, name):
    args, logits, _ = _run(files[name])
    ref = reference[0]
    assert [args.clamp(i) for i in range(L + 1)] == [ref.clamp(i) for i in range(L + 1)]
    assert dataclasses.replace(args, swiglu_limits=[]) == dataclasses.replace(ref, swiglu_limits=[])
    assert torch.equal(logits, reference[1])


def test_llamacpp_mtp_gives_identical_drafts(files, reference):
    _, logits, draft = _run(files["llama"], files["llama_mtp"])
    assert torch.equal(logits, reference[1]) and torch.equal(draft, reference[2])


def test_eh_proj_is_split_without_copying(files):
    f = gguf.open(files["llama_mtp"])
    w, where = layouts.mtp_weights(f)
    storage = f._bytes.untyped_storage().data_ptr()
    for name in ("mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.attn_q_a.weight", "mtp.0.hc_head_fn.weight"):
        assert w[name].data.untyped_storage().data_ptr() == storage, name
    assert w["mtp.0.e_proj.weight"].qtype.name == "Q8_0" and w["mtp.0.e_proj.weight"].shape == (128, 128)
    assert dict(where)["mtp.0.norm.weight"] == f"blk.{L}.nextn.shared_head_norm.weight"
    assert "token_embd.weight" not in dict(where).values()  # the repeated base weights are not read


def test_metadata_notes(files):
    f = gguf.open(files["llama"])
    md, notes = layouts.ds4_metadata(f.metadata, f.tensors)
    how = {n.key: n.how for n in notes}
    assert md[P + "vocab_size"] == 512 and how[P + "vocab_size"].startswith("derived: rows of token_embd.weight")
    assert md[P + "attention.key_length"] == 80 and how[P + "attention.key_length"].startswith("derived")
    beta = P + "rope.scaling.yarn_beta_fast"
    assert md[beta] == 32.0 and how[beta].startswith("default")
    assert md[P + "swiglu_clamp_exp"] == [10.0] * L
    f = gguf.open(files["llama_mtp"])
    md, notes = layouts.ds4_metadata(f.metadata, f.tensors)
    assert md[P + "block_count"] == L and P + "nextn_predict_layers" not in md
    assert not any(k.startswith("tokenizer.") for k in md)


def test_values_ds4py_cannot_run_are_named():
    md = {P + "block_count": 2, P + "expert_gating_func": 2}
    with pytest.raises(ModelFileError, match="expert_gating_func = 2 \\(sigmoid\\)"):
        layouts.ds4_metadata(md, {})
    with pytest.raises(ModelFileError, match="rope.scaling.type = 'linear'"):
        layouts.ds4_metadata({P + "rope.scaling.type": "linear"}, {})
    md, _ = layouts.ds4_metadata({P + "rope.scaling.type": "none", P + "rope.scaling.factor": 4.0}, {})
    assert md[P + "rope.scaling.factor"] == 1.0


def test_unsupported_quant_types_are_named(tmp_path):
    path = tmp_path / "q8_1.gguf"  # Q8_1 and Q8_K: ggml's activation-only types, not weight types ds4py reads
    writer = gguf_py.GGUFWriter(path, "deepseek4")
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_gate_exps.weight"):
        writer.add_tensor(name, np.zeros((4, 80), np.uint8), raw_dtype=gguf_py.GGMLQuantizationType.Q8_1)
    writer.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((4, 292), np.uint8),
                      raw_dtype=gguf_py.GGMLQuantizationType.Q8_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="Q8_1 \\(blk.0.ffn_gate_exps.weight and 1 more\\); Q8_K"):
        open_model(str(path), TORCH)


def _same_files(a: str, b: str) -> None:
    fa, fb = gguf.open(a), gguf.open(b)
    assert fa.metadata == fb.metadata
    assert list(fa.tensors) == list(fb.tensors) or sorted(fa.tensors) == sorted(fb.tensors)
    for name, info in fa.tensors.items():
        ib = fb.tensors[name]
        assert (info.type, info.shape) == (ib.type, ib.shape), name
        assert torch.equal(fa._bytes[info.offset:info.offset + info.nbytes],
                           fb._bytes[ib.offset:ib.offset + ib.nbytes]), name


def test_round_trip_ds4_llamacpp_ds4(files, tmp_path, reference):
    lb, lm, rb, rm = (str(tmp_path / f"{k}.gguf") for k in ("lb", "lm", "rb", "rm"))
    layouts.convert_files(files["ds4"], lb, files["ds4_mtp"], lm, to="llama.cpp")
    f = gguf.open(lm)
    assert layouts.detect(f.metadata, f.tensors).writer == "llama.cpp"
    assert f.metadata[P + "block_count"] == L + 1 and f.tensors[f"blk.{L}.nextn.eh_proj.weight"].type == "Q8_0"
    assert P + "vocab_size" not in gguf.open(lb).metadata
    layouts.convert_files(lb, rb, lm, rm, to="ds4")
    _same_files(files["ds4"], rb)
    _same_files(files["ds4_mtp"], rm)
    _, logits, draft = _run(lb, lm)
    assert torch.equal(logits, reference[1]) and torch.equal(draft, reference[2])


def test_explain_cli(files, capsys, tmp_path):
    assert formats_cli([files["llama_mtp"], "--explain"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp layout, mtp, MTP block blk.4" in out
    assert "deepseek4.vocab_size" in out and "derived: rows of token_embd.weight" in out
    assert "mtp.0.h_proj.weight  <-  blk.4.nextn.eh_proj.weight[:, 128:]" in out
    assert formats_cli([files["antirez"]]) == 0
    assert "ds4 layout, base (ds4 keys)" in capsys.readouterr().out
    out_base, out_mtp = str(tmp_path / "l.gguf"), str(tmp_path / "lm.gguf")
    assert formats_cli([files["ds4"], "--to", "llama.cpp", out_base, "--mtp", files["ds4_mtp"], out_mtp]) == 0
    f = gguf.open(out_mtp)
    assert layouts.detect(f.metadata, f.tensors).kind == "mtp" and layouts.llamacpp_problems(f.metadata, f.tensors) \
        == ["compress ratios [16]: the loader supports only 0, 4 and 128"]
    assert formats_cli([files["ds4"], "--to", "gguf2", out_base]) == 2
    assert "unknown layout 'gguf2'" in capsys.readouterr().err


def test_make_tiny_writes_either_mtp_layout(tmp_path, reference):
    make_tiny = script("make_tiny")
    sizes = ["--n-layers", str(L), "--compress-ratios", "0,0,4,16", "--seed", "5", "--mix", "f32"]
    for layout in ("ds4", "llama.cpp"):
        base, mtp = str(tmp_path / f"{layout}.gguf"), str(tmp_path / f"{layout}-mtp.gguf")
        assert make_tiny.main(["--out", base, "--mtp-out", mtp, "--mtp-layout", layout, *sizes]) == 0
        f = gguf.open(mtp)
        assert layouts.detect(f.metadata, f.tensors).writer == layout
        md = gguf.open(base).metadata
        assert md[P + "expert_gating_func"] == 4 and md[P + "rope.scaling.type"] == "yarn"
        assert md[P + "context_length"] == 64 * 16 and len(md[P + "swiglu_clamp_exp"]) == L
    a, b = gguf.open(str(tmp_path / "ds4-mtp.gguf")), gguf.open(str(tmp_path / "llama.cpp-mtp.gguf"))
    wa, wb = layouts.mtp_weights(a)[0], layouts.mtp_weights(b)[0]
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wa[name].dequantize(), wb[name].dequantize()), name


def test_hostile_llamacpp_keys_raise_model_file_errors():
    for md in ({P + "nextn_predict_layers": "one"}, {P + "block_count": [4], P + "swiglu_clamp_exp": 10.0},
               {P + "expert_gating_func": [4]}):
        with pytest.raises(ModelFileError):
            layouts.ds4_metadata(md, {})
    with pytest.raises(ModelFileError, match="nextn block is blk.4"):
        layouts.ds4_metadata({P + "block_count": 9, P + "nextn_predict_layers": 1},
                             {"blk.4.nextn.eh_proj.weight": torch.zeros(2, 4)})


def test_files_ds4py_writes_meet_llamacpp_loader_rules(files, tmp_path):
    from ds4.tiny.build import write_tiny
    base, mtp = str(tmp_path / "b.gguf"), str(tmp_path / "m.gguf")
    write_tiny(base, mtp, mtp_layout="llama.cpp", n_layers=4, compress_ratios=(0, 0, 4, 128))
    for path in (base, mtp):
        f = gguf.open(path)
        assert layouts.llamacpp_problems(f.metadata, f.tensors) == [], path
    f = gguf.open(files["llama_mtp"])  # ratio 16 of the small test model: the only complaint
    assert layouts.llamacpp_problems(f.metadata, f.tensors) == [
        "compress ratios [16]: the loader supports only 0, 4 and 128"]
    f = gguf.open(files["antirez"])
    assert layouts.llamacpp_problems(f.metadata, f.tensors) == [
        f"missing required keys: {P}context_length, {P}expert_gating_func"]
    md = dict(gguf.open(files["antirez"]).metadata) | {P + "context_length": 64, P + "expert_gating_func": 4}
    problems = layouts.llamacpp_problems(md, f.tensors)
    assert any("swiglu_clamp_exp has 5 entries" in p for p in problems)
    assert any("read as linear" in p for p in problems)
    f = gguf.open(files["ds4_mtp"])  # ds4's MTP layout is not llama.cpp's
    assert any("missing tensors" in p for p in layouts.llamacpp_problems(f.metadata, f.tensors))


def test_engine_generates_the_same_tokens_from_either_layout(files):
    import ds4
    out = {}
    for base, mtp in ((files["ds4"], files["ds4_mtp"]), (files["llama"], files["llama_mtp"])):
        engine = ds4.load(base, mtp, backend="torch", ctx=64, device="cpu")
        out[base] = [t.id for t in engine.generate(PROMPT[:8], max_tokens=4, mtp_draft=1)]
    assert out[files["ds4"]] == out[files["llama"]] and len(out[files["ds4"]]) == 4
