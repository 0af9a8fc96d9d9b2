"""`ftc bench decode ENGINE`: decode speed with the experts split between a slot cache on the
device and the CPU, the split's statistics, and the bandwidth bound of the steps that ran.

The bound (the performance model, docs/structures.md) per token: Σ over MoE layers of the miss time at the
planner's rates, max(q·S/B_P', (m−q)·S/B_H'), plus the bytes the device itself must read (the
non-expert weights once and every hit or fill expert) at the device's measured memory bandwidth.
Beside it, the CPU time per token of the thread that drives the step (`host_cpu_ms_per_token`:
Python, planning, launches; beside a GPU the expert workers and the CPU doorbell are other threads,
so this is the host's cost outside the CPU experts). Where the step is one graph on the device,
a few more steps after the timed ones record its per-layer device timeline (`device_timeline`:
body, plan, fills, hits, CPU wait, from CUDA events in the graph; `DeviceTimeline`). With a
`Speculation`, the answer's passes after the prompt (`speculation`: one per decode step or
verification of drafts), the tokens each gave out, and the share of drafts accepted; with a draft
oracle (`--draft-oracle P`) the drafts are the known greedy answer's, each wrong with probability
1 - P: the cost of verification at that acceptance, not a drafter's acceptance (random weights
make any drafter's meaningless).
"""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from ftc.bench.memory import release_device_memory
from ftc_runtime import Engine, GenerationStats, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.device.timeline import DeviceTimeline
from ftc_runtime.experts.routing_trace import RoutingTrace, TraceReplay
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.experts.throughput import torch_read_gbps
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.speculative.config import Speculation
from ftc_runtime.speculative.oracle import DraftOracle

PROFILED_STEPS = 4
TIMELINE_STEPS = 8


def bench_decode(engine_dir: Path, offload: OffloadConfig, trace: RoutingTrace | None, routing: str,
                 prompt_tokens: int = 128, new_tokens: int = 64, seed: int = 0,
                 pool: ExpertPool | None = None, profile_to: Path | None = None, temperature: float = 0.0,
                 speculation: Speculation | None = None, draft_oracle: float | None = None) -> dict:
    """`temperature` > 0 samples the tokens: a random-weight model decoding greedily repeats one
    token, so its router picks the same experts every step (a 99% hit rate on the device), while
    sampled tokens route near-uniformly. `profile_to`: also write a torch profiler table of a few
    decode steps there (not timed). `draft_oracle` P: `speculation`'s drafts come from the greedy
    answer, each wrong with probability 1 - P (`DraftOracle`), which an engine of its own decodes
    first, so that the timed one starts from the same cache as a run without speculation."""
    if draft_oracle is not None:
        if temperature > 0:
            raise ValueError(f"--draft-oracle {draft_oracle:g}: its drafts are the greedy answer's; sampled "
                             "tokens would leave it")
        speculation = _oracle_speculation(engine_dir, offload, trace, prompt_tokens, new_tokens, seed, pool,
                                          speculation, draft_oracle)
    engine = _engine_replaying(engine_dir, offload, pool, trace, routing)
    engine.enable_speculation(speculation)
    speculation = engine.speculation  # `auto`'s drafter chosen for the engine
    experts = engine.model.experts
    prompt = _prompt(engine, prompt_tokens, seed)
    device_gbps = torch_read_gbps(1 << 30, 0.5, experts.device)
    sampling = SamplingParams(temperature, seed=seed)
    if profile_to is not None:
        _profile(engine, prompt, profile_to, sampling)
    # The first decode steps of a sequence run eagerly, then capture the CUDA graphs: timed apart.
    warmup = 2 if engine.model.decode_graphs is not None else 0
    if new_tokens < warmup + 2:
        raise ValueError(f"new_tokens = {new_tokens}: decode benchmarks need at least {warmup + 2}")
    decode_s, warmup_s, host_cpu_s, gen = _timed_decode(engine, prompt, new_tokens, sampling, warmup)
    s = experts.stats
    split_bias, split_trials = experts.split_bias, experts.split_trials
    timeline = _device_timeline(engine, prompt, sampling, warmup)
    steps = new_tokens - 1 - warmup
    planner = experts.planner
    device_bytes = engine.vram.dense + (s.hits + s.fills) * engine.vram.expert_stride / steps
    miss_bound = s.miss_bound_s / steps
    bound = miss_bound + device_bytes / (device_gbps * 1e9)
    measured = decode_s / steps
    return {
        "engine": engine.spec.name, "routing": routing, "temperature": temperature, "device": str(experts.device),
        "miss_policy": planner.policy, "split_bias": split_bias, "split_trials": split_trials,
        "cache_policy": experts.cache.policy,
        "b_p": planner.b_p, "b_h": planner.b_h,
        "rates_while_both_run": planner.rates(), "measured_concurrency": planner.measured_concurrency,
        "slots": experts.cache.n_slots, "pool_experts": engine.pool.header.num_rows,
        "vram": engine.vram.to_dict(), "prompt_tokens": prompt_tokens, "decode_tokens": steps,
        "warmup_steps": warmup, "warmup_ms": round(1e3 * warmup_s, 1),
        "decode_tok_s": round(steps / decode_s, 3), "ms_per_token": round(1e3 * measured, 3),
        "miss_bound_ms_per_token": round(1e3 * miss_bound, 3), "device_read_gbps": round(device_gbps, 1),
        "device_bytes_per_token": int(device_bytes), "bound_ms_per_token": round(1e3 * bound, 3),
        "measured_over_bound": round(measured / bound, 3) if bound else None,
        "host_cpu_ms_per_token": round(1e3 * host_cpu_s / steps, 3),
        "experts": s.to_dict(),
        "decode_graphs": engine.model.decode_graphs is not None,
        "speculate": str(speculation) if speculation is not None else "off",
    } | ({"device_timeline": timeline.summary()} if timeline is not None else {}) \
        | ({"speculation": _speculation(gen, speculation)} if speculation is not None else {})


def _engine_replaying(engine_dir: Path, offload: OffloadConfig, pool: ExpertPool | None, trace: RoutingTrace | None,
                      routing: str) -> Engine:
    engine = Engine.load(engine_dir, offload=offload, pool=pool)
    if trace is not None:
        trace.check_fits(len(engine.spec.moe_layers), engine.spec.moe.num_experts, routing)
        engine.model.experts.routing = TraceReplay(trace)
    return engine


def _prompt(engine: Engine, prompt_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(engine.spec.vocab_size) for _ in range(prompt_tokens)]


def _oracle_speculation(engine_dir: Path, offload: OffloadConfig, trace: RoutingTrace | None, prompt_tokens: int,
                        new_tokens: int, seed: int, pool: ExpertPool | None, speculation: Speculation | None,
                        accuracy: float) -> Speculation:
    """`speculation`'s K with drafts from the greedy answer of the benchmark's prompt, decoded by
    an engine that is then freed (its expert cache holds that answer's experts)."""
    if speculation is None:
        raise ValueError(f"--draft-oracle {accuracy:g}: give the drafts per pass with --speculate mtp:K, ngram:K "
                         "or auto")
    engine = _engine_replaying(engine_dir, offload, pool, trace, "")
    answer = tuple(engine.generate(_prompt(engine, prompt_tokens, seed), new_tokens, SamplingParams(0.0),
                                   stop_at_eos=False))
    oracle = DraftOracle(answer, accuracy, engine.spec.vocab_size, seed)
    del engine
    release_device_memory()  # the engine's slots must be free before the timed one allocates its own
    return replace(speculation, oracle=oracle)


def _speculation(gen: GenerationStats, speculation: Speculation) -> dict:
    """The whole answer's passes after the prompt (warm-up steps included): each a plain decode
    step (where the drafter had nothing) or one verification of drafts."""
    drafts = speculation.drafter
    if speculation.oracle is not None:
        drafts = (f"a draft oracle: the known greedy answer's tokens, each wrong with probability "
                  f"{1 - speculation.oracle.accuracy:g} (what verification costs at that acceptance, not a drafter's "
                  "acceptance)" + ("; the MTP layer runs each pass as it would, its cost counted, its drafts "
                                   "replaced" if drafts == "mtp" else ""))
    return {"drafts": drafts, "steps": gen.decode_steps, "tokens_per_step": round(gen.tokens_per_step, 3),
            "drafted": gen.drafted, "accepted": gen.accepted, "acceptance": round(gen.acceptance, 3)}


def _timed_decode(engine: Engine, prompt: list[int], new_tokens: int, sampling: SamplingParams,
                  warmup: int) -> tuple[float, float, float, GenerationStats]:
    """Seconds of the decode steps after `warmup` steps (whose statistics are dropped), of those,
    the CPU seconds of this (the driving) thread in the timed steps, and the answer's statistics."""
    experts = engine.model.experts
    gen = engine.generate(prompt, new_tokens, sampling, stop_at_eos=False)
    t0 = warm_t0 = cpu_t0 = 0.0
    for n, _ in enumerate(gen):
        if n == 0:  # the prompt's token: prefill done
            warm_t0 = time.perf_counter()
        if n == warmup:  # decode statistics only, after the warm-up steps
            experts.stats = OffloadStats(experts.device)
            t0, cpu_t0 = time.perf_counter(), time.thread_time()
    return time.perf_counter() - t0, t0 - warm_t0, time.thread_time() - cpu_t0, gen.stats


def _device_timeline(engine: Engine, prompt: list[int], sampling: SamplingParams,
                     warmup: int) -> DeviceTimeline | None:
    """The device timeline of `TIMELINE_STEPS` steps of one more sequence, where the step is one
    graph on the device (after the timed steps, whose statistics it leaves alone); else None."""
    graphs, experts = engine.model.decode_graphs, engine.model.experts
    if graphs is None or not experts.device_step_ready():
        return None
    stats, timeline = experts.stats, DeviceTimeline()
    experts.stats = OffloadStats(experts.device)
    graphs.set_timeline(timeline)
    try:
        for n, _ in enumerate(engine.generate(prompt, warmup + TIMELINE_STEPS + 1, sampling, stop_at_eos=False)):
            if n == warmup:  # the new sequence's first steps run eagerly and capture
                timeline.reset()
    finally:
        graphs.set_timeline(None)
        experts.stats = stats
    return timeline


def _profile(engine: Engine, prompt: list[int], out: Path, sampling: SamplingParams) -> None:
    """A torch profiler table of `PROFILED_STEPS` decode steps, then Python's own profile (cProfile,
    by time spent in each function) of as many more: where the driving thread's CPU time goes."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    gen = iter(engine.generate(prompt, 2 * PROFILED_STEPS + 4, sampling, stop_at_eos=False))
    for _ in range(3):  # prefill, the eager first step and the step that captures graphs
        next(gen)
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            next(gen)
    python = cProfile.Profile()
    with python:
        for _ in range(PROFILED_STEPS):
            next(gen)
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("tottime").print_stats(30)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    out.write_text(f"{PROFILED_STEPS} decode steps\n"
                   + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40) + "\n"
                   + prof.key_averages().table(sort_by=key, row_limit=30) + "\n"
                   + f"cProfile of {PROFILED_STEPS} more decode steps\n" + text.getvalue())
