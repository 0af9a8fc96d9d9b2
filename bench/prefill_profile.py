"""Where a streamed prefill's time goes on the GPU: one prompt under torch.profiler, after a
warm-up, from an empty expert cache (as `ftc bench prefill` times it). Prints the wall time
(unprofiled, then profiled), how long the copy engine and the compute kernels were busy (their
union and their overlap), the host-to-device bytes and rate, and the kernels that took the most
device time; writes the Chrome trace (gzip) for a closer look.

    python bench/prefill_profile.py SPEC --tokens 8192 --vram-budget 8GiB --override expert_format=nvfp4 \
        --trace OUT/trace.json.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ftc.cli.options import engine_in_memory, offload_config, size
from ftc_runtime import Engine


def busy(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) spans, as disjoint sorted spans."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


def summarize(trace: dict, wall_s: float) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    span = lambda e: (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)  # noqa: E731
    c, k = busy([span(e) for e in copies]), busy([span(e) for e in kernels])
    nbytes = sum(e.get("args", {}).get("bytes", 0) for e in copies)
    copy_s, kernel_s = sum(b - a for a, b in c), sum(b - a for a, b in k)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"] / 1e6
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"wall_s": round(wall_s, 4), "h2d_copies": len(copies), "h2d_bytes": nbytes,
            "copy_busy_s": round(copy_s, 4), "h2d_gbps_while_busy": round(nbytes / copy_s / 1e9, 2) if copy_s else None,
            "kernel_busy_s": round(kernel_s, 4), "both_busy_s": round(overlap(c, k), 4),
            "kernels": len(kernels), "top_kernels_s": [(n[:90], round(s, 4)) for n, s in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", type=Path)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vram-budget", type=size, default=None)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--device", default="cuda", help="cpu: the same path with the CPU standing in (no GPU spans)")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--prefill-split", default="off", help="auto, off or a share: the CPU's part of streamed layers")
    ap.add_argument("--trace", type=Path, default=None, help="write the Chrome trace here (.json.gz)")
    args = ap.parse_args()
    rng = random.Random(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="ftc-profile-") as tmp:
        path, pool = engine_in_memory(args.spec, True, 0, args.target, args.override, Path(tmp))
        offload = offload_config(args.device, args.vram_budget, None, prefill_split=args.prefill_split)
        offload = dataclasses.replace(offload, max_context=args.tokens)
        engine = Engine.load(path, offload=offload, pool=pool)
        experts, vocab = engine.model.experts, engine.spec.vocab_size
        prompt = lambda n: torch.tensor([rng.randrange(vocab) for _ in range(n)])  # noqa: E731
        engine.prefill(prompt(args.tokens), engine.model.new_cache())  # warm-up: kernels compiled
        sync()
        experts.cache.clear()
        ids = prompt(args.tokens)
        t0 = time.perf_counter()
        engine.prefill(ids, engine.model.new_cache())  # the same prompt unprofiled, as ftc bench prefill times it
        sync()
        plain = time.perf_counter() - t0
        experts.cache.clear()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.prefill(ids, engine.model.new_cache())
            sync()
            wall = time.perf_counter() - t0
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
        if args.trace:
            with raw.open("rb") as src, gzip.open(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    print(json.dumps({"tokens": args.tokens, "unprofiled_s": round(plain, 4), **summarize(trace, wall)}, indent=1))


if __name__ == "__main__":
    main()
