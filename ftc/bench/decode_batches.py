"""`ftc bench decode ENGINE --sequences 1,2,4,8,16`: the aggregate decode throughput of several
sequences decoding together, as the server's scheduler runs them (`decode_batch`: one step gives
every sequence its next token; the projections, router, experts and head run once over the batch,
attention per sequence). Each count of sequences is a fresh set of random prompts; the tokens are
sampled (the model's own router: a random-weight model decoding greedily repeats one token and
routes to the same experts every step).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.sampling import Sampler

WARMUP_STEPS = 2  # a sequence's first steps run eagerly and capture its graphs


def bench_decode_batches(engine_dir: Path, offload: OffloadConfig, sequences: list[int], prompt_tokens: int = 128,
                         new_tokens: int = 64, seed: int = 0, pool: ExpertPool | None = None,
                         temperature: float = 1.0) -> dict:
    """One row per count of concurrent sequences: aggregate and per-sequence tok/s, ms per step
    and the experts' split over the timed steps."""
    if new_tokens < WARMUP_STEPS + 2:
        raise ValueError(f"new_tokens = {new_tokens}: decode benchmarks need at least {WARMUP_STEPS + 2}")
    if not sequences or min(sequences) < 1:
        raise ValueError(f"--sequences {sequences}: give counts of at least 1, e.g. 1,2,4,8,16")
    engine = Engine.load(engine_dir, offload=offload, pool=pool)
    rng = random.Random(seed)
    rows = [_batch_row(engine, n, prompt_tokens, new_tokens, temperature, rng) for n in sequences]
    return {"engine": engine.spec.name, "device": str(engine.model.experts.device),
            "routing": f"the model's own router, tokens sampled at temperature {temperature}",
            "prompt_tokens": prompt_tokens, "decode_steps": new_tokens - WARMUP_STEPS, "rows": rows}


def _batch_row(engine: Engine, n: int, prompt_tokens: int, new_tokens: int, temperature: float,
               rng: random.Random) -> dict:
    caches = [engine.model.new_cache() for _ in range(n)]
    engine.rebalance([(c, prompt_tokens + new_tokens + 1) for c in caches])
    samplers, tokens = [], []
    for cache in caches:
        prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(prompt_tokens)]
        sampler = Sampler(SamplingParams(temperature, seed=rng.randrange(2**31)), prompt)
        samplers.append(sampler)
        tokens.append(sampler(engine.prefill(torch.tensor(prompt), cache)[-1]))
    experts = engine.model.experts
    experts.end_of_prompt()
    t0 = 0.0
    for step in range(new_tokens):
        if step == WARMUP_STEPS:
            experts.stats = OffloadStats(experts.device)
            t0 = time.perf_counter()
        logits = engine.model.decode_batch(tokens, caches)
        tokens = [sample(row) for sample, row in zip(samplers, logits, strict=True)]  # reads them: a sync
    seconds, steps = time.perf_counter() - t0, new_tokens - WARMUP_STEPS
    s = experts.stats.to_dict()
    return {"sequences": n, "aggregate_tok_s": round(n * steps / seconds, 3),
            "per_sequence_tok_s": round(steps / seconds, 3), "ms_per_step": round(1e3 * seconds / steps, 3),
            "miss_rate": round(s["miss_rate"], 4), "mean_unique_per_call": round(s["unique"] / max(s["calls"], 1), 2),
            "experts": s}
