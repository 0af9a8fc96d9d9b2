"""Anthropic-compatible routes: `/v1/messages` (streamed as Anthropic's server-sent events, or
not) with thinking and tool use, and `/v1/messages/count_tokens`. Content blocks map onto the chat
template's messages: text, thinking (reasoning), tool_use (tool calls), tool_result (tool turns)."""

from __future__ import annotations

import dataclasses
import json
import secrets
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, field_validator, model_validator

from ftc_runtime.chat.tool_parsers import AssistantOutput, parse_output, tool_parser
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
from ftc_runtime.serve.token_stream import MAX_STOP_CHARS, MAX_STOPS, TokenStream, message_parts, with_keepalive

router = APIRouter(route_class=StrictJsonRoute)


# The fields each kind of content block must have, and the turns it may stand in.
_BLOCK_FIELDS = {"text": ("text",), "thinking": ("thinking",), "redacted_thinking": (),
                 "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
_BLOCK_ROLES = {"tool_use": ("assistant",), "tool_result": ("user",), "thinking": ("assistant",),
                "redacted_thinking": ("assistant",)}


class Block(ApiBody):
    type: Literal["text", "thinking", "redacted_thinking", "tool_use", "tool_result"]
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _complete(self) -> Block:
        missing = [f for f in _BLOCK_FIELDS[self.type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} block needs {', '.join(missing)}")
        for part in self.content if isinstance(self.content, list) else []:
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError("a text part of a tool_result needs its text")
        return self


class Message(ApiBody):
    role: Literal["user", "assistant", "system"]  # a system turn mid-conversation, as agent harnesses send
    content: str | list[Block]

    @model_validator(mode="after")
    def _placed(self) -> Message:
        for b in self.content if isinstance(self.content, list) else []:
            allowed = _BLOCK_ROLES.get(b.type, ("user", "assistant", "system"))
            if self.role not in allowed:
                raise ValueError(f"a {b.type} block cannot stand in a {self.role} turn")
        return self


class ToolDef(ApiBody):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(ApiBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(ApiBody):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)


class CountRequest(ApiBody):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("system")
    @classmethod
    def _text_only(cls, v: str | list[Block] | None) -> str | list[Block] | None:
        if isinstance(v, list) and any(b.type != "text" for b in v):
            raise ValueError("the system prompt takes text blocks only")
        return v

    @field_validator("tools")
    @classmethod
    def _unique(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        unique_tool_names([t.name for t in v or []])
        return v


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # left out: the engine's defaults, else the API's
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOKENS)
    stop_sequences: list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]] | None = Field(None, max_length=MAX_STOPS)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountRequest, request: Request) -> dict:
    server = server_of(request)
    ids, _ = await _prompt_ids(server, body)
    server.check_prompt(ids, "messages")  # the limits of /v1/messages: no count of what it would refuse
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    server = server_of(request)
    ids, opening = await _prompt_ids(server, body)
    server.check_prompt(ids, "messages")
    limit = server.new_tokens(body.max_tokens, len(ids))
    thinking = body.thinking
    budget = server.reasoning_budget(thinking.budget_tokens, "thinking.budget_tokens") \
        if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is not None else None
    sampling = server.sampling(secrets.randbits(63), temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                               reasoning_budget=budget)
    stream = server.stream(ids, limit, sampling, list(body.stop_sequences or []), namespace_of(request),
                         opening)
    tools = _tools(body)
    msg_id, parser = f"msg_{uuid.uuid4().hex}", tool_parser(server.engine.tool_parser)
    if body.stream:
        ping = 'event: ping\ndata: {"type": "ping"}\n\n'
        events = with_keepalive(_events(stream, msg_id, server.config.name, tools, parser, _one_call(body)), ping,
                                server.config.keepalive_s)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text = await stream.text(request)
    raise_if_failed(stream, "api_error")
    out = parse_output(text, parser, tools)
    if _one_call(body):
        out = dataclasses.replace(out, tool_calls=out.tool_calls[:1])
    return {"id": msg_id, "type": "message", "role": "assistant", "model": server.config.name,
            "content": _blocks(out), "stop_reason": _stop_reason(stream, out), "stop_sequence": stream.stop_sequence,
            "usage": _usage(stream)}


def _usage(stream: TokenStream) -> dict[str, int]:
    """Anthropic's count: input_tokens are the prompt tokens not read from the (prefix) cache."""
    return {"input_tokens": stream.prompt_tokens - stream.cached_tokens, "output_tokens": stream.completion_tokens,
            "cache_read_input_tokens": stream.cached_tokens}


def _one_call(body: CountRequest) -> bool:
    """tool_choice's disable_parallel_tool_use: the answer keeps its first tool_use block only."""
    return body.tool_choice is not None and bool(body.tool_choice.disable_parallel_tool_use)


async def _events(stream: TokenStream, msg_id: str, model: str, tools: list[dict], parser, one_call: bool):
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    yield event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": 0}}})
    yield event("ping", {})
    index, open_kind, n_calls = -1, None, 0
    async for kind, value in message_parts(stream, parser, tools, one_call):
        block = {"reasoning": "thinking", "content": "text", "tool_call": "tool_use"}[kind]
        if block != open_kind and open_kind is not None:
            yield event("content_block_stop", {"index": index})
            open_kind = None
        if block == "tool_use":  # whole: known once its block closed
            index, n_calls = index + 1, n_calls + 1
            use = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": value.name, "input": {}}
            yield event("content_block_start", {"index": index, "content_block": use})
            yield event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(value.arguments, ensure_ascii=False)}})
            yield event("content_block_stop", {"index": index})
            continue
        if open_kind is None:
            index, open_kind = index + 1, block
            yield event("content_block_start", {"index": index, "content_block": {"type": block, block: ""}})
        delta = {"type": "thinking_delta", "thinking": value} if block == "thinking" else \
            {"type": "text_delta", "text": value}
        yield event("content_block_delta", {"index": index, "delta": delta})
    if stream.finish_reason == "error":  # Anthropic's error event ends the stream
        yield event("error", {"error": {"type": "api_error", "message": f"the engine failed: {stream.error}"}})
        return
    if open_kind is not None:
        yield event("content_block_stop", {"index": index})
    stop_reason = "tool_use" if n_calls else _stop_reason(stream, AssistantOutput(""))
    yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stream.stop_sequence},
                                  "usage": _usage(stream)})
    yield event("message_stop", {})


def _blocks(out: AssistantOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.tool_calls:
        blocks.append({"type": "text", "text": out.content})
    blocks += [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c.name, "input": c.arguments}
               for c in out.tool_calls]
    return blocks


def _stop_reason(stream: TokenStream, out: AssistantOutput) -> str:
    if out.tool_calls:
        return "tool_use"
    if stream.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if stream.finish_reason == "length" else "end_turn"


async def _prompt_ids(server: Server, body: CountRequest) -> tuple[list[int], str]:
    """The prompt's ids and, where tool_choice forces a call, the opening of that call (its ids
    are the prompt's last)."""
    server.check_model(body.model)
    messages = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for m in body.messages:
        messages += _template_messages(m)
    forced = body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
    options = {}
    if body.thinking is not None:
        if forced and body.thinking.type == "enabled":
            raise ApiError(400, f"tool_choice {body.tool_choice.type!r} forces a tool call, which thinking "
                           "cannot precede: use tool_choice auto or none with thinking", "tool_choice")
        options["enable_thinking"] = body.thinking.type != "disabled"
    return await server.prompt_ids(messages, _tools(body) or None, forced, **options)


def _text(content: str | list[Block]) -> str:
    return content if isinstance(content, str) else "".join(b.text or "" for b in content if b.type == "text")


def _template_messages(m: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages: tool results become tool turns."""
    if isinstance(m.content, str) or m.role == "system":
        return [{"role": m.role, "content": _text(m.content)}]
    text = _text(m.content)
    if m.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": text}
        thinking = "".join(b.thinking or "" for b in m.content if b.type == "thinking")
        if thinking:
            out["reasoning_content"] = thinking
        calls = [b for b in m.content if b.type == "tool_use"]
        if any(b.name is None for b in calls):
            raise ApiError(400, "a tool_use block has no name", "messages")
        if calls:
            out["tool_calls"] = [{"type": "function", "id": b.id, "function": {"name": b.name,
                                                                             "arguments": b.input or {}}}
                                 for b in calls]
        return [out]
    turns = []
    for b in m.content:
        if b.type == "tool_result":
            content = b.content if isinstance(b.content, str) else \
                "".join(p.get("text", "") for p in b.content or [] if p.get("type") == "text")
            turns.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
    if text or not turns:
        turns.append({"role": "user", "content": text})
    return turns


def _tools(body: CountRequest) -> list[dict[str, Any]]:
    """The tools to offer: none for tool_choice none, the named one alone for tool_choice tool."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is not None and choice.type == "none":
        return []
    if choice is not None and choice.type in ("any", "tool") and not tools:
        raise ApiError(400, f"tool_choice {choice.type!r} forces a tool call, but the request offers no tools",
                       "tool_choice")
    if choice is not None and choice.type == "tool":
        if choice.name is None:
            raise ApiError(400, "tool_choice type 'tool' needs the tool's name", "tool_choice.name")
        tools = [t for t in tools if t.name == choice.name]
        if not tools:
            raise ApiError(400, f"tool_choice names {choice.name!r}, which is not among the tools", "tool_choice.name")
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in tools]
