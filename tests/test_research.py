"""The research loop: imatrix collection and files (both formats, llama.cpp's tools when built), importance-weighted
quantizers, perplexity and KL divergence, the scripts and the quants bench at smoke size."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess

import gguf as gguf_py
import pytest
import torch

import ds4
from ds4.bench import quants as bench_quants
from ds4.engine import default_model_paths
from ds4.errors import ModelFileError, UsageError
from ds4.formats import gguf, requantize
from ds4.formats import imatrix as imatrix_file
from ds4.research import imatrix, perplexity
from tests.script_modules import script

TINY = default_model_paths()[0]
LLAMA_IMATRIX = shutil.which("llama-imatrix", path=os.environ.get("LLAMA_CPP_BIN"))  # $LLAMA_CPP_BIN, else PATH
TEXT = '''def read_config(path):
    """Read the configuration file at path."""
    with open(path) as f:
        for line in f:
            key, value = line.split("=", 1)
            yield key.strip(), value.strip()
''' * 4


@pytest.fixture(scope="module")
def engine():
    return ds4.load(TINY, backend="torch", ctx=64)


@pytest.fixture(scope="module")
def ids(engine):
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) >= 96
    return ids[:96]


@pytest.fixture(scope="module")
def collected(engine, ids):
    return imatrix.collect(engine, ids, 32, dataset="text")


def test_recording_keeps_numerics(engine, ids):
    plain = engine.session(ctx=32, prefill_chunk=32).forward(ids[:32], eager=True)
    model, im = engine.model, imatrix_file.Imatrix()
    model.ops = imatrix.RecordingOps(model.ops, im)
    try:
        recorded = engine.session(ctx=32, prefill_chunk=32).forward(ids[:32], eager=True)
    finally:
        model.ops = model.ops._inner
    assert torch.equal(plain, recorded) and im.entries


def test_collect_entries(engine, collected):
    im, args = collected, engine.args
    assert im.chunk_count == 3 and im.chunk_size == 32 and im.datasets == ["text"]
    assert "output.weight" not in im.entries   # as llama-imatrix without --process-output
    for i in range(args.n_layers):
        for role in ("attn_q_a", "attn_q_b", "attn_kv", "attn_output_b", "ffn_gate_shexp", "ffn_down_shexp",
                     "hc_attn_fn"):
            e = im.entries[f"blk.{i}.{role}.weight"]
            assert e.counts.tolist() == [96] and (e.sums > 0).any()
        experts = im.entries[f"blk.{i}.ffn_gate_exps.weight"]
        assert experts.sums.shape == (args.n_experts, args.dim)
        assert experts.counts.sum().item() == 96 * args.n_experts_used
        assert im.entries[f"blk.{i}.attn_output_a.weight"].counts.tolist() == [96] * args.o_groups
    # gate and up see the same rows
    assert torch.equal(im.entries["blk.0.ffn_up_shexp.weight"].sums, im.entries["blk.0.ffn_gate_shexp.weight"].sums)


def test_imatrix_file_round_trip_and_legacy(tmp_path, collected):
    path = tmp_path / "im.gguf"
    imatrix_file.write(path, collected)
    r = gguf_py.GGUFReader(path)
    assert r.get_field("general.type").contents() == "imatrix" and r.get_field("general.architecture") is None
    back = imatrix_file.read(path)
    assert back.chunk_count == 3 and back.chunk_size == 32 and back.datasets == ["text"]
    for name, e in collected.entries.items():
        assert torch.equal(back.entries[name].counts, e.counts)
        assert torch.equal(back.entries[name].sums, e.sums.to(torch.float32).to(torch.float64))
    # llama.cpp's legacy .dat: entries of (name, ncall, values averaged and scaled by ncall), then chunks, dataset
    values = torch.tensor([2.0, 4.0, 6.0])
    raw = struct.pack("<i", 1) + struct.pack("<i", 3) + b"w.x" + struct.pack("<ii", 2, 3)
    raw += values.numpy().astype("<f4").tobytes() + struct.pack("<ii", 7, 4) + b"data"
    (tmp_path / "im.dat").write_bytes(raw)
    legacy = imatrix_file.read(tmp_path / "im.dat")
    assert torch.equal(legacy.entries["w.x"].importance(), (values / 2).reshape(1, 3))
    assert legacy.chunk_count == 7 and legacy.datasets == ["data"]
    (tmp_path / "bad.dat").write_bytes(b"\x00\x00")
    with pytest.raises(ModelFileError, match="not a readable imatrix"):
        imatrix_file.read(tmp_path / "bad.dat")


@pytest.mark.skipif(LLAMA_IMATRIX is None, reason="llama-imatrix not found ($LLAMA_CPP_BIN or PATH)")
def test_llama_imatrix_reads_ours_and_we_read_its_output(tmp_path, collected):
    imatrix_file.write(tmp_path / "ours.gguf", collected)
    for fmt, out in (("dat", "conv.dat"), ("gguf", "conv.gguf")):
        subprocess.run([LLAMA_IMATRIX, "-m", "/dev/null", "--in-file", str(tmp_path / "ours.gguf"),
                        "--output-format", fmt, "-o", str(tmp_path / out)], check=True, capture_output=True)
        back = imatrix_file.read(tmp_path / out)
        assert set(back.entries) == set(collected.entries)
        for name, e in collected.entries.items():
            torch.testing.assert_close(back.entries[name].importance().reshape(-1), e.importance().reshape(-1))


def test_requantize_with_imatrix(tmp_path, collected):
    imatrix_file.write(tmp_path / "im.gguf", collected)
    imp = requantize.importance_for(collected, "blk.0.ffn_down_exps.weight", (8, 256, 256))
    assert imp.shape == (8, 256, 256) and torch.equal(imp[3, 7], collected.entries["blk.0.ffn_down_exps.weight"]
                                                       .importance()[3])
    rule = "blk.0.ffn_down_exps=Q4_K"
    out_a = requantize.requantize(TINY, tmp_path / "a.gguf", rule)
    out_b = requantize.requantize(TINY, tmp_path / "b.gguf", rule, imatrix_path=tmp_path / "im.gguf")
    a, b = (gguf.open(o.path) for o in (out_a, out_b))
    assert not torch.equal(a.raw("blk.0.ffn_down_exps.weight").data, b.raw("blk.0.ffn_down_exps.weight").data)
    assert b.metadata["quantize.imatrix.entries_count"] == len(collected.entries)
    with pytest.raises(UsageError, match="imatrix entry blk.0.attn_q_a.weight has 256 values"):
        requantize.importance_for(collected, "blk.0.attn_q_a.weight", (128, 512))
    out_c = requantize.requantize(TINY, tmp_path / "c.gguf", "blk.0.ffn_down_exps=IQ2_XXS",
                                  imatrix_path=tmp_path / "im.gguf")
    unweighted = requantize.encode(gguf.open(TINY).raw("blk.0.ffn_down_exps.weight"), "IQ2_XXS", None)
    assert not torch.equal(gguf.open(out_c.path).raw("blk.0.ffn_down_exps.weight").data, unweighted.data)


def test_perplexity_and_kl(tmp_path, engine, ids):
    scores = perplexity.score(engine, ids, 32)
    assert scores.targets.tolist() == ids[17:32] + ids[49:64] + ids[81:96]
    ppl, err = scores.perplexity()
    assert 1 < ppl < engine.args.vocab_size and err > 0
    assert ppl == pytest.approx(torch.exp(scores.nll.mean()).item())
    same = perplexity.kl_stats(scores, scores)
    assert same.mean_kld == 0 and same.max_kld == 0 and same.same_top == 1 and same.rms_dp == 0
    perplexity.save(tmp_path / "base.npz", scores)
    loaded = perplexity.load(tmp_path / "base.npz")
    assert torch.equal(loaded.logprobs, scores.logprobs) and loaded.ctx == 32
    shifted = perplexity.Scores(32, scores.targets, torch.log_softmax(scores.logprobs * 0.5, -1))
    other = perplexity.kl_stats(shifted, scores)
    assert other.mean_kld > 0 and other.p99_kld >= other.median_kld and other.rms_dp > 0
    with pytest.raises(UsageError, match="scored on other tokens"):
        perplexity.kl_stats(perplexity.score(engine, ids[:64], 32), scores)
    with pytest.raises(UsageError, match="too few for one chunk"):
        perplexity.score(engine, ids[:20], 32)


def test_scripts(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert script("imatrix").main([TINY, str(text), "-o", str(tmp_path / "im.gguf"), "--ctx", "32"]) == 0
    assert "chunks of 32 tokens" in capsys.readouterr().out
    assert "blk.3.ffn_down_exps.weight" in imatrix_file.read(tmp_path / "im.gguf").entries
    perplexity_main = script("perplexity").main
    assert perplexity_main([TINY, str(text), "--ctx", "32", "--save-logits", str(tmp_path / "b.npz")]) == 0
    assert perplexity_main([TINY, str(text), "--ctx", "32", "--kl-logits", str(tmp_path / "b.npz"), "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"mean_kld": 0.0' in out and '"same_top": 1.0' in out
    assert perplexity_main([TINY, str(text), "--ctx", "4096"]) == 2
    assert "too few for one chunk" in capsys.readouterr().err
    # fed 16 tokens at a time: the same scores within float rounding; with q8's rounded activations, others
    assert perplexity_main([TINY, str(text), "--ctx", "32", "--batch", "16", "--kl-logits", str(tmp_path / "b.npz"),
                            "--json"]) == 0
    batched = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kl"]
    assert batched["mean_kld"] < 1e-6 and batched["same_top"] == 1.0
    assert perplexity_main([TINY, str(text), "--ctx", "32", "--batch", "16", "--cpu-dot", "q8", "--kl-base", TINY,
                            "--json"]) == 0
    q8 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kl"]
    assert 0 < q8["mean_kld"] < 0.05


def test_bench_quants_smoke(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = argparse.Namespace(model=TINY, mixes=["Q8_0", "blk.0.ffn_down_exps=IQ2_XXS"], text=str(text), imatrix=None,
                              imatrix_text=str(text), imatrix_chunks=1, no_imatrix=False, ctx=32, chunks=1, tokens=2,
                              runs=1, threads=1, workdir=str(tmp_path / "w"), png=str(tmp_path / "q.png"),
                              weights="memory")
    rows = bench_quants.rows(args, torch.device("cpu"))
    iq2 = "blk.0.ffn_down_exps=IQ2_XXS"
    assert [(r["mix"], r["imatrix"]) for r in rows] == [("(as given)", "-"), ("Q8_0", "no"), ("Q8_0", "yes"),
                                                       (iq2, "no"), (iq2, "yes")]
    assert rows[0]["mean KLD"] == "0.00000" and rows[0]["top-1"] == "100.00%"
    assert float(rows[1]["bits/weight"]) > float(rows[0]["bits/weight"])
    assert "needs an importance matrix" in rows[3]["note"] and rows[4]["note"] == ""
    assert (tmp_path / "q.png").stat().st_size > 0
