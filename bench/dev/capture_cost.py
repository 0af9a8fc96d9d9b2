"""What a recurrent-state checkpoint costs a prompt: one Gated DeltaNet layer of a hybrid spec
(random weights at its shapes, on the GPU) over a prompt chunk, with n states captured inside it
and without, times the spec's linear layers. Each capture count is timed with the shipped path
(`gated_deltanet`: one chunked call, the captures from its per-block states) and with one fla call
per piece between captures (the path it replaced), so that both stand in one table.

    python bench/dev/capture_cost.py model_specs/qwen3.6-35b-a3b.yaml [--tokens 2048,8192]
        [--captures 0,1,8,64] [--reps 20] [-o OUT_DIR]

Prints one line per (tokens, captures, path) and writes `capture_cost.jsonl`: the layer's median
milliseconds, and per capture (its excess over no capture, over n, times the linear layers) the
model's milliseconds: the bar of issue 24 is 5 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from ftc.compile.spec_loader import load_spec
from ftc_runtime.models.layers import fla_delta_rule as fla_layer
from ftc_runtime.models.layers import gated_deltanet as gd


def layer(spec_path: str, device: str) -> tuple[gd.DeltaNetWeights, gd.DeltaNetShape, int, int]:
    """Random weights at the spec's DeltaNet shapes, the shape, hidden size and linear layers."""
    spec, _ = load_spec(Path(spec_path), [])
    la = spec.linear_attention
    shape = gd.DeltaNetShape(la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel,
                             spec.norm.eps)
    h, nv = spec.hidden_size, la.num_v_heads * la.v_head_dim

    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, device=device) * dims[-1] ** -0.5).bfloat16()

    weights = gd.DeltaNetWeights(w(shape.conv_channels, h), w(nv, h), w(la.num_v_heads, h), w(la.num_v_heads, h),
                                 w(shape.conv_channels, 1, la.conv_kernel), torch.rand(la.num_v_heads, device=device),
                                 torch.rand(la.num_v_heads, device=device).log(),
                                 torch.ones(la.v_head_dim, device=device).bfloat16(), w(h, nv))
    return weights, shape, h, len(spec.linear_attention_layers)


def pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The replaced path: the sequence run in pieces ending after each captured token, one fla call
    each (the fused recurrent kernel for a piece of one token), the state carried between them."""
    fla = fla_layer._kernels()
    ends = sorted({i + 1 for i in capture} | {q.shape[0]})
    outs, taken, s, start = [], [], state[None].float(), 0
    for end in ends:
        kernel = fla.recurrent if end - start == 1 else fla.chunked
        o, s = kernel(q[None, start:end], k[None, start:end], v[None, start:end], g=g[None, start:end],
                      beta=beta[None, start:end].to(v.dtype), scale=q.shape[-1] ** -0.5, initial_state=s,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        if end - 1 in capture:
            taken.append(s[0].clone())
        start = end
    return torch.cat(outs), s[0], taken


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # compiles and tunes the kernels at these shapes
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--captures", default="0,1,8,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", type=Path)
    a = ap.parse_args()
    if not (torch.cuda.is_available() and fla_layer.fla_available()):
        raise SystemExit("capture_cost.py: needs a GPU and fla-core (pip install '.[gpu]')")
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    weights, shape, hidden, linear_layers = layer(a.spec, "cuda")
    state = gd.DeltaNetState.zeros(shape, torch.bfloat16, "cuda")
    state.recurrent.normal_()
    rows = []
    counts = sorted({0} | {int(x) for x in a.captures.split(",")})  # 0: what the others exceed
    for t in (int(x) for x in a.tokens.split(",")):
        x = torch.randn(t, hidden, device="cuda").bfloat16()
        for path, rule in (("blocks", fla_layer.fla_delta_rule), ("pieces", pieces)):
            base = None
            for n in counts:
                capture = tuple(sorted(rng.sample(range(t), min(n, t))))
                with mock.patch.object(gd, "fla_delta_rule", rule), torch.inference_mode():
                    ms = median_ms(lambda x=x, c=capture: gd.gated_deltanet(x, weights, shape, state, c), a.reps)
                base = ms if base is None else base
                per = (ms - base) / len(capture) * linear_layers if capture else None
                row = {"spec": a.spec, "tokens": t, "captures": len(capture), "path": path,
                       "layer_ms": round(ms, 4), "model_ms_per_capture": None if per is None else round(per, 3),
                       "linear_layers": linear_layers, "device": torch.cuda.get_device_name()}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "capture_cost.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
