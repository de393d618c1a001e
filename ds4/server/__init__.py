"""The HTTP server, the top of the tree: nothing imports it but its entry points (`python -m ds4.server`,
scripts/serve.py). app.py: the FastAPI app, its lifecycle and command line; openai_routes.py: the OpenAI
routes; anthropic_routes.py: /v1/messages; ops_routes.py: /health, /metrics, /tokenize, /detokenize;
schemas.py: request bodies and the error response; guards.py: API key, Host, JSON-only bodies, body size;
metrics.py: Prometheus counters; worker.py: the thread that owns the engine and session; streaming.py: stop
strings, server-sent events, usage, logprobs."""
