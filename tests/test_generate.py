"""scripts/generate.py and the ds4.load API on a tiny random model: output, JSON, errors."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ds4

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"


def generate(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI; the environment keeps TRITON_INTERPRET from conftest."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_json_run_with_mtp(tiny_gguf, tmp_path):
    base, mtp = tiny_gguf
    dump = tmp_path / "logits.npy"
    r = generate("--model", base, "--mtp", mtp, "-n", "32", "--json", "--mtp-draft", "2",
                 "--dump-logits", str(dump), "--backend", "torch")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["generated_ids"]) == 32 or out["generated_ids"][-1] == 1
    assert out["prompt_ids"][0] == 0  # BOS
    spec = out["speculative"]
    assert spec["num_drafts"] > 0 and spec["target_forward_passes"] > 0
    assert out["backends"]["qmatmul"]["backend"] == "torch"
    logits = np.load(dump)
    assert logits.shape == (len(out["generated_ids"]), 512)
    assert (logits.argmax(1) == np.array(out["generated_ids"])).all()
    assert "generated in" in r.stderr


def test_api_matches_cli_greedy(tiny_gguf):
    base, mtp = tiny_gguf
    engine = ds4.load(base, mtp, backend="torch")
    ids = [t.id for t in engine.generate([0, 5, 9, 17], max_tokens=6) if t.id >= 0]
    r = generate("--model", base, "--prompt-ids", "0,5,9,17", "-n", "6", "--json", "--backend", "torch")
    assert json.loads(r.stdout)["generated_ids"] == ids
    assert engine.ops.report()["qmatmul"]["calls"] > 0


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent.gguf"], "model file not found: /nonexistent.gguf"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--ctx", "8", "--prompt-ids", "1,2,3,4,5,6,7,8,9"], "context is 8"),
    (["--temp", "-1"], "--temp must be >= 0"),
    (["--mtp-draft", "many"], "--mtp-draft must be an integer or 'auto'"),
    (["--backend", "cuda-magic"], "unknown backend"),
    (["--mtp-draft", "99"], "--mtp-draft must be an integer 0..16"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--dump-logits", "/nonexistent/logits.npy"], "--dump-logits /nonexistent/logits.npy: the directory"),
    (["--device", "meta", "--compile"], "compiled steps run on the CPU only"),
])
def test_bad_input_is_one_clear_line(tiny_gguf, args, message):
    if "--model" not in args:
        args = ["--model", tiny_gguf[0], *args]
    r = generate(*args)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_load_names_the_file_without_a_vocabulary(tmp_path):
    from ds4.errors import ModelFileError
    from ds4.formats import gguf
    from ds4.tiny.build import tiny_model_weights
    md, base, _ = tiny_model_weights()
    path = tmp_path / "no-vocab.gguf"
    gguf.write(path, {k: v for k, v in md.items() if not k.startswith("tokenizer.")}, base)
    with pytest.raises(ModelFileError, match=f"^{path}: tokenizer metadata: missing key 'tokenizer.ggml.tokens'"):
        ds4.load(str(path), backend="torch")


def test_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    from ds4.errors import ModelFileError
    from ds4.formats import gguf
    from ds4.tiny.build import tiny_model_weights
    from ds4.tiny.vocab import tiny_vocab_metadata
    md, base, _ = tiny_model_weights(vocab_size=300)
    path = str(tmp_path / "bad.gguf")
    gguf.write(path, md | tiny_vocab_metadata(400), base)
    with pytest.raises(ModelFileError, match="tokenizer has 400 tokens but the model's vocabulary"):
        ds4.load(path)
