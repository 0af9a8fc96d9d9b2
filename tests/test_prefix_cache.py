"""The prefix cache (radix tree of KV, recurrent-state checkpoints at boundary tokens) over a
scripted agent session: turns that grow the context, tool outputs, and an edit that shortens an
old tool output. Greedy tokens never depend on the cache; what it saves is exactly the prefix that
a correct cache can restore."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.bench.agent import markers
from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine, SamplingParams
from ftc_runtime.cache.prefix import PrefixCache

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
NEW = 6  # greedy tokens per turn


@pytest.fixture(scope="module", params=["qwen3-moe-tiny", "qwen3.6-moe-tiny", "glm-5-tiny", "deepseek-v4-tiny"])
def engine_dir(request, tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=SPECS / f"{request.param}.yaml", target="cpu", random_weights=True,
                                         seed=3, output=tmp_path_factory.mktemp("prefix") / request.param))


def _session(engine: Engine, rng: random.Random) -> list[list[int]]:
    """Prompts of an agent session in the family's chat format (the agent bench's markers); the
    assistant's turns are filled in by `_run`."""
    m = markers(engine.spec.tokens.special)

    def text(n: int) -> list[int]:
        return [rng.randrange(400) for _ in range(n)]

    system = [*m.user, *text(30), *m.close]
    turns = [[*m.user, *text(12), *m.close, *m.assistant],
             [m.call, *text(8), m.call_end, m.resp, *text(rng.randrange(60, 120)), m.resp_end],
             [*m.user, *text(10), *m.close, *m.assistant],
             [m.call, *text(6), m.call_end, m.resp, *text(rng.randrange(60, 120)), m.resp_end],
             [*m.user, *text(9), *m.close, *m.assistant]]
    return [system, *turns]


def _run(engine: Engine, parts: list[list[int]], edit_at: int | None) -> tuple[list[list[int]], list[int], list[int]]:
    """Runs the session turn by turn (each prompt: the whole history). With `edit_at`, the last turn
    resends the history with tool output number `edit_at` cut to a 3-token placeholder. Returns
    the generated tokens, the prompt tokens restored from the cache, and the prompts."""
    history, outs, reused, prompts = list(parts[0]), [], [], []
    bodies: list[tuple[int, int]] = []  # (start, end) of each tool output's body in the history
    m = markers(engine.spec.tokens.special)
    resp, resp_end = m.resp, m.resp_end
    for part in parts[1:]:
        if resp in part:
            a = len(history) + part.index(resp) + 1
            bodies.append((a, len(history) + part.index(resp_end)))
        history += part
        gen = engine.generate(history, NEW, SamplingParams(0.0), stop_at_eos=False)
        outs.append(list(gen))
        reused.append(gen.stats.reused_tokens)
        prompts.append(list(history))
        history += outs[-1] + (m.close or m.user)
    if edit_at is not None:
        a, b = bodies[edit_at]
        history = history[:a] + history[a:a + 3] + history[b:]
        gen = engine.generate(history, NEW, SamplingParams(0.0), stop_at_eos=False)
        outs.append(list(gen))
        reused.append(gen.stats.reused_tokens)
        prompts.append(list(history))
    return outs, reused, prompts


def _expected_reuse(engine: Engine, prompts: list[list[int]], outs: list[list[int]]) -> list[int]:
    """What a correct cache restores for each prompt: the longest prefix shared with an earlier
    sequence (its prompt and all but its last generated token), at most all but the prompt's last
    token; for a hybrid model only up to just after a boundary token (a checkpoint)."""
    seen, want = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        lcp = 0
        for s in seen:
            n = 0
            while n < min(len(s), len(prompt) - 1) and s[n] == prompt[n]:
                n += 1
            lcp = max(lcp, n)
        if engine.spec.resumes_at_checkpoints:
            lcp = max([i + 1 for i in range(lcp) if prompt[i] in engine.boundary_ids], default=0)
        want.append(lcp)
        seen.append(prompt + out[:-1])
    return want


@pytest.mark.parametrize("edit_at", [0, 1])
def test_an_agent_session_decodes_the_same_with_and_without_the_cache(engine_dir, edit_at, seed):
    engine = Engine.load(engine_dir)
    parts = _session(engine, random.Random(seed))
    plain, none_reused, _ = _run(engine, parts, edit_at)
    assert none_reused == [0] * len(none_reused)
    cached = Engine.load(engine_dir)
    cache = cached.enable_prefix_cache(kv_budget=1 << 30, checkpoint_budget=1 << 30)
    outs, reused, prompts = _run(cached, parts, edit_at)
    assert outs == plain
    assert reused == _expected_reuse(cached, prompts, outs)
    assert reused[-1] > 0 and cache.stats.hits > 0
    if cached.spec.resumes_at_checkpoints:
        assert cache.checkpoints > 0 and cache.checkpoint_used > 0


@pytest.mark.parametrize("budgets", [(20_000, 1 << 30), (1 << 30, 30_000), (4_000, 4_000)])
def test_tiny_budgets_evict_and_keep_outputs_correct(engine_dir, budgets, seed):
    engine = Engine.load(engine_dir)
    parts = _session(engine, random.Random(seed))
    plain, _, _ = _run(engine, parts, 0)
    cached = Engine.load(engine_dir)
    cache = cached.enable_prefix_cache(*budgets)
    outs, _, _ = _run(cached, parts, 0)
    assert outs == plain
    assert cache.kv_used <= budgets[0] and cache.checkpoint_used <= budgets[1]
    if budgets[0] < 1 << 30 and cached.model.new_cache().kv.num_layers:  # DeepSeek-V4 keeps no per-token KV
        assert cache.stats.kv_evictions > 0
    if budgets[1] < 1 << 30 and cached.spec.resumes_at_checkpoints:
        assert cache.stats.checkpoint_evictions + cache.stats.kv_evictions > 0


def test_without_room_for_checkpoints_prompts_capture_none(engine_dir, seed):
    """KV only (`--no-checkpoints`): a hybrid model cannot resume without a checkpoint, so its
    prompts capture none (each capture costs one more recurrence call per linear layer) and
    restore nothing; a pure-attention model restores its KV as before. Outputs never change."""
    engine = Engine.load(engine_dir)
    parts = _session(engine, random.Random(seed))
    plain, _, _ = _run(engine, parts, 0)
    cached = Engine.load(engine_dir)
    cache = cached.enable_prefix_cache(1 << 30, 0)
    outs, reused, _ = _run(cached, parts, 0)
    assert outs == plain
    assert cache.checkpoints == 0 and cache.stats.checkpoint_evictions == 0
    if cached.spec.resumes_at_checkpoints:
        assert not any(reused)
    else:
        assert reused[-1] > 0


def test_held_nodes_are_never_evicted(engine_dir, seed):
    """A sequence that resumed from the cache holds its nodes: inserting others under a budget
    too small for anything evicts everything else, never them; once released, they go too."""
    rng = random.Random(seed)
    engine = Engine.load(engine_dir)
    recurrent = engine.spec.resumes_at_checkpoints
    cache = PrefixCache(kv_budget=1 << 30, checkpoint_budget=1 << 30, recurrent=recurrent)
    boundary = engine.spec.token_id(engine.spec.tokens.boundaries[-1])
    first = [rng.randrange(400) for _ in range(20)] + [boundary] + [rng.randrange(400) for _ in range(5)]
    seq = engine.model.new_cache()
    engine.prefill(torch.tensor(first), seq, checkpoints=recurrent)
    cache.insert(first, seq, seq.checkpoints if recurrent else {})
    resumed = engine.model.new_cache()
    held = cache.resume(first + [1], resumed)
    assert held.length == (21 if recurrent else len(first))
    cache.kv_budget = cache.checkpoint_budget = 0
    for _ in range(3):
        other = [400 + rng.randrange(100) for _ in range(15)]
        s = engine.model.new_cache()
        engine.prefill(torch.tensor(other), s)
        cache.insert(other, s, {})
    nodes = cache._nodes()
    assert all(n in nodes for n in held.held) and cache.stats.kv_evictions >= 3
    cache.release(held)
    cache.insert(first[:2], seq, {})  # any insert runs the eviction again
    assert cache._nodes() == [] and cache.kv_used == 0


def test_the_server_scheduler_resumes_from_the_prefix_cache(engine_dir, seed):
    """Requests through the serving scheduler: the second one's prompt extends the first's
    conversation; its tokens equal the engine's own without a cache, and it resumed after a
    cached prefix (after a boundary token, for a hybrid model)."""
    import threading

    from ftc_runtime.serve.scheduler import Request, Scheduler

    rng = random.Random(seed)
    plain = Engine.load(engine_dir)
    cached = Engine.load(engine_dir)
    prefix = cached.enable_prefix_cache(1 << 30, 1 << 30)
    scheduler = Scheduler(cached, max_batch=4, prompt_chunk=16)
    end = cached.spec.token_id(cached.spec.tokens.boundaries[-1])

    def run(ids: list[int]) -> list[int]:
        out, done = [], threading.Event()

        def on_token(token, reason):
            if token is not None:
                out.append(token)
            if reason is not None:
                done.set()
        scheduler.submit(Request(ids, NEW, SamplingParams(0.0), on_token))
        assert done.wait(120)
        return out

    try:
        first = [rng.randrange(400) for _ in range(40)] + [end] + [rng.randrange(400) for _ in range(30)]
        got = run(first)
        assert got == list(plain.generate(first, NEW, SamplingParams(0.0), stop_at_eos=False))
        second = first + got + [end] + [rng.randrange(400) for _ in range(20)]
        got2 = run(second)
        assert got2 == list(plain.generate(second, NEW, SamplingParams(0.0), stop_at_eos=False))
        assert prefix.stats.reused_tokens == _expected_reuse(cached, [first, second], [got, got2])[1] > 0
    finally:
        scheduler.close()


def test_the_agent_bench_reports_what_each_mode_reuses(engine_dir, seed):
    """`ftc bench agent ENGINE` in its three modes: per turn, restored + prefilled tokens make the
    prompt; without a cache nothing is restored, without checkpoints a hybrid model restores
    nothing (its linear layers need their state) while a pure-attention one still does; with the
    cache every turn after the first resumes, and the edit turn exactly after the last boundary
    token before the edited tool output (for a pure-attention model: right after the tokens the
    edit kept)."""
    from ftc.bench.agent import EDITED, agent_session, bench_agent

    result = bench_agent(engine_dir, None, ["cache", "no-checkpoints", "no-prefix-cache"], 700, 120,
                         kv_budget=1 << 30, checkpoint_budget=1 << 30, new_tokens=2, seed=seed)
    engine = Engine.load(engine_dir)
    hybrid = engine.spec.resumes_at_checkpoints
    for mode, run in result["runs"].items():
        for row in run["turns"]:
            assert row["reused_tokens"] + row["prefilled_tokens"] == row["prompt_tokens"]
            if mode == "no-prefix-cache" or (mode == "no-checkpoints" and hybrid):
                assert row["reused_tokens"] == 0
    assert set(result["edit_speedup"]) == {"cache", "no-checkpoints", "no-prefix-cache"}
    turns = result["runs"]["cache"]["turns"]
    assert turns[0]["reused_tokens"] == 0 and all(r["reused_tokens"] > 0 for r in turns[1:])
    history, starts = [], []
    resp = markers(engine.spec.tokens.special).resp
    for turn in agent_session(engine, 700, 120, seed)[:-1]:
        if resp in turn.tokens:
            starts.append(len(history) + turn.tokens.index(resp))
        history += turn.tokens
    start = starts[EDITED]  # the edit keeps <tool_response> and changes what follows
    want = start + 1 if not hybrid else max(i + 1 for i in range(start + 1) if history[i] in engine.boundary_ids)
    assert turns[-1]["kind"] == "edit" and turns[-1]["reused_tokens"] == want
