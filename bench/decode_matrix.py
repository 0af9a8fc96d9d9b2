"""Decode benchmarks of one spec over several miss policies and routings, with the expert pool
generated into memory once (a 48-layer pool takes most of a minute to draw and pin).

    python bench/decode_matrix.py model_specs/qwen3-30b-a3b.yaml --target h200 --vram-budget 32GiB \
        --policies adaptive,gpu,cpu --routings own,trace:bench/traces/qwen3-30b-a3b-k6.npz,synthetic:0.8 \
        -o OUT_DIR [--profile]

Appends one JSON line per run to `decode.jsonl` and prints one summary line each; `--variant`
(repeatable) runs the matrix again under other environment settings (FTC_NUM_THREADS=15, ...);
`--profile` also writes a torch profiler table of a few decode steps of the first run;
`--prefill-lengths 2048,8192` then times prompts of those lengths on the same engine
(`ftc bench prefill`'s runs, two layer buffers) into `prefill.jsonl`.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ftc.bench.decode import bench_decode
from ftc.bench.prefill import bench_prefill
from ftc.compile.pipeline import CompileOptions, compile_with_experts_in_memory
from ftc_runtime.artifact import EngineManifest
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.routing_trace import RoutingTrace, synthetic_trace
from ftc_runtime.experts.vram_plan import parse_size


def routing(name: str, spec) -> tuple[RoutingTrace | None, str, float]:
    """(trace, label, temperature) for own (greedy), sampled (own router, tokens sampled at
    temperature 1), uniform, trace:FILE and synthetic:LOCALITY."""
    if name == "own":
        return None, "the model's own router, greedy", 0.0
    if name == "sampled":
        return None, "the model's own router, sampled at temperature 1", 1.0
    if name == "uniform":  # no locality at all: every step draws k experts uniformly
        return (synthetic_trace(512, len(spec.moe_layers), spec.moe.num_experts, spec.moe.top_k, 0.0, skew=0.0),
                "synthetic uniform (locality 0, Zipf 0, seed 0)", 0.0)
    kind, _, arg = name.partition(":")
    if kind == "trace":
        return RoutingTrace.load(Path(arg)), f"trace {arg}", 0.0
    if kind == "synthetic":
        return (synthetic_trace(512, len(spec.moe_layers), spec.moe.num_experts, spec.moe.top_k, float(arg)),
                f"synthetic (locality {arg}, Zipf 1.0, seed 0)", 0.0)
    raise SystemExit(f"--routings: {name!r} is not own, sampled, uniform, trace:FILE or synthetic:LOCALITY")


def summary(r: dict) -> str:
    e = r["experts"]
    return (f"{r['routing']:<48} {r['miss_policy']:<8} {r['decode_tok_s']:>8} tok/s {r['ms_per_token']:>8} ms/token "
            f"bound {r['bound_ms_per_token']} (x{r['measured_over_bound']}) miss rate {e['miss_rate']:.3f} "
            f"m {e['mean_m']:.2f} q {e['mean_q']:.2f} bias {r.get('split_bias', 0.0)} {e['ms_per_call']} "
            f"host {e['host_ms_per_call']} "
            f"host CPU {r['host_cpu_ms_per_token']} ms/token"
            + (f" device ms per MoE layer {r['device_timeline']['ms_per_moe_layer']}, per token "
               f"{r['device_timeline']['ms_per_token']}" if "device_timeline" in r else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--target", default="auto")
    ap.add_argument("--vram-budget", default="32GiB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--policies", default="adaptive,gpu,cpu")
    ap.add_argument("--routings", default="own")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill-lengths", default="", help="prompt lengths to time after decode, e.g. 2048,8192")
    ap.add_argument("--variant", action="append", default=[],
                    help="environment settings for one more pass over the matrix, e.g. FTC_NUM_THREADS=15,"
                         "FTC_TORCH_COMPILE=1 (each engine reads them when it loads); default: one pass as is")
    ap.add_argument("-o", "--output", type=Path, required=True)
    a = ap.parse_args()
    a.output.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ftc-bench-") as tmp:
        t0 = time.perf_counter()
        opts = CompileOptions(a.spec, a.target, Path(tmp) / "engine", None, True, 0, tuple(a.override))
        engine, pool = compile_with_experts_in_memory(opts)
        print(f"engine with {pool.buffer.numel() / 1e9:.1f} GB of experts in memory in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        spec = EngineManifest.read(engine).spec
        profile_to = a.output / "profile.txt" if a.profile else None  # the first run only
        base_env = dict(os.environ)
        for variant, name in itertools.product(a.variant or [""], a.routings.split(",")):
            trace, label, temperature = routing(name, spec)
            os.environ.clear()  # each variant on the environment the script started with, plus its own
            os.environ.update(base_env | dict(kv.split("=", 1) for kv in variant.split(",") if kv))
            for policy in a.policies.split(","):
                cfg = OffloadConfig(device=a.device, vram_budget=parse_size(a.vram_budget), miss_policy=policy)
                r = bench_decode(engine, cfg, trace, label, a.prompt_tokens, a.new_tokens, pool=pool,
                                 profile_to=profile_to, temperature=temperature)
                profile_to = None
                tag = name.split(":")[0] + (name.split(":")[1] if name.startswith("synthetic") else "")
                with open(a.output / "decode.jsonl", "a") as f:
                    f.write(json.dumps(r | {"tag": f"{tag}_{policy}", "variant": variant}) + "\n")
                print(variant, summary(r), flush=True)
                gc.collect()  # the engine's slots must be free before the next one allocates its own
                torch.cuda.empty_cache()
        if a.prefill_lengths:
            prefill(engine, pool, a)
    sys.exit(0)


def prefill(engine: Path, pool, a: argparse.Namespace) -> None:
    """The prompt lengths of `--prefill-lengths` on the engine, one summary line each."""
    cfg = OffloadConfig(device=a.device, vram_budget=parse_size(a.vram_budget))
    runs = bench_prefill(engine, [cfg], [int(n) for n in a.prefill_lengths.split(",")], [True], pool=pool)["runs"]
    with open(a.output / "prefill.jsonl", "a") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
            print(f"prefill {r['tokens']} tokens: {r['tok_s']} tok/s in {r['seconds']} s, {r['chunks']} chunks of "
                  f"{r['prefill_chunk']}, PCIe ceiling {r['pcie_ceiling_tok_s']} tok/s (x{r['of_ceiling']}), "
                  f"{r['stream_layers']} layers streamed", flush=True)


if __name__ == "__main__":
    main()
