"""`ftc bench experts | decode | matrix | prefill | agent | load`: one command per benchmark, each
with the options it reads. Every one prints one JSON object (and writes it with -o), but `matrix`,
which prints a table of its runs (the JSON with --json)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ftc.cli.errors import failing_on_user_errors
from ftc.cli.options import (
    MAX_SEED,
    CachePolicyArg,
    CpuExpertsArg,
    MissPolicyArg,
    MissPolicyOpt,
    PrefillChunkArg,
    PrefillSplitArg,
    SlotsArg,
    SpeculateArg,
    VramBudgetArg,
    check_draft_oracle,
    check_plot,
    engine_in_memory,
    err,
    number_in,
    offload_config,
    output_file,
    parse_ids,
    routing_for,
    size,
)

if TYPE_CHECKING:
    from ftc_runtime.io.ftw import ExpertPool

bench_app = typer.Typer(no_args_is_help=True, help="Measure an engine, or a spec built in memory with random weights; "
                        "each benchmark prints one JSON object (matrix: a table, or the JSON with --json).")

# Options that several benchmarks share.
EngineArg = Annotated[Path, typer.Argument(metavar="ENGINE", help="Engine directory, or a spec YAML with "
                                           "--random-weights.")]
OutputArg = Annotated[Path | None, typer.Option("-o", "--output", parser=output_file, help="Also write the JSON "
                                                "here.")]
PlotArg = Annotated[Path | None, typer.Option(parser=output_file, help="Also draw the result as a PNG here (needs "
                                              "matplotlib: the `plot` extra).")]
# Where the model runs: every benchmark but `experts` measures the engine on a device.
DeviceArg = Annotated[str, typer.Option(help="Torch device of the model and the expert slot cache: cuda, cuda:N, or "
                                        "cpu (to emulate a GPU).")]
StreamMinTokensArg = Annotated[int | None, typer.Option(min=1, help="Prompt chunks of at least this many tokens "
                                                        "stream whole MoE layers (default: the plan's); shorter "
                                                        "ones split their misses as decode does.")]
PromptSeedArg = Annotated[int, typer.Option(min=0, max=MAX_SEED, help="Seed of the random prompts (and of "
                                            "--random-weights).")]
# ENGINE a spec: compiled into a temporary engine for the run, its experts generated into memory.
SPEC = "With a spec YAML as ENGINE"
RandomWeightsArg = Annotated[bool, typer.Option("--random-weights", rich_help_panel=SPEC, help="Random weights, "
                                                "generated straight into memory (no weight file).")]
SeedArg = Annotated[int, typer.Option(min=0, max=MAX_SEED, rich_help_panel=SPEC, help="Seed for "
                                      "--random-weights.")]
TargetArg = Annotated[str, typer.Option(rich_help_panel=SPEC, help="Hardware target: 'auto' (this machine) or a "
                                        "preset name.")]
OverrideArg = Annotated[list[str] | None, typer.Option(rich_help_panel=SPEC, help="Edit a spec field: FIELD=VALUE, "
                                                       "repeatable.")]

# What `bench decode` and `bench matrix` share: the decode run's lengths and the synthetic traces' shape.
PromptTokensArg = Annotated[int, typer.Option(min=1, help="Prompt length (random tokens).")]
NewTokensArg = Annotated[int, typer.Option(min=2, help="Tokens to generate.")]
ZipfArg = Annotated[float, typer.Option(parser=number_in(0), help="With --synthetic-locality: the Zipf exponent of "
                                        "the experts' popularity (0: uniform routing).")]


@contextmanager
def _engine(engine: Path, random_weights: bool, seed: int, target: str,
            override: list[str] | None) -> Iterator[tuple[Path, ExpertPool | None]]:
    """The engine directory to measure and its expert pool: a directory as given (the pool None:
    the engine loads its file), or a spec compiled for the run, its pool in memory. Commands check
    their other options first: a large spec takes minutes to build."""
    if not engine.is_file():
        yield engine, None
        return
    with tempfile.TemporaryDirectory(prefix="ftc-bench-") as tmp:
        yield engine_in_memory(engine, random_weights, seed, target, override, Path(tmp))


def _report(result: dict, output: Path | None) -> str:
    """The result's JSON, also written to `output`."""
    text = json.dumps(result, indent=1)
    if output:
        output.write_text(text + "\n")
    return text


@bench_app.command()
def experts(
    engine: EngineArg,
    tokens: Annotated[int, typer.Option(min=1, help="Tokens per call (the batch each expert sees).")] = 1,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU workers (default: the plan's).")] = None,
    seconds: Annotated[float, typer.Option(parser=number_in(0, low_open=True), help="Seconds per "
                                           "measurement.")] = 3.0,
    output: OutputArg = None,
    random_weights: RandomWeightsArg = False,
    seed: SeedArg = 0,
    target: TargetArg = "auto",
    override: OverrideArg = None,
) -> None:
    """The CPU expert kernel's throughput, against torch bf16 and a plain memory read.

    GB/s of the expert weights that routed calls must read, on the CPU only; next to it torch's
    bf16 matmul on the same experts and the machine's plain read bandwidth."""
    from ftc.bench.experts import bench_experts

    with failing_on_user_errors(), _engine(engine, random_weights, seed, target, override) as (path, pool):
        result = bench_experts(path, tokens, threads, seconds, pool=pool)
    print(_report(result, output))
    if "note" in result:
        err.print(f"note: {result['note']}", markup=False, soft_wrap=True)


@bench_app.command()
def decode(
    engine: EngineArg,
    routing_trace: Annotated[Path | None, typer.Option(help="Replay the router choices of this trace (.npz, from "
                                                       "`ftc trace`).")] = None,
    synthetic_locality: Annotated[float | None, typer.Option(parser=number_in(0, 1), help="Replay a synthetic trace "
                                                             "of this locality, in [0, 1].")] = None,
    zipf: ZipfArg = 1.0,
    prompt_tokens: PromptTokensArg = 128,
    new_tokens: NewTokensArg = 64,
    sequences: Annotated[str | None, typer.Option(help="Concurrent sequences, comma-separated (e.g. 1,2,4,8,16): "
                                                  "the aggregate throughput of each count decoding together, "
                                                  "with the model's own router and sampled tokens.")] = None,
    device: DeviceArg = "cuda",
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    miss_policy: MissPolicyArg = "adaptive",
    cache_policy: CachePolicyArg = "lru",
    cpu_experts: CpuExpertsArg = False,
    stream_min_tokens: StreamMinTokensArg = None,
    prefill_split: PrefillSplitArg = None,
    speculate: SpeculateArg = None,
    draft_oracle: Annotated[float | None, typer.Option(parser=number_in(0, 1), metavar="P", help="With --speculate "
                                                       "mtp:K, ngram:K or auto: draft from the known greedy answer "
                                                       "instead, each draft wrong with probability 1 - P: what "
                                                       "verification "
                                                       "costs at acceptance P (with random weights no drafter's "
                                                       "acceptance means anything).")] = None,
    output: OutputArg = None,
    random_weights: RandomWeightsArg = False,
    seed: SeedArg = 0,
    target: TargetArg = "auto",
    override: OverrideArg = None,
) -> None:
    """Decode speed with the experts split between a device slot cache and the CPU.

    Tok/s, the split's statistics (hits, fills, CPU misses) and the bandwidth bound of the steps
    that ran; the router's own choices, or a replayed trace. With --sequences, the aggregate
    throughput of several sequences at once instead. With --speculate, the passes after the prompt,
    the tokens each gave out and the share of drafts accepted (`speculation`)."""
    from ftc.bench.decode import bench_decode
    from ftc.bench.decode_batches import bench_decode_batches
    from ftc_runtime.artifact import EngineManifest

    with failing_on_user_errors():
        offload = offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts,
                                 stream_min_tokens, prefill_split)
        counts = parse_ids(sequences, "--sequences", low=1) if sequences is not None else None
        if counts is not None and (routing_trace is not None or synthetic_locality is not None or zipf != 1.0):
            raise ValueError("--sequences decodes with the model's own router: leave out --routing-trace, "
                             "--synthetic-locality and --zipf")
        if counts is not None and speculate is not None:
            raise ValueError(f"--speculate {speculate}: sequences decoded together (--sequences) do not speculate")
        check_draft_oracle(draft_oracle, speculate)
        with _engine(engine, random_weights, seed, target, override) as (path, pool):
            if counts is not None:
                print(_report(bench_decode_batches(path, offload, counts, prompt_tokens, new_tokens, pool=pool),
                              output))
                return
            spec = EngineManifest.read(path).spec
            if speculate is not None:
                speculate.check_family(spec)  # before the engine loads
            trace, routing = routing_for(routing_trace, synthetic_locality, spec, 0, zipf)
            text = _report(bench_decode(path, offload, trace, routing, prompt_tokens, new_tokens, pool=pool,
                                        speculation=speculate, draft_oracle=draft_oracle), output)
    print(text)


@bench_app.command()
def matrix(
    engine: EngineArg,
    miss_policy: Annotated[str, typer.Option(metavar="POLICY[,POLICY...]", help="Where cache misses run, "
                                             "comma-separated: each policy is measured on each routing (adaptive, "
                                             "gpu, cpu, half).")] = "adaptive,gpu,cpu",
    routing_trace: Annotated[list[Path] | None, typer.Option(metavar="PATH", help="Replay the router choices of "
                                                             "this trace (.npz, from `ftc trace`); "
                                                             "repeatable.")] = None,
    synthetic_locality: Annotated[str | None, typer.Option(metavar="LOCALITY[,LOCALITY...]", help="Replay "
                                                           "synthetic traces of these localities, in [0, 1], "
                                                           "comma-separated.")] = None,
    zipf: ZipfArg = 1.0,
    uniform: Annotated[bool, typer.Option("--uniform", help="Uniform routing: every step draws its experts "
                                          "uniformly (--synthetic-locality 0 --zipf 0).")] = False,
    own_router: Annotated[bool, typer.Option("--own-router", help="The model's own router too (without any "
                                             "routing option, the only one).")] = False,
    prompt_tokens: PromptTokensArg = 128,
    new_tokens: NewTokensArg = 64,
    device: DeviceArg = "cuda",
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    cache_policy: CachePolicyArg = "lru",
    cpu_experts: CpuExpertsArg = False,
    stream_min_tokens: StreamMinTokensArg = None,
    prefill_split: PrefillSplitArg = None,
    speculate: SpeculateArg = None,
    draft_oracle: Annotated[str | None, typer.Option(metavar="P[,P...]", help="With --speculate: each "
                                                     "routing and policy also with drafts from the known greedy "
                                                     "answer, each wrong with probability 1 - P (`bench decode "
                                                     "--draft-oracle`), beside the run without drafts.")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Run each routing's policies this many times, in reverse "
                                         "order every other time; the table gives each one's median run.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON object instead of the table.")] = False,
    output: OutputArg = None,
    random_weights: RandomWeightsArg = False,
    seed: SeedArg = 0,
    target: TargetArg = "auto",
    override: OverrideArg = None,
) -> None:
    """`bench decode` under several miss policies and routings, as a table.

    One `bench decode` run per routing and miss policy on one engine, its experts read (or drawn,
    for a spec) once; routings: each --routing-trace, each --synthetic-locality, --uniform and
    --own-router, in that order. With --speculate, each also without drafts and with them (or,
    with --draft-oracle, with the oracle's drafts at each P). Prints a table (--json: the JSON
    object, the runs as `bench decode` prints them; -o writes it either way); each run's tok/s on
    stderr as it ends."""
    from ftc.bench.matrix import bench_matrix, matrix_table
    from ftc_runtime.artifact import EngineManifest
    from ftc_runtime.experts.routing_trace import RoutingTrace

    with failing_on_user_errors():
        policies = _matrix_policies(miss_policy)
        offloads = [offload_config(device, vram_budget, slots, policy, cache_policy, cpu_experts, stream_min_tokens,
                                   prefill_split) for policy in policies]
        localities = [] if synthetic_locality is None else \
            [_locality(part) for part in synthetic_locality.split(",")]
        if zipf != 1.0 and not localities:
            raise ValueError("--zipf shapes the synthetic traces: give --synthetic-locality too (--uniform is "
                             "locality 0, Zipf 0)")
        traces = [(path, RoutingTrace.load(path)) for path in routing_trace or ()]  # before a spec's build
        drafts = _matrix_drafts(speculate, draft_oracle)
        with _engine(engine, random_weights, seed, target, override) as (path, pool):
            spec = EngineManifest.read(path).spec
            if speculate is not None:
                speculate.check_family(spec)
            routings = _matrix_routings(spec, traces, localities, zipf, uniform, own_router)

            def progress(i: int, n: int, routing, run: dict) -> None:
                err.print(f"matrix {i}/{n}: {routing.name}, {run['miss_policy']}, drafts {run['speculate']}: "
                          f"{run['decode_tok_s']} tok/s, {run['ms_per_token']} ms/token", markup=False,
                          highlight=False)

            result = bench_matrix(path, offloads, routings, prompt_tokens, new_tokens, pool, progress, drafts, repeats)
        text = _report(result, output)
    if as_json:
        print(text)
    else:
        from rich.console import Console

        console = Console()
        if not console.is_terminal:  # a pipe or a log: no terminal width to fit the rows into
            console.width = 160
        console.print(matrix_table(result))


def _matrix_drafts(speculate, draft_oracle: str | None) -> list:
    """The ways each run drafts: none, then `speculate`'s drafter, or the oracle at each P."""
    from ftc.bench.matrix import Drafts

    check_draft_oracle(draft_oracle, speculate)
    if speculate is None:
        return [Drafts()]
    if draft_oracle is None:
        return [Drafts(), Drafts(speculate)]
    return [Drafts(), *(Drafts(speculate, number_in(0, 1)(p)) for p in draft_oracle.split(","))]


def _matrix_policies(text: str) -> list[str]:
    """--miss-policy of `bench matrix`: policies, comma-separated, each once."""
    names = [p.value for p in MissPolicyOpt]
    policies = [part.strip() for part in text.split(",")]
    bad = [p for p in policies if p not in names]
    if bad or len(set(policies)) != len(policies):
        raise ValueError(f"--miss-policy {text!r}: expected policies among {', '.join(names)}, comma-separated, "
                         "each once")
    return policies


def _locality(text: str) -> float:
    try:
        return number_in(0, 1)(text)
    except ValueError as e:
        raise ValueError(f"--synthetic-locality: {e}") from None


def _matrix_routings(spec, traces: list, localities: list[float], zipf: float, uniform: bool, own_router: bool):
    """`bench matrix`'s routings, as `bench decode` builds and names each (routing_for); the model's
    own router where none is given."""
    from ftc.bench.matrix import Routing

    routings = [Routing(f"trace {path.name}", f"trace {path}", trace) for path, trace in traces]
    for locality in localities:
        trace, label = routing_for(None, locality, spec, 0, zipf)
        routings.append(Routing(f"locality {locality:g}, Zipf {zipf:g}", label, trace))
    if uniform:
        trace, label = routing_for(None, 0.0, spec, 0, 0.0)
        routings.append(Routing("uniform", label, trace))
    if own_router or not routings:
        routings.append(Routing("own router", routing_for(None, None, spec, 0)[1], None))
    seen: set[str] = set()  # --uniform and --synthetic-locality 0 --zipf 0 are one routing
    return [r for r in routings if not (r.label in seen or seen.add(r.label))]


@bench_app.command()
def prefill(
    engine: EngineArg,
    lengths: Annotated[str, typer.Option(help="Prompt lengths in tokens, comma-separated.")] = "1024,2048,4096,8192",
    no_overlap: Annotated[bool, typer.Option("--no-overlap", help="One layer buffer: load, then compute (the "
                                             "baseline).")] = False,
    compare: Annotated[bool, typer.Option("--compare", help="Both modes: two layer buffers, then one.")] = False,
    prefill_chunk: PrefillChunkArg = None,
    device: DeviceArg = "cuda",
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    miss_policy: MissPolicyArg = "adaptive",
    cache_policy: CachePolicyArg = "lru",
    cpu_experts: CpuExpertsArg = False,
    stream_min_tokens: StreamMinTokensArg = None,
    prefill_split: Annotated[str, typer.Option(metavar="MODE[,MODE...]", help="Streamed chunks' CPU share: auto, "
                                               "off or a share in [0, 1]; several, comma-separated, are each "
                                               "measured (e.g. off,auto).")] = "off",
    plot: PlotArg = None,
    output: OutputArg = None,
    random_weights: RandomWeightsArg = False,
    seed: PromptSeedArg = 0,
    target: TargetArg = "auto",
    override: OverrideArg = None,
) -> None:
    """Prefill speed by prompt length, against the PCIe ceiling.

    The MoE layers stream through two layer buffers (the next layer's copies beside this one's
    compute) or, with --no-overlap, one; the CPU computes part of each layer's uncached experts in
    place (--prefill-split). The ceiling: every uncached expert over PCIe. --plot: tok/s against
    length."""
    from ftc.bench.prefill import bench_prefill, plot_prefill

    with failing_on_user_errors():
        check_plot(plot)
        splits = [part.strip() for part in prefill_split.split(",")]
        offloads = [offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts,
                                   stream_min_tokens, split) for split in splits]
        prompt_lengths = parse_ids(lengths, "--lengths", low=1)
        modes = [True, False] if compare else [not no_overlap]
        with _engine(engine, random_weights, seed, target, override) as (path, pool):
            result = bench_prefill(path, offloads, prompt_lengths, modes, prefill_chunk, seed, pool)
        if plot:
            plot_prefill(result, plot)
        text = _report(result, output)
    print(text)


@bench_app.command()
def agent(
    engine: EngineArg,
    session_tokens: Annotated[int, typer.Option(min=1, help="The session grows to about this many "
                                                "tokens.")] = 20000,
    tool_output_tokens: Annotated[int, typer.Option(min=1, help="Tokens of each tool output.")] = 2000,
    prefix_cache: Annotated[int, typer.Option(parser=size, metavar="SIZE", help="KV memory of the prefix "
                                              "cache.")] = "8GiB",
    checkpoint_cache: Annotated[int, typer.Option(parser=size, metavar="SIZE", help="Memory for recurrent-state "
                                                  "checkpoints.")] = "4GiB",
    no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="No cache at all.")] = False,
    no_checkpoints: Annotated[bool, typer.Option("--no-checkpoints", help="The KV cache only (a hybrid model then "
                                                 "cannot resume).")] = False,
    compare: Annotated[bool, typer.Option("--compare", help="All three: with the cache, without checkpoints, "
                                          "without any cache.")] = False,
    prefill_chunk: PrefillChunkArg = None,
    device: DeviceArg = "cuda",
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    miss_policy: MissPolicyArg = "adaptive",
    cache_policy: CachePolicyArg = "lru",
    cpu_experts: CpuExpertsArg = False,
    stream_min_tokens: StreamMinTokensArg = None,
    prefill_split: PrefillSplitArg = None,
    plot: PlotArg = None,
    output: OutputArg = None,
    random_weights: RandomWeightsArg = False,
    seed: PromptSeedArg = 0,
    target: TargetArg = "auto",
    override: OverrideArg = None,
) -> None:
    """A coding-agent session replayed turn by turn, with and without the prefix cache.

    A scripted session (long tool outputs, then an edit that cuts one) resent whole each turn,
    as an agent does: per turn the time to first token, and the tokens restored from the prefix
    cache and prefilled. --plot: time to first token per turn."""
    from ftc.bench.agent import bench_agent, plot_agent

    with failing_on_user_errors():
        check_plot(plot)
        offload = offload_config(device, vram_budget, slots, miss_policy, cache_policy, cpu_experts,
                                 stream_min_tokens, prefill_split)
        modes = (["cache", "no-checkpoints", "no-prefix-cache"] if compare else
                 ["no-prefix-cache" if no_prefix_cache else "no-checkpoints" if no_checkpoints else "cache"])
        with _engine(engine, random_weights, seed, target, override) as (path, pool):
            result = bench_agent(path, offload, modes, session_tokens, tool_output_tokens, prefix_cache,
                                 checkpoint_cache, seed=seed, pool=pool, prefill_chunk=prefill_chunk)
        if plot:
            plot_agent(result, plot)
        text = _report(result, output)
    print(text)


@bench_app.command()
def load(
    engine: Annotated[Path, typer.Argument(metavar="ENGINE", help="Compiled engine directory (a spec has no expert "
                                           "file to read).")],
    device: DeviceArg = "cuda",
    vram_budget: VramBudgetArg = None,
    slots: SlotsArg = None,
    cpu_experts: CpuExpertsArg = False,
    output: OutputArg = None,
) -> None:
    """How fast an engine loads, against the disk's own read rate.

    The loader's read of the expert file or a package's shards (parallel direct reads, every row's
    checksum checked) against one sequential direct read of the same bytes, then the rest of the
    engine."""
    from ftc.bench.load import bench_load

    with failing_on_user_errors():
        if engine.is_file():
            raise ValueError(f"bench load {engine}: give a compiled engine directory (a spec has no expert file "
                             "to load)")
        # The miss and cache policies are left at their defaults: they change no byte that loads.
        offload = offload_config(device, vram_budget, slots, cpu_experts=cpu_experts)
        text = _report(bench_load(engine, offload), output)
    print(text)
