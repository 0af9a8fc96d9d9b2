"""Times the grouped GEMM (prompt chunks) of each expert format over several tilings, on one GPU.

    python bench/dev/tune_grouped_gemm.py model_specs/qwen3-30b-a3b.yaml --formats bf16,mxfp4,nvfp4 \\
        --tokens 8192 --tiles 64x64x4x3,128x64x4x3,128x128x8x3

A tiling is BLOCK_M x BLOCK_N x warps x stages. Every expert of one MoE layer sits in a slot (random
weights drawn in the format), the tokens are routed uniformly to top-k of them, and one call runs
the layer's experts; prints one JSON line per (format, tiling): median ms and TFLOP/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch

from ftc.codegen.render import render_triton_kernels
from ftc.compile.spec_loader import load_spec
from ftc.compile.weights import RandomWeights
from ftc_runtime.formats import expert_format
from ftc_runtime.io.ftw import FtwHeader


def slots_of(spec, fmt: str) -> torch.Tensor:
    """One layer's experts in the format, as device slots."""
    header = FtwHeader.create(fmt, 1, spec.moe.num_experts, spec.hidden_size, spec.moe.expert_intermediate_size)
    weights = RandomWeights(spec)
    slots = torch.zeros(spec.moe.num_experts, header.expert_stride, dtype=torch.uint8)
    for e in range(spec.moe.num_experts):
        rows = expert_format(fmt).rows_of(weights.expert(spec.moe_layers[0], e))
        for name, dst in header.rows(slots[e]).items():
            dst.copy_(rows[name])
    return slots.cuda()


def routed_pairs(spec, tokens: int) -> tuple[torch.Tensor, ...]:
    """(x, slot, token, weight) of `tokens` tokens routed uniformly, pairs sorted by slot."""
    e, k = spec.moe.num_experts, spec.moe.top_k
    ids = torch.rand(tokens, e, device="cuda").topk(k, dim=1).indices.reshape(-1).int()
    order = torch.argsort(ids, stable=True)
    tok = torch.arange(tokens, device="cuda").repeat_interleave(k).int()[order]
    return (torch.randn(tokens, spec.hidden_size, device="cuda"), ids[order].contiguous(), tok.contiguous(),
            torch.rand(tokens * k, device="cuda"))


def time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--formats", default="bf16,mxfp4,nvfp4")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tiles", default="64x64x4x3,128x64x4x3,64x128x4x3,128x128x8x3,128x128x8x4,128x64x8x3")
    a = ap.parse_args()
    for fmt in a.formats.split(","):
        spec, _ = load_spec(a.spec, [f"expert_format={fmt}"])
        slots = slots_of(spec, fmt)
        x, slot, tok, w = routed_pairs(spec, a.tokens)
        flops = 2 * 3 * spec.hidden_size * spec.moe.expert_intermediate_size * slot.numel()
        for tiles in a.tiles.split(","):
            m, n, warps, stages = (int(v) for v in tiles.split("x"))
            with tempfile.TemporaryDirectory() as tmp:
                render_triton_kernels(spec, Path(tmp), (m, n, warps, stages))
                path = next(Path(tmp).glob("*.py"))
                module_spec = importlib.util.spec_from_file_location(f"grouped_{fmt}_{tiles}", path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                out = torch.zeros_like(x)
                ms = time_ms(partial(module.grouped_expert_ffn, x, slots, slot, tok, w, out))
            print(json.dumps({"format": fmt, "tiles": tiles, "tokens": a.tokens, "ms": round(ms, 4),
                              "tflops": round(flops / ms / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()
