"""The decode step's body (everything of a MoE layer before its experts: the residual join, the
attention's input half, the KV write, decode attention, the output half and the router) of
qwen3-30b-a3b's shapes, 48 layers with their own weights, captured as one CUDA graph per variant
and replayed: µs per layer, and a torch profiler table of the graph's kernels.

    python bench/dev/decode_body.py -o OUT_DIR [--position 190] [--variants engine,fused,gemv_only] [--gemv-sweep]

Variants: `engine` (the functions the decode graphs run, compiled as they are), `gemv_only` (the
three projections alone: the floor of cuBLAS at batch 1), `fused` (the fused body kernels of
`qwen3_moe/decode.py`). `--gemv-sweep` times `linear_gpu`'s block configurations on the three
projections' shapes against cuBLAS.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, KV_HEADS, D, EXPERTS, TOP_K, EPS = 48, 2048, 32, 4, 128, 128, 8, 1e-6
CAPACITY = 1024


def make_layers(dev: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

    return [{"norm": 1 + w(HIDDEN), "qkv": w((HEADS + 2 * KV_HEADS) * D, HIDDEN), "q_norm": 1 + w(D),
             "k_norm": 1 + w(D), "o": w(HIDDEN, HEADS * D), "post": 1 + w(HIDDEN), "gate": w(EXPERTS, HIDDEN),
             "keys": w(CAPACITY, KV_HEADS, D, scale=1.0), "values": w(CAPACITY, KV_HEADS, D, scale=1.0)}
            for _ in range(LAYERS)]


def engine_body(io: dict, layers: list[dict]):
    from ftc_runtime.models.layers.attention import attention_in, attention_out, decode_attention
    from ftc_runtime.models.layers.router import route

    compiled = {"attention_in": torch.compile(attention_in, dynamic=False, fullgraph=True),
                "attention_out": torch.compile(attention_out, dynamic=False, fullgraph=True)}
    heads = (HEADS, KV_HEADS, D)

    def run(i: int) -> None:
        L = layers[i]
        io["x"].add_(io["mlp"])
        q, k, v = compiled["attention_in"](io["x"], L["norm"], L["qkv"], None, L["q_norm"], L["k_norm"], io["cos"],
                                           io["sin"], EPS, heads)
        L["keys"].index_copy_(0, io["position"], k)
        L["values"].index_copy_(0, io["position"], v)
        attn = decode_attention(q, L["keys"], L["values"], io["position"], heads)
        x, h = compiled["attention_out"](io["x"], attn, L["o"], None, L["post"], EPS)
        io["x"].copy_(x)
        ids, weights = route(h, L["gate"], TOP_K, True)
        io["h"].copy_(h.float())
        io["ids"].copy_(ids)
        io["weights"].copy_(weights)
    return run


def gemv_only_body(io: dict, layers: list[dict]):
    def run(i: int) -> None:
        L = layers[i]
        qkv = F.linear(io["x"], L["qkv"])
        io["x"].add_(F.linear(qkv[:, :HEADS * D], L["o"]))
        io["logits"].copy_(F.linear(io["x"], L["gate"]))
    return run


def fused_body(io: dict, layers: list[dict]):
    from ftc_runtime.models.layers.decode_attention_kernel import decode_attention_gpu
    from ftc_runtime.models.layers.gemv_kernel import linear_gpu
    from ftc_runtime.models.layers.qk_rope_kernel import qk_norm_rope_store_gpu
    from ftc_runtime.models.layers.router_kernel import softmax_top_k_gpu

    heads = (HEADS, KV_HEADS, D)

    def run(i: int) -> None:
        L, x, position = layers[i], io["x"], io["position"]
        x.add_(io["mlp"])
        qkv = linear_gpu(x, L["qkv"], norm_w=L["norm"], eps=EPS)
        q = qk_norm_rope_store_gpu(qkv, L["q_norm"], L["k_norm"], io["cos"], io["sin"], EPS, heads, L["keys"],
                                   L["values"], position)
        attn = decode_attention_gpu(q, L["keys"], L["values"], position, heads)
        linear_gpu(attn, L["o"], residual=x, out=x)
        logits = linear_gpu(x, L["gate"], norm_w=L["post"], eps=EPS, normed_out=io["h"])
        ids, weights = softmax_top_k_gpu(logits, TOP_K, True)
        io["ids"].copy_(ids)
        io["weights"].copy_(weights)
    return run


def gemv_sweep(out: Path, dev: torch.device) -> None:
    """µs per call of `linear_gpu` on the body's three shapes (48 weights each, one graph) over
    block configurations, against cuBLAS (F.linear)."""
    shapes = {"qkv": ((HEADS + 2 * KV_HEADS) * D, HIDDEN), "o": (HIDDEN, HEADS * D), "gate": (EXPERTS, HIDDEN)}
    with (out / "gemv_sweep.jsonl").open("a") as f:
        for name, (n, k) in shapes.items():
            r = sweep_shape(name, n, k, dev)
            f.write(json.dumps(r) + "\n")
            print({key: r[key] for key in ("shape", "best", "best_us", "cublas_us", "default", "default_us")},
                  flush=True)


def sweep_shape(name: str, n: int, k: int, dev: torch.device) -> dict:
    from ftc_runtime.models.layers import gemv_kernel

    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    results = {"cublas": _time_graph(lambda: [y.copy_(F.linear(x, w)) for w in ws])}
    default = gemv_kernel.gemv_blocks
    try:
        for bn in (1, 2, 4) if n <= 256 else (2, 4, 8, 16):
            for bk in (256, 512, 1024):
                gemv_kernel.gemv_blocks = lambda n_, k_, c=(bn, bk, 4): c
                results[f"{bn}x{bk}w4"] = _time_graph(lambda: [linear_gpu_(x, w, y) for w in ws])
    finally:
        gemv_kernel.gemv_blocks = default
    results["default"] = _time_graph(lambda: [linear_gpu_(x, w, y) for w in ws])
    best_us, best = min((v, c) for c, v in results.items())
    return {"shape": name, "n": n, "k": k, "best": best, "best_us": best_us, "cublas_us": results["cublas"],
            "default": default(n, k), "default_us": results["default"], "all": results}


def linear_gpu_(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
    from ftc_runtime.models.layers.gemv_kernel import linear_gpu

    linear_gpu(x, w, out=y)


def _time_graph(fn) -> float:
    """µs per weight of `fn` (one call per weight of a shape) replayed as one graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) * 1e3 / 20 / LAYERS, 3)


VARIANTS = {"engine": engine_body, "gemv_only": gemv_only_body, "fused": fused_body}


def measure(name: str, position: int, out: Path, dev: torch.device, layers: list[dict]) -> dict:
    from ftc_runtime.models.layers.rope import rope_cos_sin

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.float64, device=dev) / D))
    pos = torch.tensor([position], device=dev)
    cos, sin = rope_cos_sin(inv_freq, pos, torch.bfloat16)
    io = {"x": torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16), "mlp": torch.zeros(1, HIDDEN, device=dev,
          dtype=torch.bfloat16), "cos": cos, "sin": sin, "position": pos,
          "h": torch.zeros(1, HIDDEN, device=dev), "ids": torch.zeros(1, TOP_K, dtype=torch.long, device=dev),
          "weights": torch.zeros(1, TOP_K, device=dev), "logits": torch.zeros(1, EXPERTS, device=dev,
                                                                             dtype=torch.bfloat16)}
    run = VARIANTS[name](io, layers)
    with torch.inference_mode():
        for _ in range(2):
            for i in range(LAYERS):
                run(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(LAYERS):
                run(i)
        for _ in range(10):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 50
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        us_per_layer = start.elapsed_time(end) * 1e3 / replays / LAYERS
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
    (out / f"body_{name}.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    return {"variant": name, "position": position, "us_per_layer": round(us_per_layer, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--position", type=int, default=190)
    ap.add_argument("--variants", default="engine,gemv_only")
    ap.add_argument("--gemv-sweep", action="store_true", help="also time linear_gpu's block configurations")
    a = ap.parse_args()
    a.output.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    layers = make_layers(dev)
    with (a.output / "body.jsonl").open("a") as f:
        for name in a.variants.split(","):
            r = measure(name, a.position, a.output, dev, layers)
            f.write(json.dumps(r) + "\n")
            print(r, flush=True)
    if a.gemv_sweep:
        gemv_sweep(a.output, dev)


if __name__ == "__main__":
    main()
