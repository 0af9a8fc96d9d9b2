"""The model's text turned into an API message: reasoning (`<think>`), content and structured tool
calls, by a parser per family's tool-call format, registered by name (`TOOL_PARSERS`).

A block that does not parse (truncated, bad JSON, unknown shape) stays in the content as the model
wrote it: nothing the model said is dropped.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

from ftc_runtime.chat.stop_strings import partial_suffix


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
    open_tag: str  # a call's block in the model's text: open_tag ... close_tag
    close_tag: str
    # Tags, or tokens that tags are written with, inside a block that the parser reads (a tokenizer
    # may mark them special)
    inner_tags: tuple[str, ...]

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        """(content without the parsed calls, the calls); `tools` (OpenAI schemas) type the arguments
        of formats that write them as text."""


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of a whole answer, read as `ReasoningSplitter` streams it, so that a
    message and its stream agree: text that opens with `<think>` (after blank space) is reasoning
    until `</think>` (all of it where none comes); other text is content, a `</think>` in it too.
    The server writes the `<think>` that a prompt opened at the answer's start (`Server.prompt_ids`'
    opening)."""
    splitter = ReasoningSplitter()
    pieces = splitter.feed(text) + splitter.flush()
    content = "".join(t for kind, t in pieces if kind == "content")
    if not text.lstrip().startswith("<think>"):
        return None, content
    return "".join(t for kind, t in pieces if kind == "reasoning").strip(), content


def prompt_opens_reasoning(tokenizer, ids: list[int]) -> bool:
    """The prompt ends with `<think>`, written by the template for the answer (DeepSeek-V4's with
    thinking on): the answer's text starts inside the reasoning."""
    return tokenizer.decode(ids[-4:]).rstrip().endswith("<think>")


class ReasoningSplitter:
    """Streamed text split into ("reasoning", text) and ("content", text) pieces as it arrives: text
    that opens with `<think>` (after blank space) is reasoning until `</think>`; so is all text from
    the start where the prompt already `opened` it (DeepSeek-V4's prompts end with `<think>` when
    thinking is on). A piece that might be the start of a tag is held back until the next delta (or
    `flush`) tells."""

    def __init__(self, opened: bool = False):
        self.mode, self.held = "reasoning" if opened else "start", ""
        self.after_reasoning = False  # content right after `</think>`: its leading blank lines go

    def feed(self, delta: str) -> list[tuple[str, str]]:
        text, out = self.held + delta, []
        self.held = ""
        if self.mode == "start":
            lead = text.lstrip()  # GLM's answers open with a newline before <think>
            if "<think>".startswith(lead):  # still undecided: blank, or a piece of the tag
                self.held = text
                return out
            if lead.startswith("<think>"):
                self.mode, text = "reasoning", lead[len("<think>"):].lstrip("\n")
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            end = text.find("</think>")
            if end < 0:
                keep = partial_suffix(text, "</think>")
                if text[:len(text) - keep]:
                    out.append(("reasoning", text[:len(text) - keep]))
                self.held = text[len(text) - keep:]
                return out
            if text[:end].rstrip():
                out.append(("reasoning", text[:end].rstrip()))
            self.mode, self.after_reasoning, text = "content", True, text[end + len("</think>"):]
        if self.after_reasoning:
            text = text.lstrip()
            self.after_reasoning = not text
        if text:
            out.append(("content", text))
        return out

    def flush(self) -> list[tuple[str, str]]:
        held, self.held = self.held, ""
        return [("reasoning" if self.mode == "reasoning" else "content", held)] if held else []


class ToolCallStream:
    """Streamed content split into ("content", text) and ("tool_call", ToolCall) pieces as it
    arrives: text outside the parser's blocks passes at once (a possible start of a tag is held
    back), a block is parsed when it closes, and one that does not parse passes as content."""

    def __init__(self, parser: ToolParser, tools: list[dict[str, Any]]):
        self.parser, self.tools = parser, tools
        self.held, self.in_block = "", False

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        out: list[tuple[str, Any]] = []
        open_tag, close_tag = self.parser.open_tag, self.parser.close_tag
        while True:
            if not self.in_block:
                start = self.held.find(open_tag)
                if start < 0:
                    keep = partial_suffix(self.held, open_tag)
                    _content(out, self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    return out
                _content(out, self.held[:start])
                self.held, self.in_block = self.held[start:], True
            end = self.held.find(close_tag)
            if end < 0:
                return out
            block, self.held = self.held[:end + len(close_tag)], self.held[end + len(close_tag):]
            self.in_block = False
            content, calls = self.parser.parse(block, self.tools)
            out += [("tool_call", c) for c in calls]
            _content(out, content if calls else block)

    def flush(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        _content(out, self.held)  # an unfinished block stays text
        self.held, self.in_block = "", False
        return out


def _content(out: list[tuple[str, Any]], text: str) -> None:
    if text:
        out.append(("content", text))


_FUNCTION = re.compile(r"^<function=([^>\s]+)>(.*)</function>$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class BlockToolParser(ABC):
    """Calls in `open_tag` ... `close_tag` blocks; a subclass reads one block's body into its calls."""

    open_tag: str
    close_tag: str
    inner_tags: tuple[str, ...] = ()

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[ToolCall]]:
        schemas = {t.get("function", t).get("name"): t.get("function", t).get("parameters") or {}
                   for t in tools or [] if isinstance(t, dict)}
        block = re.compile(f"{re.escape(self.open_tag)}(.*?){re.escape(self.close_tag)}", re.DOTALL)
        calls, kept, last = [], [], 0
        for m in block.finditer(text):
            found = self._calls(m.group(1), schemas)
            if not found:
                continue  # left in the content
            kept.append(text[last:m.start()])
            last = m.end()
            calls += found
        kept.append(text[last:])
        return "".join(kept).strip(), calls

    @abstractmethod
    def _calls(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        """The calls in a block's body (`schemas`: the tools' parameters by name), None where it
        does not read as calls."""


class TaggedToolParser(BlockToolParser):
    """One call per `<tool_call>` ... `</tool_call>` block; a subclass reads one block's body."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def _calls(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        call = self._call(body.strip(), schemas)
        return None if call is None else [call]

    @abstractmethod
    def _call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        """The call in a block's stripped body (`schemas`: the tools' parameters by name), None
        where it is not one."""


class QwenToolParser(TaggedToolParser):
    """`<tool_call>` blocks holding either a JSON object {"name", "arguments"} (Qwen2.5/Qwen3) or
    `<function=NAME><parameter=KEY>VALUE</parameter>...</function>` (Qwen3-Coder), whose values are
    text: typed by the tool's schema where it gives a type, else read as JSON when they parse."""

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


_GLM_CALL = re.compile(r"^([^\s<>]+)\s*(.*)$", re.DOTALL)
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class GlmToolParser(TaggedToolParser):
    """GLM-4.5/5's `<tool_call>NAME <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`
    blocks (whitespace between the parts), whose values are text: typed by the tool's schema where
    it gives a type, else read as JSON when they parse. A block with anything else between its
    pairs is not a call."""

    inner_tags = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def _call(self, body: str, schemas: dict[str, dict]) -> ToolCall | None:
        m = _GLM_CALL.match(body)
        if m is None or _GLM_ARGUMENT.sub("", m.group(2)).strip():
            return None
        name, props = m.group(1), schemas.get(m.group(1), {}).get("properties", {})
        return ToolCall(name, {k: _typed(v, props.get(k, {})) for k, v in _GLM_ARGUMENT.findall(m.group(2))})


# DeepSeek-V4's DSML markup (its checkpoint's encoding/README.md): every tag is written with the
# vocabulary's `｜DSML｜` token, so a tokenizer that marks that token special must keep it in the text.
_DSML = "｜DSML｜"
_INVOKE = re.compile(rf'\s*<{_DSML}invoke\s+name="([^"]+)"\s*>(.*?)</{_DSML}invoke>', re.DOTALL)
_DSML_PARAMETER = re.compile(rf'\s*<{_DSML}parameter\s+name="([^"]+)"\s+string="(true|false)"\s*>(.*?)'
                             rf'</{_DSML}parameter>', re.DOTALL)


class DeepseekToolParser(BlockToolParser):
    """DeepSeek-V4's `<｜DSML｜tool_calls>` blocks: one or more `<｜DSML｜invoke name="NAME">` calls,
    each holding `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`
    arguments (whitespace between the parts). A `string="true"` value is the text as written; a
    `string="false"` one is JSON. A block with anything else in it (stray text, a value that is not
    JSON, a key given twice) is not calls: it stays in the content, whole."""

    open_tag, close_tag = f"<{_DSML}tool_calls>", f"</{_DSML}tool_calls>"
    inner_tags = (_DSML,)

    def _calls(self, body: str, schemas: dict[str, dict]) -> list[ToolCall] | None:
        calls, at = [], 0
        while m := _INVOKE.match(body, at):
            arguments = _dsml_arguments(m.group(2))
            if arguments is None:
                return None
            calls.append(ToolCall(m.group(1), arguments))
            at = m.end()
        return calls if body[at:].strip() == "" else None


def _dsml_arguments(body: str) -> dict[str, Any] | None:
    """An invoke's parameters as arguments; None where the body is anything else."""
    arguments: dict[str, Any] = {}
    at = 0
    while m := _DSML_PARAMETER.match(body, at):
        key, is_string, value = m.groups()
        if key in arguments:
            return None
        if is_string == "true":
            arguments[key] = value
        else:
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                return None
        at = m.end()
    return arguments if body[at:].strip() == "" else None


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


TOOL_PARSERS: dict[str, type[ToolParser]] = {"qwen": QwenToolParser, "glm": GlmToolParser,
                                             "deepseek": DeepseekToolParser}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool parser {name!r}: known parsers are {', '.join(TOOL_PARSERS)}") from None


def hidden_token_ids(special_tokens: dict[str, int], parser: ToolParser) -> frozenset[int]:
    """The control tokens an answer's text never shows (<|im_start|>, <|im_end|>, ...): every
    special token but the tags that the reasoning split and the tool-call parser read (a
    tokenizer may mark those special too)."""
    read = {"<think>", "</think>", parser.open_tag, parser.close_tag, *parser.inner_tags}
    return frozenset(i for text, i in special_tokens.items() if text not in read)


def parse_output(text: str, parser: ToolParser, tools: list[dict[str, Any]] | None = None) -> AssistantOutput:
    """The assistant message for the model's generated `text` (without its end-of-turn token);
    tool calls only where `tools` offers some."""
    reasoning, rest = split_reasoning(text)
    if not tools:  # calls are parsed only where the request offered tools, as the APIs answer
        return AssistantOutput(rest.strip(), reasoning)
    content, calls = parser.parse(rest, tools)
    return AssistantOutput(content, reasoning, calls)
