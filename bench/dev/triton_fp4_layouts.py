"""The fp4 Triton expert kernels over the row-major FTW packing of the 4-bit formats (before the
16-row one: `expert_ffn_fp4_rowmajor.py.j2` here) against the shipped template, on one GPU, at
qwen3-30b-a3b's shapes with every expert of a layer in a slot (random bytes: timing only). Decode
expert_ffn (1, 4, 32 tokens, top-8) through CUDA graphs; grouped prompt-chunk GEMM (8192 tokens,
top-8). Rounds interleaved; medians. Also PTX load statistics.

    python3 bench/dev/triton_fp4_layouts.py     (ROUNDS=5, OUT=DIR: bench.json)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.testing

import ftc.codegen.render as render
from ftc.compile.spec_loader import load_spec
from ftc_runtime.io.ftw import FtwHeader

REPO = Path(os.environ.get("REPO", Path(__file__).resolve().parents[2]))
DEV = Path(__file__).resolve().parent
SCRATCH = Path(os.environ.get("SCRATCH", tempfile.mkdtemp(prefix="ftc-fp4-layouts-")))
OUT = Path(os.environ.get("OUT", SCRATCH / "out"))
SPEC = REPO / "model_specs/qwen3-30b-a3b.yaml"
ROUNDS = int(os.environ.get("ROUNDS", "5"))


def template_dirs() -> dict[str, Path | None]:
    old = Path(tempfile.mkdtemp(prefix="tpl_old_", dir=SCRATCH))
    shutil.copytree(render.TEMPLATE_DIR, old, dirs_exist_ok=True)
    (old / "triton/expert_ffn_fp4.py.j2").write_text((DEV / "expert_ffn_fp4_rowmajor.py.j2").read_text())
    out = {"old": old, "new": None}
    for extra in sorted(SCRATCH.glob("variant_*.py.j2")):  # other versions of the fp4 template
        d = Path(tempfile.mkdtemp(prefix=f"tpl_{extra.stem}_", dir=SCRATCH))
        shutil.copytree(render.TEMPLATE_DIR, d, dirs_exist_ok=True)
        (d / "triton/expert_ffn_fp4.py.j2").write_text(extra.read_text())
        out[extra.name.split(".")[0].removeprefix("variant_")] = d
    return out


def load(spec, template_dir, tag):
    d = Path(tempfile.mkdtemp(prefix=f"mod_{tag}_", dir=SCRATCH))
    saved = render.TEMPLATE_DIR
    if template_dir is not None:
        render.TEMPLATE_DIR = template_dir
    try:
        render.render_triton_kernels(spec, d)
    finally:
        render.TEMPLATE_DIR = saved
    path = next(d.glob("*.py"))
    ms = importlib.util.spec_from_file_location(f"m_{tag}", path)
    m = importlib.util.module_from_spec(ms)
    ms.loader.exec_module(m)
    return m


def ptx_stats(m) -> dict:
    stats = {}
    for name in ("_gate_up_act", "_down", "_grouped_gate_up_act", "_grouped_down"):
        fn = getattr(m, name)
        for cache in fn.device_caches.values():
            for k in cache[0].values():
                ptx = k.asm["ptx"]
                loads = re.findall(r"(ld\.global[\w.]*|cp\.async[\w.]*)", ptx)
                counts = {}
                for x in loads:
                    counts[x] = counts.get(x, 0) + 1
                stats[name] = {"loads": counts, "st.shared": len(re.findall(r"st\.shared", ptx)),
                               "ld.shared": len(re.findall(r"ld\.shared", ptx)),
                               "bar": len(re.findall(r"bar\.sync|barrier", ptx)), "regs": k.n_regs,
                               "spills": k.n_spills}
    return stats


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    dirs = template_dirs()
    results = []
    for fmt in sys.argv[1:] or ["mxfp4", "nvfp4"]:
        spec, _ = load_spec(SPEC, [f"expert_format={fmt}"])
        h, i, e, k = spec.hidden_size, spec.moe.expert_intermediate_size, spec.moe.num_experts, spec.moe.top_k
        header = FtwHeader.create(fmt, 1, e, h, i)
        slots = torch.randint(0, 256, (e, header.expert_stride), dtype=torch.uint8, device="cuda")
        mods = {v: load(spec, d, f"{fmt}_{v}") for v, d in dirs.items()}
        expert_bytes = sum(b.row_bytes for b in header.banks)
        cases = []
        for t in (1, 4, 32):
            ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices.reshape(-1).int().contiguous()
            tok = torch.arange(t, device="cuda").repeat_interleave(k).int().contiguous()
            cases.append((f"decode_t{t}", "expert_ffn", torch.randn(t, h, device="cuda"), ids, tok,
                          torch.rand(t * k, device="cuda"), t * k * expert_bytes))
        t = 8192
        ids = torch.rand(t, e, device="cuda").topk(k, dim=1).indices.reshape(-1).int()
        order = torch.argsort(ids, stable=True)
        tok = torch.arange(t, device="cuda").repeat_interleave(k).int()[order].contiguous()
        cases.append(("grouped_t8192", "grouped_expert_ffn", torch.randn(t, h, device="cuda"),
                      ids[order].contiguous(), tok, torch.rand(t * k, device="cuda"), 2 * 3 * h * i * t * k))
        for case, fn_name, x, ps, pt, pw, work in cases:
            times = {v: [] for v in mods}
            for _ in range(ROUNDS):
                for v, m in mods.items():
                    out = torch.zeros_like(x)
                    f = getattr(m, fn_name)

                    def call(f=f, out=out, x=x, slots=slots, ps=ps, pt=pt, pw=pw):
                        f(x, slots, ps, pt, pw, out)

                    if fn_name == "expert_ffn":
                        ms = triton.testing.do_bench_cudagraph(call, rep=100)
                    else:
                        ms = triton.testing.do_bench(call, warmup=50, rep=300)
                    times[v].append(ms)
            for v, ts in times.items():
                ms = statistics.median(ts)
                unit = "GB/s" if fn_name == "expert_ffn" else "TFLOP/s"
                rate = work / ms / 1e6 if fn_name == "expert_ffn" else work / ms / 1e9
                r = {"format": fmt, "case": case, "variant": v, "us": round(ms * 1e3, 2), unit: round(rate, 1),
                     "rounds_us": [round(x * 1e3, 2) for x in ts]}
                results.append(r)
                print(json.dumps(r), flush=True)
        for v, m in mods.items():
            s = ptx_stats(m)
            print(json.dumps({"format": fmt, "variant": v, "ptx": s}), flush=True)
            results.append({"format": fmt, "variant": v, "ptx": s})
    (OUT / "bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
