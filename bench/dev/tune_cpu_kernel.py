"""Sweeps the CPU expert kernel's tiling knobs and worker counts on one engine's expert pool.

    python bench/dev/tune_cpu_kernel.py ENGINE [--threads 8,12,16] [--prefetch 0,2,4] [--chunk 8,16,32]

Each variant is rendered and built like `ftc compile` does (cached by source hash) and measured
like `ftc bench experts ENGINE`; prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from ftc.codegen.render import render_cpu_kernels
from ftc_runtime.artifact import EXPERTS_FILE, EngineManifest
from ftc_runtime.cpu_info import worker_cpus
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.throughput import expert_kernel_gbps
from ftc_runtime.io import ftw
from ftc_runtime.kernel_build import build_kernels
from ftc_runtime.settings import settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", type=Path)
    ap.add_argument("--threads", default="16")
    ap.add_argument("--prefetch", default="2")
    ap.add_argument("--chunk", default="16")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    m = EngineManifest.read(args.engine)
    pool = ftw.load(m.path(EXPERTS_FILE))
    for chunk in ints(args.chunk):
        for pf in ints(args.prefetch):
            plan = dataclasses.replace(m.plan, gate_up_chunk=chunk, down_chunk=chunk, prefetch_rows=pf)
            with tempfile.TemporaryDirectory() as tmp:
                render_cpu_kernels(m.spec, plan, Path(tmp) / "kernels")
                lib, _ = build_kernels(Path(tmp) / "kernels", Path(tmp) / "lib", settings().cache_dir)
                for threads in ints(args.threads):
                    kernel = CpuExpertKernel(lib, plan.isa, m.spec.hidden_size,
                                             m.spec.moe.expert_intermediate_size, worker_cpus(threads))
                    for tokens in ints(args.tokens):
                        r = expert_kernel_gbps(m.spec, pool, kernel, tokens, args.seconds)
                        print(json.dumps({"chunk": chunk, "prefetch_rows": pf, "threads": threads,
                                          "tokens": tokens, "gbps": round(r["gbps"], 2),
                                          "ms_per_layer": round(r["ms_per_layer"], 4)}), flush=True)
                    del kernel


if __name__ == "__main__":
    main()
