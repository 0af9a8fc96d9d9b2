"""Chat templates render as transformers renders them, tool calls survive a round trip through the
template and the family's parser, and bad output or templates are handled without loss."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine
from ftc_runtime.chat.template import ChatTemplate, ChatTemplateError
from ftc_runtime.chat.tool_parsers import (
    GlmToolParser,
    QwenToolParser,
    ReasoningSplitter,
    ToolCall,
    ToolCallStream,
    hidden_token_ids,
    parse_output,
    split_reasoning,
    tool_parser,
)
from ftc_runtime.models import family
from ftc_runtime.spec import SpecError

from hf_models import TinyShape, build_model, save_checkpoint

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
SPEC = SPECS / "qwen3-moe-tiny.yaml"
# Where the family's template starts the assistant's turn and what it writes after it: the text
# between is what the model generated.
ASSISTANT_TURN = {"qwen3_moe": ("<|im_start|>assistant\n", "<|im_end|>\n"), "glm_moe_dsa": ("<|assistant|>", "")}


@pytest.fixture(scope="module", params=["qwen3-moe-tiny", "glm-5-tiny"])
def engine(request, tmp_path_factory) -> Engine:
    """An engine of each chat format's family: ChatML with JSON calls, GLM's with <arg_key> pairs."""
    out = tmp_path_factory.mktemp("chat") / request.param
    return Engine.load(compile_engine(CompileOptions(source=SPECS / f"{request.param}.yaml", target="cpu",
                                                     random_weights=True, output=out)))


def _word(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice(string.ascii_letters + "éü中 _") for _ in range(rng.randrange(1, n)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "bool", "null", "list", "dict"] if depth < 2 else ["str", "int"])
    return {"str": lambda: _word(rng, 12), "int": lambda: rng.randrange(-10**6, 10**6),
            "float": lambda: rng.uniform(-1e3, 1e3), "bool": lambda: rng.random() < 0.5, "null": lambda: None,
            "list": lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(3))],
            "dict": lambda: {_word(rng): _value(rng, depth + 1) for _ in range(rng.randrange(3))}}[kind]()


def _tools(rng: random.Random, n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}_{rng.randrange(100)}", "description": _word(rng, 30),
                                              "parameters": {"type": "object", "properties": {}}}}
            for i in range(n)]


def _conversation(rng: random.Random, tools: list[dict]) -> list[dict]:
    messages = [{"role": "system", "content": _word(rng, 40)}] if rng.random() < 0.6 else []
    for _ in range(rng.randrange(1, 4)):
        messages.append({"role": "user", "content": _word(rng, 60)})
        reply = {"role": "assistant", "content": _word(rng, 40) if rng.random() < 0.7 else ""}
        if rng.random() < 0.4:
            reply["reasoning_content"] = _word(rng, 40)
        if tools and rng.random() < 0.5:
            reply["tool_calls"] = [{"type": "function", "function": {
                "name": rng.choice(tools)["function"]["name"],
                "arguments": {_word(rng): _value(rng) for _ in range(rng.randrange(3))}}}
                for _ in range(rng.randrange(1, 3))]
        messages.append(reply)
        for _ in reply.get("tool_calls", []):
            messages.append({"role": "tool", "content": json.dumps(_value(rng))})
    messages.append({"role": "user", "content": _word(rng, 60)})
    return messages


@pytest.mark.parametrize("trial", range(10))  # ten conversations: each test id draws from its own seed
def test_template_renders_as_transformers_does(engine, trial, seed):
    rng = random.Random(seed)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(engine.manifest.root / "tokenizer.json"))
    reference.chat_template = engine.chat_template.source
    tools = _tools(rng, rng.randrange(0, 4))
    messages = _conversation(rng, tools)
    options = {"enable_thinking": rng.random() < 0.5} if rng.random() < 0.5 else {}
    want = reference.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **options)
    assert engine.chat_template.render(messages, tools, **options) == want


def test_checkpoint_templates_are_kept_and_checked(tmp_path):
    """A checkpoint's own template (tokenizer_config.json, string or named list) wins over the
    family's; one with a syntax error fails the compile, naming the file."""
    model = build_model(TinyShape(), seed=5)
    ckpt = save_checkpoint(model, tmp_path / "ckpt", "fused", 1)
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "unused"}, {"name": "default", "template": own}]}))
    engine = Engine.load(compile_engine(CompileOptions(source=ckpt, target="cpu", output=tmp_path / "e1")))
    assert engine.chat_template.source == own
    assert engine.chat_template.render([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(SpecError, match="tokenizer_config.json"):
        compile_engine(CompileOptions(source=ckpt, target="cpu", output=tmp_path / "e2"))


def test_template_errors_name_the_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ raise_exception('no tools here') if tools else 'ok' }}")
    template = ChatTemplate.load(path)
    assert template.render([]) == "ok"
    with pytest.raises(ChatTemplateError, match=r"t\.jinja: no tools here"):
        template.render([], tools=[{"name": "x"}])
    with pytest.raises(ChatTemplateError, match="t.jinja"):
        ChatTemplate("{% if %}", str(path))


@pytest.mark.parametrize("trial", range(10))  # ten sets of calls: each test id draws from its own seed
def test_tool_calls_round_trip_through_template_and_parser(engine, trial, seed):
    """The assistant turn the template writes for given tool calls (the model's own format) parses
    back into the same calls, content and reasoning."""
    rng = random.Random(seed)
    tools = _tools(rng, 3)
    calls = [ToolCall(rng.choice(tools)["function"]["name"], {_word(rng): _value(rng) for _ in range(3)})
             for _ in range(rng.randrange(1, 4))]
    content = _word(rng, 30).strip() if rng.random() < 0.5 else ""
    reasoning = _word(rng, 30).strip() or "r"
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}
    text = engine.chat_template.render([{"role": "user", "content": "q"}, turn], tools, add_generation_prompt=False)
    opening, closing = ASSISTANT_TURN[engine.spec.family]
    generated = text.split(opening)[-1].removesuffix(closing)
    out = parse_output(generated, tool_parser(family(engine.spec.family).tool_parser), tools)
    assert out.tool_calls == calls and out.content == content and out.reasoning == reasoning


def test_xml_style_parameters_are_typed_by_the_schema(seed):
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                               "scale": {"type": "number"}, "force": {"type": "boolean"},
                                               "opts": {"type": "object"}, "items": {"type": "array"}}}
    tools = [{"type": "function", "function": {"name": "edit", "parameters": schema}}]
    args = {"path": "42", "line": rng.randrange(10**6), "scale": rng.uniform(0, 9), "force": rng.random() < 0.5,
            "opts": {"a": [1, "x"]}, "items": [rng.randrange(9)], "untyped": {"k": None}}
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in args.items())
    text = f"Editing.\n<tool_call>\n<function=edit>\n{body}</function>\n</tool_call>"
    content, calls = QwenToolParser().parse(text, tools)
    assert content == "Editing." and calls == [ToolCall("edit", args)]


@pytest.mark.parametrize("text", [
    'Let me check. <tool_call>{"name": "f", "argu',  # cut off by max_tokens
    '<tool_call>{"name": "f", "arguments": {bad json}}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>["f", {}]</tool_call>',
    "<tool_call><function=f><parameter=a>1</parameter></tool_call>",  # no </function>
])
def test_unparsable_calls_stay_in_the_content(text):
    out = parse_output(text, QwenToolParser(), _tools(random.Random(0), 1))
    assert out.tool_calls == [] and out.content == text.strip()


def test_reasoning_split():
    assert split_reasoning("<think>\nplan\n</think>\n\nanswer") == ("plan", "answer")
    assert split_reasoning("plan opened by the prompt</think>answer") == ("plan opened by the prompt", "answer")
    assert split_reasoning("no reasoning") == (None, "no reasoning")
    assert parse_output("a <tool_call>{}</tool_call>", QwenToolParser(), None).content == "a <tool_call>{}</tool_call>"


@pytest.mark.parametrize("text", ["<think>\nplan a b\n</think>\n\nthe answer", "plain <think> answer", "<thi",
                                  "<think>never closed", "</think> after nothing"])
def test_streamed_reasoning_split_agrees_with_the_whole_text(text, seed):
    """Cut anywhere, the streamed pieces add up to what `split_reasoning` makes of the whole text
    (text that does not open with <think> is content, all of it)."""
    rng = random.Random(seed)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(8, len(text) - 1))))
        splitter, pieces = ReasoningSplitter(), []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            pieces += splitter.feed(text[a:b])
        pieces += splitter.flush()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        content = "".join(t for kind, t in pieces if kind == "content")
        if not text.startswith("<think>"):
            assert (reasoning, content) == ("", text)
        elif "</think>" in text:
            assert (reasoning.strip(), content) == split_reasoning(text)
        else:
            assert (reasoning.strip(), content) == ("never closed", "")


def _json_block(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _glm_block(call: ToolCall) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
                    for k, v in call.arguments.items())
    return f"<tool_call>{call.name}\n{pairs}</tool_call>"


@pytest.mark.parametrize("parser,block,bad", [
    (QwenToolParser, _json_block, "<tool_call>{bad}</tool_call>"),
    (GlmToolParser, _glm_block, "<tool_call>f\n<arg_key>a</arg_key> stray <arg_value>1</arg_value></tool_call>"),
])
def test_streamed_tool_calls_agree_with_the_whole_text(parser, block, bad, seed):
    """Cut anywhere, ToolCallStream yields the calls that parsing the whole text finds, in order,
    and passes every other character through as content (bad and unfinished blocks included)."""
    rng = random.Random(seed)
    tools = _tools(rng, 2)
    calls = [ToolCall(tools[i % 2]["function"]["name"], {_word(rng): _value(rng)}) for i in range(3)]
    blocks = [block(c) for c in calls]
    text = f"Looking. {blocks[0]}\n{blocks[1]} then {bad} and {blocks[2]} and <tool_call>cut off"
    whole_content, whole_calls = parser().parse(text, tools)
    assert whole_calls == calls
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 30)))
        stream, pieces = ToolCallStream(parser(), tools), []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            pieces += stream.feed(text[a:b])
        pieces += stream.flush()
        assert [v for k, v in pieces if k == "tool_call"] == calls
        content = "".join(v for k, v in pieces if k == "content")
        assert content == text.replace(blocks[0], "").replace(blocks[1], "").replace(blocks[2], "")
        assert content.strip() == whole_content


def test_glm_values_are_typed_by_the_schema_and_its_tags_stay_in_the_text(seed):
    """GLM's <arg_value> text typed by the tool's schema (a string that reads as a number stays a
    string), and an engine of the family keeps <arg_key>/<arg_value> in its text for the parser."""
    rng = random.Random(seed)
    schema = {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                                               "force": {"type": "boolean"}, "opts": {"type": "object"}}}
    tools = [{"type": "function", "function": {"name": "edit", "parameters": schema}}]
    args = {"path": str(rng.randrange(100)), "line": rng.randrange(10**6), "force": rng.random() < 0.5,
            "opts": {"a": [1, "x"]}, "untyped": [None, 2.5]}
    content, calls = GlmToolParser().parse(f"Editing.\n{_glm_block(ToolCall('edit', args))}", tools)
    assert content == "Editing." and calls == [ToolCall("edit", args)]
    special = load_spec(SPECS / "glm-5-tiny.yaml")[0].tokens.special
    hidden = hidden_token_ids(special, tool_parser(family("glm_moe_dsa").tool_parser))
    assert not {special[t] for t in GlmToolParser.inner_tags} & hidden and special["<|assistant|>"] in hidden
