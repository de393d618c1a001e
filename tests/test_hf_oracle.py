"""Oracle: HF transformers' DeepseekV4ForCausalLM, saved, converted with convert_hf.py --outtype f32 and loaded
by ds4py, gives the same logits (fp32, FP8/FP4 simulations off, shared clamp on, lower-index top-k ties)
for a prompt longer than the window across many ratio-4 and ratio-16 blocks, in chunked prefill and decode."""
from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from backends.registry import OpSet
from ds4.engine import open_model
from ds4.session import Session
from ds4.tiny.hf import tiny_config, tiny_model
from tests.script_modules import script

PROMPT_LEN = 90  # window 16; 22 ratio-4 rows (indexer keeps 4 of them); 5 ratio-16 rows
REL_TOL = 1e-4   # max abs logit difference, relative to the largest |logit|

convert_hf = script("convert_hf")


def lower_index_wins(scorer_forward):
    """The indexer scorer with exact ties broken toward the lower row (docs/switches.md D5).

    Scores move to float64 and row c loses c·1e-300: that separates exact ties (e.g. all-relu-zero
    rows) and leaves every other comparison unchanged, since 1e-300 is far below a float32 score's ulp.
    """
    def forward(self, q, compressed_kv, hidden_states):
        scores = scorer_forward(self, q, compressed_kv, hidden_states).double()
        return scores - torch.arange(scores.shape[-1], dtype=torch.float64) * 1e-300
    return forward


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """(transformers logits [T, V], ds4py model, prompt ids) for a tiny random model."""
    tmp = tmp_path_factory.mktemp("oracle")
    cfg = tiny_config(head_dim=80)  # 64 no-RoPE dims: the KV FP8 simulation works in blocks of 64
    model = tiny_model(cfg, seed=0)
    model.save_pretrained(tmp / "hf")
    assert convert_hf.main([str(tmp / "hf"), "--out", str(tmp / "base.gguf"), "--outtype", "f32",
                            "--no-tokenizer"]) == 0
    ids = torch.randint(0, cfg.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(hf.DeepseekV4IndexerScorer, "forward", lower_index_wins(hf.DeepseekV4IndexerScorer.forward))
        expected = model(ids, use_cache=False).logits[0]
        for layer in model.model.layers:  # the same model attending to every visible compressed row
            if layer.self_attn.layer_type == "compressed_sparse_attention":
                layer.self_attn.compressor.indexer.index_topk = PROMPT_LEN
        unselected = model(ids, use_cache=False).logits[0]
    ds4 = open_model(str(tmp / "base.gguf"), ops=OpSet("torch"), indexer_fp4_sim=False,
                               kv_fp8_sim=False, shared_swiglu_clamp=True)
    return expected, unselected, ds4, ids[0].tolist()


def max_rel_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_oracle_is_not_degenerate(oracle):
    expected, unselected, _, _ = oracle
    assert 1 < expected.abs().max() < 20 and expected.std() > 0.3
    assert len(set(expected.argmax(-1).tolist())) > 10
    assert max_rel_diff(unselected, expected) > 100 * REL_TOL  # the indexer's top-k really drops rows


@pytest.mark.parametrize("chunk", [7, 16, 2048])
def test_chunked_prefill_matches_transformers(oracle, chunk):
    expected, _, ds4, ids = oracle
    session = Session(ds4, ctx=PROMPT_LEN, prefill_chunk=chunk)
    assert max_rel_diff(session.forward(ids, "all"), expected) <= REL_TOL


def test_decode_matches_transformers(oracle):
    expected, _, ds4, ids = oracle
    session = Session(ds4, ctx=PROMPT_LEN, prefill_chunk=1)
    got = torch.stack([session.decode(t) for t in ids])
    assert max_rel_diff(got, expected) <= REL_TOL

