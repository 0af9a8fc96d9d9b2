"""Chat templates render as transformers renders them, tool calls survive a round trip through the
template and the family's parser, and bad output or templates are handled without loss."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine
from ftc_runtime.chat.template import ChatTemplate, ChatTemplateError
from ftc_runtime.chat.tool_parsers import (
    DeepseekToolParser,
    GlmToolParser,
    QwenToolParser,
    ReasoningSplitter,
    ToolCall,
    ToolCallStream,
    ToolParser,
    hidden_token_ids,
    parse_output,
    split_reasoning,
    tool_parser,
)
from ftc_runtime.models import family
from ftc_runtime.models.base import CHAT_TEMPLATES
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
    assert split_reasoning("no reasoning") == (None, "no reasoning")
    # the server writes the <think> a prompt opened: a </think> in text that did not open one is content
    assert split_reasoning("not opened</think>answer") == (None, "not opened</think>answer")
    assert split_reasoning("<think>\ncut at the limit ") == ("cut at the limit", "")
    assert parse_output("a <tool_call>{}</tool_call>", QwenToolParser(), None).content == "a <tool_call>{}</tool_call>"


@pytest.mark.parametrize("text", ["<think>\nplan a b\n</think>\n\nthe answer", "plain <think> answer", "<thi",
                                  "<think>never closed", "</think> after nothing",
                                  "\n<think>plan a b</think>\nthe answer", " \n", "\n<thi"])
def test_streamed_reasoning_split_agrees_with_the_whole_text(text, seed):
    """Cut anywhere, the streamed pieces add up to what `split_reasoning` makes of the whole text
    (text that does not open with <think> is content, all of it; an unclosed one is reasoning)."""
    rng = random.Random(seed)
    whole = split_reasoning(text)
    assert whole == ((None, text) if not text.lstrip().startswith("<think>") else
                     ("plan a b", "the answer") if "</think>" in text else ("never closed", ""))
    for _ in range(100):
        reasoning, content = _streamed_reasoning(text, ReasoningSplitter(), rng)
        assert (reasoning.strip() if whole[0] is not None else None, content) == whole, f"seed={seed}"


@pytest.mark.parametrize("text", ["plan a b\n</think>\n\nthe answer", "</think>answer at once", "never closed",
                                  "cut at </thi"])
def test_streamed_reasoning_of_a_prompt_that_opened_it_agrees_with_the_whole_text(text, seed):
    """DeepSeek-V4's prompts end with <think> when thinking is on: the answer's text is reasoning from
    its start, until </think> (all of it where none comes), as `split_reasoning` reads it with the
    <think> that the server writes for such a prompt."""
    rng = random.Random(seed)
    for _ in range(100):
        reasoning, content = _streamed_reasoning(text, ReasoningSplitter(opened=True), rng)
        assert (reasoning.strip(), content) == split_reasoning("<think>" + text), f"seed={seed}"
        if "</think>" not in text:
            assert (reasoning, content) == (text, ""), f"seed={seed}"


def _streamed_reasoning(text: str, splitter: ReasoningSplitter, rng: random.Random) -> tuple[str, str]:
    """(reasoning, content) that `splitter` yields for `text` cut at random places."""
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(8, len(text) - 1))))
    pieces = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += splitter.feed(text[a:b])
    pieces += splitter.flush()
    return ("".join(t for kind, t in pieces if kind == "reasoning"),
            "".join(t for kind, t in pieces if kind == "content"))


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
    _check_streamed(parser, tools, text, calls, blocks, rng)


def _check_streamed(parser: type[ToolParser], tools: list[dict], text: str, calls: list[ToolCall],
                    blocks: list[str], rng: random.Random) -> None:
    """The whole text parses into `calls`; so does every one of 200 random cuts of it, its content
    the text without the good `blocks` (the rest passed through)."""
    whole_content, whole_calls = parser().parse(text, tools)
    assert whole_calls == calls
    want = text
    for b in blocks:
        want = want.replace(b, "")
    for _ in range(200):
        streamed_calls, content = _streamed_calls(parser(), tools, text, rng)
        assert streamed_calls == calls and content == want
        assert content.strip() == whole_content


def _streamed_calls(parser: ToolParser, tools: list[dict], text: str, rng: random.Random) -> tuple[list, str]:
    """(the calls, the content) that ToolCallStream yields for `text` cut at random places."""
    cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 30)))
    stream, pieces = ToolCallStream(parser, tools), []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += stream.feed(text[a:b])
    pieces += stream.flush()
    return [v for k, v in pieces if k == "tool_call"], "".join(v for k, v in pieces if k == "content")


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


# DeepSeek-V4's chat format, as its checkpoints document it: deepseek-ai/DeepSeek-V4-Flash,
# encoding/README.md (special tokens, turns, thinking, the DSML tool-call block, <tool_result>) and
# encoding/encoding_dsv4.py (the reference encoder: tools appended to the first system message after a
# blank line, tool messages merged with neighbouring user messages into one user turn joined by blank
# lines, reasoning dropped before the last user turn unless tools are offered). The releases bring
# that encoder, not a chat template; ours writes the same prompt but for the wording of the tools
# section, which is ftc's own (`_deepseek_tool_section`).
DEEPSEEK = ChatTemplate.load(CHAT_TEMPLATES / "deepseek_v4_tools.jinja")
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def _deepseek_tool_section(tools: list[dict]) -> str:
    schemas = "".join(json.dumps(t["function"], ensure_ascii=False) + "\n" for t in tools)
    return ("## Tools\n\n"
            "You can call the tools below. To call tools, write one <｜DSML｜tool_calls> block with an invoke "
            "per call:\n\n"
            "<｜DSML｜tool_calls>\n"
            '<｜DSML｜invoke name="TOOL_NAME">\n'
            '<｜DSML｜parameter name="PARAMETER_NAME" string="true|false">VALUE</｜DSML｜parameter>\n'
            "...\n"
            "</｜DSML｜invoke>\n"
            '<｜DSML｜invoke name="OTHER_TOOL_NAME">\n'
            "...\n"
            "</｜DSML｜invoke>\n"
            "</｜DSML｜tool_calls>\n\n"
            'A string VALUE is written as it is, with string="true"; any other VALUE (number, boolean, array, '
            'object, null) is written as JSON, with string="false".\n\n'
            "When thinking is on (opened by <think>), reason inside <think>...</think> before any tool call or "
            "answer; otherwise call tools or answer right after </think>.\n\n"
            "### Tool schemas (JSON, one per line)\n\n"
            f"{schemas}\n"
            "Call only the tools defined above, with the parameters their schemas define.\n")


def _call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("messages,tools,options,want", [
    # README's quick start, word for word: thinking by default, the answer's turn opened with <think>.
    ([{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}],
     None, {}, f"{BOS}You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>"),
    # Without tools, reasoning before the last user turn is dropped, closed turns open with </think>.
    ([{"role": "user", "content": "hello"},
      {"role": "assistant", "content": "Hi!", "reasoning_content": "greet"}, {"role": "user", "content": "1+1=?"}],
     None, {}, f"{BOS}<｜User｜>hello<｜Assistant｜></think>Hi!{EOS}<｜User｜>1+1=?<｜Assistant｜><think>"),
    # Chat mode (thinking off): every turn opens with </think>, no reasoning is written.
    ([{"role": "user", "content": "hello"},
      {"role": "assistant", "content": "Hi!", "reasoning_content": "greet"}, {"role": "user", "content": "1+1=?"}],
     None, {"enable_thinking": False},
     f"{BOS}<｜User｜>hello<｜Assistant｜></think>Hi!{EOS}<｜User｜>1+1=?<｜Assistant｜></think>"),
    # Tools: the section after the system prompt; reasoning kept; two invokes in one block (string and
    # JSON parameters); both results in one user turn, joined by a blank line.
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Hangzhou and Beijing?"},
      {"role": "assistant", "content": "", "reasoning_content": "Two cities.",
       "tool_calls": [_call("get_weather", {"city": "杭州", "days": 2}),
                      _call("get_weather", {"city": "北京", "detail": {"wind": True, "hours": [6, 12]}})]},
      {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rain"}],
     [WEATHER], {},
     f"{BOS}Be brief.\n\n{_deepseek_tool_section([WEATHER])}<｜User｜>Weather in Hangzhou and Beijing?"
     "<｜Assistant｜><think>Two cities.</think>\n\n<｜DSML｜tool_calls>\n"
     '<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">杭州</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
     "</｜DSML｜invoke>\n"
     '<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="detail" string="false">{"wind": true, "hours": [6, 12]}</｜DSML｜parameter>\n'
     "</｜DSML｜invoke>\n"
     f"</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result>"
     "<｜Assistant｜><think>"),
    # Tools without a system prompt (an empty one carries them), chat mode, a call without arguments,
    # and a user message after a tool result joining its turn.
    ([{"role": "user", "content": "Time?"}, {"role": "assistant", "content": "Checking.",
                                             "tool_calls": [_call("now", {})]},
      {"role": "tool", "content": "12:00"}, {"role": "user", "content": "And?"}],
     [NOW, WEATHER], {"enable_thinking": False},
     f"{BOS}\n\n{_deepseek_tool_section([NOW, WEATHER])}<｜User｜>Time?<｜Assistant｜></think>Checking.\n\n"
     '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
     f"{EOS}<｜User｜><tool_result>12:00</tool_result>\n\nAnd?<｜Assistant｜></think>"),
])
def test_deepseek_template_writes_the_documented_prompt(messages, tools, options, want):
    assert DEEPSEEK.render(messages, tools, **options) == want


@pytest.mark.parametrize("trial", range(10))  # ten conversations: each test id draws from its own seed
def test_deepseek_template_renders_as_transformers_does(trial, seed):
    rng = random.Random(seed)
    reference = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    reference.chat_template = DEEPSEEK.source
    tools = _tools(rng, rng.randrange(0, 4))
    messages = _conversation(rng, tools)
    options = {"enable_thinking": rng.random() < 0.5} if rng.random() < 0.5 else {}
    want = reference.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                         **options)
    assert DEEPSEEK.render(messages, tools, **options) == want


@pytest.mark.parametrize("trial", range(10))  # ten sets of calls: each test id draws from its own seed
def test_deepseek_calls_round_trip_through_template_and_parser(trial, seed):
    """The assistant turn the template writes for given calls (strings and JSON values of every kind),
    content and reasoning, in thinking and chat mode, parses back into the same message."""
    rng = random.Random(seed)
    tools = _tools(rng, 3)
    calls = [ToolCall(rng.choice(tools)["function"]["name"], {_word(rng): _value(rng) for _ in range(rng.randrange(4))})
             for _ in range(rng.randrange(1, 4))]
    content = _word(rng, 30).strip() if rng.random() < 0.5 else ""
    thinking = rng.random() < 0.7
    reasoning = (_word(rng, 30).strip() or "r") if thinking else None
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning,
            "tool_calls": [_call(c.name, c.arguments) for c in calls]}
    text = DEEPSEEK.render([{"role": "user", "content": "q"}, turn], tools, add_generation_prompt=False,
                           enable_thinking=thinking)
    opening = "<｜Assistant｜>" + ("<think>" if thinking else "</think>")
    generated = text.split(opening)[-1].removesuffix(EOS)
    # the server writes the <think> that the prompt opened at the answer's start
    out = parse_output(("<think>" if thinking else "") + generated, tool_parser("deepseek"), tools)
    assert (out.tool_calls, out.content, out.reasoning) == (calls, content, reasoning)


def _dsml_block(calls: list[ToolCall]) -> str:
    invokes = "".join(
        f'<｜DSML｜invoke name="{c.name}">\n' + "".join(
            f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n" for k, v in c.arguments.items())
        + "</｜DSML｜invoke>\n" for c in calls)
    return f"<｜DSML｜tool_calls>\n{invokes}</｜DSML｜tool_calls>"


def test_deepseek_streamed_calls_agree_with_the_whole_text(seed):
    """Cut anywhere, ToolCallStream yields the calls of every DSML block (two in the first) in order,
    and passes every other character through as content: a bad block and an unfinished one whole."""
    rng = random.Random(seed)
    tools = _tools(rng, 2)
    calls = [ToolCall(tools[i % 2]["function"]["name"], {_word(rng): _value(rng) for _ in range(rng.randrange(3))})
             for i in range(3)]
    blocks = [_dsml_block(calls[:2]), _dsml_block(calls[2:])]
    bad = _dsml_block([ToolCall("f", {"a": 1})]).replace('"false">1<', '"false">{bad}<')
    text = f'Looking. {blocks[0]}\n then {bad} and\n\n{blocks[1]} and <｜DSML｜tool_calls>\n<｜DSML｜invoke name="cut'
    _check_streamed(DeepseekToolParser, tools, text, calls, blocks, rng)


_OPEN, _CLOSE, _END = "<｜DSML｜tool_calls>\n", "</｜DSML｜tool_calls>", "</｜DSML｜invoke>\n"
_INVOKE_F = '<｜DSML｜invoke name="f">\n'
_PARAMETER_A = '<｜DSML｜parameter name="a" string="true">x</｜DSML｜parameter>\n'


@pytest.mark.parametrize("text", [
    f"Let me check. {_OPEN}{_INVOKE_F}{_PARAMETER_A[:-20]}",  # cut off by max_tokens
    f"{_OPEN}{_INVOKE_F}{_PARAMETER_A}{_CLOSE}",  # invoke never closed
    f'{_OPEN}{_INVOKE_F}<｜DSML｜parameter name="a" string="false">{{bad json}}</｜DSML｜parameter>\n{_END}{_CLOSE}',
    f'{_OPEN}{_INVOKE_F}<｜DSML｜parameter name="a">x</｜DSML｜parameter>\n{_END}{_CLOSE}',  # no string="..."
    f'{_OPEN}{_INVOKE_F}<｜DSML｜parameter name="a" string="yes">x</｜DSML｜parameter>\n{_END}{_CLOSE}',
    f"{_OPEN}{_INVOKE_F}{_PARAMETER_A}{_PARAMETER_A}{_END}{_CLOSE}",  # a key twice
    f"{_OPEN}{_INVOKE_F}{_PARAMETER_A}{_END}stray\n{_CLOSE}",
    f"{_OPEN}{_INVOKE_F}stray {_PARAMETER_A}{_END}{_CLOSE}",
    f"{_OPEN}{_PARAMETER_A}{_CLOSE}",  # a parameter outside an invoke
    f'{_OPEN}<｜DSML｜invoke name="">\n{_END}{_CLOSE}',  # no name
    f"{_OPEN}{_CLOSE}",  # no invoke
    f"{_OPEN}{_INVOKE_F}{_PARAMETER_A}{_END}{_INVOKE_F}oops{_END}{_CLOSE}",  # one bad invoke spoils its block
])
def test_deepseek_malformed_blocks_stay_in_the_content(text):
    out = parse_output(text, DeepseekToolParser(), [WEATHER])
    assert out.tool_calls == [] and out.content == text.strip()


def test_deepseek_string_flag_decides_text_or_json(seed):
    """string="true": the value as written, whitespace and JSON-looking text included; string="false":
    JSON, whatever the schema says; several invokes of one block, one without parameters."""
    rng = random.Random(seed)
    n = rng.randrange(10**6)
    raw = ' {"a": 1}\n  two lines '
    params = [("count", "false", str(n), n), ("label", "true", str(n), str(n)), ("raw", "true", raw, raw),
              ("quoted", "false", '"x y"', "x y"), ("none", "false", "null", None),
              ("nested", "false", ' {"k": [1, 2.5, true]} ', {"k": [1, 2.5, True]}), ("empty", "true", "", "")]
    rng.shuffle(params)
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{flag}">{v}</｜DSML｜parameter>\n'
                   for k, flag, v, _ in params)
    block = f'{_OPEN}{_INVOKE_F}{body}{_END}<｜DSML｜invoke name="g">\n\n{_END}{_CLOSE}'
    schema = {"type": "object", "properties": {"count": {"type": "string"}, "label": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    content, calls = DeepseekToolParser().parse(f"Two calls.\n\n{block}\nDone.", tools)
    assert content == "Two calls.\n\n\nDone."
    assert calls == [ToolCall("f", {k: want for k, _, _, want in params}), ToolCall("g", {})]


def test_deepseek_dsml_token_stays_in_the_text():
    """Every DSML tag is written with the vocabulary's ｜DSML｜ token: where a tokenizer marks it special
    (a spec-built engine's marks every chat token special), the answer's text must still show it, as
    it must <think> and </think>; the turn tokens are control tokens. Ids as in the released
    tokenizer.json."""
    special = {BOS: 0, EOS: 1, "<｜User｜>": 128803, "<｜Assistant｜>": 128804, "<think>": 128821,
               "</think>": 128822, "｜DSML｜": 128825}
    parser = tool_parser("deepseek")
    assert isinstance(parser, DeepseekToolParser)
    assert hidden_token_ids(special, parser) == {0, 1, 128803, 128804}
