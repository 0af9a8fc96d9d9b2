"""The model's text turned into an API message: reasoning (`<think>`), content and structured tool
calls, by a parser per family's tool-call format, registered by name (`TOOL_PARSERS`).

A block that does not parse (truncated, bad JSON, unknown shape) stays in the content as the model
wrote it: nothing the model said is dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class AssistantOutput:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        """(content without the parsed calls, the calls); `tools` (OpenAI schemas) type the arguments
        of formats that write them as text."""


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest). The prompt may already have opened `<think>` (templates with thinking
    on), so text ending at `</think>` without an opening tag is reasoning too."""
    end = text.find("</think>")
    if end < 0:
        return None, text
    start = text.find("<think>")
    reasoning = text[start + len("<think>"):end] if 0 <= start < end else text[:end]
    return reasoning.strip(), text[end + len("</think>"):].lstrip()


_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"^<function=([^>\s]+)>(.*)</function>$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class QwenToolParser:
    """`<tool_call>` blocks holding either a JSON object {"name", "arguments"} (Qwen2.5/Qwen3) or
    `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` (Qwen3-Coder), whose values are
    text: typed by the tool's schema where it gives a type, else read as JSON when they parse."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        schemas = {t.get("function", t).get("name"): t.get("function", t).get("parameters") or {}
                   for t in tools or [] if isinstance(t, dict)}
        calls, kept, last = [], [], 0
        for m in _BLOCK.finditer(text):
            call = self._call(m.group(1).strip(), schemas)
            if call is None:
                continue  # left in the content
            kept.append(text[last:m.start()])
            last = m.end()
            calls.append(call)
        kept.append(text[last:])
        return "".join(kept).strip(), calls

    def _call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        if body.startswith("{"):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return None
            args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                return None
            return ToolCall(obj["name"], args)
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name, props = m.group(1), schemas.get(m.group(1), {}).get("properties", {})
        return ToolCall(name, {k: _typed(v, props.get(k, {})) for k, v in _PARAMETER.findall(m.group(2))})


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as its schema's type; without one, JSON where it parses, else the text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if kind in (None, "object", "array") or (kind == "boolean" and isinstance(parsed, bool)) \
            or (kind in ("integer", "number") and isinstance(parsed, (int, float)) and not isinstance(parsed, bool)):
        return parsed
    return value


TOOL_PARSERS: dict[str, type[ToolParser]] = {"qwen": QwenToolParser}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool parser {name!r}: known parsers are {', '.join(TOOL_PARSERS)}") from None


def parse_output(text: str, parser: ToolParser, tools: list[dict[str, Any]] | None = None) -> AssistantOutput:
    """The assistant message for the model's generated `text` (without its end-of-turn token);
    tool calls only where `tools` offers some."""
    reasoning, rest = split_reasoning(text)
    if not tools:  # calls are parsed only where the request offered tools, as the APIs answer
        return AssistantOutput(rest.strip(), reasoning)
    content, calls = parser.parse(rest, tools)
    return AssistantOutput(content, reasoning, calls)
