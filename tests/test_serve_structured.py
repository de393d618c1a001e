"""Structured output on the tiny model: json_schema replies validate, json_object replies parse, tool_choice
required / named always yields a parsed call of an allowed tool; the grammar's mask against its definition."""
import argparse
import json

import jsonschema
import pytest
import torch

import ds4
from ds4.bench import grammar as grammar_bench
from ds4.formats.vocab import THINK_END
from ds4.grammar import Constraint, json_grammar, tool_call_grammar
from ds4.server.app import create_app
from tests.test_serve import MODEL, LiveServer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["n", "ok", "kind"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "Answer in JSON"}]


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return ds4.load(*tiny_gguf, backend="torch", ctx=1536, prefill_chunk=512)


@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(create_app(engine))
    yield server
    server.close()


def test_mask_allows_exactly_the_grammar(engine):
    tokenizer, vocab = engine.tokenizer, engine.args.vocab_size
    state = Constraint(tokenizer, vocab, json_grammar({"enum": ["cat", "dog"]}))
    allowed = state.allowed()
    expected = [i for i in range(vocab) if i not in tokenizer.control_ids and
                any(s.startswith(tokenizer.token_bytes(i)) for s in (b'"cat"', b'"dog"')) and tokenizer.token_bytes(i)]
    assert allowed.nonzero().flatten().tolist() == expected
    masked = state.mask(torch.zeros(vocab))
    assert bool(torch.isinf(masked[~allowed]).all()) and bool((masked[allowed] == 0).all())
    for token in tokenizer.encode('"dog"'):
        state.advance(token)
    assert state.complete and state.allowed().nonzero().flatten().tolist() == [tokenizer.eos_id]
    forced = Constraint(tokenizer, vocab, json_grammar({"enum": ["weather_report"]}))
    for token in tokenizer.encode('"weather_report"'):  # a forced run: each mask keeps the next forced token only
        assert torch.isfinite(forced.mask_forced(torch.zeros(vocab))).nonzero().flatten().tolist() == [token]
        forced.advance(token)
    with pytest.raises(ds4.errors.UsageError, match="breaks the grammar"):
        Constraint(tokenizer, vocab, json_grammar({"type": "boolean"})).advance(tokenizer.encode("x")[0])


def test_json_schema_replies_validate(live):
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    replies = []
    for seed in range(4):
        r = live.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, n=5, seed=seed,
                                                temperature=1.0, max_tokens=120)
        replies += r.choices
        spec = r.usage.model_extra["speculative"]  # forced runs are verified many tokens per pass
        assert spec["target_forward_passes"] < spec["generated_tokens"] - 5
    assert len(replies) == 20
    for choice in replies:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    obj = live.client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                              temperature=0, max_tokens=16)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")


def test_thinking_then_json(live, engine):
    think_end = engine.tokenizer.encode(THINK_END, specials=True)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    r = live.client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=150,
                                            extra_body={"thinking": {"type": "enabled"}}, seed=3, temperature=1.0,
                                            logit_bias={str(think_end): 8})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_tool_choice_required_and_named_always_call(live):
    for seed in range(2):
        r = live.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                n=2, seed=seed, temperature=1.0, max_tokens=400)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = live.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, n=2, seed=1,
                                            temperature=1.0, max_tokens=400)
    assert {c.function.name for ch in r.choices for c in ch.message.tool_calls} == {"get_time"}
    assert all(json.loads(c.function.arguments)["zone"] in ("utc", "cet")
               for ch in r.choices for c in ch.message.tool_calls)


def test_grammar_errors_are_400(live):
    import openai
    for extra, message in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                            "not in tools"),
                           ({"response_format": {"type": "json_schema", "json_schema": {
                               "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}},
                            "cannot be enforced")):
        with pytest.raises(openai.BadRequestError, match=message):
            live.client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=extra)
    assert "/[^<]{0,4}/" in tool_call_grammar([TOOLS[0]["function"]])


def test_grammar_bench_smoke():
    rows = grammar_bench.rows(argparse.Namespace(skip_outlines=True, threads=1), torch.device("cpu"))
    assert [r["schema"] for r in rows] == list(grammar_bench.SCHEMAS)
    assert all(float(r["llg us/token"]) > 0 and r["tokens"] > 5 for r in rows)


def test_constrained_greedy_is_the_same_at_every_draft_depth(engine):
    """Greedy json_schema, tool_choice required and penalized json_object requests give the same tokens with
    mtp_draft 0 (no MTP drafts) and 1..3: every verify and draft row is masked and adjusted with its own
    prefix, forced runs are verified in one pass (the reference ops are batch-invariant, so the worker's
    verify is strict's)."""
    from ds4.server.worker import Worker
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    requests = [{"response_format": fmt}, {"tools": TOOLS, "tool_choice": "required"},
                {"response_format": {"type": "json_object"}, "frequency_penalty": 1.5, "presence_penalty": 0.5,
                 "logit_bias": {"9": 5}}]
    outputs, worker = {}, Worker(engine)
    server = LiveServer(create_app(engine, worker=worker))
    try:
        for draft in (0, 1, 2, 3):
            worker.mtp_draft = draft or None
            replies = [server.client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=300,
                                                             **extra) for extra in requests]
            spec = [r.usage.model_extra["speculative"] for r in replies]
            assert (spec[2]["num_drafts"] > 0) == bool(draft)  # the free-text reply drafts with the MTP head
            assert all(s["target_forward_passes"] < s["generated_tokens"] - 5 for s in spec[:2])  # forced runs
            outputs[draft] = [(c.finish_reason, c.message.content,
                               [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
                              for c in (r.choices[0] for r in replies)]
            schema_reply, tool_reply, _ = (r.choices[0] for r in replies)
            jsonschema.validate(json.loads(schema_reply.message.content), SCHEMA)
            assert tool_reply.finish_reason == "tool_calls" and tool_reply.message.tool_calls
    finally:
        server.close()
    assert outputs[1] == outputs[2] == outputs[3] == outputs[0]
