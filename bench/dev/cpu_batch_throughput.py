"""The engine's CPU kernel with T tokens routed to the same k experts (T tokens per expert, as a
prompt chunk gives each expert: from the kernel's `tile_min` on, its tile GEMMs, AMX where the CPU
has it unless FTC_AMX=0), against torch's bf16 matmul of the same experts (oneDNN, which uses AMX tiles
where the CPU has them), their weights dequantized to bf16 before the timing. Prints TFLOP/s and
GB/s of expert bytes per T.

    python bench/dev/cpu_batch_throughput.py ENGINE [--tokens 1,8,16,32,64,128] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from ftc_runtime.artifact import EXPERTS_FILE, LIBRARY_FILE, EngineManifest
from ftc_runtime.cpu_info import worker_cpus
from ftc_runtime.experts.base import group_by_expert
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.throughput import time_calls
from ftc_runtime.io import ftw


def kernel_seconds(kernel: CpuExpertKernel, pool: ftw.ExpertPool, x: torch.Tensor, out: torch.Tensor,
                   grouped: tuple, seconds: float) -> float:
    return statistics.median(time_calls(lambda: kernel.run(pool.experts, x, out, *grouped), seconds))


def bf16_matmul_seconds(weights: list[tuple[torch.Tensor, torch.Tensor]], xb: torch.Tensor, seconds: float) -> float:
    def call() -> None:
        for gate_up, down in weights:
            gate, up = F.linear(xb, gate_up).chunk(2, dim=-1)
            F.linear(F.silu(gate) * up, down)

    return statistics.median(time_calls(call, seconds))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", type=Path)
    ap.add_argument("--tokens", default="1,8,16,32,64,128")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    m = EngineManifest.read(args.engine)
    spec = m.spec
    pool = ftw.load(m.path(EXPERTS_FILE))
    cpus = worker_cpus(args.threads)
    torch.set_num_threads(len(cpus))
    kernel = CpuExpertKernel(m.path(LIBRARY_FILE), m.plan.isa, spec.hidden_size, spec.moe.expert_intermediate_size,
                             cpus)
    e, k, h, inter = spec.moe.num_experts, spec.moe.top_k, spec.hidden_size, spec.moe.expert_intermediate_size
    g = torch.Generator().manual_seed(0)
    experts = torch.randperm(e, generator=g)[:k]
    weights = [tuple(w.to(torch.bfloat16) for w in pool.header.dequantize(pool.experts[int(x)])) for x in experts]
    row_bytes = sum(b.row_bytes for b in pool.header.banks)
    for t in (int(x) for x in args.tokens.split(",")):
        ids = experts.repeat(t, 1)
        w = torch.rand(t, k, generator=g)
        x, out = torch.randn(t, h, generator=g), torch.zeros(t, h)
        ours = kernel_seconds(kernel, pool, x, out, group_by_expert(0, ids, w), args.seconds)
        ref = bf16_matmul_seconds(weights, x.to(torch.bfloat16), args.seconds)
        flops = 2 * t * k * 3 * h * inter
        tiled = kernel.tile_min is not None and t >= kernel.tile_min
        print(json.dumps({"format": spec.expert_format, "threads": len(cpus), "tokens_per_expert": t,
                          "tile_backend": kernel.tile_backend if tiled else "none",
                          "kernel_ms": round(ours * 1e3, 4), "kernel_tflops": round(flops / ours / 1e12, 3),
                          "kernel_gbps": round(k * row_bytes / ours / 1e9, 2),
                          "torch_bf16_ms": round(ref * 1e3, 4), "torch_bf16_tflops": round(flops / ref / 1e12, 3)}),
              flush=True)


if __name__ == "__main__":
    main()
