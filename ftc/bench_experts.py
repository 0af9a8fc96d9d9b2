"""`ftc bench ENGINE experts`: the CPU expert kernel's throughput in GB/s of expert weights, next
to torch's bf16 matmul on the same experts and the machine's plain memory read bandwidth."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ftc_runtime import ftw
from ftc_runtime.artifact import EXPERTS_FILE, LIBRARY_FILE, EngineManifest
from ftc_runtime.cpu_info import worker_cpus
from ftc_runtime.experts import group_by_expert
from ftc_runtime.kernels import CpuExpertKernel
from ftc_runtime.spec import ModelSpec


def _l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("K")) * 1024 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return 0


def _time(fn: Callable[[], None], seconds: float, min_iters: int = 10,
          after_warmup: Callable[[], None] = lambda: None) -> list[float]:
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


def torch_read_gbps(nbytes: int = 2 << 30, seconds: float = 1.0) -> float:
    """A plain read of a large fp32 tensor with torch's threads (t.sum())."""
    t = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / statistics.median(_time(lambda: t.sum(), seconds, 5)) / 1e9


def _routed_calls(spec: ModelSpec, tokens: int, seed: int) -> list[tuple]:
    """64 calls, each a random MoE layer with random top-k routing, so that successive calls do not
    hit in cache."""
    g = torch.Generator().manual_seed(seed)
    e, k, layers = spec.moe.num_experts, spec.moe.top_k, len(spec.moe_layers)
    calls = []
    for it in range(64):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
        calls.append((it % layers, ids, torch.rand(tokens, k, generator=g),
                      torch.randn(tokens, spec.hidden_size, generator=g)))
    return calls


def measure(spec: ModelSpec, pool: ftw.ExpertPool, kernel: CpuExpertKernel | None, tokens: int,
            seconds: float, seed: int = 0) -> dict:
    """GB/s of expert weights (all bytes over all time, and the mean bytes of a call over the median
    call time) and the median ms per MoE layer call, for the kernel or (None) torch bf16."""
    e = spec.moe.num_experts
    calls = _routed_calls(spec, tokens, seed)
    row_bytes = pool.header.bank("gate_up").row_bytes + pool.header.bank("down").row_bytes
    out = torch.zeros(tokens, spec.hidden_size)
    state = {"i": 0, "bytes": 0}

    def kernel_call() -> None:
        layer, ids, w, x = calls[state["i"] % len(calls)]
        state["i"] += 1
        grouped = group_by_expert(layer * e, ids, w)
        state["bytes"] += grouped[0].numel() * row_bytes
        kernel.run(pool.bank("gate_up"), pool.bank("down"), x, out, *grouped)

    def torch_call() -> None:
        layer, ids, w, x = calls[state["i"] % len(calls)]
        state["i"] += 1
        xb = x.to(torch.bfloat16)
        for expert in ids.unique().tolist():
            row = layer * e + expert
            state["bytes"] += row_bytes
            gate, up = F.linear(xb, pool.expert_tensor("gate_up", row)).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, pool.expert_tensor("down", row))

    times = _time(kernel_call if kernel else torch_call, seconds, after_warmup=lambda: state.update(bytes=0))
    median = statistics.median(times)
    return {"gbps": state["bytes"] / sum(times) / 1e9, "ms_per_layer": median * 1e3,
            "gbps_median": state["bytes"] / len(times) / median / 1e9}


def bench_experts(engine: Path, tokens: int = 1, threads: int | None = None, seconds: float = 3.0,
                  seed: int = 0, pool: ftw.ExpertPool | None = None) -> dict:
    manifest = EngineManifest.read(engine)
    manifest.verify()
    spec, plan = manifest.spec, manifest.plan
    pool = pool or ftw.load(engine / EXPERTS_FILE)
    kernel = CpuExpertKernel(engine / LIBRARY_FILE, plan.isa, spec.hidden_size,
                             spec.moe.expert_intermediate_size, worker_cpus(threads or plan.cpu_threads))
    ours = measure(spec, pool, kernel, tokens, seconds, seed)
    ref = measure(spec, pool, None, tokens, seconds, seed)
    read = torch_read_gbps()
    return {
        "engine": spec.name, "isa": plan.isa, "threads": kernel.n_threads,
        "torch_threads": torch.get_num_threads(), "tokens": tokens, "top_k": spec.moe.top_k,
        "hidden": spec.hidden_size, "expert_intermediate": spec.moe.expert_intermediate_size,
        "expert_bytes": spec.expert_bytes, "pool_bytes": pool.nbytes, "l3_bytes": _l3_bytes(),
        "kernel_gbps": round(ours["gbps"], 2), "kernel_gbps_median": round(ours["gbps_median"], 2),
        "kernel_ms_per_layer": round(ours["ms_per_layer"], 4),
        "torch_bf16_gbps": round(ref["gbps"], 2), "torch_read_gbps": round(read, 2),
        "kernel_vs_read": round(ours["gbps"] / read, 3), "kernel_vs_torch_bf16": round(ours["gbps"] / ref["gbps"], 3),
    }
