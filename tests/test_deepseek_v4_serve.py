"""DeepSeek-V4 served: its template opens the answer's reasoning (the prompt ends with `<think>` when
thinking is on), so the server reads the answer's text from the start as reasoning up to
`</think>`, streamed or not; a forced tool call closes that reasoning before the call's tag."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from ftc.compile.pipeline import CompileOptions, compile_engine  # noqa: E402
from ftc_runtime import Engine  # noqa: E402
from ftc_runtime.serve.server import Server, ServerConfig  # noqa: E402

from live_server import script_sampler, serving  # noqa: E402

SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "deepseek-v4-tiny.yaml"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    out = tmp_path_factory.mktemp("dsv4") / "engine"
    return Engine.load(compile_engine(CompileOptions(source=SPEC, target="cpu", random_weights=True, output=out)))


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 5))) for _ in range(n))


def test_the_answer_reasons_first_streamed_or_not(engine, monkeypatch, seed):
    rng = random.Random(seed)
    reasoning, answer = _words(rng, rng.randint(1, 6)), _words(rng, rng.randint(1, 6))
    script = engine.tokenizer.encode(f"{reasoning}</think>{answer}") + [engine.spec.eos_token_ids[0]]
    positions = script_sampler(monkeypatch, script)
    messages = [{"role": "user", "content": _words(rng, 3)}]
    with serving(engine) as base:
        api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        whole = api.chat.completions.create(model="m", messages=messages, max_tokens=64).choices[0].message
        positions.clear()
        parts = {"reasoning_content": "", "content": ""}
        for chunk in api.chat.completions.create(model="m", messages=messages, max_tokens=64, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            for kind in parts:
                parts[kind] += (getattr(delta, kind, None) or "") if delta is not None else ""
    assert (whole.reasoning_content, whole.content) == (reasoning, answer)
    assert (parts["reasoning_content"], parts["content"]) == (reasoning, answer)


def test_a_forced_call_closes_the_opened_reasoning(engine):
    server = Server(engine, ServerConfig(model_name="m"))
    messages = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    ids, opening = asyncio.run(server.prompt_ids(messages, tools))
    assert opening == "<think>" and engine.tokenizer.decode(ids).endswith("<｜Assistant｜><think>")
    forced, opening = asyncio.run(server.prompt_ids(messages, tools, force_call=True))
    assert forced[:len(ids)] == ids and opening == "<｜DSML｜tool_calls>\n"
    assert engine.tokenizer.decode(forced[len(ids):]) == "</think><｜DSML｜tool_calls>\n"
    _, opening = asyncio.run(server.prompt_ids(messages, tools, enable_thinking=False))
    assert opening == ""
