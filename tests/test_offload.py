"""The offloaded expert path (slot cache + miss split, the device played by the CPU) computes what
the all-CPU path computes, whatever the slot count, miss policy and cache policy."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ftc.cli.options import size as parse_size
from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.miss_planner import MISS_POLICIES, MissPlanner
from ftc_runtime.experts.offload import OffloadedExperts
from ftc_runtime.experts.recurrence import recurring_pairs
from ftc_runtime.experts.routing_trace import TraceReplay, synthetic_trace
from ftc_runtime.experts.vram_plan import VramError, plan_vram

from slot_checks import check_slots_hold_their_rows


@pytest.mark.parametrize("run", range(12))
def test_offloaded_experts_equal_cpu_experts(cpu_engine, run, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cpu = cpu_engine.model.experts
    e, k, layers = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, len(cpu_engine.spec.moe_layers)
    n_slots = rng.choice([0, 1, 3, k, 2 * k, e * layers])
    planner = MissPlanner(rng.choice(MISS_POLICIES), rng.uniform(5, 60), rng.uniform(5, 120))
    off = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), n_slots, planner, rng.choice(["lru", "static"]))
    for step in range(25):
        t = rng.choice([1, 1, 2, 5, 17])
        layer = rng.randrange(layers)
        # Skewed routing, so that the cache sees reuse as in real decoding.
        ids = torch.stack([torch.tensor(rng.sample(range(e), k)) if rng.random() < 0.3
                           else torch.tensor(rng.sample(range(min(e, k + 3)), k)) for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        x = torch.randn(t, cpu_engine.spec.hidden_size, generator=g)
        ref = cpu.forward(layer, x, ids, w)
        got = off.forward(layer, x, ids, w)
        rel = float((got - ref).norm() / ref.norm())
        assert rel < 1e-5, f"step {step}, policy {planner.policy}/{off.cache.policy}, slots {n_slots}: {rel:.2e}"
        if step == 5:
            off.end_of_prompt()
        check_slots_hold_their_rows(off)
        assert off.cache.resident <= n_slots
    s = off.stats
    assert s.hits + s.fills + s.cpu == s.unique
    if n_slots == 0 or (planner.policy == "cpu" and off.cache.policy == "lru"):
        assert s.fills == 0 and s.hits == 0
    if off.cache.policy == "static":
        assert s.fills == 0  # pinned once after the prompt, never filled on a miss
    if planner.policy == "gpu" and off.cache.policy == "lru" and n_slots >= e * layers:
        assert s.cpu == 0


@pytest.mark.parametrize("run", range(8))
def test_native_one_token_plan_equals_the_general_path(cpu_engine, run, seed):
    """One-token calls planned natively (TokenPlanner) leave the same outputs, cache state and
    counts as the general numpy path, step after step, prompts (several tokens) in between."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cpu = cpu_engine.model.experts
    e, k, layers = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, len(cpu_engine.spec.moe_layers)
    n_slots = rng.choice([0, 1, k - 1, k, 2 * k + 1, e * layers])
    planner = MissPlanner(rng.choice(MISS_POLICIES), rng.uniform(5, 60), rng.uniform(5, 120))
    policy = rng.choice(["lru", "lru", "static"])
    native, general = (OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), n_slots, planner, policy)
                       for _ in range(2))
    general.native_token_plan = False
    for step in range(40):
        t = rng.choice([1, 1, 1, 1, 3])
        layer = rng.randrange(layers)
        hot = range(min(e, k + 4))
        ids = torch.stack([torch.tensor(rng.sample(hot if rng.random() < 0.7 else range(e), k)) for _ in range(t)])
        w, x = torch.rand(t, k, generator=g), torch.randn(t, cpu_engine.spec.hidden_size, generator=g)
        got, want = native.forward(layer, x, ids, w), general.forward(layer, x, ids, w)
        assert torch.equal(got, want), f"step {step}"
        for name in ("slot_of", "id_of", "last_used"):
            assert np.array_equal(getattr(native.cache, name), getattr(general.cache, name)), f"step {step}: {name}"
        assert native.cache.step == general.cache.step
        if step == 6:
            native.end_of_prompt()
            general.end_of_prompt()
    counts = ("calls", "unique", "hits", "fills", "cpu")
    assert [native.stats.to_dict()[c] for c in counts] == [general.stats.to_dict()[c] for c in counts]
    assert native.host_split.token is not None and general.host_split.token is None
    check_slots_hold_their_rows(native)


def test_adaptive_split_sends_q_misses_to_the_device(cpu_engine, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cpu = cpu_engine.model.experts
    e, k = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k
    planner = MissPlanner("adaptive", 25.0, 50.0)
    off = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), 64, planner, "lru")
    ids = torch.tensor([rng.sample(range(e), k)])
    off.forward(0, torch.randn(1, cpu_engine.spec.hidden_size, generator=g), ids, torch.rand(1, k, generator=g))
    assert (off.stats.fills, off.stats.cpu) == (planner.fills(k), k - planner.fills(k))
    off.forward(0, torch.randn(1, cpu_engine.spec.hidden_size, generator=g), ids, torch.rand(1, k, generator=g))
    assert off.stats.hits == planner.fills(k)  # the filled experts are hits the next time


@pytest.mark.parametrize("native", [True, False])
def test_misses_the_cpu_computed_lately_are_filled(cpu_engine, native, seed):
    """Adaptive with a slow link sends one of k misses to the device; when the same experts come
    back within `recent_tokens` tokens, every one the CPU computed is filled (and then hit), and
    without the window (recent_tokens 0) the split stays at one."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cpu = cpu_engine.model.experts
    e, k, hidden = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, cpu_engine.spec.hidden_size
    layers = len(cpu_engine.spec.moe_layers)
    for window in (4, 0):
        planner = MissPlanner("adaptive", 1.0, 100.0, recent_tokens=window)
        off = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), 64, planner, "lru")
        off.native_token_plan = native
        ids = torch.tensor([rng.sample(range(e), k)])
        layer = rng.randrange(layers)
        got = [off.forward(layer, torch.randn(1, hidden, generator=g), ids, torch.rand(1, k, generator=g))
               for _ in range(3)]
        assert all(o.isfinite().all() for o in got)
        s = off.stats
        assert planner.fills(k) == 1
        if window:  # token 1: 1 fill, k - 1 on the CPU; token 2: 1 hit, k - 1 fills; token 3: k hits
            assert (s.hits, s.fills, s.cpu) == (1 + k, k, k - 1)
        else:  # one more fill a token: hits 0, 1, 2
            assert (s.hits, s.fills, s.cpu) == (3, 3, 3 * k - 6)
        check_slots_hold_their_rows(off)


def test_recurring_pairs_are_what_a_brute_force_count_finds(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(30):
        e, t, w = rng.randrange(2, 40), rng.randrange(1, 60), rng.randrange(1, 9)
        k = rng.randrange(1, e + 1)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        rows = ids.tolist()
        want = sum(1 for i in range(w, t) for x in rows[i] if any(x in rows[i - d] for d in range(1, w + 1)))
        assert int(recurring_pairs(ids, e, w)) == want, f"seed={seed}: E {e}, k {k}, T {t}, W {w}"


@pytest.mark.parametrize("slots", [24, 40])  # 40: the prompt streams whole layers (2 × 16 slots lent)
def test_the_recency_rule_runs_where_the_prompts_routing_recurs(engine_dir, slots, seed):
    """Prompts replaying synthetic routing: a local one (each token keeps each of its experts with
    probability 0.95) keeps the adaptive split's recency window, a uniform one turns it off, a local
    one turns it on again; each answer decodes on with the slots holding their rows."""
    engine = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=slots, miss_policy="adaptive"))
    experts, spec = engine.model.experts, engine.spec
    rng = random.Random(seed)
    window = experts.planner.recent_tokens
    assert window > 0
    for locality, zipf, want in ((0.95, 1.0, window), (0.0, 0.0, 0), (0.95, 1.0, window)):
        trace = synthetic_trace(512, len(spec.moe_layers), spec.moe.num_experts, spec.moe.top_k, locality, zipf,
                                rng.randrange(1 << 30))
        experts.routing = TraceReplay(trace)
        prompt = [rng.randrange(256) for _ in range(200)]
        out = list(engine.generate(prompt, 8, SamplingParams(0.0), stop_at_eos=False))
        assert len(out) == 8 and experts.planner.recent_tokens == want, f"seed={seed}: locality {locality}"
        check_slots_hold_their_rows(experts)


@pytest.mark.parametrize("miss_policy,cache_policy,slots", [("adaptive", "lru", 5), ("gpu", "lru", 20),
                                                          ("cpu", "lru", 8), ("half", "static", 12),
                                                          ("adaptive", "static", 3)])
def test_engine_greedy_tokens_equal_the_cpu_engine(engine_dir, cpu_engine, miss_policy, cache_policy, slots, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(rng.randrange(4, 30))]
    want = list(cpu_engine.generate(ids, 24, SamplingParams(0.0), stop_at_eos=False))
    cfg = OffloadConfig(device="cpu", n_slots=slots, miss_policy=miss_policy, cache_policy=cache_policy,
                        b_p=rng.uniform(5, 50), b_h=rng.uniform(20, 100))
    off = Engine.load(engine_dir, offload=cfg)
    assert list(off.generate(ids, 24, SamplingParams(0.0), stop_at_eos=False)) == want
    assert torch.allclose(off.logits(ids), cpu_engine.logits(ids), rtol=1e-4, atol=1e-4)
    assert off.model.experts.cache.resident <= slots


def test_vram_budget_is_respected(engine_dir, cpu_engine, seed):
    rng = random.Random(seed)
    spec = cpu_engine.spec
    dense = 2 * sum(t.numel() for t in cpu_engine.model.w.values()) + 2 * cpu_engine.model.embed.numel()
    stride = cpu_engine.pool.header.expert_stride
    for _ in range(20):
        budget = rng.randrange(8 << 20, 64 << 20)
        try:
            plan = plan_vram(spec, dense, budget, stride, cpu_engine.pool.header.num_rows, 512)
        except VramError as e:
            assert "leave no room" in str(e)
            continue
        assert plan.total <= budget
        free = budget - plan.dense - plan.kv - plan.workspace
        assert plan.n_slots == min(cpu_engine.pool.header.num_rows, free // stride)
    off = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", vram_budget=70 << 20, max_context=512))
    assert off.vram.total <= 70 << 20
    assert off.model.experts.store.slots.numel() == off.vram.slots
    with pytest.raises(VramError, match="leave no room"):
        Engine.load(engine_dir, offload=OffloadConfig(device="cpu", vram_budget=1 << 20))
    with pytest.raises(ValueError, match="--slots"):
        Engine.load(engine_dir, offload=OffloadConfig(device="cpu", vram_budget=70 << 20, n_slots=10**6,
                                                      max_context=512))


def test_parse_size():
    assert parse_size("32GiB") == 32 << 30 and parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5gib") == int(1.5 * 2**30) and parse_size("4096") == 4096
    for bad in ("", "GiB", "12 parsecs", "-1GiB"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    assert np.isclose(parse_size("1e9"), 10**9)


def uncached(stats) -> int:
    """Experts that streamed chunks found uncached: copied, or computed on the CPU in place (the
    prompt split, on by default where the engine has rates)."""
    return stats.streamed + stats.stream_cpu


def _prefill(engine: Engine, ids: list[int]):
    cache = engine.model.new_cache()
    logits = engine.prefill(torch.tensor(ids), cache, all_logits=True)
    return logits, cache


@pytest.mark.parametrize("overlap,slots,chunk", [(True, 40, 13), (False, 16, 11), (True, 32, 64),
                                                 (True, 64, 12), (True, 31, 13), (False, 15, 20)])
def test_prefill_streaming_equals_the_cpu_engine(engine_dir, cpu_engine, overlap, slots, chunk, seed):
    """Prompt chunks stream whole MoE layers through one or two layer buffers borrowed from the
    cache (E = 16 slots each) when the chunk is long enough and the cache can lend them; otherwise
    (31 < 2E, 15 < E) routed experts load on demand. Logits of every token and the KV cache equal
    the all-CPU engine's, chunks split the prompt unevenly, and streamed slots stay valid entries.
    Every uncached expert is copied here (no prompt split: test_prompt_split.py has it)."""
    rng = random.Random(seed)
    e = cpu_engine.spec.moe.num_experts
    ids = [rng.randrange(256) for _ in range(rng.randrange(30, 60))]
    threshold = rng.choice([None, rng.randrange(1, 70)])  # None: the plan's
    cfg = OffloadConfig(device="cpu", n_slots=slots, b_p=rng.uniform(5, 50), b_h=rng.uniform(20, 100),
                        prefill_overlap=overlap, stream_min_tokens=threshold, prefill_split="off")
    off = Engine.load(engine_dir, offload=cfg, prefill_chunk=chunk)
    threshold = threshold or off.manifest.plan.prefill_stream_min_tokens
    got, got_cache = _prefill(off, ids)
    want, want_cache = _prefill(cpu_engine, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    for layer in range(cpu_engine.spec.num_layers):
        assert torch.allclose(got_cache.kv.keys(layer), want_cache.kv.keys(layer), rtol=1e-4, atol=1e-5)
        assert torch.allclose(got_cache.kv.values(layer), want_cache.kv.values(layer), rtol=1e-4, atol=1e-5)
    experts = off.model.experts
    streams = slots >= experts.stream_slots
    n_moe = len(cpu_engine.spec.moe_layers)
    full_chunks = sum(1 for i in range(0, len(ids), chunk) if len(ids[i:i + chunk]) >= threshold)
    assert experts.stats.stream_layers == (n_moe * full_chunks if streams else 0)
    assert experts.stream_slots == e * (2 if overlap else 1)
    check_slots_hold_their_rows(experts)
    last_chunk = ids[(len(ids) - 1) // chunk * chunk:]
    if streams and len(last_chunk) >= threshold:
        # the last layer streamed stays cached for decode, and the layers before it fill every
        # slot (streaming takes the slots it has not used first, not two fixed buffers)
        last = (n_moe - 1) * e + np.arange(e)
        assert (experts.cache.slot_of[last] >= 0).all()
        assert experts.cache.resident == min(slots, n_moe * e)


def test_copies_start_at_the_first_uncached_layer(cpu_engine, seed):
    """With the first two MoE layers cached, streaming queues layer 2's copies while layer 0
    computes (layer 1 needs none) and goes no further; outputs equal the CPU experts'."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cpu = cpu_engine.model.experts
    e, k, hidden = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, cpu_engine.spec.hidden_size
    off = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), 4 * e, MissPlanner("adaptive", 20.0, 40.0),
                           stream_min_tokens=8)
    cached = np.arange(2 * e)
    off.cache.install(cached, cached)
    off.store.copy_rows_now(cached, cached)
    t = rng.randrange(8, 40)
    off.begin_pass(t)
    for layer in range(2):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w, x = torch.rand(t, k, generator=g), torch.randn(t, hidden, generator=g)
        got = off.forward(layer, x, ids, w)
        assert torch.allclose(got, cpu.forward(layer, x, ids, w), rtol=1e-5, atol=1e-5)
        if layer == 0:
            assert off._stream.loaded == {0: 0, 1: 0, 2: e}
    assert off.stats.streamed == e
    check_slots_hold_their_rows(off)


@pytest.mark.parametrize("overlap,slots", [(True, 40), (True, 56), (False, 40), (True, 32)])
def test_a_second_streamed_chunk_finds_the_first_layers_cached(engine_dir, cpu_engine, overlap, slots, seed):
    """Two full chunks stream every MoE layer; the first leaves its first layers cached (all but
    the layer buffers' worth of slots), so the second streams only the rest: at most the pool's
    experts less the slots beyond the buffers. Logits still equal the all-CPU engine's."""
    rng = random.Random(seed)
    e, n_moe = cpu_engine.spec.moe.num_experts, len(cpu_engine.spec.moe_layers)
    cfg = OffloadConfig(device="cpu", n_slots=slots, b_p=20.0, b_h=40.0, prefill_overlap=overlap)
    chunk = 24
    off = Engine.load(engine_dir, offload=cfg, prefill_chunk=chunk)
    assert chunk >= off.manifest.plan.prefill_stream_min_tokens
    ids = [rng.randrange(256) for _ in range(2 * chunk)]
    experts = off.model.experts
    first, cache = _prefill(off, ids[:chunk])
    streamed_first = uncached(experts.stats)
    second = off.prefill(torch.tensor(ids[chunk:]), cache, all_logits=True)
    streamed_second = uncached(experts.stats) - streamed_first
    assert experts.stats.stream_layers == 2 * n_moe
    assert streamed_first == n_moe * e
    buffers = e * (2 if overlap else 1)
    assert streamed_second <= n_moe * e - (slots - buffers)
    want, _ = _prefill(cpu_engine, ids)
    assert torch.allclose(torch.cat([first, second]), want, rtol=1e-4, atol=1e-4)
    check_slots_hold_their_rows(experts)


@pytest.mark.parametrize("overlap", [True, False])
def test_turns_of_an_agent_stream_at_most_the_uncached_share(engine_dir, cpu_engine, overlap, seed):
    """An agent's turns: prompt chunks streamed whole, a few decode steps (LRU fills) between.
    Every chunk after the first streams at most the pool less the slots beyond the buffers, as a
    second chunk straight after the first does (the earlier rule, evicting what the chunk had not
    used yet, streamed 87 % of the pool per turn with 45 % of it cached); logits equal the all-CPU
    engine's throughout."""
    rng = random.Random(seed)
    e, n_moe = cpu_engine.spec.moe.num_experts, len(cpu_engine.spec.moe_layers)
    buffers = e * (2 if overlap else 1)
    slots = rng.randrange(buffers + 1, n_moe * e)
    chunk = 24
    off = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=slots, b_p=20.0, b_h=40.0,
                                                        prefill_overlap=overlap), prefill_chunk=chunk)
    experts = off.model.experts
    ids = [rng.randrange(256) for _ in range(5 * (chunk + 3))]
    got, cache = [], off.model.new_cache()
    for turn in range(5):
        prompt, answer = ids[turn * (chunk + 3):][:chunk], ids[turn * (chunk + 3) + chunk:][:3]
        before = uncached(experts.stats)
        got.append(off.prefill(torch.tensor(prompt), cache, all_logits=True))
        if turn:
            assert uncached(experts.stats) - before <= n_moe * e - (slots - buffers)
        got += [off.model.forward(torch.tensor([t]), cache) for t in answer]
    want, _ = _prefill(cpu_engine, ids)
    assert torch.allclose(torch.cat(got), want, rtol=1e-4, atol=1e-4)
    check_slots_hold_their_rows(experts)


@pytest.mark.parametrize("offloaded", [False, True])
def test_batched_decode_equals_one_sequence_at_a_time(engine_dir, cpu_engine, offloaded, seed):
    """Sequences of different lengths decoded together (one call per step) give each sequence the
    logits it gets alone; on the emulated device too, whose experts see the batch as one call."""
    rng = random.Random(seed)
    engine = cpu_engine if not offloaded else Engine.load(engine_dir, offload=OffloadConfig(
        device="cpu", n_slots=rng.choice([3, 12, 40]), b_p=20.0, b_h=40.0))
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 20))] for _ in range(rng.randrange(2, 6))]
    steps = [[rng.randrange(256) for _ in range(6)] for _ in prompts]
    model = engine.model
    caches = [model.new_cache() for _ in prompts]
    for ids, cache in zip(prompts, caches, strict=True):
        model.forward(torch.tensor(ids), cache)
    batched = [model.decode_batch([s[t] for s in steps], caches) for t in range(6)]
    for j, (ids, cache) in enumerate(zip(prompts, caches, strict=True)):
        alone = model.new_cache()
        model.forward(torch.tensor(ids), alone)
        for t in range(6):
            want = model.forward(torch.tensor([steps[j][t]]), alone)[-1]
            assert torch.allclose(batched[t][j], want, rtol=1e-4, atol=1e-4), (j, t)
        assert cache.length == alone.length


def test_a_failed_streamed_chunk_leaves_no_pass_behind(engine_dir, cpu_engine, monkeypatch, seed):
    """A prompt chunk that fails halfway through its streamed layers must not leave its layer stream
    to the next call: a decode batch after it streams nothing and computes what the CPU engine does."""
    from ftc_runtime.experts.layer_stream import LayerStream

    rng = random.Random(seed)
    off = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=40, b_p=20.0, b_h=40.0))
    real = LayerStream.forward

    def fail_on_layer_1(self, j, *args):
        if j == 1:
            raise RuntimeError("injected")
        return real(self, j, *args)

    prompts = [[rng.randrange(256) for _ in range(rng.randrange(2, 9))] for _ in range(3)]
    got_caches, want_caches = [off.model.new_cache() for _ in prompts], [cpu_engine.model.new_cache() for _ in prompts]
    for p, g, w in zip(prompts, got_caches, want_caches, strict=True):
        off.model.forward(torch.tensor(p), g)
        cpu_engine.model.forward(torch.tensor(p), w)
    monkeypatch.setattr(LayerStream, "forward", fail_on_layer_1)
    with pytest.raises(RuntimeError, match="injected"):
        off.model.forward(torch.tensor([rng.randrange(256) for _ in range(30)]), off.model.new_cache())
    monkeypatch.setattr(LayerStream, "forward", real)
    step = [rng.randrange(256) for _ in prompts]
    streamed = off.model.experts.stats.stream_layers
    got, want = off.model.decode_batch(step, got_caches), cpu_engine.model.decode_batch(step, want_caches)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    assert off.model.experts.stats.stream_layers == streamed


def test_cpu_experts_run_every_routed_expert_on_the_cpu(engine_dir, cpu_engine, capsys, seed):
    """--cpu-experts: no expert slots at all (the budget's go unused), one log line, and the
    all-CPU engine's tokens; prompts long enough to stream do not (there is nothing to stream into)."""
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(rng.randrange(4, 60))]
    want = list(cpu_engine.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False))
    off = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", cpu_experts=True, b_p=20.0, b_h=40.0))
    assert "--cpu-experts" in capsys.readouterr().err
    assert list(off.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False)) == want
    s = off.model.experts.stats
    assert off.vram.n_slots == 0 and s.hits == s.fills == s.stream_layers == 0 and s.cpu > 0



def test_a_chunk_abandoned_between_layers_leaves_the_sequence_and_the_cache_as_they_were(engine_dir, cpu_engine,
                                                                                           seed):
    """`between_layers` raising ends the pass at that layer: the sequence's length is unchanged, and
    the next pass (a decode step after the first chunk) computes what the CPU engine does."""
    rng = random.Random(seed)
    off = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=40, b_p=20.0, b_h=40.0))
    prompt = [rng.randrange(256) for _ in range(rng.randrange(2, 9))]
    got, want = off.model.new_cache(), cpu_engine.model.new_cache()
    off.model.forward(torch.tensor(prompt), got)
    cpu_engine.model.forward(torch.tensor(prompt), want)
    calls = []

    def leave() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise InterruptedError

    with pytest.raises(InterruptedError):
        off.model.forward(torch.tensor([rng.randrange(256) for _ in range(30)]), got, between_layers=leave)
    assert got.length == len(prompt) and len(calls) == 2
    step = rng.randrange(256)
    a, b = off.model.forward(torch.tensor([step]), got), cpu_engine.model.forward(torch.tensor([step]), want)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("run", range(4))
def test_fills_copy_runs_of_consecutive_slots_and_rows_as_one(cpu_engine, run, seed):
    """`copy_rows_now` copies each run where slots and FTW rows both go up by one as one copy:
    random fills (runs of random lengths in random order, a free slot between two runs) leave
    every slot filled with its row's bytes and every other slot untouched, and the runs found are
    exactly the fill's."""
    from ftc_runtime.experts.slots import SlotStore, consecutive_runs

    rng = np.random.default_rng(seed)
    pool = cpu_engine.model.experts.pool
    n = pool.header.num_rows
    store = SlotStore(pool, torch.device("cpu"), n)
    runs, slot0 = [], 0
    while slot0 < n:
        length = int(min(rng.integers(1, 6), n - slot0))
        runs.append((slot0, int(rng.integers(0, n - length + 1)), length))
        slot0 += length + 1
    runs = [runs[j] for j in rng.permutation(len(runs))]
    slots = np.concatenate([np.arange(s, s + k) for s, _, k in runs])
    ids = np.concatenate([np.arange(i, i + k) for _, i, k in runs])
    assert consecutive_runs(slots, ids) == runs
    store.slots.zero_()
    store.copy_rows_now(slots, ids)
    for s, i in zip(slots.tolist(), ids.tolist(), strict=True):
        assert torch.equal(store.slots[s], store.host_rows[i]), (s, i)
    untouched = torch.from_numpy(np.setdiff1d(np.arange(n), slots))
    assert not store.slots[untouched].any()
