"""Throughput measurements shared by `ftc bench experts` and `ftc profile`: the CPU expert kernel
over a pool far larger than the caches, and a plain memory read."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ftc_runtime.experts.base import group_by_expert
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.spec import ModelSpec


def l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("K")) * 1024 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 0


def time_calls(fn: Callable[[], None], seconds: float, min_iters: int = 10,
               after_warmup: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of each call of `fn` after 3 warm-up calls, for at least `seconds` and `min_iters`."""
    for _ in range(3):
        fn()
    after_warmup()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_iters or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def torch_read_gbps(nbytes: int = 2 << 30, seconds: float = 1.0, device: torch.device | str = "cpu") -> float:
    """A plain read of a large fp32 tensor (t.sum()) on `device`: the CPU with torch's threads, or
    a GPU's own memory."""
    t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if t.is_cuda else (lambda: None)

    def read() -> None:
        t.sum()
        sync()

    return nbytes / statistics.median(time_calls(read, seconds, 5)) / 1e9


def routed_calls(spec: ModelSpec, tokens: int, seed: int) -> list[tuple]:
    """64 calls, each a random MoE layer with random top-k routing, so that successive calls do not
    hit in cache: (moe layer, ids [T, k], weights [T, k], x [T, hidden])."""
    g = torch.Generator().manual_seed(seed)
    e, k, layers = spec.moe.num_experts, spec.moe.top_k, len(spec.moe_layers)
    calls = []
    for it in range(64):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        calls.append((it % layers, ids, torch.rand(tokens, k, generator=g),
                      torch.randn(tokens, spec.hidden_size, generator=g)))
    return calls


def routed_gbps(spec: ModelSpec, tokens: int, seconds: float, call: Callable[[int, torch.Tensor, torch.Tensor,
                torch.Tensor], int], seed: int = 0) -> dict:
    """Times `call(moe_layer, ids, weights, x) -> expert bytes it read` over fresh routed calls:
    GB/s (all bytes over all time, and a call's bytes over the median call time), median ms."""
    calls = routed_calls(spec, tokens, seed)
    state = {"i": 0, "bytes": 0}

    def one() -> None:
        state["bytes"] += call(*calls[state["i"] % len(calls)])
        state["i"] += 1

    times = time_calls(one, seconds, after_warmup=lambda: state.update(bytes=0))
    median = statistics.median(times)
    return {"gbps": state["bytes"] / sum(times) / 1e9, "ms_per_layer": median * 1e3,
            "gbps_median": state["bytes"] / len(times) / median / 1e9}


def expert_kernel_gbps(spec: ModelSpec, pool: ExpertPool, kernel: CpuExpertKernel, tokens: int, seconds: float,
                       seed: int = 0) -> dict:
    """The engine's CPU expert kernel, one MoE layer's routed experts per call. Each routing is
    grouped by expert once (the decode path groups in native code, `TokenPlanner`), so the
    kernel's time is not mixed with Python's."""
    row_bytes = sum(b.row_bytes for b in pool.header.banks)
    out = torch.zeros(tokens, spec.hidden_size)
    grouped_of: dict[int, tuple] = {}

    def call(layer: int, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> int:
        grouped = grouped_of.get(id(ids))
        if grouped is None:
            grouped = grouped_of[id(ids)] = group_by_expert(layer * spec.moe.num_experts, ids, w)
        kernel.run(pool.experts, x, out, *grouped)
        return grouped[0].numel() * row_bytes

    return routed_gbps(spec, tokens, seconds, call, seed)
