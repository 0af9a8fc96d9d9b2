"""The HTTP app: the request guard, errors in the API's own shape, health, metrics and shutdown.
The routes are in `openai_api` and `anthropic_api`, the engine behind them in `server.Server`, and
the generation stream they read is `token_stream.TokenStream`."""

from __future__ import annotations

import errno
import socket
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ftc_runtime.engine import Engine
from ftc_runtime.serve.anthropic_api import router as anthropic_router
from ftc_runtime.serve.api_types import ApiError, error_response
from ftc_runtime.serve.guard import OPEN_PATHS, RequestGuard
from ftc_runtime.serve.openai_api import router as openai_router
from ftc_runtime.serve.scheduler import Scheduler
from ftc_runtime.serve.server import Server, ServerConfig

__all__ = ["ServerConfig", "bind", "create_app", "default_allowed_hosts", "run_server"]

# Hosts a server bound to loopback answers by default: a page elsewhere that resolves its own name
# to 127.0.0.1 (DNS rebinding) sends its own name as Host, and is refused.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Seconds that open connections get to close once the server is told to stop (SIGTERM, Ctrl-C).
SHUTDOWN_S = 3


def default_allowed_hosts(bind: str) -> tuple[str, ...] | None:
    """Loopback names for a loopback bind (DNS-rebinding protection), else any host."""
    return LOOPBACK_HOSTS if bind in LOOPBACK_HOSTS or bind.startswith("127.") else None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the engine loads: a port in use is an error at once, not
    after minutes of loading."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = "in use by another program: give another --port" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"{host}:{port}: {why}") from None
    return sock


def run_server(app: FastAPI, sock: socket.socket) -> None:
    """Serves on `sock` (from `bind`) until SIGTERM or Ctrl-C: the engine stops at once, in-flight
    requests end with an error, and their connections get SHUTDOWN_S seconds to close."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # The engine stops first, within a layer: in-flight requests end with an error their
            # clients can read, before uvicorn waits for their connections.
            scheduler = app.state.server.scheduler
            if scheduler is not None:
                scheduler.stop()
            super().handle_exit(sig, frame)

    host, port = sock.getsockname()[:2]
    StoppingServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  timeout_graceful_shutdown=SHUTDOWN_S)).run(sockets=[sock])


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        server.scheduler = server.metrics.scheduler = Scheduler(engine, config.max_batch, server.metrics)
        yield
        server.scheduler.close()

    app = FastAPI(title="ftc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(RequestGuard, api_keys=config.keys, allowed_hosts=config.allowed_hosts,
                       max_body_bytes=config.max_body_bytes,
                       open_paths=OPEN_PATHS + (("/metrics",) if config.metrics_public else ()))

    @app.exception_handler(ApiError)
    async def apierror_response(request: Request, e: ApiError):
        return error_response(request, e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return _invalid(request, e)

    @app.exception_handler(HTTPException)
    async def httperror_response(request: Request, e: HTTPException):
        return error_response(request, e.status_code, str(e.detail), None,
                      "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health():
        s = server.scheduler
        if s is None or not s.alive:
            return JSONResponse({"status": "the engine thread has stopped"}, status_code=503)
        return {"status": "ok", "running": len(s.running), "waiting": s.waiting.qsize()}

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router)
    app.include_router(anthropic_router)
    return app


def _invalid(request: Request, e: RequestValidationError) -> Response:
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return error_response(request, 400, f"the body is not valid JSON: {detail}".strip(), None)
    return error_response(request, 400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", where)


