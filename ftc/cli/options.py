"""Turning command-line options into the runtime's and compiler's own objects."""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

if TYPE_CHECKING:
    from ftc_runtime.speculative.config import Speculation

err = Console(stderr=True)


MissPolicyOpt = Enum("MissPolicyOpt", {p: p for p in ("adaptive", "gpu", "cpu", "half")}, type=str)
CachePolicyOpt = Enum("CachePolicyOpt", {p: p for p in ("lru", "static")}, type=str)
# The names of ftc_runtime.formats.FORMATS, spelled out so that `--help` imports no torch (a test holds them equal).
ExpertQuant = Enum("ExpertQuant", {f: f for f in ("bf16", "mxfp4", "nvfp4")}, type=str)
DenseFormat = Enum("DenseFormat", {f: f for f in ("bf16", "fp8")}, type=str)  # spec.DENSE_FORMATS

MAX_SEED = 2**64 - 1  # torch.Generator takes seeds in [0, 2**64)


# Parsers of option values. Typer reports their ValueError as a usage error naming the option, before
# the command starts (and so before an engine loads or a benchmark runs).


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def size(text: str) -> int:
    """A byte count: '32GiB', '8GB', '512MiB', '1e9' → bytes, at least 0, less than 2**63."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number >= 0 with an optional unit (B, KB, MB, GB, KiB, MiB, "
                         "GiB, ...)")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not n < 2**63:  # '1e999' is inf; byte counts must fit the int64 that torch and the OS use
        raise ValueError(f"size {text!r}: too large (8 EiB or more)")
    return int(n)


def positive_size(text: str) -> int:
    """A byte count of at least 1."""
    n = size(text)
    if n < 1:
        raise ValueError(f"size {text!r}: expected at least 1 byte")
    return n


def cache_size(text: str) -> int | None:
    """A size, or 'auto' (None): the command picks one."""
    return None if text.strip().lower() == "auto" else size(text)


def number_in(low: float, high: float | None = None, low_open: bool = False) -> Callable[[str], float]:
    """A parser of finite numbers in [low, high] ((low, high] with `low_open`); typer's own `min=`
    lets inf through."""
    span = f"{'(' if low_open else '['}{low:g}, {'∞)' if high is None else f'{high:g}]'}"

    def parse(text: str | float) -> float:
        x = float(text)
        if not (math.isfinite(x) and (x > low if low_open else x >= low) and (high is None or x <= high)):
            raise ValueError(f"{text!r}: expected a number in {span}")
        return x

    return parse


def speculate(text: str) -> Speculation | None:
    """--speculate: off (None), auto, mtp:K or ngram:K, as `ftc_runtime.speculative.config.Speculation`."""
    from ftc_runtime.speculative.config import parse_speculation

    return parse_speculation(text)


def output_file(text: str | Path) -> Path:
    """A file to write once the work is done: its folder must exist now, not only minutes later."""
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a folder: give a file path")
    if not path.parent.is_dir():
        raise ValueError(f"{str(path)!r}: the folder {str(path.parent)!r} does not exist")
    return path


def check_plot(path: Path | None) -> None:
    """`--plot`: matplotlib must be there to draw it; checked before the benchmark runs."""
    import importlib.util

    if path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--plot {str(path)!r}: drawing it needs matplotlib: pip install 'ftc[plot]' "
                         "(or leave --plot out)")


# The offload options that `ftc run` and `ftc bench` share (`offload_config` turns them into one).
VramBudgetArg = Annotated[int | None, typer.Option(parser=size, metavar="SIZE", help="Cap on device memory, e.g. "
                                                   "32GiB.")]
SlotsArg = Annotated[int | None, typer.Option(min=0, help="Expert slots (default: what the budget holds).")]
MissPolicyArg = Annotated[MissPolicyOpt, typer.Option(help="Where cache misses run.")]
CachePolicyArg = Annotated[CachePolicyOpt, typer.Option(help="lru, or static (the prompt's top experts).")]
CpuExpertsArg = Annotated[bool, typer.Option("--cpu-experts", help="With --device: every routed expert on the CPU, "
                                             "the rest of the model on the device.")]
PrefillChunkArg = Annotated[int | None, typer.Option(min=1, help="Prompt chunk in tokens (default: the plan's).")]
PrefillSplitArg = Annotated[str | None, typer.Option(metavar="auto|off|SHARE", help="With --device: streamed prompt "
                                                     "chunks leave part of each layer's uncached experts to the "
                                                     "CPU, which computes them in place: auto (as many as finish "
                                                     "beside the copies at the measured rates), off (copy them "
                                                     "all; the default), or a fixed share in [0, 1].")]
# `ftc run` and `ftc bench decode`: a Speculation, or None (off). Parsed when given (the default
# is not), so that a command line that leaves it out imports no torch to read it.
SpeculateArg = Annotated[object | None, typer.Option(parser=speculate, metavar="off|auto|mtp:K|ngram:K",
                                                     help="Speculative decoding: draft up to K tokens (1..8) a step, "
                                                     "with the model's own multi-token-prediction layer (mtp) or "
                                                     "from earlier text that the context's last tokens follow "
                                                     "(ngram, prompt lookup), verified in one pass; greedy output "
                                                     "is unchanged and sampled output keeps its distribution. auto: "
                                                     "mtp where the engine has the layer, else ngram, each pass "
                                                     "drafting 0 to 4 tokens as the sequence's own passes measured "
                                                     "what pays. Served, a request drafts while it decodes alone. "
                                                     "Not yet for DeepSeek-V4, whose compressed state does not roll "
                                                     "back yet. Default: off.")]

# --serve's options.
HostArg = Annotated[str, typer.Option(help="--serve: address to bind (loopback unless told).")]
PortArg = Annotated[int, typer.Option(min=1, max=65535, help="--serve: TCP port.")]
ApiKeyArg = Annotated[str | None, typer.Option(envvar="FTC_API_KEY", help="--serve: require this key "
                                               "(Authorization: Bearer KEY or x-api-key); never empty.")]
ApiKeysFileArg = Annotated[Path | None, typer.Option(help="--serve: a file of keys, one per line (# comments); "
                                                     "each user's own prefix-cache namespace.")]
AllowedHostsArg = Annotated[str | None, typer.Option(help="--serve: Host header names answered, comma-separated; "
                                                     "* for any (default: the loopback names when bound to "
                                                     "loopback, else any).")]
MaxBodyBytesArg = Annotated[int | None, typer.Option(parser=positive_size, metavar="SIZE", help="--serve: largest "
                                                     "request body accepted, e.g. 16MiB (default: 8MiB).")]
MaxBatchArg = Annotated[int, typer.Option(min=1, help="--serve: requests decoded together at most.")]
MaxPromptTokensArg = Annotated[int, typer.Option(min=1, help="--serve: longest prompt accepted.")]
MaxTokensArg = Annotated[int, typer.Option(min=1, help="--serve: most tokens one answer may have.")]
ServedModelNameArg = Annotated[str | None, typer.Option(help="--serve: the model names requests must give, "
                                                      "comma-separated (default: any name is this engine).")]
MetricsPublicArg = Annotated[bool, typer.Option("--metrics-public", help="--serve: /metrics answers without the "
                                                "API key.")]


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


LogLevelArg = Annotated[LogLevel, typer.Option(help="--serve: the log's level (info: one line per request).")]
PrefixCacheArg = Annotated[int | None, typer.Option(parser=cache_size, metavar="SIZE|auto", help="--serve: memory "
                                                    "for past sequences' KV that later prompts resume from: auto "
                                                    "(an eighth of the VRAM budget on a device, else a quarter of "
                                                    "the free host memory, at most 8GiB), a size such as 4GiB, or "
                                                    "0 (off); as much again for the hybrid models' recurrent-state "
                                                    "checkpoints.")]


def check_device(device: str) -> str:
    """`device` if this machine has it: 'cpu', or 'cuda[:N]' with that GPU present. (Without the
    check, torch fails deep inside the engine with an assertion.)"""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: expected cuda, cuda:N, or cpu (to emulate a GPU)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA GPU on this machine (--device cpu emulates one)")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def offload_config(device: str | None, vram_budget: int | None, slots: int | None, miss_policy: str = "adaptive",
                   cache_policy: str = "lru", cpu_experts: bool = False, stream_min_tokens: int | None = None,
                   prefill_split: str | None = None):
    """The OffloadConfig for --device and its options (None: every expert on the CPU)."""
    from ftc_runtime.engine import OffloadConfig
    from ftc_runtime.experts.prompt_split import parse_prefill_split

    if device is None:
        if vram_budget is not None or slots is not None or cpu_experts or stream_min_tokens is not None \
                or prefill_split is not None:
            raise ValueError("--vram-budget, --slots, --cpu-experts, --stream-min-tokens and --prefill-split need "
                             "--device (cuda, or cpu to emulate a GPU)")
        return None
    if prefill_split is not None:
        parse_prefill_split(prefill_split)  # a bad value is refused before the engine loads
    return OffloadConfig(device=check_device(device), vram_budget=vram_budget, n_slots=slots,
                         miss_policy=str(getattr(miss_policy, "value", miss_policy)),
                         cache_policy=str(getattr(cache_policy, "value", cache_policy)), cpu_experts=cpu_experts,
                         stream_min_tokens=stream_min_tokens, prefill_split=prefill_split or "off")


# `ftc run` options of one mode only: given in the other, they would be silently ignored. Every
# other option of `ftc run` is in RUN_SHARED (a test holds the three to the command's options).
SERVE_ONLY = ("host", "port", "api_key", "api_keys_file", "allowed_hosts", "max_batch", "max_prompt_tokens",
              "max_tokens", "max_body_bytes", "prefix_cache", "metrics_public", "log_level", "served_model_name")
GENERATE_ONLY = ("prompt", "prompt_file", "prompt_ids", "system", "raw", "max_new_tokens", "temperature", "top_p",
                 "top_k", "seed", "repeat_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "stop",
                 "as_json", "reprofile")
RUN_SHARED = ("engine", "device", "vram_budget", "slots", "miss_policy", "cache_policy", "cpu_experts",
              "prefill_chunk", "prefill_split", "speculate", "serve")


def check_speculation(speculation: Speculation | None, engine_dir: Path) -> None:
    """--speculate against the engine's family, before the engine loads (`Speculation.check_family`)."""
    from ftc_runtime.artifact import EngineManifest

    if speculation is not None:
        speculation.check_family(EngineManifest.read(engine_dir).spec)


def check_draft_oracle(draft_oracle: object, speculation: Speculation | None) -> None:
    """--draft-oracle replaces the drafts of a --speculate drafter, so it needs one."""
    if draft_oracle is not None and speculation is None:
        raise ValueError(f"--draft-oracle {draft_oracle}: give the drafts per pass with --speculate mtp:K, ngram:K "
                         "or auto")


def sampling_penalties(repeat: float | None, presence: float | None, frequency: float | None) -> dict:
    """--repeat-penalty, --presence-penalty and --frequency-penalty as SamplingParams' fields (None:
    the engine's default), checked before the engine loads: a bad one is one error line naming it."""
    from ftc_runtime.sampling import MAX_REPETITION_PENALTY, PENALTY_RANGE

    options = {"repetition_penalty": ("--repeat-penalty", repeat, number_in(0, MAX_REPETITION_PENALTY, True)),
               "presence_penalty": ("--presence-penalty", presence, number_in(*PENALTY_RANGE)),
               "frequency_penalty": ("--frequency-penalty", frequency, number_in(*PENALTY_RANGE))}
    out = {}
    for field, (option, value, parse) in options.items():
        try:
            out[field] = None if value is None else parse(value)
        except ValueError as e:
            raise ValueError(f"{option} {e}") from None
    return out


def check_run_mode(ctx: typer.Context, serve: bool) -> None:
    """Refuses a command-line option that the mode (--serve or not) would not use."""
    other = GENERATE_ONLY if serve else SERVE_ONLY
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if param.name in other and source is not None and source.name == "COMMANDLINE":
            raise ValueError(f"{param.opts[-1]} {'does not go with' if serve else 'needs'} --serve")


def served_names(text: str | None) -> tuple[str, ...]:
    """--served-model-name A,B: the names, checked."""
    if text is None:
        return ()
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise ValueError(f"--served-model-name {text!r}: give model names, comma-separated, none empty")
    return names


def server_config(host: str, api_key: str | None, api_keys_file: Path | None, allowed_hosts: str | None,
                  **limits: int | None) -> dict:
    """ServerConfig's arguments for `ftc run --serve` (limits left None: the server's defaults),
    checked before the engine loads."""
    from ftc_runtime.serve.app import default_allowed_hosts

    if api_key is None and os.environ.get("FTC_API_KEY") == "":
        api_key = ""  # typer reads an empty variable as unset, which would serve without a key
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or FTC_API_KEY) is empty: give a key, or none to serve without one")
    if allowed_hosts is None:
        hosts = default_allowed_hosts(host)
    else:
        hosts = tuple(h.strip() for h in allowed_hosts.split(",") if h.strip())
        if not hosts:
            raise ValueError(f"--allowed-hosts {allowed_hosts!r}: give host names (comma-separated), or * for any")
    keys = read_api_keys(api_keys_file) if api_keys_file is not None else ()
    return {"api_key": api_key, "api_keys": keys, "allowed_hosts": None if hosts is None or "*" in hosts else hosts,
            **{k: v for k, v in limits.items() if v is not None}}


def reprofile_engine(engine_dir: Path, eng, offload) -> None:
    """Measures this machine with the loaded engine, records it, and re-plans the miss split."""
    import dataclasses

    from ftc_runtime.artifact import store_profile
    from ftc_runtime.experts.miss_planner import MissPlanner
    from ftc_runtime.profile import measure_profile

    experts = eng.model.experts
    prof = measure_profile(eng.spec, eng.pool, experts.kernel, offload.device if offload else None, seconds=1.0)
    store_profile(engine_dir, dataclasses.asdict(prof))
    if offload is not None and prof.b_p is not None:
        experts.planner = MissPlanner(experts.planner.policy, prof.b_p, prof.b_h, prof.b_p_during_cpu,
                                      prof.b_h_during_copy)
    err.print(f"profile: B_H {prof.b_h} GB/s" + (f", B_P {prof.b_p} GB/s" if prof.b_p else "") + " (engine.json)")


def parse_ids(text: str, option: str = "--prompt-ids", low: int = 0) -> list[int]:
    """Comma-separated integers of at least `low`; at least one."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < low:
        raise ValueError(f"{option} {text!r}: expected comma-separated integers >= {low}, e.g. 1,2,3")
    return ids


def run_prompt(engine_dir: Path, prompt: str | None, prompt_file: Path | None, prompt_ids: str | None, raw: bool,
               system: str | None, as_json: bool) -> tuple[str | None, list[int] | None]:
    """`ftc run`'s prompt, checked before the engine loads: (text, None), (None, ids), or
    (None, None): a conversation at the terminal."""
    given = [name for name, v in (("--prompt", prompt), ("--prompt-file", prompt_file), ("--prompt-ids", prompt_ids))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one prompt: {' and '.join(given)} were both given")
    if system is not None and (raw or prompt_ids is not None):
        raise ValueError("--system is the chat's: it does not go with --raw or --prompt-ids")
    if prompt_ids is not None:
        return None, prompt_ids_for(prompt_ids, engine_dir)
    if prompt_file is not None:
        return _read_prompt(prompt_file), None
    if prompt is not None:
        return prompt, None
    if not sys.stdin.isatty():
        text = sys.stdin.read()
        if not text.strip():
            raise ValueError("stdin is empty: give the prompt there, or --prompt TEXT")
        return text, None
    if raw or as_json:
        raise ValueError(f"{'--raw' if raw else '--json'} needs a prompt: --prompt TEXT, --prompt-file PATH or "
                         "text on stdin")
    return None, None


def _read_prompt(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--prompt-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def prompt_ids_for(text: str, engine_dir: Path) -> list[int]:
    """--prompt-ids, checked against the engine's vocabulary before the engine loads."""
    from ftc_runtime.artifact import EngineManifest

    ids = parse_ids(text)
    vocab = EngineManifest.read(engine_dir).spec.vocab_size
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise ValueError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return ids


def engine_in_memory(spec: Path, random_weights: bool, seed: int, target: str, override: list[str] | None,
                     workdir: Path):
    """A benchmark engine for `spec` in `workdir`, its expert pool generated into memory."""
    from ftc.compile.pipeline import CompileOptions, compile_with_experts_in_memory

    if not random_weights:
        raise ValueError(f"{spec}: benchmarking a spec needs --random-weights (or compile an engine first)")
    opts = CompileOptions(spec, target, workdir / "engine", None, True, seed, tuple(override or ()))
    return compile_with_experts_in_memory(opts, err)


def routing_for(trace: Path | None, synthetic_locality: float | None, spec, seed: int, zipf: float = 1.0):
    """The trace a decode benchmark replays, and how the JSON names it."""
    from ftc_runtime.experts.routing_trace import RoutingTrace, synthetic_trace

    if trace is not None and synthetic_locality is not None:
        raise ValueError("give --routing-trace or --synthetic-locality, not both")
    if zipf != 1.0 and synthetic_locality is None:
        raise ValueError("--zipf shapes a synthetic trace: give --synthetic-locality too")
    if trace is not None:
        return RoutingTrace.load(trace), f"trace {trace}"
    if synthetic_locality is not None:
        t = synthetic_trace(512, len(spec.moe_layers), spec.moe.num_experts, spec.moe.top_k, synthetic_locality,
                            skew=zipf, seed=seed)
        return t, f"synthetic (locality {synthetic_locality:g}, Zipf {zipf:g}, seed {seed})"
    return None, "the model's own router"


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys of --api-keys-file: one per line, blank lines and # comments skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys-file {path}: {getattr(e, 'strerror', None) or e}") from None
    keys = tuple(k for k in (line.strip() for line in lines) if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"--api-keys-file {path}: holds no key (one per line)")
    return keys
