"""The embedded default model: scripts/train_tiny.py's transformers model and ds4py give the same logits on the
GGUF it exports (a smoke-size run); the shipped model speculates exactly like plain greedy, its MTP drafts are
accepted, and `generate.py` with no arguments continues code with it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import ds4
from backends.registry import OpSet
from ds4.engine import open_model, open_mtp
from ds4.session import Session
from tests.script_modules import script
from tests.test_hf_oracle import lower_index_wins, max_rel_diff

ROOT = Path(__file__).resolve().parents[1]
train_tiny = script("train_tiny")

REL_TOL = 1e-4
COPY_PROMPT = "def show(items):\n" + "    for key, value in sorted(items.items()):\n        print(key, value)\n" * 3


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A 3-step smoke-size training run exported as f32 GGUFs: (Trained, base path, MTP path)."""
    out = tmp_path_factory.mktemp("train_tiny")
    trained = train_tiny.train("smoke", out, minutes=5, max_steps=3, threads=1, mix="f32", log=lambda msg: None)
    return trained, str(out / "tiny.gguf"), str(out / "tiny-mtp.gguf")


def test_smoke_run_reports_and_plots(smoke):
    trained, base, _ = smoke
    r = trained.report
    assert r.steps == 3 and r.tokens_seen == 3 * 2 * 64
    assert r.unigram_ppl > 1 and r.held_out_ppl > 1
    assert (Path(base).parent / "loss.png").stat().st_size > 1000


def test_training_model_and_ds4py_agree_on_the_exported_gguf(smoke):
    trained, base, mtp_path = smoke
    T = train_tiny.SIZES["smoke"].seq  # 16 ratio-4 rows of which the indexer keeps 2
    ids = torch.randint(8, trained.model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(1))
    probe = train_tiny.Probe(trained.model)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(hf.DeepseekV4IndexerScorer, "forward", lower_index_wins(hf.DeepseekV4IndexerScorer.forward))
        expected = trained.model(ids).logits[0]
        expected_mtp = train_tiny.mtp_forward(trained.model, trained.mtp, probe.states, ids)[0]
    model = open_model(base, ops=OpSet("torch"), indexer_fp4_sim=False, kv_fp8_sim=False, shared_swiglu_clamp=True)
    mtp = open_mtp(model, mtp_path)
    session = Session(model, ctx=T, prefill_chunk=T)
    rows, tokens = list(range(T)), ids[0].tolist()
    X, logits = model.forward(tokens, 0, session.caches, rows)
    _, mtp_logits = mtp.forward(X[:-1], tokens[1:], 1, mtp.new_cache(T, T), 1, rows[:-1])
    assert expected.std() > 0.1 and expected_mtp.std() > 0.1
    assert max_rel_diff(logits, expected) <= REL_TOL
    assert max_rel_diff(mtp_logits, expected_mtp) <= REL_TOL


@pytest.fixture(scope="module")
def default_engine():
    """The shipped default model, as `ds4.load()` gives it."""
    return ds4.load(backend="torch")


def greedy_ids(engine, prompt: str, n: int, **options) -> list[int]:
    return [t.id for t in engine.generate(prompt, raw=True, max_tokens=n, **options) if t.id >= 0]


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_shipped_model_strict_speculation_equals_plain_greedy(default_engine, depth):
    plain = greedy_ids(default_engine, COPY_PROMPT, 24, mtp_draft=0)
    assert greedy_ids(default_engine, COPY_PROMPT, 24, mtp_draft=depth, strict=True) == plain
    assert default_engine.stats.spec.num_drafts > 0


def test_draft_zero_turns_speculation_off(default_engine):
    greedy_ids(default_engine, COPY_PROMPT, 8, mtp_draft=0)
    assert default_engine.stats.spec.num_drafts == 0 and default_engine.stats.spec.passes_per_token == 7 / 8


def test_shipped_mtp_head_is_trained(default_engine):
    """A random MTP head gets ~0% of its drafts accepted; the shipped one about 55% on this prompt."""
    greedy_ids(default_engine, COPY_PROMPT, 48, mtp_draft=1)
    m = default_engine.stats.spec
    assert m.num_accepted_tokens / m.num_draft_tokens >= 0.4
    assert m.passes_per_token <= 0.75


def test_shipped_model_meets_its_goals_on_the_copy_heavy_prompts(default_engine):
    """The spec benchmark's copy-heavy prompts: continuous depth 1 accepts >= 60% of its drafts and takes <= 0.6
    target passes per committed token, auto depth no more than the best fixed depth; perplexity well below unigram."""
    from ds4.bench import spec
    rows = {mode: spec.spec_row(default_engine, spec.SPEC_PROMPTS["copy"], "copy", mode, 64, **spec.SPEC_MODES[mode])
            for mode in ("continuous d1", "d2", "d3", "d4", "auto")}
    assert int(rows["continuous d1"]["accept"].rstrip("%")) >= 60
    assert float(rows["continuous d1"]["passes/token"]) <= 0.6
    assert float(rows["auto"]["passes/token"]) <= min(float(rows[d]["passes/token"]) for d in ("d2", "d3", "d4"))
    report = train_tiny.Report(**json.loads((ROOT / "ds4" / "tiny" / "default_model" / "report.json").read_text()))
    assert report.held_out_ppl < report.unigram_ppl / 5


def test_generate_without_arguments_continues_code():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert "\ufffd" not in r.stdout and len(r.stdout.strip()) > 40
    assert "spec:" in r.stderr and "accepted" in r.stderr


def test_train_tiny_rejects_bad_flags(tmp_path, capsys):
    assert train_tiny.main(["--out-dir", str(tmp_path), "--minutes", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_bench_spec_smoke(tmp_path):
    png = tmp_path / "spec.png"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "spec", "--tokens", "3", "--csv",
                        "--png", str(png)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if not line.startswith("#")][1:]  # machine line, header
    assert len(rows) == 2 * 7 + 4 and png.stat().st_size > 1000
    assert rows[0].startswith("copy,plain,15,")  # 3 tokens from each of the 5 copy-heavy prompts
