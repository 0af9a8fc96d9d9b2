"""Turning command-line options into the runtime's and compiler's own objects."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True)


MissPolicyOpt = Enum("MissPolicyOpt", {p: p for p in ("adaptive", "gpu", "cpu", "half")}, type=str)
CachePolicyOpt = Enum("CachePolicyOpt", {p: p for p in ("lru", "static")}, type=str)

# The offload options that `ftc run` and `ftc bench` share (`offload_config` turns them into one).
VramBudgetArg = Annotated[str | None, typer.Option(help="Cap on device memory, e.g. 32GiB.")]
SlotsArg = Annotated[int | None, typer.Option(help="Expert slots (default: what the budget holds).")]
MissPolicyArg = Annotated[MissPolicyOpt, typer.Option(help="Where cache misses run.")]
CachePolicyArg = Annotated[CachePolicyOpt, typer.Option(help="lru, or static (the prompt's top experts).")]
CpuExpertsArg = Annotated[bool, typer.Option("--cpu-experts", help="With --device: every routed expert on the CPU, "
                                             "the rest of the model on the device.")]
PrefillChunkArg = Annotated[int | None, typer.Option(help="Prompt chunk in tokens (default: the plan's).")]


def offload_config(device: str | None, vram_budget: str | None, slots: int | None, miss_policy: str,
                   cache_policy: str, cpu_experts: bool = False, stream_min_tokens: int | None = None):
    """The OffloadConfig for --device and its options (None: every expert on the CPU)."""
    from ftc_runtime.engine import OffloadConfig
    from ftc_runtime.vram_plan import parse_size

    if device is None:
        if vram_budget or slots is not None or cpu_experts or stream_min_tokens is not None:
            raise ValueError("--vram-budget, --slots, --cpu-experts and --stream-min-tokens need --device (cuda, "
                             "or cpu to emulate a GPU)")
        return None
    if stream_min_tokens is not None and stream_min_tokens < 1:
        raise ValueError(f"--stream-min-tokens {stream_min_tokens}: give a token count of at least 1")
    return OffloadConfig(device=device, vram_budget=parse_size(vram_budget) if vram_budget else None,
                         n_slots=slots, miss_policy=str(getattr(miss_policy, "value", miss_policy)),
                         cache_policy=str(getattr(cache_policy, "value", cache_policy)), cpu_experts=cpu_experts,
                         stream_min_tokens=stream_min_tokens)


def reprofile_engine(engine_dir: Path, eng, offload) -> None:
    """Measures this machine with the loaded engine, records it, and re-plans the miss split."""
    import dataclasses

    from ftc_runtime.artifact import store_profile
    from ftc_runtime.miss_planner import MissPlanner
    from ftc_runtime.profile import measure_profile

    experts = eng.model.experts
    prof = measure_profile(eng.spec, eng.pool, experts.kernel, offload.device if offload else None, seconds=1.0)
    store_profile(engine_dir, dataclasses.asdict(prof))
    if offload is not None and prof.b_p is not None:
        experts.planner = MissPlanner(experts.planner.policy, prof.b_p, prof.b_h, prof.b_p_during_cpu,
                                      prof.b_h_during_copy)
    err.print(f"profile: B_H {prof.b_h} GB/s" + (f", B_P {prof.b_p} GB/s" if prof.b_p else "") + " (engine.json)")


def parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated integers, e.g. 1,2,3") from None


def engine_in_memory(spec: Path, random_weights: bool, seed: int, target: str, override: list[str] | None,
                     workdir: Path):
    """A benchmark engine for `spec` in `workdir`, its expert pool generated into memory."""
    from ..pipeline import CompileOptions, compile_with_experts_in_memory

    if not random_weights:
        raise ValueError(f"{spec}: benchmarking a spec needs --random-weights (or compile an engine first)")
    opts = CompileOptions(spec, target, workdir / "engine", None, True, seed, tuple(override or ()))
    return compile_with_experts_in_memory(opts, err)


def routing_for(trace: Path | None, synthetic_locality: float | None, spec, seed: int):
    """The trace a decode benchmark replays, and how the JSON names it."""
    from ftc_runtime.routing_trace import RoutingTrace, synthetic_trace

    if trace is not None and synthetic_locality is not None:
        raise ValueError("give --routing-trace or --synthetic-locality, not both")
    if trace is not None:
        return RoutingTrace.load(trace), f"trace {trace}"
    if synthetic_locality is not None:
        t = synthetic_trace(512, len(spec.moe_layers), spec.moe.num_experts, spec.moe.top_k, synthetic_locality,
                            seed=seed)
        return t, f"synthetic (locality {synthetic_locality}, Zipf 1.0, seed {seed})"
    return None, "the model's own router"
