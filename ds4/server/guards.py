"""Request guards: the API key, the Host header, JSON-only bodies, the body-size limit, nesting and surrogates.

`Guard` is an ASGI middleware run before any route; `json_body` reads and checks a POST body off the event
loop (a multi-megabyte body is parsed in a worker thread, so other requests keep being answered).
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from dataclasses import dataclass, field

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ds4.server.schemas import ApiError

MAX_DEPTH = 64  # deepest nesting of arrays and objects a body may have
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
log = logging.getLogger("ds4.server")


@dataclass
class GuardConfig:
    """What the guards check: the key (None: no key), the hosts allowed in `Host`, the body-size limit."""

    api_key: str | None = None
    allowed_hosts: list[str] = field(default_factory=lambda: list(LOOPBACK_NAMES))
    max_body_bytes: int = 8 * 2**20

    def host_allowed(self, host: str) -> bool:
        """Whether a `Host` header (with or without a port) names this server."""
        if host.startswith("["):
            name = host[:host.find("]") + 1]
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return "*" in self.allowed_hosts or name.lower() in self.allowed_hosts


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server reachable from the network with no API key, if it is one."""
    if is_loopback(host) or api_key is not None:
        return None
    return f"warning: serving on {host} without --api-key: anyone who can reach this port can use the model"


def allowed_hosts(bind: str, extra: list[str]) -> list[str]:
    """The Host names a server bound to `bind` answers: loopback names, the bound address, and `extra`."""
    names = [*LOOPBACK_NAMES, *([] if bind in ("0.0.0.0", "::") else [bind])]
    return [n.lower() for n in [*names, *extra]]


class Guard:
    """Refuses, before any route runs: a wrong or missing API key (401), a `Host` this server is not (421),
    a POST body that is not `application/json` (415)."""

    def __init__(self, app: ASGIApp, config: GuardConfig):
        self.app, self.config = app, config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        error = self.check(scope, headers)
        if error:
            return await error.response(anthropic=scope["path"].startswith("/v1/messages"))(scope, receive, send)
        await self.app(scope, receive, send)

    def check(self, scope: Scope, headers: Headers) -> ApiError | None:
        """The error to answer instead of running the route, if any."""
        if not self.config.host_allowed(headers.get("host", "")):
            return ApiError(421, f"the Host header {headers.get('host', '')!r} is not this server "
                                 "(DNS rebinding guard; allow it with --allowed-host)", code="misdirected_request")
        if self.config.api_key is not None:
            bearer = headers.get("authorization", "")
            given = bearer[len("Bearer "):] if bearer.startswith("Bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), self.config.api_key.encode()):
                return ApiError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key)",
                                code="invalid_api_key")
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] == "POST" and kind != "application/json":
            return ApiError(415, f"request bodies must be JSON (Content-Type: application/json), got {kind!r}",
                            code="unsupported_media_type")
        return None


def check_tree(data: dict) -> None:
    """ApiError for nesting deeper than MAX_DEPTH or a string with a lone surrogate (walked iteratively)."""
    stack = [(value, 2, key, key) for key, value in data.items()] + [(key, 1, key, None) for key in data]
    while stack:
        value, depth, where, field_name = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"{where or 'a key'}: a lone surrogate at character {e.start} is not valid "
                                    "Unicode", param=field_name) from None
        elif isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise ApiError(400, f"{where}: JSON nested deeper than {MAX_DEPTH} levels", param=field_name)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                inner = f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]"
                stack.append((item, depth + 1, inner, field_name))
                if isinstance(value, dict):
                    stack.append((key, depth, f"{where} (a key)", field_name))


def decode(raw: bytes) -> dict:
    """A body's JSON object, checked by check_tree."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is JSON nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_tree(data)
    return data


async def json_body(request: Request) -> dict:
    """The request's JSON object: at most `max_body_bytes` (413 beyond), parsed and checked in a thread."""
    limit = request.app.state.guards.max_body_bytes
    too_big = ApiError(413, f"the request body is larger than {limit / 2**20:g} MB (--max-body-mb)",
                       code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return await run_in_threadpool(decode, b"".join(chunks))
