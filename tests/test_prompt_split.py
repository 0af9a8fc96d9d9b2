"""The prompt split (FreeToken's miss split applied to streamed prompt chunks): `PromptSplit`'s rule
against a brute-force search, and engines whose CPU computes part of each streamed layer in place
(the device played by the CPU) giving the logits and KV of the engine that copies every expert,
and the all-CPU engine's; the experts the CPU computes are never put into the cache. Every family
and expert format: test_transformers_parity.py's streamed-prefill test, with and without it."""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ftc_runtime import Engine
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.layer_stream import LayerStream
from ftc_runtime.experts.prompt_split import WINDOW, PromptSplit, parse_prefill_split
from ftc_runtime.experts.stream_cpu import StreamCpuPart

from slot_checks import check_slots_hold_their_rows


def _random_split(rng: random.Random) -> PromptSplit:
    copy = rng.uniform(5, 60)
    return PromptSplit(expert_bytes=rng.randrange(1 << 12, 1 << 25), top_k=rng.choice([2, 4, 6, 8]),
                       num_experts=rng.choice([16, 64, 128, 256]), copy_gbps=copy,
                       cpu_gbps=rng.uniform(5, 120), bucket=rng.choice([1, 4, 8]),
                       copy_alone_gbps=rng.choice([None, copy * rng.uniform(1.0, 1.25)]),
                       token_bytes=rng.choice([0, 4 * rng.choice([512, 2048, 7168])]))


def test_prefill_split_values():
    assert parse_prefill_split("off") is None
    assert parse_prefill_split("AUTO") == "auto"
    assert parse_prefill_split("0.25") == 0.25
    assert parse_prefill_split("1") == 1.0
    for bad in ("", "half", "-0.1", "1.5", "nan", "inf"):
        with pytest.raises(ValueError, match="--prefill-split"):
            parse_prefill_split(bad)
    with pytest.raises(ValueError, match="rates must be positive"):
        PromptSplit(1 << 20, 8, 128, copy_gbps=0.0, cpu_gbps=50.0, bucket=8)
    with pytest.raises(ValueError, match="rates must be positive"):
        PromptSplit(1 << 20, 8, 128, copy_gbps=40.0, cpu_gbps=50.0, bucket=8, copy_alone_gbps=0.0)


@pytest.mark.parametrize("run", range(10))
def test_auto_split_finishes_copies_and_cpu_soonest(run, seed):
    """The CPU's count makes the layer as quick as any whole count can: with none, u copies at the
    rate alone; with c, the slower of u − c copies at the rate beside the CPU plus the read of its
    result, and c CPU experts plus the serial stretch a CPU part adds. A search over every c
    from 0 to u, at the split's own estimates (medians of their measurements), some of them
    measured. Where that gives the CPU none on fewer than WINDOW measurements of its time, it gets
    one expert, which times it; else on fewer than WINDOW of the stretch, the count that is best
    without the stretch, whose part measures it (else a pessimistic model, or a first prompt's
    one-time cost, would never be corrected)."""
    rng = random.Random(seed)
    split = _random_split(rng)
    rates, stretches = {}, {}  # the test's own record: octave → every measurement
    for _ in range(rng.randrange(0, 3 * WINDOW)):  # measurements at some token counts
        experts, pairs, seconds = rng.randrange(1, 40), rng.randrange(40, 20000), rng.uniform(1e-4, 0.05)
        split.record(experts, pairs, seconds)
        rates.setdefault(round(math.log2(pairs / experts)), []).append(seconds / pairs)
    for _ in range(rng.randrange(0, 3 * WINDOW)):
        n_tokens, seconds = rng.randrange(1, 16385), rng.uniform(0.0, 0.03)
        split.record_serial(n_tokens, seconds)
        n = n_tokens * split.top_k / split.num_experts
        stretches.setdefault(round(math.log2(max(n, 1))), []).append(seconds)
    t_p = split.expert_bytes / (split.copy_gbps * 1e9)
    t_a = split.expert_bytes / ((split.copy_alone_gbps or split.copy_gbps) * 1e9)
    for _ in range(50):
        u, n_tokens = rng.randrange(0, split.num_experts + 1), rng.randrange(1, 16385)
        c = split.cpu_count(u, n_tokens)
        n = n_tokens * split.top_k / split.num_experts
        octave = round(math.log2(max(n, 1)))
        rate, stretch = rates.get(octave, [])[-WINDOW:], stretches.get(octave, [])[-WINDOW:]
        t_c = statistics.median(rate) * max(n, 1) if rate else split.cpu_seconds(n)
        g = statistics.median(stretch) if stretch else 0.0
        r = n_tokens * split.token_bytes / (split.copy_gbps * 1e9)

        def slower(k: int, t_c=t_c, g=g, u=u, r=r) -> float:
            return u * t_a if k == 0 else max((u - k) * t_p + r, k * t_c + g)

        best = min(range(u + 1), key=slower)
        assert 0 <= c <= u
        if best == 0 and u >= 2 and len(rate) < WINDOW:
            assert c == 1, f"seed={seed} u={u}: none on too few times of the CPU is probed with one expert"
            continue
        if best == 0 and u >= 2 and len(stretch) < WINDOW:
            best = min(range(u + 1), key=lambda k, t_c=t_c, u=u: slower(k, t_c, 0.0, u))
            assert slower(c, t_c, 0.0) == pytest.approx(slower(best, t_c, 0.0), rel=1e-12, abs=1e-15), \
                f"seed={seed} u={u}: none on too few stretches is probed with the count best without one"
            continue
        assert slower(c) == pytest.approx(slower(best), rel=1e-12, abs=1e-15), f"seed={seed} u={u}"


def test_a_serial_stretch_longer_than_the_copies_gives_the_cpu_none(seed):
    """Measured WINDOW times: a CPU part holds its layer up for longer than copying every uncached
    expert takes, so the CPU gets none at that token count, and other counts keep their split.
    Measured fewer times, the CPU still gets the count that is best without the stretch, whose part
    measures it again: a single stretch of a first prompt's one-time cost (1.18 s, seen on the
    device) must not give it none for good; the estimate is the median of the latest WINDOW."""
    rng = random.Random(seed)
    split = PromptSplit(1 << 23, 8, 128, copy_gbps=50.0, cpu_gbps=100.0, bucket=8)
    n_tokens = 128 * 64 // 8  # 64 tokens per expert
    for _ in range(WINDOW):
        split.record(10, 640, 640e-6)  # 0.064 ms an expert of 64 tokens: far quicker than its 0.17 ms copy
    u = rng.randrange(20, 128)
    assert split.cpu_count(u, n_tokens) > u // 2
    long = 2 * u * split.copy_seconds()
    without_stretch = split.cpu_count(u, n_tokens)
    split.record_serial(n_tokens, 1.18)
    assert split.cpu_count(u, n_tokens) == without_stretch, f"seed={seed}: one stretch gave the CPU none for good"
    for _ in range(WINDOW // 2):
        split.record_serial(n_tokens, 0.001)
    assert split.cpu_count(u, n_tokens) > u // 2, f"seed={seed}: the outlier outweighed the stretches after it"
    for _ in range(WINDOW):
        split.record_serial(n_tokens, long)
    assert split.cpu_count(u, n_tokens) == 0
    split.record(10, 10240, 10240e-7)  # 1024 tokens per expert, another octave: its own split
    assert split.cpu_count(u, 16 * n_tokens) > 0
    split.record_serial(n_tokens, 0.0)
    assert split.serial_seconds(64) == pytest.approx(long)


@pytest.mark.parametrize("priced", [True, False])
def test_the_results_read_and_the_slower_copies_beside_the_cpu_can_outweigh_its_share(priced, seed):
    """The device's figures for `qwen3-30b-a3b` bf16 on 16 cores (H200, profile rates B_P 51 and
    B_P' 48.31 GB/s; docs/history/performance-log.md, issue 24's sixth part): at 8K tokens an expert of 512 tokens took
    the CPU about 2.8e-6 s an expert-token and a part's stretch 6.97 ms, and the split's 11 experts
    a layer made the prompt 11% slower than copying every expert; at 2K, 2.9e-6 s and 3.1 ms,
    1.29x faster. Priced, the result's read (64 MiB a layer at 8K) and the copies' slower rate
    beside the CPU give the CPU none at 8K and keep its share at 2K; left out, 8K gets a share."""
    rng = random.Random(seed)
    split = PromptSplit(9437184, 8, 128, copy_gbps=48.31, cpu_gbps=84.48, bucket=8,
                        copy_alone_gbps=51.0 if priced else None, token_bytes=2048 * 4 if priced else 0)
    for tokens, rate, stretch in ((8192, 2.8e-6, 6.97e-3), (2048, 2.9e-6, 3.1e-3)):
        for _ in range(WINDOW):
            n = tokens // 16
            experts = rng.randrange(8, 16)
            split.record(experts, experts * n, rate * experts * n * rng.uniform(0.97, 1.03))
            split.record_serial(tokens, stretch * rng.uniform(0.97, 1.03))
    assert (split.cpu_count(128, 8192) == 0) == priced, f"seed={seed}: {split.cpu_count(128, 8192)}"
    assert split.cpu_count(128, 2048) > 30, f"seed={seed}"


def test_copies_landed_by_the_routing_take_experts_from_the_cpu(seed):
    """In a chunk, a layer whose copies had landed when it reached its routing caps the CPU's count
    for the next layers at one expert fewer each time (never below none; under a cap of none an
    unmeasured token count is not probed either); one whose copies were still landing lifts it."""
    rng = random.Random(seed)
    split = PromptSplit(1 << 23, 8, 128, copy_gbps=50.0, cpu_gbps=100.0, bucket=8)
    n_tokens = 128 * 64 // 8  # 64 tokens per expert
    split.record(10, 640, 640e-6)  # the CPU far quicker than the copies: the balance gives it many
    u = rng.randrange(20, 129)
    balance = split.cpu_count(u, n_tokens)
    assert balance > u // 2
    chunk = SimpleNamespace(cpu_cap=None)  # a LayerStream's state
    for fewer in range(1, 4):
        LayerStream._cap_cpu(chunk, split.cpu_count(u, n_tokens, chunk.cpu_cap), landed=True)
        assert split.cpu_count(u, n_tokens, chunk.cpu_cap) == balance - fewer, f"seed={seed}"
    LayerStream._cap_cpu(chunk, balance - 3, landed=False)
    assert chunk.cpu_cap is None and split.cpu_count(u, n_tokens, chunk.cpu_cap) == balance
    unmeasured = 128 * 4 // 8  # 4 tokens per expert: probed with one expert, unless capped
    assert split.cpu_count(u, unmeasured) >= 1
    LayerStream._cap_cpu(chunk, 1, landed=True)
    LayerStream._cap_cpu(chunk, 0, landed=True)
    assert chunk.cpu_cap == 0 and split.cpu_count(u, unmeasured, chunk.cpu_cap) == 0


def test_the_cpu_estimate_follows_its_measurements(seed):
    """Before any measurement, one expert of n tokens costs the kernel's model (its rows read once
    per bucket of tokens at B_H'); a measurement near n replaces it (seconds per expert-token: the
    median of the latest WINDOW, two of them averaged), and leaves other token counts to the model."""
    rng = random.Random(seed)
    split = _random_split(rng)
    n = rng.uniform(24, 40)  # about 2^5: pair counts per expert from 22.7 to 45.2 share its octave
    model = math.ceil(n / split.bucket) * split.expert_bytes / (split.cpu_gbps * 1e9)
    assert split.cpu_seconds(n) == pytest.approx(model)
    experts, seconds = rng.randrange(1, 20), rng.uniform(1e-3, 1e-1)
    split.record(experts, round(experts * n), seconds)
    first = seconds / round(experts * n)
    assert split.cpu_seconds(n) == pytest.approx(first * n)
    split.record(experts, round(experts * n), 3 * seconds)
    assert split.cpu_seconds(n) == pytest.approx((first + 3 * first) / 2 * n)
    far = 1000.0
    assert split.cpu_seconds(far) == pytest.approx(math.ceil(far / split.bucket) * split.expert_bytes
                                                   / (split.cpu_gbps * 1e9))
    fixed = PromptSplit(1 << 20, 8, 128, 30.0, 60.0, 8, share=0.3)
    assert [fixed.cpu_count(u, 4096) for u in (0, 1, 2, 5, 10)] == [0, 0, 1, 2, 3]  # rounded half up


def _prefill(engine: Engine, ids: list[int]):
    cache = engine.model.new_cache()
    return engine.prefill(torch.tensor(ids), cache, all_logits=True), cache


@pytest.mark.parametrize("device_waits", [False, True])
@pytest.mark.parametrize("split", ["auto", "share"])
@pytest.mark.parametrize("overlap,slots,chunk", [(True, 40, 13), (False, 16, 11), (True, 32, 64),
                                                 (True, 64, 24), (False, 20, 30)])
def test_split_chunks_equal_copying_every_expert(engine_dir, cpu_engine, monkeypatch, split, overlap, slots, chunk,
                                                 device_waits, seed):
    """Prompts in chunks that stream whole layers, the CPU computing part of each layer's uncached
    experts (the rates decide, or a random fixed share), the host or the device (the CPU standing
    in) waiting for each part: the logits of every token and the KV cache
    equal those of the same engine copying every expert, and the all-CPU engine's. The experts the
    CPU computes are uncached when it starts and when it ends (never filled), the first chunk's
    experts are all either copied or computed in place, and the slots hold their rows."""
    monkeypatch.setenv("FTC_DEVICE_WAITS_CPU_PART", str(int(device_waits)))
    rng = random.Random(seed)
    e, n_moe = cpu_engine.spec.moe.num_experts, len(cpu_engine.spec.moe_layers)
    ids = [rng.randrange(256) for _ in range(rng.randrange(30, 90))]
    mode = f"{rng.uniform(0.1, 1.0):.3f}" if split == "share" else "auto"
    # auto: at these rates the kernel's model gives the CPU a share of the first layer (then its
    # measured time on these tiny experts, next to their µs of copying, may give it none)
    rates = {"b_p": rng.uniform(5, 50), "b_h": rng.uniform(20, 100)} if split == "share" else {"b_p": 20.0,
                                                                                              "b_h": 100.0}
    with_split = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=slots, prefill_overlap=overlap,
                                                               stream_min_tokens=8, prefill_split=mode, **rates),
                             prefill_chunk=chunk)
    copying = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=slots, prefill_overlap=overlap,
                                                            stream_min_tokens=8, prefill_split="off", **rates),
                          prefill_chunk=chunk)
    experts = with_split.model.experts
    computed: list[np.ndarray] = []
    real_start, real_finish = StreamCpuPart.start, StreamCpuPart.finish

    def start(part, layer, x, pairs, rows):
        assert (experts.store.cache.slot_of[rows] < 0).all(), f"seed={seed}: the CPU's experts are cached"
        computed.append(rows.copy())
        real_start(part, layer, x, pairs, rows)

    def finish(part, out, copies_landed):
        real_finish(part, out, copies_landed)
        assert (experts.store.cache.slot_of[computed[-1]] < 0).all(), f"seed={seed}: a CPU expert was filled"

    monkeypatch.setattr(StreamCpuPart, "start", start)
    monkeypatch.setattr(StreamCpuPart, "finish", finish)
    first, _ = _prefill(with_split, ids[:chunk])
    assert experts.stats.streamed + experts.stats.stream_cpu == (n_moe * e if experts.stats.stream_layers else 0)
    got, got_cache = _prefill(with_split, ids)
    want, want_cache = _prefill(copying, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"seed={seed}"
    assert torch.allclose(got, _prefill(cpu_engine, ids)[0], rtol=1e-4, atol=1e-4), f"seed={seed}"
    for layer in range(cpu_engine.spec.num_layers):
        assert torch.allclose(got_cache.kv.keys(layer), want_cache.kv.keys(layer), rtol=1e-4, atol=1e-5)
        assert torch.allclose(got_cache.kv.values(layer), want_cache.kv.values(layer), rtol=1e-4, atol=1e-5)
    if slots >= experts.stream_slots:
        assert experts.stats.stream_cpu > 0 and computed, f"seed={seed}: the CPU computed nothing"
        flag = experts.buffers.held.get(("stream_cpu_flag", True))  # the jobs that raised it
        assert (flag is not None and int(flag[0]) == len(computed)) == device_waits, f"seed={seed}: {flag}"
    if experts.stats.stream_cpu:
        assert experts.prompt_split.measured, f"seed={seed}: no CPU part's time measured"
    # Every layer had a CPU part: the stretches between them are measured where the layers waited
    # for the CPU. With the host waiting that is each one here (no copies to wait for); with the
    # device waiting, none: this engine's kernel runs its job at its start, so the CPU is done by
    # the device's take.
    if split == "share" and experts.stats.stream_cpu >= 2 * n_moe:
        assert bool(experts.prompt_split.serial) != device_waits, f"seed={seed}: {experts.prompt_split.serial}"
    check_slots_hold_their_rows(experts)


def test_a_chunk_failing_while_the_cpu_computes_leaves_the_kernel_free(engine_dir, cpu_engine, monkeypatch, seed):
    """A chunk that fails between the CPU part's start and its end (the device's part raising)
    joins the kernel when the next pass begins: the next prompt runs and equals the CPU engine."""
    from ftc_runtime.experts.slots import SlotStore

    rng = random.Random(seed)
    off = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=40, b_p=20.0, b_h=40.0,
                                                        stream_min_tokens=8, prefill_split="0.5"))
    real = SlotStore.grouped_on_device
    calls = [0]

    def failing(store, *args):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("device lost")
        real(store, *args)

    monkeypatch.setattr(SlotStore, "grouped_on_device", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        off.logits([rng.randrange(256) for _ in range(32)])
    off.model.experts.begin_pass(1, prompt=False)
    assert off.model.experts.kernel._in_flight is None  # joined (a kernel left running would deadlock)
    ids = [rng.randrange(256) for _ in range(rng.randrange(20, 40))]
    assert torch.allclose(off.logits(ids), cpu_engine.logits(ids), rtol=1e-4, atol=1e-4), f"seed={seed}"
