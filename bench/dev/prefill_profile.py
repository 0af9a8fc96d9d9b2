"""Where a streamed prefill's time goes on the GPU: one prompt under torch.profiler, after a
warm-up, from an empty expert cache (as `ftc bench prefill` times it). Prints the wall time
(unprofiled, then profiled), how long the copy engine and the compute kernels were busy (their
union and their overlap), the host-to-device bytes and rate, and the kernels that took the most
device time; where host→device copies waited behind others, and with the CPU part of a split
(`--prefill-split`), how the copies ran during its parts and the serial stretches between them;
writes each run's Chrome trace (gzip) for a closer look.

    python bench/dev/prefill_profile.py SPEC --tokens 2048,8192 --vram-budget 8GiB --override expert_format=nvfp4 \
        --prefill-split off,auto --trace-dir OUT
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
from ftc_runtime.experts.stats import OffloadStats


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
            "h2d_by_stream": h2d_waits(events, copies), **cpu_parts(events, c, k),
            "kernels": len(kernels), "top_kernels_s": [(n[:90], round(s, 4)) for n, s in top]}


def span(e: dict) -> tuple[float, float]:
    return e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6


def h2d_waits(events: list[dict], copies: list[dict]) -> dict:
    """Per stream, its host→device copies and how long each waited on the device after the host
    queued it (the copy's start − the end of its cudaMemcpyAsync call): a copy that waits behind
    another stream's copies shows it here."""
    launched = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime"
                and "Memcpy" in e.get("name", "") and "correlation" in e.get("args", {})}
    out: dict[str, dict] = {}
    for e in copies:
        row = out.setdefault(str(e.get("args", {}).get("stream", "?")), {"copies": 0, "mb": 0.0, "waits_ms": []})
        row["copies"] += 1
        row["mb"] += e.get("args", {}).get("bytes", 0) / 2**20
        call = launched.get(e.get("args", {}).get("correlation"))
        if call is not None:
            row["waits_ms"].append(max(0.0, (e["ts"] - call["ts"] - call["dur"]) / 1e3))
    for row in out.values():
        waits = sorted(row.pop("waits_ms"))
        row["mb"] = round(row["mb"], 1)
        row.update(wait_total_ms=round(sum(waits), 2), wait_max_ms=round(waits[-1], 3) if waits else None,
                   waits_over_1ms=sum(w > 1 for w in waits))
    return out


def cpu_parts(events: list[dict], copy_busy: list[tuple[float, float]], kernel_busy: list[tuple[float, float]]
              ) -> dict:
    """The split's CPU parts: each from its start's end on the host (the kernel starts there) to
    its result's arrival: the end of the device's take after its wait for the CPU's flag
    (`io/host_take.take_when_signaled`: kernels `_wait`, then `_take_unless_given_up`), or where the
    host waited for the kernel, its finish's end; the copy engine's and the device kernels' busy
    time inside them, the device's time in those waits and takes, and the serial stretches between
    one part's result and the next one's start."""
    def marks(name: str) -> list[dict]:
        return sorted((e for e in events if e.get("name") == f"ftc.stream_cpu.{name}"
                       and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])  # the host's, not the GPU's

    def device(name: str) -> list[dict]:
        return sorted((e for e in events if e.get("cat") == "kernel" and e.get("name") == name), key=lambda e: e["ts"])

    takes, waits = device("_take_unless_given_up"), device("_wait")
    ends = [span(e)[1] for e in (takes or marks("finish"))]
    parts = [(span(s)[1], end) for s, end in zip(marks("start"), ends, strict=False)]
    if not parts:
        return {}
    gaps = [(a[1], b[0]) for a, b in zip(parts, parts[1:], strict=False)]
    total = lambda spans: sum(b - a for a, b in spans)  # noqa: E731
    return {"cpu_parts": len(parts), "cpu_parts_s": round(total(parts), 4),
            "copy_busy_in_parts_s": round(overlap(parts, copy_busy), 4),
            "device_takes": len(takes), "device_take_s": round(sum(e["dur"] for e in takes) / 1e6, 4),
            "device_wait_s": round(sum(e["dur"] for e in waits) / 1e6, 4),
            "serial_s": round(total(gaps), 4), "copy_busy_in_serial_s": round(overlap(gaps, copy_busy), 4),
            "kernel_busy_in_serial_s": round(overlap(gaps, kernel_busy), 4),
            "serial_median_ms": round(sorted(b - a for a, b in gaps)[len(gaps) // 2] * 1e3, 3) if gaps else None}


def write_trace(prof: profile, tmp: Path, path: Path | None) -> dict:
    """The profile's Chrome trace, read back; also gzipped to `path` where one is given."""
    raw = tmp / "trace.json"
    prof.export_chrome_trace(str(raw))
    if path is not None:
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return json.loads(raw.read_text())


def profiled(engine: Engine, n: int, rng: random.Random, sync, tmp: Path, trace_path: Path | None) -> dict:
    """One prompt of n tokens from an empty expert cache: warm-up, unprofiled, then profiled."""
    experts, vocab = engine.model.experts, engine.spec.vocab_size
    prompt = lambda: torch.tensor([rng.randrange(vocab) for _ in range(n)])  # noqa: E731
    engine.prefill(prompt(), engine.model.new_cache())  # warm-up: kernels compiled, the split measured
    sync()
    experts.cache.clear()
    experts.stats = OffloadStats(experts.device)
    ids = prompt()
    t0 = time.perf_counter()
    engine.prefill(ids, engine.model.new_cache())  # the same prompt unprofiled, as ftc bench prefill times it
    sync()
    plain = time.perf_counter() - t0
    counts = {"streamed_experts": experts.stats.streamed, "cpu_experts": experts.stats.stream_cpu,
              "cpu_s": round(experts.stats.cpu_s, 4)}
    experts.cache.clear()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.prefill(ids, engine.model.new_cache())
        sync()
        wall = time.perf_counter() - t0
    trace = write_trace(prof, tmp, trace_path)
    split = experts.prompt_split
    tables = {} if split is None else {"split_measured_s_per_token": split.measured, "split_serial_s": split.serial}
    return {"tokens": n, "unprofiled_s": round(plain, 4), "tok_s": round(n / plain, 2), **counts,
            **summarize(trace, wall), **tables}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", type=Path)
    ap.add_argument("--tokens", default="8192", help="prompt lengths, comma-separated")
    ap.add_argument("--vram-budget", type=size, default=None)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--device", default="cuda", help="cpu: the same path with the CPU standing in (no GPU spans)")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--prefill-split", default="off", help="auto, off or a share (comma-separated: each in turn)")
    ap.add_argument("--trace-dir", type=Path, default=None, help="write each run's Chrome trace here (.json.gz)")
    args = ap.parse_args()
    rng = random.Random(0)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    lengths = [int(n) for n in args.tokens.split(",")]
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ftc-profile-") as tmp:
        path, pool = engine_in_memory(args.spec, True, 0, args.target, args.override, Path(tmp))
        for split in args.prefill_split.split(","):
            offload = offload_config(args.device, args.vram_budget, None, prefill_split=split)
            engine = Engine.load(path, offload=dataclasses.replace(offload, max_context=max(lengths)), pool=pool)
            for n in lengths:
                trace = args.trace_dir / f"prefill_{split}_{n}.json.gz" if args.trace_dir else None
                row = profiled(engine, n, rng, sync, Path(tmp), trace)
                print(json.dumps({"prefill_split": split, **row}, indent=1), flush=True)
            del engine


if __name__ == "__main__":
    main()
