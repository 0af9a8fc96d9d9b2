"""The HTTP app: the request guard, errors in the API's own shape, health, metrics, shutdown,
and what both APIs share: the server's limits and a conversation turned into prompt ids off the
event loop. The routes are in `openai_api` and `anthropic_api`; the generation stream that they
read is `token_stream.TokenStream`."""

from __future__ import annotations

import json
import os
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from ftc_runtime.chat.template import ChatTemplateError
from ftc_runtime.chat.tool_parsers import tool_parser
from ftc_runtime.engine import Engine
from ftc_runtime.sampling import SamplingParams
from ftc_runtime.serve.guard import NAMESPACE, RequestGuard, error_body
from ftc_runtime.serve.scheduler import Scheduler
from ftc_runtime.serve.token_stream import TokenStream

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tool_name(name: str) -> str:
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r}: expected 1-64 letters, digits, '_' or '-'")
    return name


# A tool's name as both APIs constrain it, for their request models.
ToolName = Annotated[str, AfterValidator(_tool_name)]
MAX_TOKENS = 2**31 - 1  # the largest max_tokens taken (and clamped to the server's limit)


class ApiBody(BaseModel):
    """A request body's part in both APIs: fields this server does not use are accepted; values are
    not converted (a string is not a number, true is not 1)."""

    model_config = ConfigDict(extra="allow", strict=True)


def unique_tool_names(names: list[str]) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"tool {name!r} is defined twice")
        seen.add(name)


class StrictJsonRoute(APIRoute):
    """A route whose JSON body must be UTF-8 (json.loads guesses UTF-16 and -32 from bytes) and
    hold only valid Unicode: JSON can spell a lone surrogate (\\ud800), which no tokenizer takes."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()
            if body:
                try:
                    text = body.decode("utf-8")
                    parsed = json.loads(text)
                    json.dumps(parsed, ensure_ascii=False).encode("utf-8")
                except UnicodeError as e:
                    return _error(request, 400, f"the body is not valid UTF-8 text: {e.reason}", None)
                except (ValueError, RecursionError):
                    return await handler(request)  # not JSON: the route's own parser says why
                request._json = parsed  # Starlette's cache of the parsed body: parsed once
            return await handler(request)

        return checked


class ApiError(Exception):
    """An error answer (4xx for the request, 500 where the engine failed on it): `status`, a
    message naming the field or value, the field (`param`), the API's error type (`kind`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


# Hosts a server bound to loopback answers by default: a page elsewhere that resolves its own name
# to 127.0.0.1 (DNS rebinding) sends its own name as Host, and is refused.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Seconds that open connections get to close once the server is told to stop (SIGTERM, Ctrl-C).
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
    api_keys: tuple[str, ...] = ()  # more keys besides api_key; each its own prefix-cache namespace
    keepalive_s: float = 5.0  # a stream with nothing to send sends a keep-alive line this often

    @property
    def keys(self) -> tuple[str, ...]:
        return ((self.api_key,) if self.api_key is not None else ()) + self.api_keys


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
    """Serves until SIGTERM or Ctrl-C: the engine stops at once, in-flight requests end with an
    error, and their connections get SHUTDOWN_S seconds to close."""
    import uvicorn

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # The engine stops first, within a layer: in-flight requests end with an error their
            # clients can read, before uvicorn waits for their connections.
            scheduler = app.state.server.scheduler
            if scheduler is not None:
                scheduler.stop()
            super().handle_exit(sig, frame)

    StoppingServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  timeout_graceful_shutdown=SHUTDOWN_S)).run()


class Server:
    def __init__(self, engine: Engine, config: ServerConfig):
        for name in ("max_batch", "max_prompt_tokens", "max_new_tokens", "max_body_bytes"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} = {getattr(config, name)}: expected at least 1")
        if any(not k for k in config.keys):
            raise ValueError("the API key is empty: give a non-empty key, or none to serve without one")
        if engine.chat_template is None:
            raise ValueError(f"{engine.manifest.root}: the engine has no chat template (compile it again)")
        self.engine, self.config = engine, config
        self.context = engine.spec.max_position_embeddings
        self.scheduler: Scheduler | None = None

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        limit = min(self.config.max_prompt_tokens, self.context - 1)
        if len(ids) > limit:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this server takes at most {limit} "
                           f"(the model's context is {self.context})", param)

    def check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.config.model_name!r}",
                           "model", "not_found_error")

    def new_tokens(self, asked: int | None, prompt_tokens: int) -> int:
        """Tokens to generate at most: what the request asks (default: the server's limit), within
        the server's limit and what the model's context leaves after the prompt."""
        limit = min(self.config.max_new_tokens, self.context - prompt_tokens)
        return limit if asked is None else min(asked, limit)

    def stream(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, stop: list[str],
               namespace: str = "", opening: str = "") -> TokenStream:
        """Submits the request; its text arrives through the stream (see `TokenStream`)."""
        return TokenStream(self.engine, self.scheduler, prompt_ids, max_new_tokens, sampling, stop, namespace,
                           opening)

    async def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         force_call: bool = False, **options: Any) -> tuple[list[int], str]:
        """The conversation as prompt ids and, where a tool call is forced, the call's opening tag,
        which the prompt then ends with (the answer starts inside the call)."""
        ids = await self._render_ids(messages, tools, **options)
        if not force_call:
            return ids, ""
        opening = tool_parser(self.engine.tool_parser).open_tag + "\n"
        return ids + self.engine.tokenizer.encode(opening), opening

    async def _render_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          **options: Any) -> list[int]:
        """Rendered and tokenized on a worker thread (a long prompt takes a while): client text
        stays text (special-token strings in it are not control tokens); text that is not valid
        Unicode is a 400."""
        template, tokenizer = self.engine.chat_template, self.engine.tokenizer
        try:
            return await run_in_threadpool(template.render_ids, tokenizer, messages, tools, **options)
        except ChatTemplateError as e:
            if not _later_system_turns(messages):
                raise ApiError(400, str(e), "messages") from None
        # A checkpoint's template that takes a system turn only first: later ones join the first.
        try:
            return await run_in_threadpool(template.render_ids, tokenizer, _hoist_system(messages), tools, **options)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None

    async def encode(self, text: str, param: str) -> list[int]:
        """A raw prompt's ids (its special-token strings are control tokens: the client writes the
        whole prompt), tokenized on a worker thread."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{param}: invalid text (lone surrogate U+{ord(text[e.start]):04X} at character "
                           f"{e.start})", param) from None
        return await run_in_threadpool(self.engine.tokenizer.encode, text)


def raise_if_failed(stream: TokenStream, kind: str) -> None:
    """A non-streamed answer whose request the engine failed: a 500 in the API's shape."""
    if stream.finish_reason == "error":
        raise ApiError(500, f"the engine failed on this request: {stream.error}", None, kind)


def _later_system_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "system" for m in messages[1:])


def _hoist_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system = [m["content"] for m in messages if m.get("role") == "system"]
    rest = [m for m in messages if m.get("role") != "system"]
    return [{"role": "system", "content": "\n\n".join(system)}] + rest


def namespace_of(request: Request) -> str:
    """The prefix-cache namespace of the key that authorized the request ("" without keys)."""
    return request.scope.get(NAMESPACE, "")


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    from ftc_runtime.serve.anthropic_api import router as anthropic_router
    from ftc_runtime.serve.openai_api import router as openai_router

    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        server.scheduler = Scheduler(engine, config.max_batch)
        yield
        server.scheduler.close()

    app = FastAPI(title="ftc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(RequestGuard, api_keys=config.keys, allowed_hosts=config.allowed_hosts,
                       max_body_bytes=config.max_body_bytes)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return _error(request, e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        return _invalid(request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return _error(request, e.status_code, str(e.detail), None,
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
        return PlainTextResponse(_metrics(server), media_type="text/plain; version=0.0.4")

    app.include_router(openai_router)
    app.include_router(anthropic_router)
    return app


def _invalid(request: Request, e: RequestValidationError) -> Response:
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        return _error(request, 400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                      None)
    return _error(request, 400, f"{where or 'body'}: {first.get('msg', 'invalid value')}", where)


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


def _error(request: Request, status: int, message: str, param: str | None,
           kind: str = "invalid_request_error") -> Response:
    status, body = error_body(request.url.path, status, message, param, kind)
    return Response(body, status_code=status, media_type="application/json")
