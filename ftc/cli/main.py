"""`ftc compile | inspect | run | bench | profile | trace`. Only argument parsing and printing live here."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from .options import (
    CachePolicyArg,
    CpuExpertsArg,
    MissPolicyArg,
    PrefillChunkArg,
    SlotsArg,
    VramBudgetArg,
    engine_in_memory,
    err,
    offload_config,
    parse_ids,
    reprofile_engine,
    routing_for,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="ftc, the FreeToken compiler: MoE models compiled into engines for one machine.")


def _fail(e: Exception) -> None:
    # Plain text: messages carry paths and user input, which must be neither wrapped nor read as markup.
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


def _user_errors() -> tuple[type[Exception], ...]:
    from ftc_runtime.artifact import ArtifactError
    from ftc_runtime.ftw import FtwError
    from ftc_runtime.kernels import KernelError
    from ftc_runtime.settings import SettingsError
    from ftc_runtime.spec import SpecError

    from ..build import BuildError
    from ..checkpoint import CheckpointError
    from ..codegen import CodegenError
    from ..kernel_check import KernelCheckError
    from ..targets import TargetError

    return (ArtifactError, FtwError, KernelError, SettingsError, SpecError, BuildError, CheckpointError,
            CodegenError, KernelCheckError, TargetError, ValueError, OSError, RuntimeError)


@app.command()
def compile(
    source: Annotated[Path, typer.Argument(help="Model spec YAML, or an HF checkpoint directory.")],
    target: Annotated[str, typer.Option(help="Hardware target: 'auto' (this machine) or a preset name.")] = "auto",
    checkpoint: Annotated[Path | None, typer.Option(help="HF safetensors checkpoint directory.")] = None,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="Deterministic random weights.")] = False,
    seed: Annotated[int, typer.Option(help="Seed for --random-weights.")] = 0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Engine directory (build/<name>).")] = None,
    override: Annotated[list[str] | None, typer.Option(help="Edit a spec field: FIELD=VALUE, repeatable.")] = None,
) -> None:
    """Compile a model into an engine directory."""
    from ..pipeline import CompileOptions, compile_engine

    if random_weights and checkpoint:
        _fail(ValueError("give either --checkpoint or --random-weights, not both"))
    try:
        compile_engine(CompileOptions(source, target, output, checkpoint, random_weights, seed,
                                      tuple(override or ())), err)
    except _user_errors() as e:
        _fail(e)


@app.command()
def inspect(
    engine: Annotated[Path, typer.Argument(help="Engine directory.")],
    verify: Annotated[bool, typer.Option("--verify", help="Also check every file's sha256.")] = False,
    vram_budget: Annotated[str | None, typer.Option(help="Show the GPU memory split for this budget.")] = None,
    max_context: Annotated[int, typer.Option(help="KV cache tokens the budget reserves.")] = 4096,
) -> None:
    """Show an engine's model, memory split, plan and files."""
    from ftc_runtime.vram_plan import VramError, parse_size

    from ..inspect_engine import inspect_engine

    try:
        budget = parse_size(vram_budget) if vram_budget else None
        tables = inspect_engine(engine, verify, budget, max_context)
    except VramError as e:
        _fail(e)
    except _user_errors() as e:
        _fail(e)
    out = Console()
    for t in tables:
        out.print(t)


@app.command()
def run(
    engine: Annotated[Path, typer.Argument(help="Engine directory.")],
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="Prompt as token ids: 1,2,3.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-sequence.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (tokens, text, timings).")] = False,
    device: Annotated[str | None, typer.Option(help="Run the model on this torch device with an expert slot "
                                               "cache there ('cuda', or 'cpu' to emulate one).")] = None,
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    miss_policy: MissPolicyArg = "adaptive",
    cache_policy: CachePolicyArg = "lru",
    cpu_experts: CpuExpertsArg = False,
    reprofile: Annotated[bool, typer.Option("--reprofile", help="Measure B_P/B_H again, record them in "
                                            "engine.json and split misses by them.")] = False,
    prefill_chunk: PrefillChunkArg = None,
    serve: Annotated[bool, typer.Option("--serve", help="Serve the OpenAI API over HTTP instead.")] = False,
    host: Annotated[str, typer.Option(help="--serve: address to bind (loopback unless told).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="--serve: TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="FTC_API_KEY", help="--serve: require this key "
                                                "(Authorization: Bearer KEY or x-api-key).")] = None,
    max_batch: Annotated[int, typer.Option(help="--serve: requests decoded together at most.")] = 16,
    max_prompt_tokens: Annotated[int, typer.Option(help="--serve: longest prompt accepted.")] = 32768,
    max_tokens: Annotated[int, typer.Option(help="--serve: most tokens one answer may have.")] = 8192,
    prefix_cache: Annotated[str, typer.Option(help="--serve: memory for past sequences' KV that later prompts "
                                              "resume from (e.g. 4GiB; 0: off); as much again for the hybrid "
                                              "models' recurrent-state checkpoints.")] = "0",
) -> None:
    """Generate from a prompt, streaming the text (or one JSON object with --json); or, with
    --serve, answer the OpenAI API over HTTP."""
    from ftc_runtime import Engine, SamplingParams
    from ftc_runtime.tokenizer import StreamDecoder

    if serve:
        limits = {"max_batch": max_batch, "max_prompt_tokens": max_prompt_tokens, "max_new_tokens": max_tokens}
        offload = offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts)
        _serve(engine, offload, prefill_chunk, host, port, api_key, limits, prefix_cache)
        return
    if (prompt is None) == (prompt_ids is None):
        _fail(ValueError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3"))
    try:
        given_ids = parse_ids(prompt_ids) if prompt_ids is not None else None
        offload = offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts)
        t0 = time.perf_counter()
        eng = Engine.load(engine, show_progress=not as_json, offload=offload, prefill_chunk=prefill_chunk)
        load_s = time.perf_counter() - t0
        if reprofile:
            reprofile_engine(engine, eng, offload)
        ids = given_ids if given_ids is not None else eng.tokenizer.encode(prompt)
        gen = eng.generate(ids, max_new_tokens, SamplingParams(temperature, top_p, seed), not ignore_eos)
        decoder = StreamDecoder(eng.tokenizer)
        tokens = []
        for token in gen:
            tokens.append(token)
            delta = decoder.push(token)
            if not as_json:
                sys.stdout.write(delta)
                sys.stdout.flush()
    except _user_errors() as e:
        _fail(e)
    s = gen.stats
    timings = {"load_s": round(load_s, 4), "prefill_s": round(s.prefill_s, 4), "decode_s": round(s.decode_s, 4),
               "prefill_tok_s": round(s.prefill_tok_s, 2), "decode_tok_s": round(s.decode_tok_s, 2)}
    if as_json:
        result = {"tokens": tokens, "text": eng.tokenizer.decode(tokens), "prompt_tokens": len(ids),
                  "timings": timings}
        if eng.vram is not None:
            result["offload"] = {"vram": eng.vram.to_dict(), "experts": eng.model.experts.stats.to_dict()}
        print(json.dumps(result))
    else:
        sys.stdout.write("\n")
        err.print(f"[dim]{len(ids)} prompt tokens, {len(tokens)} generated; prefill {s.prefill_tok_s:.1f} tok/s, "
                  f"decode {s.decode_tok_s:.2f} tok/s[/]")


def _serve(engine: Path, offload, prefill_chunk: int | None, host: str, port: int, api_key: str | None,
           limits: dict[str, int], prefix_cache: str) -> None:
    import uvicorn

    from ftc_runtime import Engine
    from ftc_runtime.serve.app import ServerConfig, create_app
    from ftc_runtime.vram_plan import parse_size

    try:
        try:
            prefix_bytes = parse_size(prefix_cache) if prefix_cache != "0" else 0
        except ValueError as e:
            raise ValueError(f"--prefix-cache: {e}") from None
        eng = Engine.load(engine, show_progress=True, offload=offload, prefill_chunk=prefill_chunk)
        if prefix_bytes:
            eng.enable_prefix_cache(prefix_bytes, prefix_bytes)
        app = create_app(eng, ServerConfig(model_name=eng.spec.name, api_key=api_key, **limits))
    except _user_errors() as e:
        _fail(e)
    err.print(f"serving {eng.spec.name} on http://{host}:{port}/v1" + (" (API key required)" if api_key else ""))
    uvicorn.run(app, host=host, port=port, log_level="warning")


class BenchKind(str, Enum):
    experts = "experts"
    decode = "decode"
    prefill = "prefill"
    agent = "agent"
    load = "load"


@app.command()
def bench(
    engine: Annotated[Path, typer.Argument(help="Engine directory, or a spec YAML with --random-weights.")],
    kind: Annotated[BenchKind, typer.Argument(help="What to measure.")],
    tokens: Annotated[int, typer.Option(help="Tokens per call (experts).")] = 1,
    threads: Annotated[int | None, typer.Option(help="CPU workers (default: the plan's).")] = None,
    seconds: Annotated[float, typer.Option(help="Seconds per measurement.")] = 3.0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Also write the JSON here.")] = None,
    device: Annotated[str, typer.Option(help="decode: torch device of the model and slot cache.")] = "cuda",
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    miss_policy: MissPolicyArg = "adaptive",
    cache_policy: CachePolicyArg = "lru",
    cpu_experts: CpuExpertsArg = False,
    routing_trace: Annotated[Path | None, typer.Option(help="decode: replay this trace (.npz).")] = None,
    synthetic_locality: Annotated[float | None, typer.Option(help="decode: replay a synthetic trace.")] = None,
    prompt_tokens: Annotated[int, typer.Option(help="decode: prompt length.")] = 128,
    new_tokens: Annotated[int, typer.Option(help="decode: tokens to generate.")] = 64,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="SPEC: random weights, generated "
                                                 "straight into memory (no weight file).")] = False,
    seed: Annotated[int, typer.Option(help="SPEC: seed for --random-weights.")] = 0,
    target: Annotated[str, typer.Option(help="SPEC: hardware target.")] = "auto",
    override: Annotated[list[str] | None, typer.Option(help="SPEC: edit a spec field, FIELD=VALUE.")] = None,
    lengths: Annotated[str, typer.Option(help="prefill: prompt lengths, comma-separated.")] = "1024,2048,4096,8192",
    no_overlap: Annotated[bool, typer.Option("--no-overlap", help="prefill: one layer buffer, load then "
                                             "compute (the baseline).")] = False,
    compare: Annotated[bool, typer.Option("--compare", help="prefill: both modes, two buffers and one; agent: "
                                          "with the cache, without checkpoints, without any cache.")] = False,
    prefill_chunk: PrefillChunkArg = None,
    stream_min_tokens: Annotated[int | None, typer.Option(help="Prompt chunks of at least this many tokens stream "
                                                          "whole MoE layers (default: the plan's); shorter ones "
                                                          "split their misses as decode does.")] = None,
    plot: Annotated[Path | None, typer.Option(help="prefill: tok/s against length; agent: time to first token "
                                              "per turn (PNG).")] = None,
    session_tokens: Annotated[int, typer.Option(help="agent: the session grows to about this many tokens.")] = 20000,
    tool_output_tokens: Annotated[int, typer.Option(help="agent: tokens of each tool output.")] = 2000,
    prefix_cache: Annotated[str, typer.Option(help="agent: KV memory of the prefix cache.")] = "8GiB",
    checkpoint_cache: Annotated[str, typer.Option(help="agent: memory for recurrent-state checkpoints.")] = "4GiB",
    no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="agent: no cache at all.")] = False,
    no_checkpoints: Annotated[bool, typer.Option("--no-checkpoints", help="agent: the KV cache only (a hybrid "
                                                 "model then cannot resume).")] = False,
) -> None:
    """Measure an engine, or a spec built in memory with random weights; prints JSON."""
    from ftc_runtime.artifact import EngineManifest
    from ftc_runtime.vram_plan import parse_size

    from ..bench_agent import bench_agent, plot_agent
    from ..bench_decode import bench_decode
    from ..bench_experts import bench_experts
    from ..bench_load import bench_load
    from ..bench_prefill import bench_prefill, plot_prefill

    if tokens < 1 or new_tokens < 2 or prompt_tokens < 1:
        _fail(ValueError("--tokens and --prompt-tokens must be at least 1, --new-tokens at least 2"))
    try:
        with tempfile.TemporaryDirectory(prefix="ftc-bench-") as tmp:
            pool = None
            if engine.is_file():
                engine, pool = engine_in_memory(engine, random_weights, seed, target, override, Path(tmp))
            offload = offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts,
                                     stream_min_tokens)
            if kind == BenchKind.experts:
                result = bench_experts(engine, tokens, threads, seconds, pool=pool)
            elif kind == BenchKind.prefill:
                modes = [True, False] if compare else [not no_overlap]
                result = bench_prefill(engine, offload, parse_ids(lengths, "--lengths"), modes, prefill_chunk,
                                       seed, pool)
                if plot:
                    plot_prefill(result, plot)
            elif kind == BenchKind.load:
                if pool is not None:
                    raise ValueError("bench load: give a compiled engine directory (a random-weight spec has no "
                                     "file to load)")
                result = bench_load(engine, offload)
            elif kind == BenchKind.agent:
                modes = (["cache", "no-checkpoints", "no-prefix-cache"] if compare else
                         ["no-prefix-cache" if no_prefix_cache else "no-checkpoints" if no_checkpoints else "cache"])
                result = bench_agent(engine, offload, modes, session_tokens, tool_output_tokens,
                                     parse_size(prefix_cache), parse_size(checkpoint_cache), seed=seed, pool=pool,
                                     prefill_chunk=prefill_chunk)
                if plot:
                    plot_agent(result, plot)
            else:
                spec = EngineManifest.read(engine).spec
                trace, routing = routing_for(routing_trace, synthetic_locality, spec, 0)
                result = bench_decode(engine, offload, trace, routing, prompt_tokens, new_tokens, pool=pool)
    except _user_errors() as e:
        _fail(e)
    text = json.dumps(result, indent=1)
    if output:
        output.write_text(text + "\n")
    print(text)


@app.command()
def profile(
    engine: Annotated[Path, typer.Argument(help="Engine whose CPU kernel and expert pool are measured.")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the profile YAML here.")] = None,
    device: Annotated[str | None, typer.Option(help="GPU to measure B_P on (default: cuda if present).")] = None,
    seconds: Annotated[float, typer.Option(help="Seconds per measurement.")] = 2.0,
    store: Annotated[bool, typer.Option("--store", help="Also record it in the engine's engine.json.")] = False,
) -> None:
    """Measure this machine: CPU ISA and cores, plain read, B_H, and with a GPU B_P and both at once."""
    import dataclasses

    import torch

    from ftc_runtime import Engine
    from ftc_runtime.artifact import store_profile
    from ftc_runtime.profile import measure_profile

    try:
        eng = Engine.load(engine)
        device = device or ("cuda" if torch.cuda.is_available() else None)
        prof = measure_profile(eng.spec, eng.pool, eng.model.experts.kernel, device, seconds)
        if output:
            prof.to_yaml(output)
        if store:
            store_profile(engine, dataclasses.asdict(prof))
    except _user_errors() as e:
        _fail(e)
    print(json.dumps(dataclasses.asdict(prof), indent=1))


@app.command()
def trace(
    engine: Annotated[Path, typer.Argument(help="Engine directory.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Trace file to write (.npz).")],
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="Prompt as token ids: 1,2,3.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 128,
) -> None:
    """Record the experts the router chooses, per token and MoE layer, while generating greedily."""
    from ftc_runtime import Engine, SamplingParams
    from ftc_runtime.routing_trace import TraceRecorder

    if (prompt is None) == (prompt_ids is None):
        _fail(ValueError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3"))
    try:
        given = parse_ids(prompt_ids) if prompt_ids is not None else None
        eng = Engine.load(engine)
        ids = given if given is not None else eng.tokenizer.encode(prompt)
        recorder = TraceRecorder(len(eng.spec.moe_layers))
        eng.model.experts.routing = recorder
        for _ in eng.generate(ids, max_new_tokens, SamplingParams(0.0), stop_at_eos=False):
            pass
        recorder.trace(len(ids)).save(output)
    except _user_errors() as e:
        _fail(e)
    err.print(f"recorded {len(ids) + max_new_tokens - 1} tokens × {len(eng.spec.moe_layers)} MoE layers → {output}")


if __name__ == "__main__":
    app()
