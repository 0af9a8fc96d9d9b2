"""`ftc bench prefill ENGINE`: prompt throughput by length, with MoE layers streamed through two
layer buffers (copies of layer l + 1 beside the compute of layer l) or through one (`--no-overlap`:
load, then compute), against the PCIe ceiling: the bytes that crossed PCIe at the planner's B_P.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import time
from pathlib import Path

import torch

from ftc.bench.plot import png_axes
from ftc_runtime import Engine
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.io.ftw import ExpertPool


def bench_prefill(engine_dir: Path, offload: OffloadConfig, lengths: list[int], overlap_modes: list[bool],
                  prefill_chunk: int | None = None, seed: int = 0, pool: ExpertPool | None = None) -> dict:
    """Each mode loads the engine once, prefills the shortest length once untimed (kernels warm
    up), then each length once from a fresh KV cache and an empty expert cache, as the first
    prompt of a session: every MoE layer crosses PCIe in the first chunk, and only the layers
    that chunk did not leave cached in the next ones."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {lengths}: expected prompt lengths of at least 1 token")
    rng = random.Random(seed)
    offload = dataclasses.replace(offload, max_context=max(offload.max_context, max(lengths)))  # KV within budget
    runs = []
    for overlap in overlap_modes:
        engine = Engine.load(engine_dir, offload=dataclasses.replace(offload, prefill_overlap=overlap), pool=pool,
                             prefill_chunk=prefill_chunk)
        experts = engine.model.experts
        vocab = engine.spec.vocab_size
        engine.prefill(torch.tensor([rng.randrange(vocab) for _ in range(min(lengths))]), engine.model.new_cache())
        for n in lengths:
            ids = torch.tensor([rng.randrange(vocab) for _ in range(n)])
            experts.stats = OffloadStats(experts.device)
            _sync(experts.device)  # the warm-up's copies are done before their slots are dropped
            experts.cache.clear()
            t0 = time.perf_counter()
            engine.prefill(ids, engine.model.new_cache())
            _sync(experts.device)
            runs.append(_run(engine, n, overlap, time.perf_counter() - t0))
        del engine, experts
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"engine": runs[0]["engine"], "device": str(offload.device), "runs": runs}


def _run(engine: Engine, n: int, overlap: bool, seconds: float) -> dict:
    experts, vram = engine.model.experts, engine.vram
    s = experts.stats
    crossed = (s.streamed + s.fills) * vram.expert_stride  # whole-layer streaming and on-demand fills
    # Only a GPU has a PCIe link to measure against (the CPU standing in for one copies in memory).
    ceiling_s = crossed / (experts.planner.b_p * 1e9) if experts.device.type == "cuda" else None
    chunks = -(-n // engine.prefill_chunk)
    return {
        "engine": engine.spec.name, "tokens": n, "overlap": overlap, "prefill_chunk": engine.prefill_chunk,
        "chunks": chunks, "streaming": experts.stream_min_tokens is not None
        and experts.cache.n_slots >= experts.stream_slots, "stream_min_tokens": experts.stream_min_tokens,
        "stream_layers": s.stream_layers,
        "seconds": round(seconds, 4), "tok_s": round(n / seconds, 2), "s_per_chunk": round(seconds / chunks, 4),
        "pcie_bytes": crossed, "b_p": experts.planner.b_p,
        "pcie_ceiling_s": round(ceiling_s, 4) if ceiling_s is not None else None,
        "pcie_ceiling_tok_s": round(n / ceiling_s, 2) if ceiling_s else None,
        "of_ceiling": round(ceiling_s / seconds, 3) if ceiling_s is not None else None,  # 1.0: at the ceiling
        "cpu_experts": s.cpu,
    }


def plot_prefill(result: dict, path: Path) -> None:
    """Throughput against prompt length, one line per mode, with the PCIe ceiling, as a PNG."""
    with png_axes(path) as ax:
        for overlap, label in ((True, "two layer buffers"), (False, "one buffer (--no-overlap)")):
            runs = sorted((r for r in result["runs"] if r["overlap"] == overlap), key=lambda r: r["tokens"])
            if runs:
                ax.plot([r["tokens"] for r in runs], [r["tok_s"] for r in runs], marker="o", label=label)
                ceiling = [(r["tokens"], r["pcie_ceiling_tok_s"]) for r in runs if r["pcie_ceiling_tok_s"]]
                if ceiling and overlap:
                    ax.plot(*zip(*ceiling, strict=True), linestyle="--", color="gray", label="PCIe ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tokens / s")
        ax.set_title(f"{result['engine']} prefill ({result['device']})")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
