"""Times the decode expert kernel (`expert_ffn`: one token's top-k experts in cache slots) of a spec's
expert format over tilings, on one GPU, as a decode graph runs it (calls captured in a CUDA graph).

    python bench/dev/tune_decode_experts.py model_specs/glm-5.2.yaml [--override expert_format=nvfp4] \\
        [--pairs 8] [--gate-up 16x256x4,32x512x8] [--down 32x128x4,64x256x8]

A gate/up tiling is rows per program x K per step x warps, a down tiling likewise; the two are swept
one after the other (the down sweep on the best gate/up tiling). Every tiling's output is checked
against the default's. Prints one JSON line per tiling: µs per call and the GB/s of the experts read.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from functools import partial
from pathlib import Path

import torch

from ftc.bench.graph_timing import graph_us
from ftc.codegen.render import DECODE_TILES, render_triton_kernels
from ftc.compile.spec_loader import load_spec
from ftc.compile.weights import RandomWeights
from ftc_runtime.formats import expert_format
from ftc_runtime.io.ftw import FtwHeader


def slots_of(spec, n: int) -> torch.Tensor:
    """n experts of the first MoE layer in the spec's format, as device slots."""
    fmt = spec.expert_format
    header = FtwHeader.create(fmt, 1, spec.moe.num_experts, spec.hidden_size, spec.moe.expert_intermediate_size)
    weights = RandomWeights(spec)
    slots = torch.zeros(n, header.expert_stride, dtype=torch.uint8)
    for e in range(n):
        rows = expert_format(fmt).rows_of(weights.expert(spec.moe_layers[0], e))
        for name, dst in header.rows(slots[e]).items():
            dst.copy_(rows[name])
    return slots.cuda()


def kernel(spec, tiles: tuple[int, ...], tmp: Path):
    """The rendered module's `expert_ffn` at a decode tiling."""
    d = tmp / "x".join(map(str, tiles))
    render_triton_kernels(spec, d, decode_tiles=tiles)
    path = next(d.glob("*.py"))
    module_spec = importlib.util.spec_from_file_location(f"decode_{d.name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.expert_ffn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--pairs", type=int, default=0, help="experts per call (default: the spec's top-k)")
    ap.add_argument("--gate-up", default="16x256x4,16x512x4,32x256x4,32x512x8,16x1024x4,32x1024x8,64x512x8")
    ap.add_argument("--down", default="32x128x4,32x256x4,64x128x4,64x256x8,32x512x4,128x256x8")
    a = ap.parse_args()
    spec, _ = load_spec(a.spec, a.override)
    pairs = a.pairs or spec.moe.top_k
    slots = slots_of(spec, pairs)
    x = torch.randn(1, spec.hidden_size, device="cuda")
    slot = torch.arange(pairs, dtype=torch.int32, device="cuda")
    tok, w = torch.zeros_like(slot), torch.rand(pairs, device="cuda")
    gb = pairs * spec.expert_bytes / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        want = torch.zeros_like(x)
        kernel(spec, DECODE_TILES, Path(tmp))(x, slots, slot, tok, w, want)
        best = DECODE_TILES
        for part, choices in (("gate_up", a.gate_up), ("down", a.down)):
            timed = {}
            for choice in choices.split(","):
                rows, k, warps = (int(v) for v in choice.split("x"))
                tiles = (rows, k, *best[2:4], warps) if part == "gate_up" else (*best[:2], rows, k, warps)
                try:
                    ffn = kernel(spec, tiles, Path(tmp))
                    out = torch.zeros_like(x)
                    ffn(x, slots, slot, tok, w, out)
                    err = float((out - want).abs().max() / want.abs().max())
                    us = graph_us(partial(ffn, x, slots, slot, tok, w, torch.zeros_like(x)))
                except Exception as e:  # noqa: BLE001 (a tiling the kernel refuses: say so, go on)
                    print(json.dumps({"part": part, "tiles": tiles, "error": f"{type(e).__name__}: {e}"[:200]}))
                    continue
                timed[tiles] = us
                print(json.dumps({"format": spec.expert_format, "part": part, "tiles": tiles, "pairs": pairs,
                                  "us": round(us, 2), "gb_s": round(gb / us * 1e6, 1), "rel_err": f"{err:.1e}"}),
                      flush=True)
            best = min(timed, key=timed.get, default=best)
        print(json.dumps({"format": spec.expert_format, "best": best, "us": round(timed.get(best, 0.0), 2)}))


if __name__ == "__main__":
    main()
