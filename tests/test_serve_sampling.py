"""The server's sampling features: logit adjustments (against a plain reference loop), logprobs, n, min_tokens,
ignore_eos and stop_token_ids, on the tiny model."""
import json
import math

import pytest
import torch

import ds4
from ds4.sampling import LogitAdjustments
from ds4.server.app import create_app
from tests.test_serve import CHUNK, CTX, MODEL, LiveServer


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return ds4.load(*tiny_gguf, backend="torch", ctx=CTX, prefill_chunk=CHUNK)


@pytest.fixture(scope="module")
def live(engine):
    server = LiveServer(create_app(engine))
    yield server
    server.close()


def test_adjustments_follow_their_definitions():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, generated = [0, 1], [3, 3, 2]
    adjust = LogitAdjustments(presence=0.5, frequency=0.25, repetition=2.0, logit_bias=((4, 1.5),), early=(2,),
                              min_tokens=4, never=(0,))
    expected = [float("-inf"), -1.0 * 2, float("-inf"), 3.0 / 2 - 0.5 - 0.25 * 2, -2.0 + 1.5]
    assert adjust.apply(logits, prompt, generated).tolist() == expected
    assert adjust.apply(logits, prompt, generated + [1])[2] == 0.5 / 2 - 0.5 - 0.25  # min_tokens reached
    assert not LogitAdjustments(early=(2,), min_tokens=0).active and LogitAdjustments(never=(1,)).active
    with pytest.raises(ds4.errors.UsageError, match="repetition penalty must be > 0"):
        LogitAdjustments(repetition=0)


def reference(engine, ids: list[int], adjust: LogitAdjustments, n: int) -> list[int]:
    """Greedy decoding with `adjust` applied before every choice, on a fresh session."""
    session, out = engine.session(), []
    logits = session.prefill(ids)
    for _ in range(n):
        out.append(int(adjust.apply(logits, ids, out).argmax()))
        logits = session.decode(out[-1])
    return out


def texts(engine, ids: list[int]) -> str:
    return b"".join(engine.tokenizer.token_bytes(t) for t in ids).decode("utf-8", errors="replace")


def test_penalties_and_bias_match_the_reference_loop(live, engine):
    ids = engine.tokenizer.encode("Once upon a time")
    first = reference(engine, ids, LogitAdjustments(), 1)[0]
    extra = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {str(first): -100},
             "repetition_penalty": 1.3}
    r = live.client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=0,
                                       extra_body={k: v for k, v in extra.items() if k != "presence_penalty"},
                                       presence_penalty=0.7)
    adjust = LogitAdjustments(0.7, 0.4, 1.3, ((first, -100.0),))
    expected = reference(engine, ids, adjust, 8)
    assert r.choices[0].logprobs.tokens == [texts(engine, [t]) for t in expected] and expected[0] != first
    assert r.usage.model_extra["speculative"]["num_drafts"] > 0  # adjusted requests speculate (exactly)


def test_logprobs_chat_and_completions_streaming_too(live, engine):
    messages = [{"role": "user", "content": "Hello"}]
    r = live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content
    for c in content:  # greedy: the chosen token is the most likely one
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token and math.isclose(c.top_logprobs[0].logprob, c.logprob)
        assert c.logprob <= 0
    chunks = list(live.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                      logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    done = live.client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    streamed = list(live.client.completions.create(model=MODEL, prompt="Once", max_tokens=5, temperature=0,
                                                   logprobs=2, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs


def test_n_choices_are_the_seeded_singles(live):
    args = {"model": MODEL, "prompt": "Once", "max_tokens": 6, "temperature": 1.0}
    r = live.client.completions.create(**args, n=3, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    singles = [live.client.completions.create(**args, seed=11 + i).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    chat = live.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                               max_tokens=4, temperature=1.0, seed=5, stream=True)
    indices = {c.choices[0].index for c in chat if c.choices}
    assert indices == {0, 1}


def test_min_tokens_ignore_eos_and_stop_token_ids(live, engine):
    eos = engine.tokenizer.eos_id
    base = {"model": MODEL, "prompt": "Once", "temperature": 0, "max_tokens": 10}
    bias = {"logit_bias": {str(eos): 100}}  # EOS at once, unless held off
    assert live.client.completions.create(**base, extra_body=bias).usage.completion_tokens == 1
    held = live.client.completions.create(**base, extra_body={**bias, "min_tokens": 4})
    assert (held.usage.completion_tokens, held.choices[0].finish_reason) == (5, "stop")
    ignored = live.client.completions.create(**base, extra_body={**bias, "ignore_eos": True})
    assert (ignored.usage.completion_tokens, ignored.choices[0].finish_reason) == (10, "length")
    greedy = reference(engine, engine.tokenizer.encode("Once"), LogitAdjustments(), 3)
    assert greedy[2] not in greedy[:2]
    cut = live.client.completions.create(**base, extra_body={"stop_token_ids": [greedy[2]]})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == texts(engine, greedy[:2])
    assert json.loads(cut.model_dump_json())["usage"]["completion_tokens"] == 3
