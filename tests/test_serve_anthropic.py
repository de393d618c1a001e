"""POST /v1/messages, driven by the official `anthropic` client: text, thinking, tool_use/tool_result, streaming."""
import json

import anthropic
import pytest

import ds4
from ds4.chat import prompt_ids
from ds4.formats.vocab import EOS
from ds4.server.app import create_app
from ds4.server.guards import GuardConfig
from tests.test_serve import MODEL, WEATHER_CALL, LiveServer, ScriptedWorker

WEATHER = {"name": "get_weather", "description": "Get the weather for a location",
           "input_schema": {"type": "object", "properties": {"location": {"type": "string"},
                                                             "days": {"type": "integer"}}}}
OPENAI_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}


def client(server: LiveServer, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(tiny_gguf):
    engine = ds4.load(tiny_gguf[0], backend="torch")
    worker = ScriptedWorker(engine, "")
    server = LiveServer(create_app(engine, worker=worker, guards=GuardConfig(api_key="k")))
    yield client(server, "k"), worker
    server.close()


def test_text_reply_matches_the_model(tiny_gguf):
    engine = ds4.load(*tiny_gguf, backend="torch", ctx=1536, prefill_chunk=512)
    server = LiveServer(create_app(engine))
    try:
        c = client(server)
        r = c.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0}, system="Be brief.",
                              messages=[{"role": "user", "content": "Hello"}])
        ids = prompt_ids(engine.tokenizer, [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hello"}])
        expected = "".join(t.text for t in engine.generate(ids, max_tokens=6) if t.id != engine.tokenizer.eos_id)
        assert (r.content[0].type, r.content[0].text, r.stop_reason) == ("text", expected, "max_tokens")
        assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == len(ids)
        assert r.usage.output_tokens == 6
        with c.messages.stream(model=MODEL, max_tokens=6, extra_body={"temperature": 0}, system="Be brief.",
                               messages=[{"role": "user", "content": "Hello"}]) as stream:
            assert "".join(stream.text_stream) == expected
            assert stream.get_final_message().stop_reason == "max_tokens"
        forced = c.messages.create(model=MODEL, max_tokens=400, tools=[WEATHER], tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": "Weather?"}],
                                   extra_body={"temperature": 0})   # greedy: the same call on every machine
        assert forced.stop_reason == "tool_use" and forced.content[-1].name == "get_weather"
        assert isinstance(forced.content[-1].input, dict)
        with pytest.raises(anthropic.NotFoundError):
            c.messages.create(model="claude", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    finally:
        server.close()


def test_thinking_tool_use_and_tool_result(scripted):
    c, worker = scripted
    worker.script = "Look it up.</think>Checking." + WEATHER_CALL
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    r = c.messages.create(model=MODEL, max_tokens=2000, messages=ask, tools=[WEATHER],
                          thinking={"type": "enabled", "budget_tokens": 1024}, system=[{"type": "text",
                                                                                     "text": "Be useful."}])
    assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.stop_reason == "tool_use"
    assert (r.content[0].thinking, r.content[1].text) == ("Look it up.", "Checking.")
    call = r.content[2]
    assert (call.name, call.input) == ("get_weather", {"location": "Rome", "days": 2})
    system = {"role": "system", "content": "Be useful."}
    assert worker.prompts[-1] == prompt_ids(worker.engine.tokenizer, [system, *ask], "thinking",
                                            tools=[OPENAI_WEATHER])
    with c.messages.stream(model=MODEL, max_tokens=2000, messages=ask, tools=[WEATHER],
                           thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"location": "Rome", "days": 2} and final.stop_reason == "tool_use"
    assert events.count("content_block_start") == 3 and events[-1] == "message_stop"

    worker.script = "Sunny." + EOS
    follow = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "24C"}]}]
    r2 = c.messages.create(model=MODEL, max_tokens=50, messages=follow, tools=[WEATHER], stop_sequences=["ny"])
    assert (r2.content[0].text, r2.stop_reason, r2.stop_sequence) == ("Sun", "stop_sequence", "ny")
    openai_follow = [*ask, {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
                            "tool_calls": [{"id": call.id, "type": "function", "function": {
                                "name": "get_weather", "arguments": json.dumps(call.input)}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "24C"}]
    assert worker.prompts[-1] == prompt_ids(worker.engine.tokenizer, openai_follow, tools=[OPENAI_WEATHER])
    worker.script = WEATHER_CALL  # an undeclared tool stays text
    r3 = c.messages.create(model=MODEL, max_tokens=200, messages=ask)
    assert [b.type for b in r3.content] == ["text"] and r3.stop_reason == "end_turn"


@pytest.mark.parametrize("change, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role must be user or assistant"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "got 'image'"),
    ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
    ({"tool_choice": {"type": "tool", "name": "x"}, "tools": [WEATHER]}, "names 'x', which is not in tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "budget_tokens must be less than max_tokens"),
    ({"temperature": 1.5}, "temperature"),
])
def test_bad_messages_get_anthropic_errors(scripted, change, message):
    c, _ = scripted
    with pytest.raises(anthropic.BadRequestError) as caught:
        c.messages.create(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}], extra_body=change)
    assert caught.value.body["type"] == "error" and message in caught.value.body["error"]["message"]


def test_key_is_required(scripted):
    c, _ = scripted
    with pytest.raises(anthropic.AuthenticationError):
        c.with_options(api_key="wrong").messages.create(model=MODEL, max_tokens=4,
                                                        messages=[{"role": "user", "content": "hi"}])
