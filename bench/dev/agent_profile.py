"""Where an agent turn's time to first token goes: `ftc bench agent`'s scripted session replayed
with the prefix cache, chosen turns under torch.profiler (the prompt's prefill to its first
token), each summarized as `prefill_profile.py` summarizes a prompt (copy engine and kernels busy,
host→device copies that waited behind others, the split's CPU parts and the stretches between
them), and its time to first token (the profiler's overhead included). Turns are numbered as
`ftc bench agent` numbers them (the last is the edit).

    python bench/dev/agent_profile.py SPEC --vram-budget 32GiB --session-tokens 20000 --turns 13,14,16 \
        --prefill-split auto --trace-dir OUT
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from prefill_profile import summarize, write_trace
from torch.profiler import ProfilerActivity, profile

from ftc.bench.agent import agent_session, markers, prompts
from ftc.cli.options import engine_in_memory, offload_config, size
from ftc_runtime import Engine, SamplingParams


def first_token(engine: Engine, history: list[int], sync) -> float:
    """Seconds to the prompt's first token (the answer's other tokens are generated, untimed)."""
    t0 = time.perf_counter()
    gen = engine.generate(history, 2, SamplingParams(0.0), stop_at_eos=False)
    next(iter(gen))
    sync()
    seconds = time.perf_counter() - t0
    list(gen)
    return seconds


def replay(engine: Engine, args: argparse.Namespace, sync, tmp: Path) -> list[dict]:
    """The session once, the chosen turns profiled."""
    turns = agent_session(engine, args.session_tokens, args.tool_output_tokens, seed=0)
    rows = []
    for n, (turn, history) in enumerate(prompts(turns, markers(engine.spec.tokens.special))):
        if n not in args.turns:
            first_token(engine, history, sync)
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = first_token(engine, history, sync)
        trace = write_trace(prof, tmp, args.trace_dir / f"agent_turn{n}.json.gz" if args.trace_dir else None)
        rows.append({"turn": n, "kind": turn.kind, "prompt_tokens": len(history), **summarize(trace, wall)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", type=Path)
    ap.add_argument("--vram-budget", type=size, default=None)
    ap.add_argument("--target", default="h200")
    ap.add_argument("--device", default="cuda", help="cpu: the same path with the CPU standing in (no GPU spans)")
    ap.add_argument("--override", action="append", default=[])
    ap.add_argument("--prefill-split", default="off", help="auto, off or a share: the CPU's part of streamed layers")
    ap.add_argument("--session-tokens", type=int, default=20000)
    ap.add_argument("--tool-output-tokens", type=int, default=2000)
    ap.add_argument("--prefix-cache", type=size, default=size("8GiB"))
    ap.add_argument("--checkpoint-cache", type=size, default=size("4GiB"))
    ap.add_argument("--turns", type=lambda v: {int(t) for t in v.split(",")}, default={14, 16},
                    help="the turns to profile, comma-separated")
    ap.add_argument("--trace-dir", type=Path, default=None, help="write each profiled turn's Chrome trace here")
    args = ap.parse_args()
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="ftc-agent-profile-") as tmp:
        path, pool = engine_in_memory(args.spec, True, 0, args.target, args.override, Path(tmp))
        offload = offload_config(args.device, args.vram_budget, None, prefill_split=args.prefill_split)
        engine = Engine.load(path, offload=offload, pool=pool)
        engine.enable_prefix_cache(args.prefix_cache, args.checkpoint_cache)
        for row in replay(engine, args, sync, Path(tmp)):
            print(json.dumps(row, indent=1), flush=True)


if __name__ == "__main__":
    main()
