"""`ftc compile | inspect | run | bench | profile | trace` (the benchmarks in ftc/cli/bench.py). Only
argument parsing and printing live here."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from ftc.cli.bench import bench_app
from ftc.cli.errors import fail, user_errors
from ftc.cli.options import (
    MAX_SEED,
    AllowedHostsArg,
    ApiKeyArg,
    ApiKeysFileArg,
    CachePolicyArg,
    CpuExpertsArg,
    DenseFormat,
    ExpertQuant,
    HostArg,
    LogLevel,
    LogLevelArg,
    MaxBatchArg,
    MaxBodyBytesArg,
    MaxPromptTokensArg,
    MaxTokensArg,
    MetricsPublicArg,
    MissPolicyArg,
    PortArg,
    PrefillChunkArg,
    PrefillSplitArg,
    PrefixCacheArg,
    ServedModelNameArg,
    SlotsArg,
    SpeculateArg,
    VramBudgetArg,
    check_device,
    check_run_mode,
    check_speculation,
    err,
    number_in,
    offload_config,
    output_file,
    positive_size,
    prompt_ids_for,
    reprofile_engine,
    run_prompt,
    sampling_penalties,
    served_names,
    server_config,
    size,
)
from ftc.compile.targets import PRESETS

if TYPE_CHECKING:
    from ftc_runtime.speculative.config import Speculation

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="ftc, the FreeToken compiler: MoE models compiled into engines for one machine.")


def _print_version(value: bool) -> None:
    if value:
        from ftc import __version__

        print(f"ftc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print ftc's version and exit.")] = False) -> None:
    """ftc, the FreeToken compiler: MoE models compiled into engines for one machine."""


@app.command()
def compile(
    source: Annotated[Path, typer.Argument(help="Model spec YAML, an HF checkpoint directory, or a Hugging Face "
                                           "repository ORG/NAME (fetched into the Hub cache).")],
    target: Annotated[str, typer.Option(help="Hardware target: auto (this machine's ISA, every core of the machine "
                                        f"that runs it), a profile .yaml from `ftc profile`, or one of "
                                        f"{', '.join(PRESETS)}.")] = "auto",
    checkpoint: Annotated[Path | None, typer.Option(help="HF safetensors checkpoint directory.")] = None,
    random_weights: Annotated[bool, typer.Option("--random-weights", help="Deterministic random weights.")] = False,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed for --random-weights.")] = 0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Engine directory (build/<name>).")] = None,
    override: Annotated[list[str] | None, typer.Option(help="Edit a spec field: FIELD=VALUE, repeatable.")] = None,
    quant: Annotated[ExpertQuant | None, typer.Option(
        help="Routed experts' format: 16/32-bit weights are rounded into it; a 4-bit checkpoint keeps its own (the "
             "default).")] = None,
    dense_format: Annotated[DenseFormat | None, typer.Option(
        help="Non-expert projections: bf16, or fp8 (e4m3, a scale per 128x128 block: half the bytes, the VRAM "
             "back to expert slots). Default: the spec's; an FP8 release's own codes, kept as stored, where the "
             "family reads FP8 (GLM-5.x).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing engine at -o.")] = False,
    name: Annotated[str | None, typer.Option(help="The engine's name, which the server reports (default: the "
                                             "spec's; a checkpoint's: -o's folder, else its repository).")] = None,
) -> None:
    """Compile a model into an engine directory."""
    from ftc.compile.pipeline import CompileOptions, compile_engine

    if random_weights and checkpoint:
        fail(ValueError("give either --checkpoint or --random-weights, not both"))
    overrides = (*(override or ()), *([f"dense_format={dense_format.value}"] if dense_format else []))
    try:
        compile_engine(CompileOptions(source, target, output, checkpoint, random_weights, seed, overrides,
                                      quant.value if quant else None, force, name), err)
    except user_errors() as e:
        fail(e)


@app.command()
def package(
    engine: Annotated[Path, typer.Argument(help="Engine directory to package.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The package: a folder to upload as a Hugging Face "
                                         "model repository (or, with --archive, one tar file).")],
    shard_size: Annotated[int, typer.Option(parser=positive_size, metavar="SIZE", help="Largest expert shard "
                                            "(the Hub takes files of up to 50 GB).")] = "48GB",
    archive: Annotated[bool, typer.Option("--archive", help="One uncompressed tar of the package instead of a "
                                          "folder.")] = False,
    repo_id: Annotated[str | None, typer.Option(help="The Hub repository ORG/NAME it will be uploaded to (the model "
                                                "card's commands use it).")] = None,
) -> None:
    """Package an engine for others: expert shards, every file's sha256, a model card."""
    from ftc.package import package_engine

    try:
        out = package_engine(engine, output, shard_size, archive, repo_id, err)
    except user_errors() as e:
        fail(e)
    print(f"package ready: {out}")


@app.command()
def inspect(
    engine: Annotated[Path, typer.Argument(help="Engine directory (or archive, or Hugging Face repository ORG/NAME "
                                           "of one), or a model spec (.yaml) or checkpoint folder with --target: "
                                           "its predicted memory split and speeds.")],
    verify: Annotated[bool, typer.Option("--verify", help="Also check every file's sha256.")] = False,
    vram_budget: Annotated[int | None, typer.Option(parser=size, metavar="SIZE", help="Show the GPU memory split "
                                                    "for this budget, e.g. 8GiB.")] = None,
    max_context: Annotated[int, typer.Option(min=1, help="KV cache tokens the budget reserves.")] = 4096,
    target: Annotated[str | None, typer.Option(help="For a spec: the hardware target whose GPU and bandwidths the "
                                               "prediction uses (a preset with a GPU, e.g. rtx-pro-6000).")] = None,
    quant: Annotated[str | None, typer.Option(help="For a spec: its routed experts in this format (bf16, mxfp4, "
                                              "nvfp4).")] = None,
    override: Annotated[list[str] | None, typer.Option(help="For a spec: edit a field, FIELD=VALUE (num_layers=N: "
                                                       "its first N layers), repeatable.")] = None,
    dense_format: Annotated[DenseFormat | None, typer.Option(help="For a spec: its non-expert projections in this "
                                                             "format (bf16, fp8).")] = None,
) -> None:
    """Show an engine's model, memory split, plan and files; or a spec's predicted split and speeds."""
    from ftc.inspect_engine import inspect_engine, inspect_spec

    if dense_format is not None:
        override = [*(override or ()), f"dense_format={dense_format.value}"]
    try:
        if target is not None:
            tables = inspect_spec(engine, target, vram_budget, max_context, quant, override or [])
        elif override:
            raise ValueError("--override edits a spec: give it with --target (an engine's spec is fixed)")
        else:
            from ftc_runtime.engine_source import resolve_engine

            tables = inspect_engine(resolve_engine(engine), verify, vram_budget, max_context)
    except user_errors() as e:
        fail(e)
    out = Console()
    for t in tables:
        out.print(t)


@app.command()
def run(
    ctx: typer.Context,
    engine: Annotated[Path, typer.Argument(help="Engine directory, an engine archive (`ftc package --archive`), or "
                                           "a Hugging Face repository ORG/NAME of one.")],
    prompt: Annotated[str | None, typer.Option(help="One chat turn with this text (without a prompt: a "
                                               "conversation at a terminal, or stdin's text).")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="The prompt's text from this file.")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="A raw prompt as token ids: 1,2,3.")] = None,
    system: Annotated[str | None, typer.Option(help="The chat's system prompt.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Continue the prompt's text as it is: no chat "
                                      "template.")] = False,
    max_new_tokens: Annotated[int, typer.Option(min=0, help="Tokens to generate at most per answer "
                                                "(0: none).")] = 1024,
    temperature: Annotated[float | None, typer.Option(parser=number_in(0), help="0 is greedy (default: the "
                                                      "checkpoint's generation_config.json, else 0).")] = None,
    top_p: Annotated[float | None, typer.Option(parser=number_in(0, 1, low_open=True), help="Nucleus sampling mass, "
                                                "in (0, 1] (default: the checkpoint's, else 1).")] = None,
    top_k: Annotated[int | None, typer.Option(min=0, help="Sample among the k likeliest tokens; 0: all (default: "
                                              "the checkpoint's, else 0).")] = None,
    seed: Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Sampling seed.")] = 0,
    repeat_penalty: Annotated[float | None, typer.Option(help="Divide the logits of tokens the prompt or answer "
                                                         "holds by this (multiply where negative; HF's "
                                                         "repetition_penalty), in (0, 10]; 1: off (default: the "
                                                         "checkpoint's, else 1).")] = None,
    presence_penalty: Annotated[float | None, typer.Option(help="Subtract this from the logits of tokens the answer "
                                                           "holds, in [-2, 2] (default: the checkpoint's, else "
                                                           "0).")] = None,
    frequency_penalty: Annotated[float | None, typer.Option(help="Subtract this times its count in the answer from "
                                                            "each token's logit, in [-2, 2] (default: the "
                                                            "checkpoint's, else 0).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-sequence.")] = False,
    stop: Annotated[list[str] | None, typer.Option(help="End the answer before this text (repeatable).")] = None,
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
    prefill_split: PrefillSplitArg = None,
    speculate: SpeculateArg = None,
    serve: Annotated[bool, typer.Option("--serve", help="Serve the OpenAI and Anthropic APIs over HTTP "
                                        "instead.")] = False,
    host: HostArg = "127.0.0.1",
    port: PortArg = 8000,
    api_key: ApiKeyArg = None,
    api_keys_file: ApiKeysFileArg = None,
    allowed_hosts: AllowedHostsArg = None,
    max_body_bytes: MaxBodyBytesArg = None,
    max_batch: MaxBatchArg = 16,
    max_prompt_tokens: MaxPromptTokensArg = 32768,
    max_tokens: MaxTokensArg = 8192,
    prefix_cache: PrefixCacheArg = "auto",
    served_model_name: ServedModelNameArg = None,
    metrics_public: MetricsPublicArg = False,
    log_level: LogLevelArg = LogLevel.info,
) -> None:
    """Chat with an engine: one turn (--prompt, --prompt-file, or stdin's text), or a conversation
    when stdin is a terminal; --raw or --prompt-ids continue a prompt as it is. With --serve, answer
    the OpenAI and Anthropic APIs over HTTP."""
    from ftc_runtime.engine_source import resolve_engine

    try:
        check_run_mode(ctx, serve)
        engine = resolve_engine(engine)
        offload = offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts,
                                 prefill_split=prefill_split)
        penalties = sampling_penalties(repeat_penalty, presence_penalty, frequency_penalty)
        if serve:
            config = server_config(host, api_key, api_keys_file, allowed_hosts, max_body_bytes=max_body_bytes,
                                   max_batch=max_batch, max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_tokens)
            config |= {"metrics_public": metrics_public, "served_model_names": served_names(served_model_name)}
        else:
            text, given_ids = run_prompt(engine, prompt, prompt_file, prompt_ids, raw, system, as_json)
        check_speculation(speculate, engine)
    except user_errors() as e:
        fail(e)
    if serve:
        logging.basicConfig(level=log_level.value.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _serve(engine, offload, prefill_chunk, speculate, host, port, config, prefix_cache)
        return
    sampling = {"seed": seed, "temperature": temperature, "top_p": top_p, "top_k": top_k, **penalties}
    if raw or given_ids is not None:
        _generate(engine, offload, prefill_chunk, reprofile, speculate, given_ids, text, max_new_tokens, sampling,
                  not ignore_eos, stop or [], as_json)
    else:
        _chat(engine, offload, prefill_chunk, reprofile, speculate, text, system, max_new_tokens, sampling,
              not ignore_eos, stop or [], as_json)


def _load(engine: Path, offload, prefill_chunk: int | None, reprofile: bool, speculate: Speculation | None,
          quiet: bool, asked: dict):
    """The engine for `ftc run`, its load time, reprofiled if asked, speculating if asked, and the
    sampling: what the options ask, else the engine's defaults (its checkpoint's generation_config.json)."""
    from ftc_runtime import Engine
    from ftc_runtime.sampling import with_defaults

    t0 = time.perf_counter()
    eng = Engine.load(engine, show_progress=not quiet, offload=offload, prefill_chunk=prefill_chunk)
    load_s = time.perf_counter() - t0
    eng.enable_speculation(speculate)  # mtp:K on an engine without an MTP layer refuses
    if reprofile:
        reprofile_engine(engine, eng, offload)
    return eng, load_s, with_defaults(eng.manifest.sampling, **asked)


def _chat(engine: Path, offload, prefill_chunk: int | None, reprofile: bool, speculate: Speculation | None,
          text: str | None,
          system: str | None, max_new_tokens: int, sampling: dict, stop_at_eos: bool, stop: list[str],
          as_json: bool) -> None:
    """One chat turn (`text`), or a conversation at the terminal (`text` None)."""
    from ftc.cli.chat import note_random_weights, print_turn, repl, turn_json
    from ftc_runtime.chat.session import ChatSession

    try:
        eng, load_s, sampling = _load(engine, offload, prefill_chunk, reprofile, speculate, as_json, sampling)
        session = ChatSession(eng, system, stop_at_eos, stop)
        if not as_json:
            note_random_weights(eng)
        if as_json:
            print(json.dumps(turn_json(session, text, max_new_tokens, sampling, load_s)))
        elif text is not None:
            print_turn(session, text, max_new_tokens, sampling)
        else:  # each turn resumes from the cached conversation, not from its first token
            kv_bytes = eng.default_prefix_cache_bytes()
            if kv_bytes:
                eng.enable_prefix_cache(kv_bytes, kv_bytes)
            repl(eng, session, max_new_tokens, sampling)
    except user_errors() as e:
        fail(e)


def _generate(engine: Path, offload, prefill_chunk: int | None, reprofile: bool, speculate: Speculation | None,
              given_ids: list[int] | None, prompt: str | None, max_new_tokens: int, sampling: dict, stop_at_eos: bool,
              stop: list[str], as_json: bool) -> None:
    """Loads the engine and generates, streaming the text (or printing one JSON object at the end)
    up to the first `stop` string."""
    from ftc.cli.chat import timings
    from ftc_runtime.chat.stop_strings import StopMatcher
    from ftc_runtime.chat.tokenizer import StreamDecoder

    def show(piece: str) -> None:
        pieces.append(piece)
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        eng, load_s, sampling = _load(engine, offload, prefill_chunk, reprofile, speculate, as_json, sampling)
        ids = given_ids if given_ids is not None else eng.tokenizer.encode(prompt)
        gen = eng.generate(ids, max_new_tokens, sampling, stop_at_eos)
        decoder, stops, tokens, pieces = StreamDecoder(eng.tokenizer), StopMatcher(stop), [], []
        # end-of-sequence and control tokens are generated (and listed) but never shown, as the server does
        unshown = eng.hidden_token_ids | set(eng.spec.eos_token_ids)
        for token in gen:
            tokens.append(token)
            if token in unshown:
                continue
            show(stops.feed(decoder.push(token)))
            if stops.hit is not None:
                break
        else:
            show(stops.feed(decoder.flush()) + stops.flush())
    except user_errors() as e:
        fail(e)
    s = gen.stats
    if as_json:
        result = {"tokens": tokens, "text": "".join(pieces), "prompt_tokens": len(ids), "timings": timings(load_s, s)}
        if eng.vram is not None:
            result["offload"] = {"vram": eng.vram.to_dict(), "experts": eng.model.experts.stats.to_dict()}
        print(json.dumps(result))
    else:
        if tokens:  # --max-new-tokens 0 prints nothing, not an empty line
            sys.stdout.write("\n")
        err.print(f"[dim]{len(ids)} prompt tokens, {len(tokens)} generated; prefill {s.prefill_tok_s:.1f} tok/s, "
                  f"decode {s.decode_tok_s:.2f} tok/s[/]", soft_wrap=True)


def _serve(engine: Path, offload, prefill_chunk: int | None, speculate: Speculation | None, host: str, port: int,
           config: dict, prefix_cache: int | None) -> None:
    """Serves `engine` until SIGTERM or Ctrl-C; `prefix_cache` None: the server's default size."""
    from ftc_runtime import Engine
    from ftc_runtime.experts.vram_plan import gib
    from ftc_runtime.serve.app import ServerConfig, bind, create_app, run_server

    try:
        sock = bind(host, port)
        eng = Engine.load(engine, show_progress=True, offload=offload, prefill_chunk=prefill_chunk)
        kv_bytes = eng.default_prefix_cache_bytes() if prefix_cache is None else prefix_cache
        if kv_bytes:
            eng.enable_prefix_cache(kv_bytes, kv_bytes)
        eng.enable_speculation(speculate)
        app = create_app(eng, ServerConfig(model_name=eng.spec.name, **config))
    except user_errors() as e:
        fail(e)
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"  # an IPv6 address goes in brackets
    cache = f"prefix cache {gib(kv_bytes)}" if kv_bytes else "no prefix cache"
    # Plain text, as in _fail: the address must be neither wrapped nor read as markup.
    keyed = config["api_key"] is not None or bool(config["api_keys"])
    names = config.get("served_model_names") or ()
    as_names = f" as {', '.join(names)}" if names else " (any model name)"
    typer.echo(f"serving {eng.spec.name}{as_names} on {url} ({cache}" + (", API key required)" if keyed else ")"),
               err=True)
    run_server(app, sock)


app.add_typer(bench_app, name="bench")


@app.command()
def profile(
    engine: Annotated[Path, typer.Argument(help="Engine whose CPU kernel and expert pool are measured.")],
    output: Annotated[Path | None, typer.Option("-o", "--output", parser=output_file, help="Write the profile YAML "
                                                "here.")] = None,
    device: Annotated[str | None, typer.Option(help="GPU to measure B_P on (default: cuda if present).")] = None,
    seconds: Annotated[float, typer.Option(parser=number_in(0, low_open=True), help="Seconds per "
                                           "measurement.")] = 2.0,
    store: Annotated[bool, typer.Option("--store", help="Also record it in the engine's engine.json.")] = False,
) -> None:
    """Measure this machine: CPU ISA and cores, plain read, B_H, and with a GPU B_P and both at once."""
    import dataclasses

    import torch

    from ftc_runtime import Engine
    from ftc_runtime.artifact import store_profile
    from ftc_runtime.profile import measure_profile

    try:
        device = check_device(device) if device else ("cuda" if torch.cuda.is_available() else None)
        eng = Engine.load(engine)
        prof = measure_profile(eng.spec, eng.pool, eng.model.experts.kernel, device, seconds)
        if output:
            prof.to_yaml(output)
        if store:
            store_profile(engine, dataclasses.asdict(prof))
    except user_errors() as e:
        fail(e)
    print(json.dumps(dataclasses.asdict(prof), indent=1))


@app.command()
def trace(
    engine: Annotated[Path, typer.Argument(help="Engine directory.")],
    output: Annotated[Path, typer.Option("-o", "--output", parser=output_file, help="Trace file to write "
                                         "(.npz).")],
    prompt: Annotated[str | None, typer.Option(help="Prompt text.")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="Prompt as token ids: 1,2,3.")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 128,
) -> None:
    """Record the experts the router chooses, per token and MoE layer, while generating greedily."""
    from ftc_runtime import Engine, SamplingParams
    from ftc_runtime.experts.routing_trace import TraceRecorder

    if (prompt is None) == (prompt_ids is None):
        fail(ValueError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3"))
    try:
        given = prompt_ids_for(prompt_ids, engine) if prompt_ids is not None else None
        eng = Engine.load(engine)
        ids = given if given is not None else eng.tokenizer.encode(prompt)
        recorder = TraceRecorder(len(eng.spec.moe_layers))
        eng.model.experts.routing = recorder
        for _ in eng.generate(ids, max_new_tokens, SamplingParams(0.0), stop_at_eos=False):
            pass
        recorder.trace(len(ids)).save(output)
    except user_errors() as e:
        fail(e)
    err.print(f"recorded {len(ids) + max_new_tokens - 1} tokens × {len(eng.spec.moe_layers)} MoE layers → {output}")


if __name__ == "__main__":
    app()
