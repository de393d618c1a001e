"""The HTTP server, the top of the tree: nothing imports it but its entry points (`python -m ds4.server`,
scripts/serve.py). app.py: the FastAPI app, its lifecycle and command line; openai_routes.py: the OpenAI
routes; schemas.py: request bodies and the error response; worker.py: the thread that owns the engine and
session; streaming.py: stop strings, server-sent events, usage. Anthropic routes, request guards (API key,
Host, body size), metrics and the disk prefix cache each get a module of their own here."""
