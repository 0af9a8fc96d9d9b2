"""`ftc bench prefill ENGINE`: prompt throughput by length, with MoE layers streamed through two
layer buffers (copies of layer l + 1 beside the compute of layer l) or through one (`--no-overlap`:
load, then compute), the CPU computing part of each layer's uncached experts in place or not
(`--prefill-split`), against the PCIe ceiling: every uncached expert's bytes over PCIe at the
planner's B_P, as streaming without the CPU would move them.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import torch

from ftc.bench.memory import release_device_memory
from ftc.bench.plot import png_axes
from ftc_runtime import Engine
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.io.ftw import ExpertPool


def bench_prefill(engine_dir: Path, offloads: list[OffloadConfig], lengths: list[int], overlap_modes: list[bool],
                  prefill_chunk: int | None = None, seed: int = 0, pool: ExpertPool | None = None) -> dict:
    """Each configuration (offload × overlap mode) loads the engine once, prefills each length once
    untimed (the kernels of its shapes compile and tune), then each length once from a fresh KV
    cache and an empty expert cache, as the first prompt of a session: every MoE layer crosses
    PCIe in the first chunk, and only the layers that chunk did not leave cached in the next ones."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {lengths}: expected prompt lengths of at least 1 token")
    rng = random.Random(seed)
    runs = []
    for offload in offloads:
        offload = dataclasses.replace(offload, max_context=max(offload.max_context, max(lengths)))  # KV fits
        for overlap in overlap_modes:
            engine = Engine.load(engine_dir, offload=dataclasses.replace(offload, prefill_overlap=overlap),
                                 pool=pool, prefill_chunk=prefill_chunk)
            vocab = engine.spec.vocab_size
            for n in lengths:
                engine.prefill(torch.tensor([rng.randrange(vocab) for _ in range(n)]), engine.model.new_cache())
            for n in lengths:
                ids = torch.tensor([rng.randrange(vocab) for _ in range(n)])
                runs.append(_timed(engine, ids, overlap, offload.prefill_split))
            del engine
            release_device_memory()
    return {"engine": runs[0]["engine"], "device": str(offloads[0].device), "runs": runs}


def _timed(engine: Engine, ids: torch.Tensor, overlap: bool, split: str) -> dict:
    """One prompt from a fresh KV cache and an empty expert cache, timed."""
    experts = engine.model.experts
    experts.stats = OffloadStats(experts.device)
    _sync(experts.device)  # the warm-up's copies are done before their slots are dropped
    experts.cache.clear()
    t0 = time.perf_counter()
    engine.prefill(ids, engine.model.new_cache())
    _sync(experts.device)
    return _run(engine, ids.numel(), overlap, split, time.perf_counter() - t0)


def _run(engine: Engine, n: int, overlap: bool, split: str, seconds: float) -> dict:
    experts, vram = engine.model.experts, engine.vram
    s = experts.stats
    crossed = (s.streamed + s.fills) * vram.expert_stride  # whole-layer streaming and on-demand fills
    uncached = crossed + s.stream_cpu * vram.expert_stride  # and the experts the CPU computed in place
    # Only a GPU has a PCIe link to measure against (the CPU standing in for one copies in memory).
    ceiling_s = uncached / (experts.planner.b_p * 1e9) if experts.device.type == "cuda" else None
    chunks = -(-n // engine.prefill_chunk)
    return {
        "engine": engine.spec.name, "tokens": n, "overlap": overlap, "prefill_split": split,
        "prefill_chunk": engine.prefill_chunk, "chunks": chunks,
        "streaming": experts.stream_min_tokens is not None and experts.cache.n_slots >= experts.stream_slots,
        "stream_min_tokens": experts.stream_min_tokens, "stream_layers": s.stream_layers,
        "seconds": round(seconds, 4), "tok_s": round(n / seconds, 2), "s_per_chunk": round(seconds / chunks, 4),
        "pcie_bytes": crossed, "uncached_bytes": uncached, "b_p": experts.planner.b_p,
        "pcie_ceiling_s": round(ceiling_s, 4) if ceiling_s is not None else None,
        "pcie_ceiling_tok_s": round(n / ceiling_s, 2) if ceiling_s else None,
        "of_ceiling": round(ceiling_s / seconds, 3) if ceiling_s is not None else None,  # above 1: past it
        "cpu_experts": s.cpu, "stream_cpu_experts": s.stream_cpu, "cpu_s": round(s.cpu_s, 4),
    }


def plot_prefill(result: dict, path: Path) -> None:
    """Throughput against prompt length, one line per mode, with the PCIe ceiling, as a PNG."""
    with png_axes(path) as ax:
        configs = dict.fromkeys((r["overlap"], r["prefill_split"]) for r in result["runs"])
        for overlap, split in configs:
            runs = sorted((r for r in result["runs"] if (r["overlap"], r["prefill_split"]) == (overlap, split)),
                          key=lambda r: r["tokens"])
            label = f"{'two layer buffers' if overlap else 'one buffer (--no-overlap)'}, CPU share {split}"
            ax.plot([r["tokens"] for r in runs], [r["tok_s"] for r in runs], marker="o", label=label)
        ceiling = sorted({(r["tokens"], r["pcie_ceiling_tok_s"]) for r in result["runs"] if r["pcie_ceiling_tok_s"]
                          and r["overlap"] and r["prefill_split"] == "off"})
        if ceiling:
            ax.plot(*zip(*ceiling, strict=True), linestyle="--", color="gray", label="PCIe ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill tokens / s")
        ax.set_title(f"{result['engine']} prefill ({result['device']})")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
