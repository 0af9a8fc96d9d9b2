"""The HTTP app: auth, errors in the API's own shape, health, metrics, and the generation stream
that every route reads (`TokenStream`). The routes are in `openai_api` and `anthropic_api`."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import AfterValidator
from starlette.exceptions import HTTPException

from ..engine import Engine
from ..sampling import SamplingParams
from ..tokenizer import StreamDecoder
from ..tool_parsers import ReasoningSplitter, ToolCallStream, ToolParser
from .scheduler import Request as EngineRequest
from .scheduler import Scheduler

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tool_name(name: str) -> str:
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r}: expected 1-64 letters, digits, '_' or '-'")
    return name


# A tool's name as both APIs constrain it, for their request models.
ToolName = Annotated[str, AfterValidator(_tool_name)]


class ApiError(Exception):
    """A 4xx answer: `status`, a message naming the field or value, the field (`param`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# Hosts a server bound to loopback answers by default: a page elsewhere that resolves its own name
# to 127.0.0.1 (DNS rebinding) sends its own name as Host, and is refused.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Seconds that in-flight requests get to end once the server is told to stop (SIGTERM, Ctrl-C).
SHUTDOWN_S = 3


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_batch: int = 16
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 8192
    max_body_bytes: int = 8 << 20  # a request body larger than this is refused before it is parsed
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted (None: any)


def default_allowed_hosts(bind: str) -> tuple[str, ...] | None:
    """Loopback names for a loopback bind (DNS-rebinding protection), else any host."""
    return LOOPBACK_HOSTS if bind in LOOPBACK_HOSTS or bind.startswith("127.") else None


def default_prefix_cache_bytes(engine: Engine) -> int:
    """The prefix cache's KV budget when serving: an eighth of the device budget on a GPU engine
    (the elastic split gives the rest to expert slots), else a quarter of the host memory left
    after loading, at most 8 GiB. The hybrid models' checkpoints get as much again, in host memory."""
    if engine.vram is not None:
        return engine.vram.budget // 8
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(available // 4, 8 << 30)


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serves until SIGTERM or Ctrl-C; in-flight requests get SHUTDOWN_S seconds, then fail."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  timeout_graceful_shutdown=SHUTDOWN_S)).run()


class TokenStream:
    """One request's text as the engine thread produces it: `deltas()` yields text pieces, then
    ends; `finish_reason` and `completion_tokens` are set by then. Stop strings end it early (the
    text is cut before them). Leaving the iteration early cancels the request."""

    def __init__(self, server: Server, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams,
                 stop: list[str]):
        self.server, self.stop = server, [s for s in stop if s]
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int | None, str | None]] = asyncio.Queue()
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended the text, if one did
        self.completion_tokens = 0
        self.prompt_tokens = len(prompt_ids)
        self.request = EngineRequest(prompt_ids, max_new_tokens, sampling, self._on_token,
                                     frozenset(server.engine.spec.eos_token_ids))
        server.scheduler.submit(self.request)

    def _on_token(self, token: int | None, reason: str | None) -> None:  # the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, reason))

    async def deltas(self) -> AsyncIterator[str]:
        decoder, eos = StreamDecoder(self.server.engine.tokenizer), self.request.stop_ids
        text, engine_done = "", False
        try:
            while True:
                token, reason = await self.queue.get()
                if token is None:
                    engine_done = True
                    self.finish_reason = "length" if reason == "length" else ("error" if reason == "error" else "stop")
                    delta = decoder.flush()
                else:
                    self.completion_tokens += 1
                    if token in eos:
                        continue
                    delta = decoder.push(token)
                hit = _first_stop(text + delta, self.stop)
                if hit is not None:
                    cut, self.stop_sequence = hit
                    if cut > len(text):
                        yield (text + delta)[len(text):cut]
                    self.finish_reason = "stop"
                    return
                text += delta
                if delta:
                    yield delta
                if token is None:
                    return
        finally:
            if not engine_done:  # a stop string, or the client gone: the engine drops the request
                self.request.cancel()

    async def text(self, http: Request | None = None) -> str:
        """The whole text; with `http`, a client that leaves first cancels the request (a streamed
        answer is cancelled by its response instead)."""
        watch = asyncio.create_task(self._watch(http)) if http is not None else None
        try:
            return "".join([d async for d in self.deltas()])
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch(self, http: Request) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.25)
        self.request.cancel()
        self.queue.put_nowait((None, "cancelled"))


async def message_parts(stream: TokenStream, parser: ToolParser,
                        tools: list[dict[str, Any]]) -> AsyncIterator[tuple[str, Any]]:
    """The answer as it streams: ("reasoning", text), ("content", text), and where tools were
    offered ("tool_call", ToolCall) as soon as each call's block closes."""
    reasoning = ReasoningSplitter()
    calls = ToolCallStream(parser, tools) if tools else None

    def route(pieces: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, text in pieces:
            out += [(kind, text)] if kind == "reasoning" or calls is None else calls.feed(text)
        return out

    async for delta in stream.deltas():
        for part in route(reasoning.feed(delta)):
            yield part
    for part in route(reasoning.flush()) + (calls.flush() if calls is not None else []):
        yield part


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(i, s) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    return min(found) if found else None


class Server:
    def __init__(self, engine: Engine, config: ServerConfig):
        for name in ("max_batch", "max_prompt_tokens", "max_new_tokens"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} = {getattr(config, name)}: expected at least 1")
        if engine.chat_template is None:
            raise ValueError(f"{engine.manifest.root}: the engine has no chat template (compile it again)")
        self.engine, self.config = engine, config
        self.scheduler: Scheduler | None = None

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        limit = self.config.max_prompt_tokens
        if len(ids) > limit:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this server takes at most {limit}", param)

    def check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                           "model", "not_found_error")

    def new_tokens(self, asked: int | None, default: int) -> int:
        n = default if asked is None else asked
        if n > self.config.max_new_tokens:
            raise ApiError(400, f"max_tokens = {n}: this server generates at most {self.config.max_new_tokens}",
                           "max_tokens")
        return n


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    from .anthropic_api import router as anthropic_router
    from .openai_api import router as openai_router

    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        server.scheduler = Scheduler(engine, config.max_batch)
        yield
        server.scheduler.close()

    app = FastAPI(title="ftc", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if config.api_key is not None and request.url.path != "/health" and not _authorized(request, config.api_key):
            return _error(request, 401, "missing or wrong API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                          None, "authentication_error")
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(request, e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return _error(request, 400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                          None)
        return _error(request, 400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", where)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return _error(request, e.status_code, str(e.detail), None,
                      "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.get("/health")
    async def health():
        s = server.scheduler
        return {"status": "ok", "running": len(s.running) if s else 0, "waiting": s.waiting.qsize() if s else 0}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_metrics(server), media_type="text/plain; version=0.0.4")

    app.include_router(openai_router)
    app.include_router(anthropic_router)
    return app


def _metrics(server: Server) -> str:
    """Prometheus text: the scheduler's counts and, where the engine offloads, its expert cache."""
    s = server.scheduler
    rows = [("ftc_requests_total", "counter", "requests admitted", s.requests),
            ("ftc_requests_running", "gauge", "requests decoding now", len(s.running)),
            ("ftc_requests_waiting", "gauge", "requests queued", s.waiting.qsize()),
            ("ftc_time_to_first_token_seconds_sum", "counter", "queue + prefill time to first tokens", s.ttft_s),
            ("ftc_time_to_first_token_seconds_count", "counter", "first tokens", s.first_tokens),
            ("ftc_prefill_tokens_total", "counter", "prompt tokens run", s.prefill_tokens),
            ("ftc_prefill_seconds_total", "counter", "time in prompts (prefill tok/s: their ratio)", s.prefill_s),
            ("ftc_decode_steps_total", "counter", "decode steps run", s.decode_steps),
            ("ftc_decode_tokens_total", "counter", "tokens those steps made (several per step when batched)",
             s.decode_tokens),
            ("ftc_decode_seconds_total", "counter", "time in decode steps (decode tok/s: tokens over it)",
             s.decode_s)]
    stats = getattr(server.engine.model.experts, "stats", None)
    if stats is not None:
        d = stats.to_dict()
        rows += [("ftc_expert_hits_total", "counter", "routed experts found in the GPU cache", d["hits"]),
                 ("ftc_expert_fills_total", "counter", "misses copied into the GPU cache", d["fills"]),
                 ("ftc_expert_cpu_total", "counter", "misses computed on the CPU", d["cpu"])]
    prefix = server.engine.prefix_cache
    if prefix is not None:
        p = prefix.stats
        rows += [("ftc_prefix_lookups_total", "counter", "prompts looked up in the prefix cache", p.lookups),
                 ("ftc_prefix_hits_total", "counter", "prompts that resumed after a cached prefix", p.hits),
                 ("ftc_prefix_reused_tokens_total", "counter", "prompt tokens restored, not prefilled",
                  p.reused_tokens),
                 ("ftc_prefix_kv_bytes", "gauge", "keys and values the prefix cache holds", prefix.kv_used),
                 ("ftc_prefix_checkpoints", "gauge", "recurrent-state checkpoints held", prefix.checkpoints),
                 ("ftc_prefix_checkpoint_bytes", "gauge", "bytes of those checkpoints", prefix.checkpoint_used),
                 ("ftc_prefix_kv_evictions_total", "counter", "cached sequence pieces evicted", p.kv_evictions),
                 ("ftc_prefix_checkpoint_evictions_total", "counter", "checkpoints evicted",
                  p.checkpoint_evictions)]
    if server.engine.vram is not None:
        rows += [(f"ftc_vram_{k}_bytes", "gauge", f"VRAM plan: {k}", getattr(server.engine.vram, k))
                 for k in ("dense", "kv", "workspace", "slots")]
    elastic = server.engine.elastic
    if elastic is not None and elastic.history:
        now = elastic.history[-1]
        rows += [("ftc_vram_budget_now_bytes", "gauge", "the budget as other processes leave it", now["budget"]),
                 ("ftc_vram_kv_now_bytes", "gauge", "KV caches and prefix cache at the last safe point", now["kv"]),
                 ("ftc_vram_slots_now_bytes", "gauge", "expert slots now", now["slots"]),
                 ("ftc_vram_slot_changes_total", "counter", "expert slot cache rebuilds", len(elastic.changes))]
    return "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in rows)


def server_of(request: Request) -> Server:
    return request.app.state.server


def _authorized(request: Request, key: str) -> bool:
    given = request.headers.get("x-api-key") or ""
    bearer = request.headers.get("authorization", "")
    if bearer.lower().startswith("bearer "):
        given = given or bearer[7:].strip()
    return hmac.compare_digest(given.encode(), key.encode())


def _error(request: Request, status: int, message: str, param: str | None,
           kind: str = "invalid_request_error") -> JSONResponse:
    """The error in the shape of the API that the path belongs to (Anthropic's for /v1/messages)."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)
