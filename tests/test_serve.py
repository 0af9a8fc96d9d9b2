"""A real server on loopback (uvicorn in a thread) with the tiny engine on the CPU, driven by the
official `openai` client and by raw HTTP for what a client library would refuse to send."""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# The server stack and the API clients: where they are absent (the device machine) this module skips.
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from ftc_runtime import Engine, SamplingParams  # noqa: E402

from conftest import seed_for  # noqa: E402
from live_server import free_port, script_sampler, serving  # noqa: E402

KEY = f"test-key-{seed_for('test_serve.KEY')}"


@pytest.fixture(scope="module")
def engine(cpu_engine) -> Engine:
    return cpu_engine  # conftest's tiny engine, loaded for this module


@pytest.fixture(scope="module")
def url(engine) -> Iterator[str]:
    with serving(engine, max_prompt_tokens=512, max_new_tokens=64) as base:
        yield base


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _expected(engine: Engine, messages: list[dict], n: int) -> str:
    """What the engine itself generates, greedily, for the rendered conversation, as the server
    shows it: control tokens (`hidden_token_ids`, such as <|im_start|> from a random model) count
    but show no text."""
    ids = engine.tokenizer.encode(engine.chat_template.render(messages))
    eos = set(engine.spec.eos_token_ids)
    out = []
    for t in engine.generate(ids, n, SamplingParams(0.0), stop_at_eos=True):
        if t in eos:
            break
        if t not in engine.hidden_token_ids:
            out.append(t)
    return engine.tokenizer.decode(out)


def script_tool_call(engine: Engine, monkeypatch, tools: list[dict], *calls: tuple[str, dict]) -> dict:
    """A test-only decoding hook: every sampler emits, token by token, the assistant turn that the
    template writes for the (name, arguments) `calls` (the model's own format), then
    end-of-sequence. Returns the per-sampler positions (clear them to replay the script)."""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}
    rendered = engine.chat_template.render([{"role": "user", "content": "q"}, turn], tools,
                                           add_generation_prompt=False)
    script = engine.tokenizer.encode(rendered.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n"))
    return script_sampler(monkeypatch, script + [engine.spec.eos_token_ids[0]])


def test_models_and_health(url, engine):
    assert [m.id for m in client(url).models.list()] == [engine.spec.name]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_chat_plain_and_streamed_equal_the_engine(url, engine, seed):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Count {random.Random(seed).random()}"}]
    want = _expected(engine, messages, 12)
    c = client(url)
    r = c.chat.completions.create(model=engine.spec.name, messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.strip() and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    chunks = list(c.chat.completions.create(model=engine.spec.name, messages=messages, max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip() == want.strip()
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_tokens_become_text_on_the_engine_thread(engine, monkeypatch, seed):
    """Detokenizing never runs on the event loop that serves every request: each streamed
    request's tokens are decoded on the engine's thread, and the streamed text is the engine's."""
    from ftc_runtime.chat.tokenizer import StreamDecoder

    threads: list[str] = []
    push = StreamDecoder.push

    def recording_push(self, token):
        threads.append(threading.current_thread().name)
        return push(self, token)

    monkeypatch.setattr(StreamDecoder, "push", recording_push)
    messages = [{"role": "user", "content": f"Tell {random.Random(seed).random()}"}]
    with serving(engine) as base:
        chunks = list(client(base).chat.completions.create(model=engine.spec.name, messages=messages,
                                                           max_tokens=12, temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.strip() == _expected(engine, messages, 12).strip()
    assert threads and set(threads) == {"ftc-engine"}, set(threads)


def test_completions_equal_the_engine(url, engine):
    prompt = "The quick brown fox"
    ids = engine.tokenizer.encode(prompt)
    want = engine.tokenizer.decode([t for t in engine.generate(ids, 10, SamplingParams(0.0), stop_at_eos=False)])
    r = client(url).completions.create(model=engine.spec.name, prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == want or want.startswith(r.choices[0].text)  # an EOS token ends it early


def test_tool_call_round_trip(engine, monkeypatch, seed):
    """The model is made to emit a given tool call in its own format (the template's rendering of
    that call, token by token): the client receives the structured call, and sending the tool's
    result back renders through the template into the next prompt."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    rng = random.Random(seed)
    args = {"city": rng.choice(["Paris", "Zürich", "東京"]), "days": rng.randrange(1, 9)}
    position = script_tool_call(engine, monkeypatch, tools, ("get_weather", args))
    with serving(engine) as base:
        c = client(base)
        messages = [{"role": "user", "content": "What's the weather?"}]
        r = c.chat.completions.create(model=engine.spec.name, messages=messages, tools=tools, max_tokens=256)
        assert r.choices[0].message.tool_calls, r.choices[0].message
        assert r.choices[0].message.content is None  # only a call: no content, as OpenAI sends it
        call = r.choices[0].message.tool_calls[0]
        assert r.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == args
        streamed = list(c.chat.completions.create(model=engine.spec.name, messages=messages, tools=tools,
                                                  max_tokens=256, stream=True))
        deltas = [d for ch in streamed for d in ch.choices[0].delta.tool_calls or []]
        assert [json.loads(d.function.arguments) for d in deltas] == [args]
        follow = messages + [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        position.clear()
        r2 = c.chat.completions.create(model=engine.spec.name, messages=follow, tools=tools, max_tokens=256)
        assert r2.choices[0].message.tool_calls  # the script again: the server took the round trip


def aclient(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_anthropic_messages_plain_streamed_and_counted(url, engine, seed):
    system, user = "Be brief.", f"Count {random.Random(seed).random()}"
    want = _expected(engine, [{"role": "system", "content": system}, {"role": "user", "content": user}], 12).strip()
    c = aclient(url)
    greedy = {"temperature": 0}  # sent as a body field: recent clients no longer expose it
    r = c.messages.create(model=engine.spec.name, system=system, max_tokens=12, extra_body=greedy,
                          messages=[{"role": "user", "content": user}])
    assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in r.content if b.type == "text") == want
    with c.messages.stream(model=engine.spec.name, system=system, max_tokens=12, extra_body=greedy,
                           messages=[{"role": "user", "content": user}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed.strip() == want and final.usage.output_tokens == r.usage.output_tokens
    rendered = engine.chat_template.render([{"role": "system", "content": system}, {"role": "user", "content": user}])
    counted = c.messages.count_tokens(model=engine.spec.name, system=system,
                                      messages=[{"role": "user", "content": user}])
    assert counted.input_tokens == len(engine.tokenizer.encode(rendered)) == r.usage.input_tokens


def test_anthropic_tool_use_round_trip(engine, monkeypatch, seed):
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}}}]
    rng = random.Random(seed)
    args = {"path": f"src/{rng.randrange(100)}.py", "lines": [1, rng.randrange(2, 50)]}
    openai_tools = [{"type": "function", "function": {"name": "read_file", "parameters": tools[0]["input_schema"]}}]
    position = script_tool_call(engine, monkeypatch, openai_tools, ("read_file", args))
    with serving(engine) as base:
        c = aclient(base)
        messages = [{"role": "user", "content": "Show me the file."}]
        r = c.messages.create(model=engine.spec.name, max_tokens=256, tools=tools, messages=messages)
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [("read_file", args)]
        with c.messages.stream(model=engine.spec.name, max_tokens=256, tools=tools, messages=messages) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("read_file", args)]
        follow = messages + [{"role": "assistant", "content": [u.model_dump() for u in uses]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                           "content": "print('hi')"}]}]
        position.clear()
        r2 = c.messages.create(model=engine.spec.name, max_tokens=256, tools=tools, messages=follow)
        assert r2.stop_reason == "tool_use"


def test_anthropic_errors_have_anthropic_shape(url, engine):
    m = engine.spec.name
    cases = [{"model": m, "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
             {"model": m, "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]},
             {"model": m, "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
             {"model": m, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
             {"model": m, "max_tokens": 5, "messages": [], "tools": []},
             {"model": m, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"name": "no schema"}]}]
    for body in cases + ["{broken"]:
        r = httpx.post(url + "/v1/messages", content=body if isinstance(body, str) else json.dumps(body),
                       headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and r.json()["type"] == "error", (body, r.text)
        assert r.json()["error"]["message"]
    with serving(engine, served_model_names=(m,)) as base, pytest.raises(anthropic.NotFoundError):
        aclient(base).messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])


def test_api_key(engine):
    with serving(engine, api_key=KEY) as base:
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").models.list()
        assert httpx.get(base + "/v1/models").status_code == 401
        assert [m.id for m in client(base, KEY).models.list()] == [engine.spec.name]
        assert httpx.get(base + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert httpx.get(base + "/health").status_code == 200
        with pytest.raises(anthropic.AuthenticationError):
            aclient(base, "wrong").messages.count_tokens(model=engine.spec.name,
                                                         messages=[{"role": "user", "content": "hi"}])
        assert aclient(base, KEY).messages.count_tokens(model=engine.spec.name,
                                                        messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


def test_any_model_name_or_the_served_ones(engine, seed):
    """By default every model name is this engine (agent harnesses send their own model's name);
    with served names, only those, the first reported in answers."""
    rng = random.Random(seed)

    def chat(base: str, model: str) -> httpx.Response:
        return httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})

    with serving(engine) as base:
        for name in ("gpt-4o", f"claude-{rng.random()}", engine.spec.name):
            r = chat(base, name)
            assert r.status_code == 200 and r.json()["model"] == engine.spec.name, r.text
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == [engine.spec.name]
    names = (f"team/{rng.randrange(1000)}", "alias")
    with serving(engine, served_model_names=names) as base:
        for name in names:
            r = chat(base, name)
            assert r.status_code == 200 and r.json()["model"] == names[0], r.text
        r = chat(base, engine.spec.name)
        assert r.status_code == 404 and names[0] in r.json()["error"]["message"]
        r = httpx.post(base + "/v1/messages", timeout=60, json={
            "model": "gpt-4o", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and r.json()["type"] == "error"
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == list(names)


def test_chat_template_kwargs_reach_the_template(url, engine, seed):
    messages = [{"role": "user", "content": f"think? {random.Random(seed).random()}"}]
    body = {"model": engine.spec.name, "messages": messages, "max_tokens": 1, "temperature": 0}
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body | {"chat_template_kwargs": kwargs})
        want = engine.chat_template.render_ids(engine.tokenizer, messages, **(kwargs or {}))
        assert r.json()["usage"]["prompt_tokens"] == len(want), (kwargs, r.text)
    no_thinking = engine.chat_template.render_ids(engine.tokenizer, messages, enable_thinking=False)
    assert len(no_thinking) != len(engine.chat_template.render_ids(engine.tokenizer, messages))  # it matters here
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json=body | {"chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_usage_counts_the_prompt_tokens_the_prefix_cache_restored(engine_dir, seed):
    """OpenAI's prompt_tokens_details.cached_tokens and Anthropic's cache_read_input_tokens (its
    input_tokens are the rest) are the tokens a prompt resumed after."""
    engine = Engine.load(engine_dir)
    engine.enable_prefix_cache(64 << 20, 64 << 20)
    rng = random.Random(seed)
    first = [{"role": "user", "content": " ".join(str(rng.random()) for _ in range(8))}]
    with serving(engine) as base:
        def chat(messages: list[dict]) -> dict:
            return httpx.post(base + "/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}).json()

        answer = chat(first)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        later = first + [answer["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        again = chat(later)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < again["usage"]["prompt_tokens"]
        msg = httpx.post(base + "/v1/messages", timeout=60, json={
            "model": "m", "max_tokens": 4, "temperature": 0, "messages": later}).json()
        usage = msg["usage"]
        assert usage["cache_read_input_tokens"] > 0
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == again["usage"]["prompt_tokens"]
        # streamed: OpenAI's last chunk, and Anthropic's message_delta (which its SDK's final message takes)
        chunks = list(client(base).chat.completions.create(model="m", messages=later, max_tokens=4, temperature=0,
                                                           stream=True, stream_options={"include_usage": True}))
        streamed = chunks[-1].usage
        assert 0 < streamed.prompt_tokens_details.cached_tokens < streamed.prompt_tokens == again["usage"][
            "prompt_tokens"]
        with aclient(base).messages.stream(model="m", max_tokens=4, messages=later) as s:
            final = s.get_final_message().usage
        assert final.cache_read_input_tokens > 0
        assert final.input_tokens + final.cache_read_input_tokens == again["usage"]["prompt_tokens"]


def test_requests_sample_by_the_engines_defaults_unless_they_say(engine_dir, tmp_path, seed):
    """A request that leaves sampling out gets the checkpoint's defaults (engine.json "sampling"),
    not the API's temperature 1; what it gives wins."""
    copy = shutil.copytree(engine_dir, tmp_path / "e")
    manifest = json.loads((copy / "engine.json").read_text())
    defaults = {"temperature": 0.5, "top_p": 0.8, "top_k": 7}
    (copy / "engine.json").write_text(json.dumps(manifest | {"sampling": defaults}))
    rng = random.Random(seed)
    body = {"model": "m", "prompt": [rng.randrange(256) for _ in range(5)], "max_tokens": 24, "seed": rng.randrange(99)}
    with serving(Engine.load(copy)) as base:
        def text(**sampling) -> str:
            return httpx.post(base + "/v1/completions", json=body | sampling, timeout=60).json()["choices"][0]["text"]

        assert text() == text(**defaults)
        assert text() != text(temperature=1.0, top_p=1.0, top_k=0)


def test_metrics_need_the_key_unless_public(engine):
    for public in (False, True):
        with serving(engine, api_key=KEY, metrics_public=public) as base:
            assert httpx.get(base + "/metrics").status_code == (200 if public else 401)
            assert httpx.get(base + "/metrics", headers={"x-api-key": KEY}).status_code == 200
            assert httpx.get(base + "/v1/models").status_code == 401  # only /metrics opens


def test_metrics_histograms_and_one_log_line_per_request(engine, seed, caplog):
    """Time to first token and between tokens as prometheus histograms, and a log line per request
    with its prompt, reuse, tokens, TTFT and rate."""
    rng = random.Random(seed)
    n, new = rng.randint(2, 4), rng.randint(3, 8)
    caplog.set_level(logging.INFO, logger="ftc.serve")
    with serving(engine) as base:
        for i in range(n):
            body = {"model": engine.spec.name, "max_tokens": new, "temperature": 0,
                    "messages": [{"role": "user", "content": f"request {i} {rng.random()}"}]}
            assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(base + "/metrics").text
    rows = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    assert float(rows["ftc_time_to_first_token_seconds_count"]) == n
    assert float(rows['ftc_time_to_first_token_seconds_bucket{le="+Inf"}']) == n
    # a gap before every token but each request's first, which its prompt made: one per decoded token
    assert float(rows["ftc_time_per_output_token_seconds_count"]) == float(rows["ftc_decode_tokens_total"])
    lines = [r.getMessage() for r in caplog.records if r.name == "ftc.serve"]
    assert len(lines) == n, lines
    assert all(re.fullmatch(r"request \d+ (stop|length): prompt \d+ tokens \(\d+ reused\), \d+ generated, "
                            r"TTFT \d+\.\d{3} s, (\d+\.\d tok/s|-)", line) for line in lines), lines


def _bad_requests(model: str) -> dict[str, tuple[str, dict | str]]:
    msg = [{"role": "user", "content": "hi"}]
    return {
        "not_json": ("/v1/chat/completions", "{not json"),
        "empty_body": ("/v1/chat/completions", ""),
        "array_body": ("/v1/chat/completions", "[]"),
        "no_model": ("/v1/chat/completions", {"messages": msg}),
        "no_messages": ("/v1/chat/completions", {"model": model}),
        "empty_messages": ("/v1/chat/completions", {"model": model, "messages": []}),
        "bad_role": ("/v1/chat/completions", {"model": model, "messages": [{"role": "robot", "content": "x"}]}),
        "content_number": ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": 5}]}),
        "image_part": ("/v1/chat/completions", {"model": model, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        "temperature_string": ("/v1/chat/completions", {"model": model, "messages": msg, "temperature": "hot"}),
        "temperature_high": ("/v1/chat/completions", {"model": model, "messages": msg, "temperature": 9}),
        "top_p_zero": ("/v1/chat/completions", {"model": model, "messages": msg, "top_p": 0}),
        "max_tokens_zero": ("/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": 0}),
        "max_tokens_negative": ("/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": -5}),
        "too_long_prompt": ("/v1/chat/completions", {"model": model, "messages": [
            {"role": "user", "content": "word " * 3000}]}),
        "tool_bad_name": ("/v1/chat/completions", {"model": model, "messages": msg, "tools": [
            {"type": "function", "function": {"name": "bad name!"}}]}),
        "tool_no_function": ("/v1/chat/completions", {"model": model, "messages": msg,
                                                      "tools": [{"type": "function"}]}),
        "tool_wrong_type": ("/v1/chat/completions", {"model": model, "messages": msg, "tools": [
            {"type": "retrieval", "function": {"name": "f"}}]}),
        "tool_args_not_json": ("/v1/chat/completions", {"model": model, "messages": msg + [
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
        "too_many_stops": ("/v1/chat/completions", {"model": model, "messages": msg, "stop": list("abcde")}),
        "completion_bad_id": ("/v1/completions", {"model": model, "prompt": [1, 10**7]}),
        "completion_empty": ("/v1/completions", {"model": model, "prompt": ""}),
        "completion_prompt_object": ("/v1/completions", {"model": model, "prompt": {"a": 1}}),
        "two_choices": ("/v1/chat/completions", {"model": model, "messages": msg, "n": 2}),
        "logprobs": ("/v1/chat/completions", {"model": model, "messages": msg, "logprobs": True}),
        "json_schema": ("/v1/chat/completions", {"model": model, "messages": msg, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
        "negative_top_k": ("/v1/chat/completions", {"model": model, "messages": msg, "top_k": -1}),
        "presence_penalty_high": ("/v1/chat/completions", {"model": model, "messages": msg, "presence_penalty": 2.5}),
        "frequency_penalty_string": ("/v1/completions", {"model": model, "prompt": "a", "frequency_penalty": "1"}),
        "repetition_penalty_zero": ("/v1/chat/completions", {"model": model, "messages": msg,
                                                             "repetition_penalty": 0}),
    }


def test_malformed_requests_get_4xx_in_openai_shape_and_the_server_stays_up(url, engine):
    cases = _bad_requests(engine.spec.name)
    assert len(cases) >= 20
    for name, (path, body) in cases.items():
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"], name
    assert httpx.get(url + "/health").json()["status"] == "ok"
    r = client(url).chat.completions.create(model=engine.spec.name, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, temperature=0)
    assert r.choices[0].message is not None


def test_sampling_fields_not_served_are_refused_unless_neutral(url, engine, seed):
    """Every field that would change the answer is honoured or refused: one this server does not
    serve is a 400 naming it, unless it asks for nothing (null or its neutral value)."""
    from ftc_runtime.serve.openai_api import NOT_SERVED

    rng = random.Random(seed)
    msg = [{"role": "user", "content": "hi"}]
    asking = {"logit_bias": {"5": 10}, "top_logprobs": 3, "prompt_logprobs": 1, "best_of": 2, "echo": True,
              "suffix": "end", "min_p": 0.1, "min_tokens": 4, "ignore_eos": True, "stop_token_ids": [3],
              "typical_p": 0.5, "length_penalty": 2.0, "prediction": {"type": "content", "content": "x"},
              "logits_processors": ["p"], "guided_json": {"type": "object"}, "guided_regex": "a+",
              "guided_choice": ["a"], "guided_grammar": "root ::= \"a\""}
    assert set(asking) == set(NOT_SERVED)
    for name in rng.sample(sorted(asking), 6):
        for route, body in (("/v1/chat/completions", {"model": "m", "messages": msg}),
                            ("/v1/completions", {"model": "m", "prompt": "hi"})):
            r = httpx.post(url + route, json=body | {"max_tokens": 2, name: asking[name]}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (route, name, r.text)
            for neutral in (None, *NOT_SERVED[name]):
                ok = httpx.post(url + route, json=body | {"max_tokens": 2, name: neutral}, timeout=60)
                assert ok.status_code == 200, (route, name, neutral, ok.text)


def test_one_tool_call_when_parallel_calls_are_off(engine, monkeypatch, seed):
    """The model answers with two tool calls: both reach the client by default; with OpenAI's
    parallel_tool_calls false, or Anthropic's disable_parallel_tool_use, only the first does,
    streamed or not."""
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}} for n in ("get_weather", "get_time")]
    rng = random.Random(seed)
    names = ["get_weather", "get_time"]
    position = script_tool_call(engine, monkeypatch, tools, *[(n, {"city": rng.choice(["Oslo", "Lima"])})
                                                               for n in names])
    messages = [{"role": "user", "content": "Weather and time?"}]
    atools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in tools]
    with serving(engine) as base:
        c = client(base)
        for parallel, want in ((True, names), (False, names[:1])):
            position.clear()
            r = c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=256,
                                          parallel_tool_calls=parallel)
            assert [t.function.name for t in r.choices[0].message.tool_calls] == want
            position.clear()
            streamed = list(c.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=256,
                                                      parallel_tool_calls=parallel, stream=True))
            assert [d.function.name for ch in streamed for d in ch.choices[0].delta.tool_calls or []] == want
            choice = {"type": "auto", "disable_parallel_tool_use": not parallel}
            position.clear()
            m = aclient(base).messages.create(model="m", max_tokens=256, messages=messages, tools=atools,
                                              tool_choice=choice)
            assert [b.name for b in m.content if b.type == "tool_use"] == want and m.stop_reason == "tool_use"
            position.clear()
            with aclient(base).messages.stream(model="m", max_tokens=256, messages=messages, tools=atools,
                                               tool_choice=choice) as s:
                final = s.get_final_message()
            assert [b.name for b in final.content if b.type == "tool_use"] == want


def test_anthropic_thinking_budget_ends_the_reasoning(engine, monkeypatch, seed):
    """thinking.budget_tokens is enforced: the model (scripted) would reason on, yet its thinking
    block holds exactly the budget's tokens, and the answer goes on after the closing tag."""
    rng = random.Random(seed)
    budget, after = rng.randint(1, 6), rng.randint(1, 4)
    word = engine.tokenizer.encode("a")[0]
    script = [engine.tokenizer.encode("<think>")[0]] + [word] * (budget + after) + [engine.spec.eos_token_ids[0]]
    script_sampler(monkeypatch, script, "_pick")  # sampling's own choice: the budget's forcing stays
    with serving(engine) as base:
        m = aclient(base).messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hm?"}],
                                          thinking={"type": "enabled", "budget_tokens": budget})
    blocks = {b.type: b for b in m.content}
    assert blocks["thinking"].thinking == "a" * budget and blocks["text"].text == "a" * after, m.content


def test_concurrent_streams_and_a_client_that_leaves(url, engine, seed):
    """16 streaming clients, several requests each, decoded in shared steps; one client drops its
    stream after the first chunk, and the others finish with well-formed answers."""
    errors: list[BaseException] = []
    rng = random.Random(seed)
    max_tokens = [[rng.randrange(4, 16) for _ in range(3)] for _ in range(16)]  # drawn before the threads run

    def worker(i: int) -> None:
        try:
            c = client(url)
            for j in range(3):
                stream = c.chat.completions.create(
                    model=engine.spec.name, messages=[{"role": "user", "content": f"client {i} request {j}"}],
                    max_tokens=max_tokens[i][j], temperature=0.8, stream=True)
                if i == 0 and j == 1:
                    next(iter(stream))
                    stream.close()  # gone mid-stream
                    continue
                chunks = list(stream)
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                assert all(ch.object == "chat.completion.chunk" for ch in chunks)
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    metrics = dict(line.split() for line in httpx.get(url + "/metrics").text.splitlines() if line[0] != "#")
    assert float(metrics["ftc_decode_tokens_total"]) > float(metrics["ftc_decode_steps_total"])  # steps were shared
    assert float(metrics["ftc_requests_total"]) >= 47 and float(metrics["ftc_time_to_first_token_seconds_count"]) >= 47
    assert float(metrics["ftc_decode_seconds_total"]) > 0 and float(metrics["ftc_prefill_seconds_total"]) > 0
    deadline = time.time() + 30
    while httpx.get(url + "/health").json()["running"]:
        assert time.time() < deadline, "requests were left running"
        time.sleep(0.1)


def test_ftc_run_serve_binds_loopback_and_answers(engine):
    import subprocess
    import sys

    port = free_port()
    ftc = Path(sys.executable).parent / "ftc"
    proc = subprocess.Popen([str(ftc), "run", str(engine.manifest.root), "--serve", "--port", str(port),
                             "--api-key", KEY], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "ftc run --serve did not come up"
            time.sleep(0.2)
        r = client(f"http://127.0.0.1:{port}", KEY).completions.create(model=engine.spec.name, prompt="Hi",
                                                                        max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_long_prompt_does_not_stall_decoding(engine, seed):
    """While a long prompt is read chunk by chunk, a request that is already decoding keeps getting
    tokens between the chunks; both answers equal what each gets alone."""
    from ftc_runtime.serve.scheduler import Request, Scheduler

    scheduler = Scheduler(engine, max_batch=4, prompt_chunk=32)
    try:
        done = {name: threading.Event() for name in "ab"}
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        during_b: list[bool] = []

        def collect(name: str):
            def on_token(token, reason):
                if token is None:
                    done[name].set()
                    return
                tokens[name].append(token)
                if name == "a":
                    during_b.append(any(r.prompt_ids == long_prompt for r in scheduler.reading))
            return on_token

        rng = random.Random(seed)
        short_prompt = [rng.randrange(256) for _ in range(5)]
        long_prompt = [rng.randrange(256) for _ in range(400)]
        greedy = SamplingParams(0.0)
        scheduler.submit(Request(short_prompt, 40, greedy, collect("a")))
        while not tokens["a"]:
            time.sleep(0.01)
        scheduler.submit(Request(long_prompt, 4, greedy, collect("b")))
        assert done["a"].wait(120) and done["b"].wait(120)
        assert sum(during_b) >= 3  # a's tokens kept coming while b's prompt was being read
        for name, prompt, n in (("a", short_prompt, 40), ("b", long_prompt, 4)):
            assert tokens[name] == list(engine.generate(prompt, n, greedy, stop_at_eos=False))
    finally:
        scheduler.close()



def _served_tokens(engine: Engine, ids: list[int], n: int, sampling: SamplingParams) -> list[int]:
    """The tokens a completion of `ids` shows, from the engine itself: up to end of sequence,
    control tokens left out."""
    from ftc_runtime.chat.tool_parsers import hidden_token_ids, tool_parser

    unseen = hidden_token_ids(engine.tokenizer.special_tokens, tool_parser(engine.tool_parser))
    unseen |= set(engine.spec.eos_token_ids)
    return [t for t in engine.generate(ids, n, sampling, stop_at_eos=True) if t not in unseen]


def test_penalties_reach_the_sampler_and_out_of_range_ones_are_400(url, engine, seed):
    """presence_penalty and frequency_penalty (OpenAI's) and repetition_penalty (vLLM's extension)
    decode as the engine does with them; a value out of range is a 400 that names its field, on
    both OpenAI routes."""
    rng = random.Random(seed)
    for _ in range(100):  # a prompt whose greedy answer repeats a token, which the penalties then avoid
        ids = [rng.randrange(256) for _ in range(rng.randrange(3, 10))]
        plain = _served_tokens(engine, ids, 16, SamplingParams(0.0))
        if len(set(plain)) < len(plain):
            break
    asked = {"presence_penalty": round(rng.uniform(0.5, 2), 2), "frequency_penalty": round(rng.uniform(0, 2), 2),
             "repetition_penalty": round(rng.uniform(2, 10), 2)}
    want = _served_tokens(engine, ids, 16, SamplingParams(0.0, **asked))
    assert want != plain
    body = {"model": "m", "prompt": ids, "max_tokens": 16, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | asked, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == engine.tokenizer.decode(want), r.text
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    assert httpx.post(url + "/v1/chat/completions", json=chat | asked, timeout=60).status_code == 200
    bad = {"presence_penalty": [-2.01, 3, 1e9], "frequency_penalty": [2.5, -3],
           "repetition_penalty": [0, -1.5, 10.5, 1e6]}
    for route, base in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        for field, values in bad.items():
            for value in values:
                r = httpx.post(url + route, json=base | {field: value}, timeout=60)
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == field and field in error["message"], r.text


def _run_together(scheduler, batch: list[tuple[list[int], SamplingParams]], n: int) -> list[tuple]:
    """The requests of `batch` submitted at once (decoded in shared steps): each with its tokens."""
    from ftc_runtime.serve.scheduler import Request

    done, got = [threading.Event() for _ in batch], [[] for _ in batch]

    def collector(i: int):
        return lambda token, reason: got[i].append(token) if token is not None else done[i].set()

    requests = [Request(ids, n, sampling, collector(i)) for i, (ids, sampling) in enumerate(batch)]
    for r in requests:
        scheduler.submit(r)
    assert all(d.wait(120) for d in done)
    return list(zip(requests, got, strict=True))


def test_batched_requests_penalize_each_their_own_history(engine_dir, engine, seed):
    """Requests decoded in shared steps, one resumed from the prefix cache, each penalize their own
    prompt (the part restored from the cache included) and their own answer: each gets what
    Engine.generate gives it alone, without a cache."""
    from ftc_runtime.serve.scheduler import Scheduler

    cached = Engine.load(engine_dir)
    cached.enable_prefix_cache(64 << 20, 64 << 20)
    rng, n = random.Random(seed), 20
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 12))] for _ in range(4)]
    samplings = [SamplingParams(0.0, repetition_penalty=rng.uniform(1.5, 10)),
                 SamplingParams(0.0, presence_penalty=rng.uniform(0.5, 2), frequency_penalty=rng.uniform(0, 2)),
                 SamplingParams(0.0),
                 SamplingParams(0.0, repetition_penalty=rng.uniform(1.1, 3), frequency_penalty=-1.0)]
    scheduler = Scheduler(cached, max_batch=4)
    try:
        first = _run_together(scheduler, list(zip(prompts, samplings, strict=True)), n)
        # the first prompt again with its answer and more after it: resumed from the cache
        longer = prompts[0] + first[0][1] + [rng.randrange(256) for _ in range(3)]
        second = _run_together(scheduler, [(longer, samplings[0]), (prompts[1], samplings[3])], n)
        assert second[0][0].reused_tokens >= len(prompts[0])
        for r, tokens in first + second:
            assert tokens == list(engine.generate(r.prompt_ids, n, r.sampling, stop_at_eos=False)), r.sampling
    finally:
        scheduler.close()
