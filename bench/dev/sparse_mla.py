"""GLM-5.x's sparse latent attention of one decode query (64 heads, latent 512 + rope 64, the
indexer's 2048 chosen rows of a bf16 cache): `sparse_mla_kernel`'s tilings swept, and the whole
`attend_cached` (absorbed query, kernel, values' up-projection) against the gathered rows through
torch's `mla_attention`. Each variant is captured 20 times in one CUDA graph and replayed: µs per
call, launches included as a decode graph has them.

    python bench/dev/sparse_mla.py -o OUT_DIR [--capacity 8192] [--seen 1.0]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from ftc.bench.graph_timing import graph_us
from ftc_runtime.models.layers import sparse_mla_kernel
from ftc_runtime.models.layers.mla import MlaShape, attend_cached, mla_attention

HEADS, KV, ROPE, NOPE, V, TOP_K = 64, 512, 64, 192, 256, 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--capacity", type=int, default=8192)
    ap.add_argument("--seen", type=float, default=1.0, help="share of the chosen rows the query sees")
    a = ap.parse_args()
    a.output.mkdir(parents=True, exist_ok=True)
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    shape = MlaShape(HEADS, 2048, KV, NOPE, ROPE, V, 1e-6, (NOPE + ROPE) ** -0.5)
    rows = torch.randn(a.capacity, KV + ROPE, generator=g, device=dev).to(torch.bfloat16)
    columns = torch.randperm(a.capacity, generator=g, device=dev)[:TOP_K]
    seen = torch.rand(TOP_K, generator=g, device=dev) < a.seen
    seen[0] = True
    q_nope = torch.randn(1, HEADS, NOPE, generator=g, device=dev).to(torch.bfloat16)
    q_rope = torch.randn(1, HEADS, ROPE, generator=g, device=dev).to(torch.bfloat16)
    kv_b = (torch.randn(HEADS * (NOPE + V), KV, generator=g, device=dev) / KV ** 0.5).to(torch.bfloat16)
    q = torch.randn(HEADS, KV + ROPE, generator=g, device=dev).to(torch.bfloat16)
    results: dict[str, float] = {}
    for span in (32, 64, 128):
        for block_n in (16, 32, 64):
            for warps in (4, 8):
                if block_n > span:
                    continue
                name = f"kernel span {span} block_n {block_n} warps {warps}"
                results[name] = graph_us(partial(sparse_mla_kernel.launch, q, rows, columns, seen, KV, shape.scale,
                                                span, block_n, warps))
                print(f"{name}: {results[name]:.2f} us", flush=True)
    results["attend_cached (kernel)"] = graph_us(
        lambda: attend_cached(q_nope, q_rope, rows, kv_b, (columns[None], seen[None]), shape))
    results["gathered rows, torch mla_attention"] = graph_us(
        lambda: mla_attention(q_nope, q_rope, rows[columns, :KV], rows[columns, KV:], kv_b, seen[None], shape))
    for name in list(results)[-2:]:
        print(f"{name}: {results[name]:.2f} us", flush=True)
    got = attend_cached(q_nope, q_rope, rows, kv_b, (columns[None], seen[None]), shape).double()
    want = mla_attention(q_nope.double(), q_rope.double(), rows[columns, :KV].double(), rows[columns, KV:].double(),
                         kv_b.double(), seen[None], shape)
    results["relative error"] = float((got - want).norm() / want.norm())
    print(f"relative error against fp64: {results['relative error']:.2e}")
    (a.output / "sparse_mla.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
