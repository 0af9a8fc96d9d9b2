"""What the server tells about its requests: `/metrics` through prometheus_client (the engine's
counts, read when scraped, and histograms of the time to first token and between tokens) and one
log line per finished request (logger `ftc.serve`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ftc_runtime.engine import Engine
    from ftc_runtime.serve.scheduler import Request, Scheduler

log = logging.getLogger("ftc.serve")

# Seconds: a cached short prompt answers in milliseconds, a long prompt on an offloaded model in minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)


class RequestMetrics:
    """Observes requests on the engine thread (the scheduler calls it) and renders /metrics."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.scheduler: Scheduler | None = None
        self.registry = CollectorRegistry()
        self.ttft = Histogram("ftc_time_to_first_token_seconds", "From a request's arrival to its first token "
                              "(queue and prompt)", buckets=TTFT_BUCKETS, registry=self.registry)
        self.token_latency = Histogram("ftc_time_per_output_token_seconds", "Between two tokens of one answer",
                                       buckets=TOKEN_BUCKETS, registry=self.registry)
        self.registry.register(_Counts(self))

    def token(self, r: Request) -> None:
        now = time.perf_counter()
        if r.first_token_at is None:
            r.first_token_at = now
            self.ttft.observe(now - r.submitted)
        else:
            self.token_latency.observe(now - r.last_token_at)
        r.last_token_at = now

    def finished(self, r: Request, reason: str) -> None:
        now = time.perf_counter()
        ttft = r.first_token_at - r.submitted if r.first_token_at is not None else None
        rate = (r.produced - 1) / (now - r.first_token_at) if r.produced > 1 and now > r.first_token_at else None
        log.info("request %d %s: prompt %d tokens (%d reused), %d generated, TTFT %s, %s", r.id, reason,
                 len(r.prompt_ids), r.reused_tokens, r.produced, f"{ttft:.3f} s" if ttft is not None else "-",
                 f"{rate:.1f} tok/s" if rate is not None else "-")

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Counts(Collector):
    """The scheduler's, the expert cache's and the prefix cache's counts as they are when scraped."""

    def __init__(self, metrics: RequestMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s, engine = self.metrics.scheduler, self.metrics.engine
        if s is None:
            return
        rows = [("ftc_requests", "counter", "requests admitted", s.requests),
                ("ftc_requests_running", "gauge", "requests decoding now", len(s.running)),
                ("ftc_requests_waiting", "gauge", "requests queued", s.waiting.qsize()),
                ("ftc_prefill_tokens", "counter", "prompt tokens run", s.prefill_tokens),
                ("ftc_prefill_seconds", "counter", "time in prompts (prefill tok/s: their ratio)", s.prefill_s),
                ("ftc_decode_steps", "counter", "decode steps run", s.decode_steps),
                ("ftc_decode_tokens", "counter", "tokens those steps made (several per step when batched)",
                 s.decode_tokens),
                ("ftc_decode_seconds", "counter", "time in decode steps (decode tok/s: tokens over it)", s.decode_s),
                ("ftc_draft_tokens", "counter", "speculative draft tokens verified", s.drafted),
                ("ftc_draft_tokens_accepted", "counter", "of those, the ones accepted (acceptance: their ratio; "
                 "tokens per step: ftc_decode_tokens over ftc_decode_steps)", s.accepted)]
        stats = getattr(engine.model.experts, "stats", None)
        if stats is not None:
            d = stats.to_dict()
            rows += [("ftc_expert_hits", "counter", "routed experts found in the GPU cache", d["hits"]),
                     ("ftc_expert_fills", "counter", "misses copied into the GPU cache", d["fills"]),
                     ("ftc_expert_cpu", "counter", "misses computed on the CPU", d["cpu"])]
        prefix = engine.prefix_cache
        if prefix is not None:
            p = prefix.stats
            rows += [("ftc_prefix_lookups", "counter", "prompts looked up in the prefix cache", p.lookups),
                     ("ftc_prefix_hits", "counter", "prompts that resumed after a cached prefix", p.hits),
                     ("ftc_prefix_reused_tokens", "counter", "prompt tokens restored, not prefilled", p.reused_tokens),
                     ("ftc_prefix_kv_bytes", "gauge", "keys and values the prefix cache holds", prefix.kv_used),
                     ("ftc_prefix_checkpoints", "gauge", "recurrent-state checkpoints held", prefix.checkpoints),
                     ("ftc_prefix_checkpoint_bytes", "gauge", "bytes of those checkpoints", prefix.checkpoint_used),
                     ("ftc_prefix_kv_evictions", "counter", "cached sequence pieces evicted", p.kv_evictions),
                     ("ftc_prefix_checkpoint_evictions", "counter", "checkpoints evicted", p.checkpoint_evictions)]
        if engine.vram is not None:
            rows += [(f"ftc_vram_{k}_bytes", "gauge", f"VRAM plan: {k}", getattr(engine.vram, k))
                     for k in ("dense", "kv", "workspace", "slots")]
        elastic = engine.elastic
        if elastic is not None and elastic.history:
            now = elastic.history[-1]
            rows += [("ftc_vram_budget_now_bytes", "gauge", "the budget as other processes leave it", now["budget"]),
                     ("ftc_vram_kv_now_bytes", "gauge", "KV caches and prefix cache at the last safe point",
                      now["kv"]),
                     ("ftc_vram_slots_now_bytes", "gauge", "expert slots now", now["slots"]),
                     ("ftc_vram_slot_changes", "counter", "expert slot cache rebuilds", len(elastic.changes))]
        for name, kind, doc, value in rows:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, doc, value=value)
