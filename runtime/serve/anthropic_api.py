"""Anthropic-compatible routes: `/v1/messages` (streamed as Anthropic's server-sent events, or
not) with thinking and tool use, and `/v1/messages/count_tokens`. Content blocks map onto the chat
template's messages: text, thinking (reasoning), tool_use (tool calls), tool_result (tool turns)."""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SamplingParams
from ..tool_parsers import AssistantOutput, parse_output, tool_parser
from .app import ApiError, Server, TokenStream, ToolName, message_parts, server_of

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Body):
    type: Literal["text", "thinking", "redacted_thinking", "tool_use", "tool_result"]
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Body):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]


class CountRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] | None = None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountRequest, request: Request) -> dict:
    server = server_of(request)
    return {"input_tokens": len(_prompt_ids(server, body))}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    server = server_of(request)
    ids = _prompt_ids(server, body)
    server.check_prompt(ids, "messages")
    limit = server.new_tokens(body.max_tokens, body.max_tokens)
    sampling = SamplingParams(body.temperature, body.top_p, secrets.randbits(63), body.top_k)
    stops = list(body.stop_sequences or [])
    stream = TokenStream(server, ids, limit, sampling, stops)
    tools = _tools(body)
    msg_id, parser = f"msg_{uuid.uuid4().hex}", tool_parser(server.engine.tool_parser)
    if body.stream:
        return StreamingResponse(_events(stream, msg_id, server.config.model_name, tools, parser),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = parse_output(await stream.text(request), parser, tools)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": server.config.model_name,
            "content": _blocks(out), "stop_reason": _stop_reason(stream, out), "stop_sequence": stream.stop_sequence,
            "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": stream.completion_tokens}}


async def _events(stream: TokenStream, msg_id: str, model: str, tools: list[dict], parser):
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    yield event("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": stream.prompt_tokens, "output_tokens": 0}}})
    yield event("ping", {})
    index, open_kind, n_calls = -1, None, 0
    async for kind, value in message_parts(stream, parser, tools):
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
    if open_kind is not None:
        yield event("content_block_stop", {"index": index})
    stop_reason = "tool_use" if n_calls else _stop_reason(stream, AssistantOutput(""))
    yield event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stream.stop_sequence},
                                  "usage": {"output_tokens": stream.completion_tokens}})
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


def _prompt_ids(server: Server, body: CountRequest) -> list[int]:
    server.check_model(body.model)
    messages = []
    if body.system:
        text = body.system if isinstance(body.system, str) else "".join(b.text or "" for b in body.system)
        messages.append({"role": "system", "content": text})
    for m in body.messages:
        messages += _template_messages(m)
    options = {}
    if body.thinking is not None:
        options["enable_thinking"] = body.thinking.get("type") == "enabled"
    prompt = server.engine.chat_template.render(messages, _tools(body) or None, **options)
    return server.engine.tokenizer.encode(prompt)


def _template_messages(m: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages: tool results become tool turns."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text = "".join(b.text or "" for b in m.content if b.type == "text")
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
    if body.tool_choice and body.tool_choice.get("type") == "none":
        return []
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in body.tools or []]
