"""`ftc bench ENGINE decode`: decode speed with the experts split between a slot cache on the
device and the CPU, the split's statistics, and the bandwidth bound for the misses that happened."""

from __future__ import annotations

import random
import time
from pathlib import Path

from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.ftw import ExpertPool
from ftc_runtime.offload import OffloadStats
from ftc_runtime.routing_trace import RoutingTrace, TraceReplay


def bench_decode(engine_dir: Path, offload: OffloadConfig, trace: RoutingTrace | None, routing: str,
                 prompt_tokens: int = 128, new_tokens: int = 64, seed: int = 0,
                 pool: ExpertPool | None = None) -> dict:
    engine = Engine.load(engine_dir, offload=offload, pool=pool)
    experts = engine.model.experts
    if trace is not None:
        trace.check_fits(len(engine.spec.moe_layers), engine.spec.moe.num_experts, routing)
        engine.model.routing = TraceReplay(trace)
    rng = random.Random(seed)
    prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(prompt_tokens)]
    gen = engine.generate(prompt, new_tokens, SamplingParams(0.0), stop_at_eos=False)
    t0 = 0.0
    for n, _ in enumerate(gen):
        if n == 0:  # decode statistics only: the prompt's are dropped
            experts.stats = OffloadStats(experts.device)
            t0 = time.perf_counter()
    decode_s = time.perf_counter() - t0
    s = experts.stats
    steps = new_tokens - 1
    planner = experts.planner
    bound = s.miss_bound_s / steps
    measured = decode_s / steps
    return {
        "engine": engine.spec.name, "routing": routing, "device": str(experts.device),
        "miss_policy": planner.policy, "cache_policy": experts.cache.policy, "b_p": planner.b_p, "b_h": planner.b_h,
        "rates_while_both_run": planner.rates(), "measured_concurrency": planner.measured_concurrency,
        "slots": experts.cache.n_slots, "pool_experts": engine.pool.header.num_rows,
        "vram": engine.vram.to_dict(), "prompt_tokens": prompt_tokens, "decode_tokens": steps,
        "decode_tok_s": round(steps / decode_s, 3), "ms_per_token": round(1e3 * measured, 3),
        "miss_bound_ms_per_token": round(1e3 * bound, 3),
        "measured_over_bound": round(measured / bound, 3) if bound else None,
        "experts": s.to_dict(),
    }
