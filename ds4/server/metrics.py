"""Prometheus metrics of one server (`GET /metrics`): requests, tokens, time to first token, decode speed,
speculative acceptance, prefix-cache hits. Each app has its own registry, so several apps can live in one
process (the tests run several)."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ds4.server.worker import Finished

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SPEED_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class Metrics:
    """The server's counters, fed by the request middleware and by the worker after each generation."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ds4_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.generations = Counter("ds4_generations", "Generations by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("ds4_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("ds4_cached_prompt_tokens", "Prompt tokens whose KV state was reused",
                                     registry=r)
        self.cache_hits = Counter("ds4_prefix_cache_hits", "Generations that reused a cached prefix", registry=r)
        self.completion_tokens = Counter("ds4_completion_tokens", "Generated tokens", registry=r)
        self.draft_tokens = Counter("ds4_spec_draft_tokens", "MTP draft tokens verified", registry=r)
        self.accepted_tokens = Counter("ds4_spec_accepted_tokens", "MTP draft tokens accepted", registry=r)
        self.acceptance = Gauge("ds4_spec_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self.first_token = Histogram("ds4_time_to_first_token_seconds", "Queueing + prefill + first token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.decode_speed = Histogram("ds4_decode_tokens_per_second", "Decode speed after the first token",
                                      buckets=SPEED_BUCKETS, registry=r)
        self.queued = Gauge("ds4_queued_requests", "Generations waiting or running", registry=r)
        self.drafted = self.accepted = 0

    def observe(self, done: Finished) -> None:
        """Count one finished generation (called from the worker thread)."""
        self.generations.labels(done.reason).inc()
        self.prompt_tokens.inc(done.prompt_tokens)
        self.completion_tokens.inc(done.completion_tokens)
        self.cached_tokens.inc(done.cached_tokens)
        if done.cached_tokens:
            self.cache_hits.inc()
        self.draft_tokens.inc(done.spec.num_draft_tokens)
        self.accepted_tokens.inc(done.spec.num_accepted_tokens)
        self.drafted += done.spec.num_draft_tokens
        self.accepted += done.spec.num_accepted_tokens
        self.acceptance.set(self.accepted / self.drafted if self.drafted else 0.0)
        if done.first_token_s is not None:
            self.first_token.observe(done.first_token_s)
        if done.completion_tokens > 1 and done.decode_s > 0:
            self.decode_speed.observe((done.completion_tokens - 1) / done.decode_s)

    def text(self) -> bytes:
        """The Prometheus exposition text."""
        return generate_latest(self.registry)


class Metered:
    """ASGI middleware counting every HTTP request by path (routes only; others as "other") and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: set[str]):
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
