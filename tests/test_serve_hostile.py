"""The server under hostile requests: every probed failure answers 4xx (never 5xx, never a traceback), the
guards (API key, Host, JSON only, body size), the operations routes, and /health during a long prefill."""
import http.client
import json
import logging
import random
import threading
import time
import urllib.parse

import pytest

import ds4
from ds4.chat import ChatFormatError, CompletionParser, prompt_ids
from ds4.formats.vocab import DSML, EOS
from ds4.server.app import create_app, main
from ds4.server.guards import MAX_DEPTH, GuardConfig, allowed_hosts, exposure_warning
from ds4.server.worker import Worker
from tests.test_serve import MODEL, WEATHER_CALL, WEATHER_TOOL, LiveServer, ScriptedWorker, rss_mb

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class Records(logging.Handler):
    """Collects log records that carry a traceback."""

    def __init__(self):
        super().__init__()
        self.tracebacks = []

    def emit(self, record):
        if record.exc_info:
            self.tracebacks.append(record)


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return ds4.load(tiny_gguf[0], backend="torch")  # the default context fits tool prompts


def serve(engine, script="ok" + EOS, **guards):
    worker = ScriptedWorker(engine, script)
    server = LiveServer(create_app(engine, worker=worker, guards=GuardConfig(**guards)))
    records = Records()
    for name in ("uvicorn", "ds4.server"):
        logging.getLogger(name).addHandler(records)
    return server, worker, records


def stop(server, records):
    for name in ("uvicorn", "ds4.server"):
        logging.getLogger(name).removeHandler(records)
    server.close()


@pytest.fixture(scope="module")
def hostile(engine):
    server, worker, records = serve(engine, max_body_bytes=1 << 20)
    yield server, worker, records
    stop(server, records)


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            chunked: bool = False) -> tuple[int, dict | str]:
    """A raw HTTP request (http.client: any header, any body)."""
    url = urllib.parse.urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body, {k: v for k, v in headers.items() if v is not None}, encode_chunked=chunked)
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, json.loads(text) if r.headers.get("content-type", "").startswith("application/json") else text


def nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


def chat(**change) -> bytes:
    """A chat body; the value DEEP becomes 2,000 nested arrays (too deep for json.dumps to write)."""
    return json.dumps({**CHAT, **change}).replace(f'"{DEEP}"', "[" * 2000 + "1" + "]" * 2000).encode()


SURROGATE = "a\ud800b"
DEEP = "@deep@"
HOSTILE = [  # (path, body, headers, status, part of the message)
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": SURROGATE}]), {}, 400, "lone surrogate"),
    ("/v1/chat/completions", chat(messages=[{"role": "system", "content": SURROGATE},
                                            {"role": "user", "content": "hi"}]), {}, 400, "messages[0].content"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": SURROGATE}}]), {}, 400,
     "tools[0].function.name"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": SURROGATE}).encode(), {}, 400, "lone surrogate"),
    ("/v1/chat/completions", chat(stop=SURROGATE), {}, 400, "stop"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": DEEP}]), {}, 400, "nested deeper than"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": DEEP}}]), {},
     400, "nested deeper than"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                          "schema": DEEP}}),
     {}, 400, "nested deeper than"),
    ("/v1/chat/completions", chat(messages=nested(MAX_DEPTH)), {}, 400, f"nested deeper than {MAX_DEPTH}"),
    ("/v1/chat/completions", chat(stop=""), {}, 400, "stop: String should have at least 1 character"),
    ("/v1/chat/completions", chat(response_format={"type": "bogus"}), {}, 400, "response_format"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), {}, 400,
     "json_schema.schema: Field required"),
    ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "yes"}), {}, 400,
     "stream_options"),
    ("/v1/chat/completions", chat(), {"Content-Type": "text/plain"}, 415, "must be JSON"),
    ("/v1/chat/completions", chat(), {"Content-Type": None}, 415, "must be JSON"),
    ("/v1/chat/completions", chat(), {"Host": "evil.example"}, 421, "DNS rebinding"),
    ("/health", None, {"Host": "attacker.test:8000"}, 421, "is not this server"),
    ("/v1/chat/completions", b"x" * 100, {"Content-Length": str(2 << 20)}, 413, "larger than 1 MB"),
    ("/v1/completions", b"[" * 100_000, {}, 400, "nested deeper than"),
    ("/v1/completions", b"\xff\xfe", {}, 400, "not valid JSON"),
    ("/tokenize", json.dumps({"prompt": "hi", "messages": []}).encode(), {}, 400, "exactly one of"),
    ("/detokenize", json.dumps({"tokens": [1, 10**9]}).encode(), {}, 400, "outside"),
    ("/tokenize", json.dumps({"messages": [{"role": "user", "content": SURROGATE}]}).encode(), {}, 400,
     "lone surrogate"),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": SURROGATE}]}]}).encode(),
     {}, 400, "lone surrogate"),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 4, "system": DEEP,
                                 "messages": [{"role": "user", "content": "hi"}]}).replace(
        f'"{DEEP}"', "[" * 2000 + "]" * 2000).encode(), {}, 400, "nested deeper than"),
    ("/v1/messages", json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}
                                ).encode(), {}, 400, "content a string or a list of blocks"),
]


@pytest.mark.parametrize("path, body, headers, status, message", HOSTILE)
def test_hostile_request_table(hostile, path, body, headers, status, message):
    server, _, records = hostile
    got, answer = request(server, "GET" if body is None else "POST", path, body, headers)
    assert (got, message in answer["error"]["message"]) == (status, True), answer
    assert not records.tracebacks


def test_body_limit_holds_without_a_declared_length(hostile):
    server, _, records = hostile
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (1 << 20)}]}).encode()
    before = rss_mb()
    for _ in range(4):
        assert request(server, "POST", "/v1/chat/completions", body, chunked=True)[0] == 413
        assert request(server, "POST", "/v1/chat/completions", body[:100], {"Content-Length": str(50 << 20)})[0] == 413
    assert rss_mb() - before < 50 and not records.tracebacks


def fuzz_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null", "list", "dict", "big", "neg"]
    kind = rng.choice(kinds if depth < 3 else kinds[:5])
    return {"int": lambda: rng.randint(-3, 300), "float": lambda: rng.uniform(-5, 5), "big": lambda: 10**30,
            "str": lambda: rng.choice(["", "auto", "none", "text", "\u0000", "<｜User｜>", "x" * 50, "json_object",
                                       "required", "function", "json_schema", "enabled"]),
            "bool": lambda: rng.random() < 0.5, "null": lambda: None, "neg": lambda: -1,
            "list": lambda: [fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            "dict": lambda: {rng.choice(["type", "role", "content", "name", "x", "function", "json_schema",
                                         "schema", "parameters", "properties"]): fuzz_value(rng, depth + 1)
                             for _ in range(rng.randint(0, 3))}}[kind]()


FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stream", "stream_options", "n", "tools", "tool_choice", "response_format", "thinking", "logprobs",
          "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "reasoning_effort", "user", "n",
          "min_tokens", "ignore_eos", "stop_token_ids", "repetition_penalty", "system", "stop_sequences"]


def test_seeded_fuzz_of_request_bodies(hostile):
    server, worker, records = hostile
    rng = random.Random(27)
    seen = set()
    for _ in range(150):
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/messages"])
        body = {**CHAT, "prompt": "hi"} if path != "/tokenize" else {"prompt": "hi"}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = fuzz_value(rng)
        status, answer = request(server, "POST", path, json.dumps(body).encode())
        assert status in (200, 400, 404), (body, answer)
        seen.add(status)
    assert {200, 400} <= seen and not records.tracebacks
    assert 'status="500"' not in request(server, "GET", "/metrics")[1]


TEMPLATES = [
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER_TOOL], "tool_choice": "required"}),
    ("/v1/chat/completions", {**CHAT, "tools": [WEATHER_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "tools": [{"name": "w", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}], "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
]


def mutate(rng: random.Random, value):
    """`value` with one node, reached by a random walk from the root, replaced by a fuzz value."""
    if not isinstance(value, dict | list) or not value or rng.random() < 0.25:
        return fuzz_value(rng)
    value = dict(value) if isinstance(value, dict) else list(value)
    key = rng.choice(list(value) if isinstance(value, dict) else range(len(value)))
    value[key] = mutate(rng, value[key])
    return value


def test_seeded_fuzz_of_nested_fields(hostile):
    server, _, records = hostile
    rng, seen = random.Random(2727), set()
    for _ in range(300):
        path, template = rng.choice(TEMPLATES)
        status, answer = request(server, "POST", path, json.dumps(mutate(rng, template)).encode())
        assert status in (200, 400, 404), answer
        seen.add(status)
    assert {200, 400} <= seen and not records.tracebacks


def test_unexpected_errors_are_logged_once(engine):
    server, _, records = serve(engine)
    app = server.server.config.app

    async def broken():
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken)
    try:
        status, answer = request(server, "GET", "/broken")
        assert (status, answer["error"]["message"]) == (500, "internal error (RuntimeError)")
        assert len(records.tracebacks) == 1 and "a bug" in str(records.tracebacks[0].exc_info[1])
    finally:
        stop(server, records)


def test_chat_format_refuses_surrogates_and_gates_tool_calls(engine):
    tokenizer = engine.tokenizer
    bad_tool = [{"type": "function", "function": {"name": SURROGATE}}]
    for messages, tools in (([{"role": "user", "content": SURROGATE}], None),
                            ([{"role": "system", "content": SURROGATE}, {"role": "user", "content": "x"}], None),
                            ([{"role": "user", "content": "x"}], bad_tool)):
        with pytest.raises(ChatFormatError, match="lone surrogate"):
            prompt_ids(tokenizer, messages, tools=tools)
    text = "ok" + WEATHER_CALL
    calls = {names: parse(text, names) for names in (None, frozenset(), frozenset({"get_time"}),
                                                     frozenset({"get_weather"}))}
    assert [len(c["tool_calls"]) for c in calls.values()] == [1, 0, 0, 1]
    assert calls[frozenset()]["content"] == text.removesuffix(EOS)
    assert f'<{DSML}invoke name="get_weather">' in calls[frozenset({"get_time"})]["content"]


def parse(text: str, names) -> dict:
    parser = CompletionParser("chat", tools=names)
    deltas = parser.feed(text) + parser.finish()
    return {"content": "".join(d.content for d in deltas), "tool_calls": [d.tool_call for d in deltas if d.tool_call]}


def test_tool_calls_only_for_declared_tools(hostile):
    server, worker, _ = hostile
    worker.script = WEATHER_CALL
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    for tools, choice in ((None, None), ([WEATHER_TOOL], "none"), ([other], "auto")):
        extra = {"tools": tools, "tool_choice": choice} if tools else {}
        r = server.client.chat.completions.create(model=MODEL, messages=messages, **extra)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert f'<{DSML}invoke name="get_weather">' in r.choices[0].message.content
    r = server.client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, other])
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    worker.script = "ok" + EOS


def test_api_key_on_every_endpoint(engine):
    server, _, records = serve(engine, api_key="s3cret")
    try:
        for method, path, body in (("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", chat()), ("POST", "/tokenize", b"{}")):
            for key in (None, "Bearer wrong", "s3cret"):
                status, _ = request(server, method, path, body, {"Authorization": key})
                assert status == 401, (path, key)
        assert request(server, "GET", "/health", None, {"Authorization": "Bearer s3cret"})[0] == 200
        assert request(server, "GET", "/v1/models", None, {"x-api-key": "s3cret"})[0] == 200
        server.client.api_key = "s3cret"
        assert server.client.chat.completions.create(model=MODEL, messages=CHAT["messages"]).choices[0]
    finally:
        stop(server, records)


def test_tokenize_detokenize_and_metrics(hostile):
    server, worker, _ = hostile
    tokenizer = worker.engine.tokenizer
    status, answer = request(server, "POST", "/tokenize", json.dumps({"prompt": "Hello world"}).encode())
    assert status == 200 and answer["tokens"] == tokenizer.encode("Hello world") and answer["count"] > 0
    status, chat_ids = request(server, "POST", "/tokenize", json.dumps({"messages": CHAT["messages"]}).encode())
    assert status == 200 and chat_ids["count"] > answer["count"] - 2
    status, text = request(server, "POST", "/detokenize", json.dumps({"tokens": answer["tokens"]}).encode())
    assert (status, text) == (200, {"prompt": "Hello world"})
    server.client.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    server.client.chat.completions.create(model=MODEL, messages=CHAT["messages"])
    status, exposition = request(server, "GET", "/metrics")
    assert status == 200
    for name in ("ds4_requests_total", "ds4_completion_tokens_total", "ds4_time_to_first_token_seconds_bucket",
                 "ds4_decode_tokens_per_second_bucket", "ds4_spec_acceptance_rate", "ds4_prefix_cache_hits_total"):
        assert name in exposition, name
    assert 'ds4_requests_total{path="/v1/chat/completions",status="200"}' in exposition
    assert request(server, "GET", "/health")[1]["status"] == "ok"


def timed_gets(server, path: str, busy, count: int = 5) -> list[float]:
    """Latencies of GET `path` sent while `busy()` holds (at least one)."""
    latencies = []
    while busy() or not latencies:
        start = time.monotonic()
        assert request(server, "GET", path)[0] == 200
        latencies.append(time.monotonic() - start)
        if len(latencies) >= count:
            break
        time.sleep(0.05)
    return latencies


def test_endpoints_answer_during_a_long_tokenize(engine):
    server, _, records = serve(engine)
    try:
        body = json.dumps({"model": MODEL, "prompt": "hello world, this is text " * 50_000}).encode()  # 1.3 MB
        out = {}
        thread = threading.Thread(target=lambda: out.update(r=request(server, "POST", "/v1/completions", body)))
        thread.start()
        time.sleep(0.3)  # the body is read and being tokenized
        latencies = timed_gets(server, "/v1/models", thread.is_alive)
        thread.join()
        assert out["r"][0] == 400 and out["r"][1]["error"]["code"] == "context_length_exceeded"
        assert max(latencies) < 1.0, latencies  # generous: the tokenizer runs in a thread, not on the loop
    finally:
        stop(server, records)


def test_health_answers_during_a_long_prefill(tiny_gguf):
    engine = ds4.load(tiny_gguf[0], backend="torch", ctx=2048, prefill_chunk=256)
    worker = Worker(engine)
    server = LiveServer(create_app(engine, worker=worker))
    try:
        ids = [random.Random(0).randrange(3, 500) for _ in range(2000)]
        prefilling = threading.Event()
        engine_session = engine.session

        def watched_session(*args, **kwargs):
            session = engine_session(*args, **kwargs)
            session.on_chunk = lambda n: prefilling.set()
            return session

        engine.session = watched_session
        thread = threading.Thread(target=lambda: server.client.completions.create(model=MODEL, prompt=ids,
                                                                                  max_tokens=1))
        thread.start()
        assert prefilling.wait(60)
        latencies = timed_gets(server, "/health", lambda: worker.current is not None)
        thread.join()
        assert max(latencies) < 1.0, latencies  # the prefill runs in the worker thread
        assert worker.finished[-1].prompt_tokens == 2000 and len(latencies) > 1
    finally:
        server.close()


def test_exposure_warning_hosts_and_flags(capsys):
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    assert "without --api-key" in exposure_warning("0.0.0.0", None)
    assert "without --api-key" in exposure_warning("192.168.1.5", None)
    config = GuardConfig(allowed_hosts=allowed_hosts("192.168.1.5", ["box.lan"]))
    assert all(config.host_allowed(h) for h in ("192.168.1.5:8000", "box.lan", "localhost:1", "[::1]:8000"))
    assert not any(config.host_allowed(h) for h in ("evil.example", "192.168.1.6:8000", ""))
    assert not GuardConfig(allowed_hosts=allowed_hosts("0.0.0.0", [])).host_allowed("0.0.0.0:8000")
    for argv, message in ((["--max-body-mb", "0"], "--max-body-mb must be in (0, 4096], got 0.0"),
                          (["--api-key", " "], "--api-key (DS4_API_KEY) is empty")):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
