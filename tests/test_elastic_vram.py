"""Elastic VRAM on the CPU standing in for the GPU: one budget shared by the KV caches and the
expert slots, fitted at safe points; memory that other processes take; requests that cannot fit."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.elastic_vram import ElasticVram
from ftc_runtime.experts.vram_plan import VramError
from ftc_runtime.serve.scheduler import Request, Scheduler

from slot_checks import check_slots_hold_their_rows


def _budget_for(engine_dir: Path, tokens: int, slots: int) -> int:
    """A budget that holds the weights, the workspace, one cache of `tokens` and `slots` slots."""
    probe = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", b_p=20.0, b_h=40.0))
    plan = probe.vram
    return plan.dense + plan.workspace + probe.model.new_cache().bytes_for(tokens) + slots * plan.expert_stride


def test_a_growing_context_gives_up_expert_slots_and_gets_them_back(engine_dir, cpu_engine, seed):
    """One budget for KV and expert slots (the CPU standing in for the GPU): as a sequence's KV
    cache doubles, slots are given up at the next safe point; a short sequence afterwards gets
    them back; memory that another process takes shrinks the slots, and when even no slots leave
    room for the KV, generation stops with an error naming the split. Tokens never change, and
    no safe point ever planned past the budget."""
    rng = random.Random(seed)
    budget = _budget_for(engine_dir, 200, 40)  # a 256-token cache and 40 slots
    cfg = OffloadConfig(device="cpu", vram_budget=budget, max_context=64, b_p=20.0, b_h=40.0)
    engine = Engine.load(engine_dir, offload=cfg)
    plan = engine.vram
    elastic = engine.elastic
    ids = [rng.randrange(256) for _ in range(rng.randrange(150, 200))]  # the cache doubles to 512
    want = list(cpu_engine.generate(ids, 120, SamplingParams(0.0), stop_at_eos=False))
    assert list(engine.generate(ids, 120, SamplingParams(0.0), stop_at_eos=False)) == want
    shrunk = elastic.slots
    assert any(after < before for before, after in elastic.changes) and shrunk < plan.n_slots
    short = [rng.randrange(256) for _ in range(10)]
    assert list(engine.generate(short, 5, SamplingParams(0.0), stop_at_eos=False)) == \
        list(cpu_engine.generate(short, 5, SamplingParams(0.0), stop_at_eos=False))
    assert elastic.slots > shrunk  # given back
    before, taken = elastic.slots, 25 * plan.expert_stride
    elastic.memory_info = lambda: (budget, taken)  # another process holds 25 slots' worth
    assert list(engine.generate(short, 5, SamplingParams(0.0), stop_at_eos=False)) == \
        list(cpu_engine.generate(short, 5, SamplingParams(0.0), stop_at_eos=False))
    assert elastic.history[-1]["budget"] == budget - taken and elastic.slots < before
    elastic.memory_info = lambda: (budget, 0)  # the other process is gone: the slots come back
    list(engine.generate(short, 2, SamplingParams(0.0), stop_at_eos=False))
    assert elastic.slots == before
    assert all(h["fixed"] + h["kv"] + h["slots"] <= h["budget"] for h in elastic.history)
    elastic.memory_info = lambda: (budget, budget - plan.dense)  # nothing left beside the weights
    with pytest.raises(VramError, match="even with no expert slots"):
        list(engine.generate(short, 5, SamplingParams(0.0), stop_at_eos=False))
    check_slots_hold_their_rows(engine.model.experts)


def test_a_request_that_cannot_fit_ends_alone(engine_dir, cpu_engine, seed):
    """Through the serving scheduler: a prompt whose KV cannot fit even with no expert slots ends
    with an error; a request beside it decodes the all-CPU engine's tokens."""
    rng = random.Random(seed)
    budget = _budget_for(engine_dir, 200, 2)
    engine = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", vram_budget=budget, max_context=64,
                                                           b_p=20.0, b_h=40.0))
    scheduler = Scheduler(engine, max_batch=4, prompt_chunk=32)
    results: dict[str, tuple[list[int], str]] = {}
    done = threading.Barrier(3)

    def submit(name: str, ids: list[int]) -> None:
        out: list[int] = []

        def on_token(token, reason):
            if token is not None:
                out.append(token)
            if reason is not None:
                results[name] = (out, reason)
                threading.Thread(target=done.wait).start()
        scheduler.submit(Request(ids, 8, SamplingParams(0.0), on_token))

    small = [rng.randrange(256) for _ in range(20)]
    try:
        submit("small", small)
        submit("huge", [rng.randrange(256) for _ in range(900)])  # a 1024-token cache: more than the budget
        done.wait(timeout=120)
    finally:
        scheduler.close()
    assert results["huge"] == ([], "error")
    assert results["small"] == (list(cpu_engine.generate(small, 8, SamplingParams(0.0), stop_at_eos=False)), "length")


def test_a_stand_in_budget_loses_what_others_take_after_the_start(engine_dir, seed):
    """A budget smaller than the device (`--vram-budget` standing in for a smaller card): memory
    that other processes take after the start comes out of the budget, as it would on that card,
    although the device itself still has room; what they held before is not counted twice."""
    rng = random.Random(seed)
    budget = _budget_for(engine_dir, 200, 40)
    engine = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", vram_budget=budget, max_context=64,
                                                           b_p=20.0, b_h=40.0))
    stride, held = engine.vram.expert_stride, [3 * budget]
    elastic = ElasticVram(engine.vram, engine.model.experts, lambda: (100 * budget, held[0]))
    assert elastic.budget() == budget
    cache = engine.model.new_cache()
    before = elastic.rebalance(cache.bytes_for(200))
    taken = rng.randrange(5, before) * stride
    held[0] += taken
    assert elastic.budget() == budget - taken
    after = elastic.rebalance(cache.bytes_for(200))
    assert after < before and elastic.history[-1]["budget"] == budget - taken
    assert all(h["fixed"] + h["kv"] + h["slots"] <= h["budget"] for h in elastic.history)
    held[0] -= taken
    assert elastic.rebalance(cache.bytes_for(200)) >= before  # back to the fit (`before` may sit below it)
    check_slots_hold_their_rows(engine.model.experts)
