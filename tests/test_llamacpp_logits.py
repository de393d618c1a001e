"""Teacher-forced log-probabilities of ds4py against llama.cpp's at full width (docs/cpu.md, "Comparing against
llama.cpp"): `llama-perplexity --kl-divergence-base` saves llama.cpp's log-probabilities of the second half of a
64-token chunk, batched (one ubatch of 64) and one token at a time (`-ub 1`); ds4py prefills the same tokens in one
chunk with its storage simulations set as llama.cpp computes (no FP8 KV or FP4 indexer simulation, F16 rows).

Skips unless $LLAMA_CPP_BIN (else PATH) has llama-perplexity and $DS4_FULL_GGUF names a full-width truncated V4
Flash file that llama.cpp loads (`scripts/bench.py cpu --full-layers 4 --workdir DIR` writes one).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.registry import OpSet
from ds4.engine import open_model
from ds4.formats import gguf
from ds4.session import Session

LLAMA_PERPLEXITY = shutil.which("llama-perplexity", path=os.environ.get("LLAMA_CPP_BIN"))
FULL_GGUF = os.environ.get("DS4_FULL_GGUF", "")
CTX = 64                                  # one chunk; llama-perplexity scores positions CTX/2 .. CTX-2
TEXT = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"   # >= 2·CTX tokens of plain text
MATCH_LLAMA = {"kv_fp8_sim": False, "indexer_fp4_sim": False, "f16_cache": True}


@dataclass(frozen=True)
class SavedLogprobs:
    """A `--kl-divergence-base` file: the tokens of every chunk and the log-probabilities of its scored rows."""

    ctx: int
    tokens: np.ndarray      # [n_chunk · ctx] int32, as tokenized (before any BOS substitution)
    logprobs: np.ndarray    # [n_chunk · (ctx − 1 − ctx/2), vocab] float32


def read_saved_logprobs(path: Path) -> SavedLogprobs:
    """Read llama-perplexity's file: "_logits_", n_ctx, n_vocab, n_chunk (int32), the tokens, then per scored row
    two floats (scale, minimum log-probability) and n_vocab uint16 steps above that minimum (padded to even)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
    ctx, vocab, chunks = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, chunks * ctx, 20)
    stride = 2 * ((vocab + 1) // 2) + 4                  # uint16 per row: 2 floats, then the steps
    rows = np.frombuffer(raw, np.uint16, offset=20 + 4 * tokens.size).reshape(-1, stride)
    head = rows[:, :4].copy().view(np.float32)           # [rows, 2]: scale, minimum
    steps = rows[:, 4:4 + vocab].astype(np.float32)
    return SavedLogprobs(int(ctx), tokens, head[:, 1:2] + head[:, 0:1] * steps)


def llama_logprobs(tmp_path: Path, ubatch: int) -> SavedLogprobs:
    """llama.cpp's log-probabilities of the first chunk of TEXT with ubatches of `ubatch` tokens, one thread."""
    out = tmp_path / f"llama-ub{ubatch}.kld"
    cmd = [LLAMA_PERPLEXITY, "-m", FULL_GGUF, "-f", str(TEXT), "-c", str(CTX), "-b", str(CTX), "-ub", str(ubatch),
           "-t", "1", "--chunks", "1", "--kl-divergence-base", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} failed: {done.stderr[-2000:]}"
    return read_saved_logprobs(out)


@pytest.mark.skipif(LLAMA_PERPLEXITY is None or not Path(FULL_GGUF).is_file(),
                    reason="needs llama-perplexity ($LLAMA_CPP_BIN or PATH) and $DS4_FULL_GGUF")
@pytest.mark.parametrize("ubatch", [CTX, 1])
def test_logprobs_match_llamacpp_at_every_scored_position(tmp_path, ubatch):
    saved = llama_logprobs(tmp_path, ubatch)
    ids = saved.tokens[:CTX].tolist()
    md = gguf.open(FULL_GGUF).metadata
    if md.get("tokenizer.ggml.add_bos_token", False):   # llama-perplexity feeds BOS in place of the first token
        ids[0] = int(md["tokenizer.ggml.bos_token_id"])
    model = open_model(FULL_GGUF, OpSet("auto"), **MATCH_LLAMA)
    scored = list(range(CTX // 2, CTX - 1))
    logits = Session(model, CTX, CTX).forward(ids, logit_rows=scored, eager=True)
    ours = torch.log_softmax(logits.double(), -1).numpy()
    theirs = saved.logprobs.astype(np.float64)
    assert ours.shape == theirs.shape
    near_max = theirs > theirs.max(-1, keepdims=True) - 16   # llama.cpp stores 16 nats below the top exactly
    for row, (a, b, keep) in enumerate(zip(ours, theirs, near_max, strict=True)):
        corr = np.corrcoef(a[keep], b[keep])[0, 1]
        assert corr > 0.99, f"position {scored[row]} (ubatch {ubatch}): correlation {corr:.4f}"
        assert np.abs(a - b)[keep].max() < 0.5, f"position {scored[row]} (ubatch {ubatch})"
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.8
