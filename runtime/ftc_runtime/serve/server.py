"""`Server`: one engine behind the HTTP APIs: the limits it serves under (`ServerConfig`), prompt
checks, the conversation rendered into prompt ids, and the token stream of a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ftc_runtime.chat.template import ChatTemplateError
from ftc_runtime.chat.tool_parsers import prompt_opens_reasoning, tool_parser
from ftc_runtime.engine import Engine
from ftc_runtime.sampling import ReasoningBudget, SamplingParams, with_defaults
from ftc_runtime.serve.api_types import ApiError
from ftc_runtime.serve.metrics import RequestMetrics
from ftc_runtime.serve.scheduler import Scheduler
from ftc_runtime.serve.token_stream import TokenStream


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
    metrics_public: bool = False  # /metrics readable without an API key (a scraper on a trusted network)
    # The model names requests must give (the first is the one answers report); none: any name is
    # this engine (agent harnesses send their own model's name: gpt-4o, claude-...).
    served_model_names: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The model name answers report."""
        return self.served_model_names[0] if self.served_model_names else self.model_name

    @property
    def keys(self) -> tuple[str, ...]:
        return ((self.api_key,) if self.api_key is not None else ()) + self.api_keys


API_SAMPLING = {"temperature": 1.0}  # OpenAI's and Anthropic's default where neither request nor engine says


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
        self.metrics = RequestMetrics(engine)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        limit = min(self.config.max_prompt_tokens, self.context - 1)
        if len(ids) > limit:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this server takes at most {limit} "
                           f"(the model's context is {self.context})", param)

    def check_model(self, model: str) -> None:
        names = self.config.served_model_names
        if names and model not in names:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
                           "model", "not_found_error")

    def sampling(self, seed: int, **asked: float | int | ReasoningBudget | None) -> SamplingParams:
        """A request's sampling: what it asks, else the engine's defaults, else the APIs' (temperature 1)."""
        return with_defaults(API_SAMPLING | self.engine.manifest.sampling, seed, **asked)

    def reasoning_budget(self, tokens: int, param: str) -> ReasoningBudget:
        """A budget of `tokens` reasoning tokens, enforced on the model's `<think>` tags; a model
        whose tags are not single tokens cannot have one (400, naming `param`)."""
        tags = [self.engine.tokenizer.encode(tag) for tag in ("<think>", "</think>")]
        if any(len(ids) != 1 for ids in tags):
            raise ApiError(400, f"{param}: this model has no single-token <think> tags to end its reasoning at", param)
        return ReasoningBudget(tokens, tags[0][0], tags[1][0])

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
        """The conversation as prompt ids and the text the prompt ends with on the answer's behalf:
        `<think>` where the template opened the reasoning, and where a tool call is forced, the
        call's opening tag (the answer starts inside the call; an opened reasoning is closed first)."""
        ids = await self._render_ids(messages, tools, **options)
        opened = prompt_opens_reasoning(self.engine.tokenizer, ids)
        if not force_call:
            return ids, "<think>" if opened else ""
        opening = tool_parser(self.engine.tool_parser).open_tag + "\n"
        return ids + self.engine.tokenizer.encode(("</think>" if opened else "") + opening), opening

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


def server_of(request: Request) -> Server:
    return request.app.state.server
