"""`ftc bench experts ENGINE`: the CPU expert kernel's throughput in GB/s of expert weights, next
to torch's bf16 matmul on the same experts and the machine's plain memory read bandwidth."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ftc_runtime.artifact import LIBRARY_FILE, EngineManifest
from ftc_runtime.cpu_info import worker_cpus
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.throughput import expert_kernel_gbps, l3_bytes, routed_gbps, torch_read_gbps
from ftc_runtime.io import ftw
from ftc_runtime.spec import ModelSpec


def torch_bf16_gbps(spec: ModelSpec, pool: ftw.ExpertPool, tokens: int, seconds: float, seed: int = 0) -> dict:
    """The same routed calls through torch's bf16 matmul. bf16 experts are read in place (the
    format's reference is a view of the pool's rows); other formats' are dequantized per call."""
    row_bytes = sum(b.row_bytes for b in pool.header.banks)

    def call(layer: int, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> int:
        xb = x.to(torch.bfloat16)
        experts = ids.unique().tolist()
        for expert in experts:
            gate_up, down = (t.to(torch.bfloat16) for t in
                             pool.header.dequantize(pool.experts[layer * spec.moe.num_experts + expert]))
            gate, up = F.linear(xb, gate_up).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, down)
        return len(experts) * row_bytes

    return routed_gbps(spec, tokens, seconds, call, seed)


# A pool up to this many times the L3 serves a good share of random routed reads from the cache.
CACHED_POOL = 4


def bench_experts(engine: Path, tokens: int = 1, threads: int | None = None, seconds: float = 3.0,
                  seed: int = 0, pool: ftw.ExpertPool | None = None) -> dict:
    manifest = EngineManifest.read(engine)
    manifest.verify()
    spec, plan = manifest.spec, manifest.plan
    pool = pool or ftw.load(manifest.experts_source())
    kernel = CpuExpertKernel(manifest.path(LIBRARY_FILE), plan.isa, spec.hidden_size,
                             spec.moe.expert_intermediate_size, worker_cpus(threads or plan.cpu_threads))
    ours = expert_kernel_gbps(spec, pool, kernel, tokens, seconds, seed)
    ref = torch_bf16_gbps(spec, pool, tokens, seconds, seed)
    read = torch_read_gbps()
    l3 = l3_bytes()
    result = {
        "engine": spec.name, "isa": plan.isa, "threads": kernel.n_threads,
        "torch_threads": torch.get_num_threads(), "tokens": tokens, "top_k": spec.moe.top_k,
        "hidden": spec.hidden_size, "expert_intermediate": spec.moe.expert_intermediate_size,
        "expert_bytes": spec.expert_bytes, "pool_bytes": pool.nbytes, "l3_bytes": l3,
        "kernel_gbps": round(ours["gbps"], 2), "kernel_gbps_median": round(ours["gbps_median"], 2),
        "kernel_ms_per_layer": round(ours["ms_per_layer"], 4),
        "torch_bf16_gbps": round(ref["gbps"], 2), "torch_read_gbps": round(read, 2),
        "kernel_vs_read": round(ours["gbps"] / read, 3), "kernel_vs_torch_bf16": round(ours["gbps"] / ref["gbps"], 3),
    }
    if l3 and pool.nbytes <= CACHED_POOL * l3:
        result["note"] = (f"the expert pool ({pool.nbytes / 2**20:.1f} MiB) is within {CACHED_POOL}x this CPU's L3 "
                          f"({l3 / 2**20:.1f} MiB): most reads hit the cache, so kernel_gbps is not memory bandwidth")
    return result
