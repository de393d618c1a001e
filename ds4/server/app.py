"""The server's app and its lifecycle: `python -m ds4.server` (docs/server.md).

The app serves one engine through one worker thread (ds4/server/worker.py); the routes live beside it
(openai_routes.py, ops_routes.py), request bodies in schemas.py, streaming in streaming.py, the request
guards in guards.py and the Prometheus metrics in metrics.py. Under torchrun with `--parallel`, rank 0 serves
and every other rank follows its jobs (ranks.py, docs/distributed.md).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from backends.cpu import kernels
from backends.registry import PARALLEL
from ds4 import distributed, weights
from ds4.engine import Engine, load
from ds4.errors import Ds4Error, UsageError
from ds4.server.anthropic_routes import ANTHROPIC_PREFIX, anthropic_router
from ds4.server.guards import Guard, GuardConfig, allowed_hosts, exposure_warning
from ds4.server.metrics import Metered, Metrics
from ds4.server.openai_routes import openai_router
from ds4.server.ops_routes import ops_router
from ds4.server.prefix_cache import PrefixCache
from ds4.server.ranks import Link
from ds4.server.schemas import ApiError
from ds4.server.worker import Worker
from ds4.speculative import MAX_DRAFT

DEFAULT_MODEL_NAME = "deepseek-v4-flash"
log = logging.getLogger("ds4.server")


class LogOnce:
    """ASGI middleware: an exception no handler took is logged once (with its traceback) and answered 500
    (when no response has started), instead of being re-raised for the server to log a second time."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            log.exception("%s %s failed", scope.get("method", ""), scope.get("path", ""))
            if scope["type"] == "http" and not started:
                await ApiError(500, f"internal error ({type(e).__name__})").response()(scope, receive, send)


def create_app(engine: Engine, model_name: str = DEFAULT_MODEL_NAME, worker: Worker | None = None,
               guards: GuardConfig | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name` (the worker stops with the app)."""
    worker = worker or Worker(engine)
    metrics = Metrics()
    worker.on_finished = metrics.observe
    metrics.queued.set_function(lambda: worker.jobs.qsize() + (worker.current is not None))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.close()

    app = FastAPI(title="ds4py", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.guards = worker, metrics, guards or GuardConfig()

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response(anthropic=request.url.path.startswith(ANTHROPIC_PREFIX))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        error = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        return error.response(anthropic=request.url.path.startswith(ANTHROPIC_PREFIX))

    routers = [openai_router(engine, worker, model_name), anthropic_router(engine, worker, model_name),
               ops_router(engine, worker, metrics, model_name)]
    for router in routers:
        app.include_router(router)
    app.add_middleware(LogOnce)
    app.add_middleware(Guard, config=app.state.guards)
    app.add_middleware(Metered, metrics=metrics, paths={r.path for router in routers for r in router.routes})
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m ds4.server",
                                description="Serve DeepSeek V4 Flash over an OpenAI-compatible HTTP API.")
    p.add_argument("--model", help="base GGUF (default: the embedded tiny model, trained on Python code)")
    p.add_argument("--mtp", help="MTP GGUF for speculative decoding (default model: its own tiny MTP)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME, help=f"model id (default {DEFAULT_MODEL_NAME})")
    p.add_argument("--ctx", type=int, default=4096, help="context length in tokens (default 4096)")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    p.add_argument("--backend", default="auto", help="auto | torch | triton | mlx")
    p.add_argument("--mtp-draft", choices=["auto", *map(str, range(MAX_DRAFT + 1))],
                   help="speculative draft depth (0 = off) or 'auto' (default 1 with an MTP head)")
    p.add_argument("--threads", type=int, help="CPU threads of the kernels (torch's own ops run on one; "
                                                          "default: 1 for the tiny model)")
    p.add_argument("--cpu-dot", choices=("exact", "q8"), default="exact",
                   help="cpu backend's quantized products: exact float (default) or q8, activations rounded to 8 bits "
                        "per block as llama.cpp does (faster on 2-bit types, other numbers)")
    p.add_argument("--weights", choices=weights.CHOICES, default="auto", help=weights.HELP)
    p.add_argument("--api-key", default=os.environ.get("DS4_API_KEY"),
                   help="require this key on every request (Authorization: Bearer KEY); default $DS4_API_KEY")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also accept this Host header (repeatable; '*' accepts any; default: loopback names and "
                        "the bound address)")
    p.add_argument("--max-body-mb", type=float, default=8.0, help="largest request body in MB (default 8)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="compiled decode/verify steps (CPU; about a minute per row count on first use, then "
                        "faster steps for the server's lifetime; docs/cpu.md)")
    p.add_argument("--cuda-graphs", action="store_true", help="decode/verify steps as CUDA graphs (CUDA only)")
    p.add_argument("--parallel", choices=PARALLEL,
                   help="split the model over the ranks torchrun starts; rank 0 serves, the others follow "
                        "(torchrun --nproc-per-node N -m ds4.server ... --parallel ep; docs/distributed.md)")
    p.add_argument("--kv-disk-dir", metavar="DIR",
                   help="keep session files of long prompts in DIR so later requests and later server processes "
                        "skip prefilling them (docs/server.md)")
    p.add_argument("--kv-disk-space-mb", metavar="N", type=float, default=4096,
                   help="space limit of --kv-disk-dir in MiB (default 4096); least useful entries go first")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Load the model and serve until Ctrl-C; bad options print one `error:` line and exit 2."""
    a = parse_args(argv)
    try:
        if not 0 <= a.port < 65536:
            raise UsageError(f"--port must be in 0..65535 (0: any free port), got {a.port}")
        if a.threads is not None and a.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {a.threads}")
        if not 0 < a.max_body_mb <= 4096:
            raise UsageError(f"--max-body-mb must be in (0, 4096], got {a.max_body_mb}")
        if a.api_key is not None and not a.api_key.strip():
            raise UsageError("--api-key (DS4_API_KEY) is empty")
        guards = GuardConfig(a.api_key, allowed_hosts(a.host, a.allowed_host), int(a.max_body_mb * 2**20))
        if a.threads or a.model is None:
            kernels.set_threads(a.threads or 1)     # the kernel pool; torch's own ops on one thread
        if a.parallel and a.kv_disk_dir:
            raise UsageError("--kv-disk-dir does not run across ranks yet: drop it with --parallel")
        engine = load(a.model, a.mtp, a.backend, ctx=a.ctx, prefill_chunk=a.prefill_chunk, compile=a.compile,
                      cuda_graphs=a.cuda_graphs, cpu_dot=a.cpu_dot, parallel=a.parallel, weights=a.weights)
        draft = int(a.mtp_draft) if a.mtp_draft not in (None, "auto") else a.mtp_draft
        cache = PrefixCache(engine, a.kv_disk_dir, a.kv_disk_space_mb) if a.kv_disk_dir else None
        worker = Worker(engine, draft, cache, Link(engine.world) if engine.world else None)
        if engine.world and not engine.world.is_main:
            return follow(worker)
        app = create_app(engine, a.served_model_name, worker, guards)
    except Ds4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    warning = exposure_warning(a.host, a.api_key)
    if warning:
        print(warning, file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    if a.parallel:
        distributed.stop()
    return 0


def follow(worker: Worker) -> int:
    """A rank other than 0: run rank 0's jobs until it shuts down (0), or until it stops answering (1)."""
    try:
        worker.follow()
    except Ds4Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C under torchrun reaches every rank
        return 0
    distributed.stop()
    return 0

