"""Where the 4-bit AVX-512 expert kernel's time goes, without hardware counters (the device VM
has none): each variant rewrites one stage of the rendered kernel (drops it, or does it another
way), and is timed like `ftc bench experts` over cold experts (DRAM) and over the same 8 experts
every call (hot: in the caches), with the pool on huge pages or on 4 KiB pages. Every case is
measured once per round, rounds interleaved, since this VM's rates move from minute to minute.
Dropped stages give wrong sums; only the time counts.

    python bench/dev/fp4_kernel_ablation.py ENGINE [--variants base,pf_t0,...] [--threads 16,1] [--pages 2m,4k]

Prints one JSON line per (variant, threads, pages, routing): the median GB/s and each round's.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import tempfile
from pathlib import Path

import torch

from ftc.codegen.render import render_cpu_kernels
from ftc_runtime.artifact import EXPERTS_FILE, EngineManifest
from ftc_runtime.cpu_info import worker_cpus
from ftc_runtime.experts.base import group_by_expert
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.throughput import expert_kernel_gbps, time_calls
from ftc_runtime.io import ftw
from ftc_runtime.kernel_build import build_kernels
from ftc_runtime.settings import settings

HUGE_PAGE = 2 << 20

PREFETCH = "prefetch(ahead_of(groups[g].codes, groups[g].pf_codes, o, CODES_AHEAD, CODE_BYTES));"
GROUP_AT = ("  return {expert + codes + int64_t{r} * (K / 2), expert + scales + int64_t{r} * (K / B),\n"
            "          pf_expert + codes + int64_t{pf} * (K / 2), pf_expert + scales + int64_t{pf} * (K / B)")
LO_DOTS = ("          lo[g][t][0] = _mm512_dpbusd_epi32(lo[g][t][0], w0[g], l0);\n",
           "          lo[g][t][S - 1] = _mm512_dpbusd_epi32(lo[g][t][S - 1], w1[g], l1);\n")

# name -> (text in the rendered kernel, its replacement); a variant may join several with '+'.
EDITS: dict[str, list[tuple[str, str]]] = {
    "base": [],
    # the codes prefetched non-temporally (into L1 only), or not at all
    "pf_nta": [(PREFETCH, PREFETCH.replace("prefetch(", "_mm_prefetch(reinterpret_cast<const char*>(")
                .replace("));", ")), _MM_HINT_NTA);"))],
    "pf_none": [(PREFETCH, "")],
    # one phase left out (its bytes still counted: compare ms, not GB/s)
    "nodown": [("constexpr int n_down = (H + DOWN_CHUNK - 1) / DOWN_CHUNK;", "constexpr int n_down = 0;")],
    "nogateup": [("const int n_gate_up = c.n_experts * items_per_expert;", "const int n_gate_up = 0;")],
    # every group read is one of the first two of its matrix: the same instructions on data in
    # L1 and L2, the kernel's ceiling when memory costs nothing
    "l1": [(GROUP_AT, GROUP_AT.replace("{r}", "{r % 32}").replace("{pf}", "{pf % 32}"))],
    # larger work items: fewer item starts
    "gu64": [("constexpr int GU_CHUNK = 32;", "constexpr int GU_CHUNK = 64;")],
    "down64": [("constexpr int DOWN_CHUNK = 32;", "constexpr int DOWN_CHUNK = 64;")],
    "down128": [("constexpr int DOWN_CHUNK = 32;", "constexpr int DOWN_CHUNK = 128;")],
    # how far ahead a 16-row stream prefetches (the kernel's: 4 rows' bytes)
    "ahead2": [("constexpr int AHEAD_ROWS = 4;", "constexpr int AHEAD_ROWS = 2;")],
    "ahead8": [("constexpr int AHEAD_ROWS = 4;", "constexpr int AHEAD_ROWS = 8;")],
    # activations as one int8 part per 32 columns (no low part): half the vpdpbusd
    "q8": [(LO_DOTS[0], ""), (LO_DOTS[1], "")],
    # no work item claimed ahead, nor its first rows prefetched
    "noahead": [("  if (next.load(std::memory_order_relaxed) + n_threads > n) return n;", "  return n;"),
                ("  if (next.expert == nullptr) return {expert, r};\n"
                 "  return {next.expert, next.row + r + PREFETCH_ROWS - r1};", "  return {expert, r};")],
    # the int32 sums never split in two, or always
    "split1": [("return r * nb >= 4 ? 1 : 2;", "return 1;")],
    "split2": [("return r * nb >= 4 ? 1 : 2;", "return 2;")],
    # fewer groups per pass at one token (their broadcasts not shared)
    "pass2": [("return nb == 1 ? 4 : nb == 2 ? 2 : 1;", "return nb == 1 ? 2 : nb == 2 ? 2 : 1;")],
}


def patched(source: str, variant: str) -> str:
    for name in variant.split("+"):
        for old, new in EDITS[name]:
            if old not in source:
                raise SystemExit(f"variant {name!r}: {old[:60]!r}... is not in the rendered kernel")
            source = source.replace(old, new)
    return source


def hot_gbps(m: EngineManifest, pool: ftw.ExpertPool, kernel: CpuExpertKernel, seconds: float) -> dict:
    """The same 8 experts of layer 0 every call, one token: they stay in the caches."""
    spec = m.spec
    k = spec.moe.top_k
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(spec.moe.num_experts, generator=g)[:k].unsqueeze(0)
    grouped = group_by_expert(0, ids, torch.rand(1, k, generator=g))
    x, out = torch.randn(1, spec.hidden_size, generator=g), torch.zeros(1, spec.hidden_size)
    row_bytes = sum(b.row_bytes for b in pool.header.banks)
    median = statistics.median(time_calls(lambda: kernel.run(pool.experts, x, out, *grouped), seconds))
    return {"gbps": k * row_bytes / median / 1e9, "ms_per_layer": median * 1e3}


def build_variant(m: EngineManifest, variant: str, tmp: Path) -> Path:
    kdir = tmp / variant / "kernels"
    render_cpu_kernels(m.spec, m.plan, kdir)
    src = kdir / f"expert_ffn_{m.plan.isa}.cpp"
    src.write_text(patched(src.read_text(), variant))
    lib, _ = build_kernels(kdir, tmp / variant / "lib", settings().cache_dir)
    return lib


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into a private anonymous mapping advised onto transparent huge pages."""
    area = mmap.mmap(-1, t.numel() + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` mapped while a view lives
    skip = -raw.data_ptr() % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE, skip, t.numel())
    out = raw[skip:skip + t.numel()]
    out.copy_(t)
    return out


def pools(loaded: ftw.ExpertPool, pages: list[str]) -> dict[str, ftw.ExpertPool]:
    """The pool as `ftw.load` placed it (4k: a plain torch allocation, 4 KiB pages unless
    transparent huge pages are on for every mapping) and a copy on huge pages (2m)."""
    return {kind: loaded if kind == "4k" else ftw.ExpertPool(loaded.header, huge_page_copy(loaded.buffer))
            for kind in pages}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", type=Path)
    ap.add_argument("--variants", default="base,pf_nta,pf_none")
    ap.add_argument("--threads", default="16")
    ap.add_argument("--routings", default="cold,hot")
    ap.add_argument("--pages", default="4k", help="4k, 2m or both: where the pool lies")
    ap.add_argument("--rounds", type=int, default=3, help="every case is measured once per round, interleaved")
    ap.add_argument("--seconds", type=float, default=1.0)
    args = ap.parse_args()
    m = EngineManifest.read(args.engine)
    by_pages = pools(ftw.load(m.path(EXPERTS_FILE)), args.pages.split(","))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(json.dumps({"transparent_hugepage": thp.read_text().strip() if thp.exists() else None}), flush=True)
    results: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build_variant(m, v, Path(tmp)) for v in args.variants.split(",")}
        kernels = {(v, t): CpuExpertKernel(lib, m.plan.isa, m.spec.hidden_size, m.spec.moe.expert_intermediate_size,
                                           worker_cpus(t))
                   for v, lib in libs.items() for t in (int(x) for x in args.threads.split(","))}
        for _ in range(args.rounds):
            for (variant, threads), kernel in kernels.items():
                for pages, pool in by_pages.items():
                    for routing in args.routings.split(","):
                        r = (expert_kernel_gbps(m.spec, pool, kernel, 1, args.seconds) if routing == "cold"
                             else hot_gbps(m, pool, kernel, args.seconds))
                        results.setdefault((variant, threads, pages, routing), []).append(r["gbps"])
    for (variant, threads, pages, routing), gbps in results.items():
        print(json.dumps({"format": m.spec.expert_format, "variant": variant, "threads": threads, "pages": pages,
                          "routing": routing, "gbps_median": round(statistics.median(gbps), 2),
                          "gbps": [round(g, 2) for g in gbps]}), flush=True)


if __name__ == "__main__":
    main()
