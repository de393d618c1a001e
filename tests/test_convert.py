"""Converter: official naming with FP8/FP4 weights, transformers naming, MTP split, mixes, metadata and errors."""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ds4.formats.convert
from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf, layouts
from ds4.formats.convert import convert, metadata_from_config, read_config
from ds4.formats.quant_mix import MIXES, tensor_type
from ds4.formats.vocab import real_v4_tokenizer_json
from ds4.tiny.hf import CSA, HCA, tiny_config, tiny_model
from ops.quants import QTensor
from tests.script_modules import script

convert_hf = script("convert_hf")
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
# transformers parameter -> official name, for the weights the official checkpoint stores as FP8 128x128 tiles
FP8 = {"self_attn.q_a_proj.weight": "attn.wq_a.weight", "self_attn.q_b_proj.weight": "attn.wq_b.weight",
       "self_attn.kv_proj.weight": "attn.wkv.weight", "self_attn.o_b_proj.weight": "attn.wo_b.weight",
       "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
       "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
       "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
       "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight"}
FP4 = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # packed FP4 experts, one tensor per expert
RATIOS = [0, 0, 4, 16, 4, 16]


def fp8_tiles(shape: tuple[int, int], g: torch.Generator, float_scale: bool = False):
    """A random official FP8 weight: (its float32 value, e4m3 [out, in], scale [ceil(out/128), in/128])."""
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    e4m3 = codes.view(torch.float8_e4m3fn)
    exps = torch.randint(117, 125, (-(-shape[0] // 128), shape[1] // 128), generator=g, dtype=torch.uint8)
    per_elem = torch.exp2(exps.float() - 127).repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)
    scale = torch.exp2(exps.float() - 127) if float_scale else exps.view(torch.float8_e8m0fnu)
    return e4m3.float() * per_elem, e4m3, scale


def fp4_blocks(shape: tuple[int, ...], g: torch.Generator):
    """A random official FP4 weight: (float32 value, int8 [..., out, in/2] two e2m1 a byte, e8m0 [..., out, in/32])."""
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    exps = torch.randint(120, 129, (*shape[:-1], shape[-1] // 32), generator=g, dtype=torch.uint8)
    value = E2M1[codes.long()] * torch.exp2(exps.float() - 127).repeat_interleave(32, -1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
    return value, packed, exps.view(torch.float8_e8m0fnu)


def official_config(cfg) -> dict:
    """The config.json of the official checkpoint: legacy keys (compress_ratios, num_hash_layers, rope_scaling)."""
    d = cfg.to_dict()
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor"):
        d.pop(key)
    yarn = {k: v for k, v in cfg.rope_parameters["compress"].items() if k in ("factor", "beta_fast", "beta_slow",
                                                                            "original_max_position_embeddings")}
    return d | {"compress_ratios": RATIOS + [0], "num_hash_layers": 3, "qk_rope_head_dim": 16,
                "rope_scaling": {"type": "yarn", **yarn}}


def official_name(hf_name: str) -> str:
    """The official name of a tensor written by transformers' save_pretrained (which keeps a few of its own)."""
    name = hf_name.removeprefix("model.")
    for mine, theirs in (("embed_tokens.weight", "embed.weight"), ("hc_head.hc_fn", "hc_head_fn"),
                         ("hc_head.hc_base", "hc_head_base"), ("hc_head.hc_scale", "hc_head_scale"),
                         (".attn.norm.weight", ".attn.kv_norm.weight")):
        name = name.replace(mine, theirs)
    return name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny model three ways: transformers save_pretrained, transformers state_dict, official FP8/FP4 + MTP."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_config(q_lora_rank=128, o_lora_rank=64, moe_intermediate_size=128)
    model = tiny_model(cfg, seed=3)
    g = torch.Generator().manual_seed(7)
    official = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("model.layers."):
                continue
            layer, suffix = name.split(".")[2], name.split(".", 3)[-1]
            if suffix in FP8:
                value, e4m3, scale = fp8_tiles(tuple(p.shape), g, float_scale="q_b_proj" in name)
                official[f"layers.{layer}.{FP8[suffix]}"] = e4m3
                official[f"layers.{layer}.{FP8[suffix]}".removesuffix("weight") + "scale"] = scale
                p.copy_(value)
            elif suffix in FP4:
                value, packed, scale = fp4_blocks(tuple(p.shape), g)
                inter = cfg.moe_intermediate_size
                halves = ({"w1": slice(0, inter), "w3": slice(inter, None)} if "gate_up" in suffix
                          else {"w2": slice(None)})
                for e in range(cfg.n_routed_experts):
                    for w, rows in halves.items():
                        official[f"layers.{layer}.ffn.experts.{e}.{w}.weight"] = packed[e, rows]
                        official[f"layers.{layer}.ffn.experts.{e}.{w}.scale"] = scale[e, rows]
                p.copy_(value)
    model.save_pretrained(root / "hf")
    (root / "state_dict").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "state_dict" / "model.safetensors")
    (root / "state_dict" / "config.json").write_text((root / "hf" / "config.json").read_text())

    saved = {official_name(k): v for k, v in load_file(root / "hf" / "model.safetensors").items()}
    tensors = saved | official
    mtp = {k.replace("layers.3.", "mtp.0."): v for k, v in tensors.items()
           if k.startswith("layers.3.") and ".compressor." not in k}
    mtp_values = {}
    for proj in ("e_proj", "h_proj"):
        mtp_values[proj], mtp[f"mtp.0.{proj}.weight"], mtp[f"mtp.0.{proj}.scale"] = fp8_tiles((128, 128), g)
    for norm in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{norm}.weight"] = 1 + 0.1 * torch.randn(128, generator=g)
    mtp |= {"mtp.0.hc_head_fn": torch.randn(4, 512, generator=g), "mtp.0.hc_head_base": torch.randn(4, generator=g),
            "mtp.0.hc_head_scale": torch.randn(1, generator=g),
            "mtp.0.emb.tok_emb.weight": tensors["embed.weight"], "mtp.0.head.weight": tensors["head.weight"]}
    (root / "official").mkdir()
    everything = sorted({**tensors, **mtp}.items())
    half = len(everything) // 2
    for i, part in enumerate((everything[:half], everything[half:])):
        save_file({k: v.clone() for k, v in part}, root / "official" / f"model-0000{i + 1}-of-00002.safetensors")
    (root / "official" / "config.json").write_text(json.dumps(official_config(cfg)))
    return root, model, cfg, mtp, mtp_values


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A GGUF's metadata and its tensors as float32."""
    f = gguf.open(path)
    return f.metadata, {name: f.dequantize(name) for name in f.tensors}


def test_official_and_transformers_namings_give_the_same_gguf(checkpoints, tmp_path):
    root, model, cfg, _, _ = checkpoints
    results = {}
    for kind in ("hf", "state_dict", "official"):
        convert(root / kind, tmp_path / f"{kind}.gguf", outtype="f32", tokenizer=False)
        results[kind] = read_gguf(tmp_path / f"{kind}.gguf")
    meta, ref = results["hf"]
    assert not any(n.startswith("mtp.") for n in ref)
    for kind in ("state_dict", "official"):
        other_meta, other = results[kind]
        assert sorted(other) == sorted(ref), kind
        for name in ref:
            assert torch.equal(other[name], ref[name]), (kind, name)
        assert {k: v for k, v in other_meta.items() if k != "general.name"} == \
               {k: v for k, v in meta.items() if k != "general.name"}, kind
    layer2 = model.model.layers[2]
    inter = cfg.moe_intermediate_size
    checks = {
        "token_embd.weight": model.model.embed_tokens.weight, "output.weight": model.lm_head.weight,
        "output_hc_fn.weight": model.model.hc_head.hc_fn,
        "blk.2.attn_q_a.weight": layer2.self_attn.q_a_proj.weight,
        "blk.2.attn_kv_a_norm.weight": layer2.self_attn.kv_norm.weight,
        "blk.2.attn_compressor_ape.weight": layer2.self_attn.compressor.position_bias,
        "blk.2.indexer_compressor_norm.weight": layer2.self_attn.compressor.indexer.kv_norm.weight,
        "blk.2.ffn_gate_exps.weight": layer2.mlp.experts.gate_up_proj[:, :inter],
        "blk.2.ffn_up_exps.weight": layer2.mlp.experts.gate_up_proj[:, inter:],
        "blk.2.ffn_down_exps.weight": layer2.mlp.experts.down_proj,
        "blk.2.ffn_gate_tid2eid.weight": layer2.mlp.gate.tid2eid,
        "blk.3.exp_probs_b.bias": model.model.layers[3].mlp.gate.e_score_correction_bias,
    }
    for name, expected in checks.items():
        assert torch.equal(ref[name], expected.detach().float()), name
    assert "blk.3.indexer.proj.weight" not in ref and "blk.1.attn_compressor_kv.weight" not in ref


def test_mtp_gguf_holds_the_mtp_block_without_shared_embedding_and_head(checkpoints, tmp_path):
    root, _, _, mtp, mtp_values = checkpoints
    convert(root / "official", tmp_path / "base.gguf", tmp_path / "mtp.gguf", outtype="f32", tokenizer=False)
    _, base = read_gguf(tmp_path / "base.gguf")
    _, got = read_gguf(tmp_path / "mtp.gguf")
    assert not any(n.startswith("mtp.") for n in base)
    assert all(n.startswith("mtp.0.") for n in got)
    block = {n.replace("blk.3.", "mtp.0.") for n in base if n.startswith("blk.3.") and "compressor" not in n}
    own = {f"mtp.0.{n}.weight" for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm",
                                         "hc_head_fn", "hc_head_scale", "hc_head_base")}
    assert set(got) == block | own
    for name in block:
        assert torch.equal(got[name], base[name.replace("mtp.0.", "blk.3.")]), name
    assert torch.equal(got["mtp.0.e_proj.weight"], mtp_values["e_proj"])
    assert torch.equal(got["mtp.0.hc_head_fn.weight"], mtp["mtp.0.hc_head_fn"])


def test_metadata_follows_the_config(checkpoints):
    root, *_ = checkpoints
    for kind in ("hf", "official"):
        meta = metadata_from_config(read_config(root / kind))
        assert set(gguf.DS4_KEYS) <= set(meta)
        assert meta["deepseek4.attention.compress_ratios"] == RATIOS
        assert meta["deepseek4.hash_layer_count"] == 3
        assert meta["deepseek4.rope.dimension_count"] == 16
        assert meta["deepseek4.rope.scaling.factor"] == 4.0
        assert meta["deepseek4.rope.scaling.original_context_length"] == 4096
        assert meta["deepseek4.attention.sliding_window"] == 16
        assert meta["deepseek4.swiglu_clamp_exp"] == [10.0] * 6
    plain = tiny_config(rope_parameters=None).to_dict()
    assert metadata_from_config(plain)["deepseek4.rope.scaling.factor"] == 1.0  # no YaRN = plain RoPE


def test_mixes_give_the_quant_mix_types(tmp_path):
    cfg = tiny_config(hidden_size=256, moe_intermediate_size=256, n_routed_experts=2, q_lora_rank=64,
                      layer_types=[CSA, HCA], mlp_layer_types=["hash_moe", "moe"])
    tiny_model(cfg, seed=1).save_pretrained(tmp_path / "hf")
    for mix in ("q2", "q4"):
        convert(tmp_path / "hf", tmp_path / f"{mix}.gguf", outtype=mix, tokenizer=False)
        f = gguf.open(tmp_path / f"{mix}.gguf")
        for name, info in f.tensors.items():
            assert info.type == tensor_type(name, info.shape, mix), name
        routed = {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K")}[mix]
        assert (f.tensors["blk.1.ffn_up_exps.weight"].type, f.tensors["blk.1.ffn_down_exps.weight"].type) == routed
        assert f.tensors["blk.0.attn_q_b.weight"].type == "Q8_0"
        assert f.tensors["blk.0.indexer.proj.weight"].type == "F16"
        assert f.tensors["blk.0.ffn_gate_tid2eid.weight"].type == "I32"
        assert f.tensors["blk.1.attn_sinks.weight"].type == "F32"
        w = f.dequantize("blk.1.attn_output_b.weight")  # Q8_0 keeps the layout: close to the source
        from safetensors import safe_open
        src = safe_open(tmp_path / "hf" / "model.safetensors", "pt").get_tensor("model.layers.1.attn.wo_b.weight")
        assert (w - src).norm() / src.norm() < 0.01


def test_quant_mix_types_and_fallback():
    assert tensor_type("blk.5.ffn_gate_exps.weight", (256, 2048, 4096), "q2") == "IQ2_XXS"
    assert tensor_type("blk.5.ffn_down_exps.weight", (256, 4096, 2048), "q2") == "Q2_K"
    assert tensor_type("blk.5.ffn_down_exps.weight", (256, 4096, 2048), "q4") == "Q4_K"
    assert tensor_type("mtp.0.e_proj.weight", (4096, 4096), "q4") == "Q8_0"
    assert tensor_type("blk.2.attn_compressor_ape.weight", (4, 1024), "q2") == "F16"
    assert tensor_type("output_hc_base.weight", (4,), "q2") == "F32"
    assert tensor_type("blk.5.exp_probs_b.bias", (256,), "q2") == "F32"
    assert tensor_type("blk.0.ffn_gate_tid2eid.weight", (129280, 6), "f32") == "I32"
    assert tensor_type("output.weight", (129280, 4096), "f32") == "F32"
    with pytest.warns(UserWarning, match="blk.0.ffn_up_exps.weight: row length 64"):
        assert tensor_type("blk.0.ffn_up_exps.weight", (8, 32, 64), "q4") == "F16"
    with pytest.raises(ValueError, match="q3"):
        tensor_type("output.weight", (8, 32), "q3")
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        tensor_type("blk.0.mystery.weight", (8, 32), "q2")
    assert MIXES == ("q2", "q4", "f32")


def test_tokenizer_json_becomes_gguf_vocab(checkpoints, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root, *_ = checkpoints
    src = tmp_path / "ckpt"
    src.mkdir()
    for f in (root / "hf").iterdir():
        (src / f.name).symlink_to(f)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    trainer = trainers.BpeTrainer(vocab_size=270, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world, hello there"] * 4, trainer=trainer)
    tok.save(str(src / "tokenizer.json"))
    convert(src, tmp_path / "base.gguf", outtype="f32")
    meta = gguf.open(tmp_path / "base.gguf").metadata
    assert meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.bos_token_id"]] == "<｜begin▁of▁sentence｜>"
    n, vocab = tok.get_vocab_size(), meta["deepseek4.vocab_size"]
    assert n < vocab  # the tokenizer is padded up to the model's vocabulary, so every id decodes
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) == vocab
    assert meta["tokenizer.ggml.tokens"][:n] == [tok.id_to_token(i) for i in range(n)]
    assert meta["tokenizer.ggml.tokens"][n:] == [f"[PAD{i}]" for i in range(n, vocab)]


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return path


def test_errors_name_the_file_and_tensor(checkpoints, tmp_path):
    root, *_ = checkpoints
    config = json.loads((root / "hf" / "config.json").read_text())
    tensors = load_file(root / "hf" / "model.safetensors")
    with pytest.raises(ModelFileError, match="config.json: missing"):
        convert(tmp_path, tmp_path / "x.gguf", tokenizer=False)
    with pytest.raises(ModelFileError, match=r"no \*.safetensors"):
        (tmp_path / "bare").mkdir()
        (tmp_path / "bare" / "config.json").write_text(json.dumps(config))
        convert(tmp_path / "bare", tmp_path / "x.gguf", tokenizer=False)
    with pytest.raises(ModelFileError, match="unknown naming, e.g. layers.0.attn.mystery.weight"):
        extra = tensors | {"model.layers.0.attn.mystery.weight": torch.zeros(2)}
        convert(write_checkpoint(tmp_path / "extra", config, extra), tmp_path / "x.gguf", tokenizer=False)
    with pytest.raises(ModelFileError, match="missing tensor for attn_q_a.weight .*layers.4.attn.wq_a.weight"):
        fewer = {k: v for k, v in tensors.items() if k != "model.layers.4.attn.wq_a.weight"}
        convert(write_checkpoint(tmp_path / "fewer", config, fewer), tmp_path / "x.gguf", tokenizer=False)
    with pytest.raises(ModelFileError, match="tokenizer.json: missing"):
        convert(root / "hf", tmp_path / "x.gguf")
    with pytest.raises(ModelFileError, match="not a readable safetensors file"):
        (tmp_path / "garbage").mkdir()
        (tmp_path / "garbage" / "config.json").write_text(json.dumps(config))
        (tmp_path / "garbage" / "model.safetensors").write_bytes(b"garbage")
        convert(tmp_path / "garbage", tmp_path / "x.gguf", tokenizer=False)
    with pytest.raises(ModelFileError, match=r"tokens, more than the model's vocab_size 320"):
        (tmp_path / "big_vocab").mkdir()
        for f in (root / "hf").iterdir():
            (tmp_path / "big_vocab" / f.name).symlink_to(f)
        (tmp_path / "big_vocab" / "tokenizer.json").symlink_to(real_v4_tokenizer_json())
        convert(tmp_path / "big_vocab", tmp_path / "x.gguf")
    with pytest.raises(ModelFileError, match=r"layers.1.mlp.experts.down_proj has shape \(3, 128, 128\), expected \[8"):
        fused = load_file(root / "state_dict" / "model.safetensors")
        short = fused | {"model.layers.1.mlp.experts.down_proj": fused["model.layers.1.mlp.experts.down_proj"][:3]}
        convert(write_checkpoint(tmp_path / "short", config, short), tmp_path / "x.gguf", tokenizer=False)
    with pytest.raises(UsageError, match="unknown tensor-type mix 'q3'"):
        convert(root / "hf", tmp_path / "x.gguf", outtype="q3", tokenizer=False)
    with pytest.raises(UsageError, match="output directory does not exist"):
        convert(root / "hf", tmp_path / "nowhere" / "x.gguf", tokenizer=False)
    with pytest.raises(ModelFileError, match="neither compress_ratios nor layer_types"):
        metadata_from_config({k: v for k, v in config.items() if k != "layer_types"})
    with pytest.raises(ModelFileError, match="missing key hidden_size"):
        metadata_from_config({k: v for k, v in config.items() if k != "hidden_size"})


@pytest.mark.filterwarnings("ignore:.*row length.*is not a multiple")  # tiny experts fall back to F16
def test_mtp_layout_llamacpp_holds_the_same_head(checkpoints, tmp_path):
    root, *_ = checkpoints
    assert convert_hf.main([str(root / "official"), "--out", str(tmp_path / "b.gguf"), "--mtp-out",
                            str(tmp_path / "m.gguf"), "--outtype", "q2", "--no-tokenizer"]) == 0
    assert convert_hf.main([str(root / "official"), "--out", str(tmp_path / "lb.gguf"), "--mtp-out",
                            str(tmp_path / "lm.gguf"), "--outtype", "q2", "--no-tokenizer",
                            "--mtp-layout", "llama.cpp"]) == 0
    base = gguf.open(tmp_path / "lb.gguf").metadata
    assert base["deepseek4.expert_gating_func"] == 4 and base["deepseek4.rope.scaling.type"] == "yarn"
    assert base["deepseek4.context_length"] > 0 and len(base["deepseek4.swiglu_clamp_exp"]) == 6
    ours, theirs = gguf.open(tmp_path / "m.gguf"), gguf.open(tmp_path / "lm.gguf")
    assert theirs.metadata["deepseek4.block_count"] == 7 and theirs.metadata["deepseek4.nextn_predict_layers"] == 1
    assert theirs.tensors["blk.6.nextn.eh_proj.weight"].type == "Q8_0"
    a, b = layouts.mtp_weights(ours)[0], layouts.mtp_weights(theirs)[0]
    assert sorted(a) == sorted(b)
    for name in a:  # the same blocks: eh_proj is e_proj's and h_proj's rows side by side
        assert torch.equal(a[name].data, b[name].data), name


def test_cli_converts_and_reports_errors_in_one_line(checkpoints, tmp_path, capsys):
    root, *_ = checkpoints
    assert convert_hf.main([str(root / "official"), "--out", str(tmp_path / "b.gguf"), "--mtp-out",
                            str(tmp_path / "m.gguf"), "--outtype", "f32", "--no-tokenizer"]) == 0
    assert gguf.open(tmp_path / "m.gguf").tensors and gguf.open(tmp_path / "b.gguf").tensors
    capsys.readouterr()
    assert convert_hf.main([str(tmp_path / "nope"), "--out", str(tmp_path / "b.gguf")]) == 2
    assert capsys.readouterr().err.strip() == (f"convert_hf: error: {tmp_path / 'nope' / 'config.json'}: missing "
                                               "(the checkpoint's config.json is needed)")


def test_conversion_streams_one_tensor_at_a_time(checkpoints, tmp_path, monkeypatch):
    """Each tensor is read (experts one by one), encoded and dropped before the next; progress follows the writes."""
    root, *_ = checkpoints
    live, most_live, loaded, progressed = set(), [0], [], []
    encode, load = ds4.formats.convert.encode, ds4.formats.convert.Checkpoint.load

    def tracked_encode(ckpt, name, parts, ggml_type):
        out = encode(ckpt, name, parts, ggml_type)
        live.add(name)
        weakref.finalize(out.data if isinstance(out, QTensor) else out, live.discard, name)
        most_live[0] = max(most_live[0], len(live))
        return out

    def tracked_load(ckpt, part):
        w = load(ckpt, part)
        loaded.append((part.name, w.dim()))
        return w

    def progress(items):
        for name, t in items:
            progressed.append((name, sorted(p.name for p in tmp_path.glob(".*.tmp"))))
            yield name, t

    monkeypatch.setattr(ds4.formats.convert, "encode", tracked_encode)
    monkeypatch.setattr(ds4.formats.convert.Checkpoint, "load", tracked_load)
    for kind in ("state_dict", "official"):  # fused expert stacks, FP8/FP4 tensors one per expert
        out = tmp_path / f"{kind}.gguf"
        convert(root / kind, out, outtype="f32", tokenizer=False, progress=progress)
        names = list(gguf.open(out).tensors)
        assert [name for name, _ in progressed] == names and most_live[0] == 1 and not live, kind
        assert all(tmps == [f".{kind}.gguf.{os.getpid()}.tmp"] for _, tmps in progressed), kind
        routed = [dims for name, dims in loaded if ".experts." in name]
        assert routed and set(routed) == {2}, kind  # one [out, in] expert at a time, never a whole stack
        progressed.clear()
        loaded.clear()
