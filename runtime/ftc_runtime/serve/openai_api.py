"""OpenAI-compatible routes: `/v1/chat/completions` (streamed or not, with reasoning and tool
calls), `/v1/completions`, `/v1/models`. Requests are validated by their pydantic models; the
answers follow OpenAI's shapes, errors included (`app.ApiError`)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator, model_validator

from ftc_runtime.chat.template import TEMPLATE_NAMES
from ftc_runtime.chat.tool_parsers import parse_output, tool_parser
from ftc_runtime.sampling import MAX_REPETITION_PENALTY, PENALTY_RANGE, SEED_RANGE, SamplingParams
from ftc_runtime.serve.api_types import (
    MAX_TOKENS,
    ApiBody,
    ApiError,
    StrictJsonRoute,
    ToolName,
    namespace_of,
    unique_tool_names,
)
from ftc_runtime.serve.server import Server, raise_if_failed, server_of
from ftc_runtime.serve.token_stream import MAX_STOP_CHARS, TokenStream, message_parts, with_keepalive

router = APIRouter(route_class=StrictJsonRoute)


class TextPart(ApiBody):
    type: Literal["text"]
    text: str


class FunctionCallIn(ApiBody):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; an object is taken too


class ToolCallIn(ApiBody):
    id: str
    type: Literal["function"]
    function: FunctionCallIn


class Message(ApiBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> Message:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self


class FunctionDef(ApiBody):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionName(ApiBody):
    name: str


class Tool(ApiBody):
    type: Literal["function"]
    function: FunctionDef


# Request fields of OpenAI's API (and vLLM's extensions) that would change the answer and are not
# served: refused unless they ask for nothing (null or their neutral value), never silently ignored.
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},), "top_logprobs": (0,), "prompt_logprobs": (0,), "best_of": (1,), "echo": (False,),
    "suffix": ("",), "min_p": (0, 0.0), "min_tokens": (0,), "ignore_eos": (False,), "stop_token_ids": ([],),
    "typical_p": (1, 1.0), "length_penalty": (1, 1.0), "prediction": (), "logits_processors": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
}


class Sampling(ApiBody):
    model: str
    stream: bool = False
    # Left out: the engine's defaults (its checkpoint's generation_config.json), else the API's.
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOKENS)  # an extension (vLLM and others take it too); 0: no limit
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    # An extension, as in vLLM: Hugging Face's multiplicative penalty of prompt and answer tokens; 1: off.
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    stop: str | list[str] | None = None
    stream_options: dict[str, Any] | None = None
    # Asked for but not served: refused rather than ignored.
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    logprobs: bool | int | None = None  # chat's is a flag, completions' a count: either way refused
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("log probabilities are not served")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError(f"response_format type {v.get('type')!r}: only 'text' is served (no constrained decoding)")
        return v


class NamedToolChoice(ApiBody):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: the answer keeps its first tool call only
    # Variables for the chat template (vLLM's and SGLang's extension), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_names(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & TEMPLATE_NAMES)
        if taken:
            raise ValueError(f"{', '.join(taken)}: the server sets these template variables itself")
        return v

    @field_validator("tools")
    @classmethod
    def _unique(cls, v: list[Tool] | None) -> list[Tool] | None:
        unique_tool_names([t.function.name for t in v or []])
        return v


class CompletionRequest(Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    config = server_of(request).config
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ftc"}
                                       for name in config.served_model_names or (config.model_name,)]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request):
    server = server_of(request)
    server.check_model(body.model)
    tools, forced = _tool_choice(body)
    parser = tool_parser(server.engine.tool_parser)
    ids, opening = await server.prompt_ids([_template_message(m) for m in body.messages], tools or None, forced,
                                           **(body.chat_template_kwargs or {}))
    server.check_prompt(ids, "messages")
    limit = server.new_tokens(body.max_completion_tokens or body.max_tokens, len(ids))
    stream = server.stream(ids, limit, _sampling(server, body), _stops(body.stop), namespace_of(request), opening)
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.config.name}
    if body.stream:
        return _sse(server, _chat_chunks(stream, meta, tools, parser, _include_usage(body), body.parallel_tool_calls))
    text = await stream.text(request)
    raise_if_failed(stream, "server_error")
    out = parse_output(text, parser, tools)
    if not body.parallel_tool_calls:
        out = dataclasses.replace(out, tool_calls=out.tool_calls[:1])
    # A reply that is only tool calls has no content: null, as OpenAI sends it.
    message: dict[str, Any] = {"role": "assistant", "content": out.content or (None if out.tool_calls else "")}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [_call_out(c) for c in out.tool_calls]
    finish = "tool_calls" if out.tool_calls else stream.finish_reason
    return {**meta, "object": "chat.completion", "usage": _usage(stream),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = server_of(request)
    server.check_model(body.model)
    ids = body.prompt if isinstance(body.prompt, list) else await server.encode(body.prompt, "prompt")
    vocab = server.engine.spec.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
    server.check_prompt(ids, "prompt")
    stream = server.stream(ids, server.new_tokens(body.max_tokens, len(ids)), _sampling(server, body),
                         _stops(body.stop), namespace_of(request))
    meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.config.name,
            "object": "text_completion"}
    if body.stream:
        async def chunks():
            async for delta in stream.deltas():
                yield {**meta, "choices": [{"index": 0, "text": delta, "finish_reason": None, "logprobs": None}]}
            if stream.finish_reason == "error":
                yield _stream_error(stream)
                return
            yield {**meta, "choices": [{"index": 0, "text": "", "finish_reason": stream.finish_reason,
                                        "logprobs": None}]}
            if _include_usage(body):
                yield {**meta, "choices": [], "usage": _usage(stream)}
        return _sse(server, chunks())
    text = await stream.text(request)
    raise_if_failed(stream, "server_error")
    return {**meta, "usage": _usage(stream),
            "choices": [{"index": 0, "text": text, "finish_reason": stream.finish_reason, "logprobs": None}]}


async def _chat_chunks(stream: TokenStream, meta: dict, tools: list[dict], parser, include_usage: bool,
                       parallel_calls: bool):
    base = {**meta, "object": "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    yield chunk({"role": "assistant", "content": ""})
    n_calls = 0
    async for kind, value in message_parts(stream, parser, tools, one_call=not parallel_calls):
        if kind == "tool_call":
            yield chunk({"tool_calls": [{"index": n_calls, **_call_out(value)}]})
            n_calls += 1
        else:
            yield chunk({"reasoning_content" if kind == "reasoning" else "content": value})
    if stream.finish_reason == "error":
        yield _stream_error(stream)
        return
    finish = "tool_calls" if n_calls else stream.finish_reason
    yield chunk({}, finish)
    if include_usage:
        yield {**base, "choices": [], "usage": _usage(stream)}


def _sse(server: Server, chunks) -> StreamingResponse:
    async def body():
        async for c in chunks:
            yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    # An SSE comment line while the prompt is read: clients ignore it, their idle timers restart.
    lines = with_keepalive(body(), ": keep-alive\n\n", server.config.keepalive_s)
    return StreamingResponse(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _stream_error(stream: TokenStream) -> dict[str, Any]:
    """The error event of a stream whose request the engine failed (OpenAI sends errors as data)."""
    return {"error": {"message": stream.error, "type": "server_error", "param": None, "code": None}}


def _tool_choice(body: ChatRequest) -> tuple[list[dict[str, Any]], bool]:
    """The tools to offer and whether a call is forced: "none" offers none; "required" forces a
    call of one of them; a named function offers that one alone and forces its call."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice == "none":
        return [], False
    if choice in (None, "auto"):
        return tools, False
    if not tools:
        raise ApiError(400, "tool_choice forces a tool call, but the request offers no tools", "tool_choice")
    if choice == "required":
        return tools, True
    named = [t for t in tools if t["function"]["name"] == choice.function.name]
    if not named:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
    return named, True


def _template_message(m: Message) -> dict[str, Any]:
    """A message as chat templates expect it: text content, tool-call arguments as objects."""
    content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "id": c.id, "function": _function_in(c.function)}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _function_in(f: FunctionCallIn) -> dict[str, Any]:
    name, args = f.name, f.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ApiError(400, f"tool call {name}: arguments are not valid JSON ({e})", "messages") from None
    if not isinstance(args, dict):
        raise ApiError(400, f"tool call {name}: arguments must be a JSON object", "messages")
    return {"name": name, "arguments": args}


def _call_out(call) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def _sampling(server: Server, body: Sampling) -> SamplingParams:
    """Without a seed every request draws its own (the same seed repeats a sampled answer)."""
    for name, value in (body.model_extra or {}).items():
        if name in NOT_SERVED and value is not None and not any(value == v and type(value) is type(v)
                                                                 for v in NOT_SERVED[name]):
            raise ApiError(400, f"{name}: not served by this server (leave it out)", name)
    return server.sampling(body.seed if body.seed is not None else secrets.randbits(63), temperature=body.temperature,
                           top_p=body.top_p, top_k=body.top_k, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty)


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise ApiError(400, f"stop: {len(stops)} sequences; at most 4", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop: a sequence is longer than {MAX_STOP_CHARS} characters", "stop")
    return stops


def _include_usage(body: Sampling) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


def _usage(stream: TokenStream) -> dict[str, Any]:
    return {"prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens,
            "total_tokens": stream.prompt_tokens + stream.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stream.cached_tokens}}
