"""`ftc compile`: spec + target + weights → an engine directory.

A checkpoint's tokenizer is checked first, before any weight is read (checkpoint_tokenizer.py).
Stages: dense weights → experts.ftw (streamed, one expert at a time) → tokenizer → kernel sources
→ kernel build → kernel check against torch on the engine's own experts → engine.json. The engine is
assembled in a staging directory and moved into place only when every stage has passed, so a failed
compile never damages an engine that was there before.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from safetensors.torch import save_file

from ftc import __version__
from ftc.codegen.kernel_check import check_expert_kernel
from ftc.codegen.render import render_cpu_kernels, render_triton_kernels
from ftc.compile.checkpoint_tokenizer import check_checkpoint_tokenizer, control_tokenizer
from ftc.compile.fp8_checkpoint import quantize_fp8_blocks
from ftc.compile.ftw_writer import FtwWriter
from ftc.compile.hub import Source, hub_repo_name, resolve_source
from ftc.compile.spec_loader import load_spec
from ftc.compile.targets import BATCH_BUCKETS, Target, resolve_target
from ftc.compile.tokenizer_builder import build_byte_tokenizer
from ftc.compile.weights import CheckpointWeights, RandomWeights, WeightSource
from ftc_runtime.artifact import (
    CHAT_TEMPLATE_FILE,
    DENSE_FILE,
    EXPERTS_FILE,
    FORMAT,
    FORMAT_VERSION,
    LIBRARY_FILE,
    MANIFEST,
    TOKENIZER_FILE,
    Plan,
    describe_files,
)
from ftc_runtime.chat.template import ChatTemplate, ChatTemplateError
from ftc_runtime.cpu_info import missing_flags, worker_cpus
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.formats import expert_format
from ftc_runtime.io.ftw import ExpertPool, FtwHeader, read_header
from ftc_runtime.kernel_build import build_kernels
from ftc_runtime.models import family
from ftc_runtime.models.dense_layout import FP8_BLOCK, fp8_names, scale_name
from ftc_runtime.sampling import DEFAULT_FIELDS, PENALTY_FIELDS, check_defaults
from ftc_runtime.settings import settings
from ftc_runtime.spec import ModelSpec, SpecError


@dataclass(frozen=True)
class CompileOptions:
    source: Path
    target: str = "auto"
    output: Path | None = None
    checkpoint: Path | None = None
    random_weights: bool = False
    seed: int = 0
    overrides: tuple[str, ...] = ()
    quant: str | None = None  # the experts' format (a name of ftc_runtime.formats); None: the spec's or checkpoint's
    force: bool = False  # replace an engine already at `output` (anything else there is never deleted)
    name: str | None = None  # the engine's (and served) name; default: the spec's, a checkpoint's -o or repository


def make_plan(target: Target, spec: ModelSpec | None = None) -> Plan:
    # 16-row work items: 128 KiB of gate/up rows at hidden 2048, many items per thread per layer
    # for dynamic balance, few enough that the shared counter is not contended.
    plan = Plan(isa=target.isa, cpu_threads=target.cpu_threads, batch_buckets=BATCH_BUCKETS[target.isa],
                gate_up_chunk=16, down_chunk=16, prefetch_rows=2)
    if spec is None or spec.moe is None:
        return plan
    kernel = expert_format(spec.expert_format).cpu_templates.get(target.isa)
    if kernel is not None:
        plan = dataclasses.replace(plan, gate_up_chunk=kernel.work_rows, down_chunk=kernel.work_rows,
                                   prefetch_rows=kernel.prefetch_rows)
    # Streaming a whole layer moves every expert not cached; it pays once a chunk routes to nearly
    # all of them anyway: at T tokens a given expert is missed with probability (1 - k/E)^T, so
    # stream from the T at which the routed union is expected to be 95% of the layer.
    e, k = spec.moe.num_experts, spec.moe.top_k
    min_tokens = math.ceil(math.log(0.05) / math.log(1 - k / e)) if k < e else 1
    return dataclasses.replace(plan, prefill_stream_min_tokens=max(2, min_tokens))


def _weights(spec: ModelSpec, opts: CompileOptions, checkpoint: Path | None) -> WeightSource:
    if opts.random_weights:
        return RandomWeights(spec, opts.seed)
    if checkpoint is None:
        raise SpecError(f"{opts.source}: no weights: give --checkpoint DIR or --random-weights "
                        "(the spec names no checkpoint)")
    return CheckpointWeights(spec, checkpoint)


def _engine_name(opts: CompileOptions, source: Source) -> str | None:
    """A checkpoint's engine is named by --name, else by -o, else after its repository (not its
    snapshot folder, a hash); a spec YAML's keeps the spec's name unless --name gives one."""
    if opts.name is not None or not source.path.is_dir():
        return opts.name
    return opts.output.name if opts.output is not None else source.repo_name


def compile_engine(opts: CompileOptions, console: Console | None = None) -> Path:
    return _compile(opts, console, experts_in_memory=False)[0]


def compile_with_experts_in_memory(opts: CompileOptions, console: Console | None = None) -> tuple[Path, ExpertPool]:
    """Everything but experts.ftw on disk; the expert pool generated straight into host memory.
    For benchmarks of models larger than the disk: the engine loads only with the pool it returns."""
    if not opts.random_weights:
        raise SpecError("experts in memory are for --random-weights engines")
    return _compile(opts, console, experts_in_memory=True)


def _compile(opts: CompileOptions, console: Console | None, experts_in_memory: bool) -> tuple[Path, ExpertPool | None]:
    console = console or Console(stderr=True)
    repo = hub_repo_name(opts.source)
    if repo is not None:  # a download can take hours: an engine in the way is refused before it
        _check_output(opts.output or Path("build") / (opts.name or repo), opts.force)
    source = resolve_source(opts.source)
    spec, spec_checkpoint = load_spec(source.path, list(opts.overrides), opts.quant, _engine_name(opts, source))
    checkpoint = None if opts.random_weights else opts.checkpoint or spec_checkpoint
    if checkpoint is not None and not Path(checkpoint).is_dir():
        named = "--checkpoint" if opts.checkpoint else f"{source.path} (its `checkpoint:`)"
        raise SpecError(f"{spec.name} needs its checkpoint at {checkpoint}, named by {named}, which is not a "
                        f"folder: download the model's HF files there, or pass --checkpoint DIR where they are "
                        f"(--random-weights for a benchmark engine)")
    if checkpoint is not None:
        check_checkpoint_tokenizer(spec, checkpoint)
    weights = _weights(spec, opts, checkpoint)
    no_mtp, spec = weights.spec != spec, weights.spec
    target = resolve_target(opts.target)
    plan = make_plan(target, spec)
    out = opts.output or Path("build") / spec.name
    _check_output(out, opts.force)  # before the work, not only after it
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _fresh_dir(out, "partial")
    console.print(f"[bold]ftc compile[/] {spec.name} ({spec.family}) from {weights.description} "
                  f"for target {target.name} ({plan.isa}) → {out}")
    if no_mtp:
        console.print(f"{checkpoint} has no multi-token-prediction tensors: the engine has no MTP layer "
                      "(--speculate mtp is not available; ngram is)")
    if weights.extra_layers:
        skipped = ", ".join(f"{p} ({n} tensors)" for p, n in sorted(weights.extra_layers.items()))
        console.print(f"not read: {skipped}, past the spec's {spec.num_layers} layers (multi-token prediction)")
    try:
        pool = _build_engine(spec, target, plan, weights, checkpoint, staging, console, experts_in_memory)
        _replace(staging, out, opts.force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    console.print(f"[green]engine ready:[/] {out}" + (" (experts in memory)" if experts_in_memory else ""))
    return out, pool


def _build_engine(spec: ModelSpec, target: Target, plan: Plan, weights: WeightSource, checkpoint: Path | None,
                  staging: Path, console: Console, experts_in_memory: bool) -> ExpertPool | None:
    """Every stage, into the staging directory; engine.json is written last. Returns the expert
    pool when it was generated into memory instead of experts.ftw."""
    columns = (SpinnerColumn(), TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        _write_dense(weights, staging, progress, spec)
        if experts_in_memory:
            pool, hashes = _experts_in_memory(weights, spec, progress), {}
        else:
            hashes = {EXPERTS_FILE: _write_experts(weights, spec, staging, progress)}
            pool = None
        task = progress.add_task("tokenizer", total=1)
        _write_tokenizer(spec, checkpoint, staging)
        _write_chat_template(spec, checkpoint, staging)
        progress.advance(task)
        task = progress.add_task("kernel sources", total=1)
        kernels = render_cpu_kernels(spec, plan, staging / "kernels") + render_triton_kernels(spec, staging / "kernels")
        progress.advance(task)
        task = progress.add_task("kernel build", total=1)
        _, cached = build_kernels(staging / "kernels", staging / "lib", settings().cache_dir)
        progress.update(task, advance=1, description="kernel build (cached)" if cached else "kernel build")
        lacking = missing_flags(plan.isa)
        if lacking:  # compiling for another machine: the check runs when the engine loads there
            console.print(f"kernel check not run: this CPU lacks {', '.join(lacking)} ({plan.isa})")
            checks = [{"not_run": f"compiling machine lacks {', '.join(lacking)}"}]
        else:
            task = progress.add_task("kernel check", total=len(plan.batch_buckets) + 1)
            checks = _check_kernels(spec, plan, staging, pool, lambda: progress.advance(task))
    files = [*hashes, DENSE_FILE, TOKENIZER_FILE, CHAT_TEMPLATE_FILE, LIBRARY_FILE] + [k["source"] for k in kernels]
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "ftc_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "name": spec.name, "spec": spec.to_dict(), "target": target.to_dict(), "plan": plan.to_dict(),
        "weights_source": weights.description, "kernels": kernels, "kernel_check": checks,
        "experts_in_memory": experts_in_memory, "sampling": sampling_defaults(checkpoint),
        "files": describe_files(staging, files, hashes),
    }
    # allow_nan=False: the runtime refuses NaN and Infinity, which are not JSON.
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, allow_nan=False) + "\n")
    return pool


def sampling_defaults(checkpoint: Path | None) -> dict[str, float | int]:
    """The checkpoint's generation_config.json as ftc samples: its temperature, top_p, top_k and
    penalties, or greedy (with its penalties, as HF's greedy search applies them) where it says
    do_sample false; nothing without one."""
    path = checkpoint / "generation_config.json" if checkpoint is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SpecError(f"{path}: expected a JSON object")
    fields = PENALTY_FIELDS if config.get("do_sample") is False else DEFAULT_FIELDS
    defaults = {k: config[k] for k in fields if config.get(k) is not None}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    try:
        return check_defaults(defaults)
    except ValueError as e:
        raise SpecError(f"{path}: {e}") from None


def _write_dense(weights: WeightSource, staging: Path, progress: Progress, spec: ModelSpec) -> None:
    """The dense tensors as the engine stores them (`dense_layout`): bf16, and where the spec's
    dense_format is fp8 the family's projections as e4m3 codes and block scales, an FP8 release's
    own codes kept bit for bit, 16-bit weights quantized here."""
    task = progress.add_task("dense weights", total=len(family(spec.family).dense_tensor_shapes(spec)))
    fp8 = fp8_names(spec)
    tensors = {}
    for name, t in weights.dense():
        if name in fp8:
            codes, scale_inv = weights.dense_fp8(name) or quantize_fp8_blocks(t, FP8_BLOCK)
            tensors |= {name: codes.contiguous(), scale_name(name): scale_inv.float().contiguous()}
        else:
            tensors[name] = t.contiguous()
        progress.advance(task)
    save_file(tensors, str(staging / DENSE_FILE), metadata={"format": "pt"})


def _ftw_header(spec: ModelSpec) -> FtwHeader:
    """The FTW header of the spec's routed experts, in its expert format."""
    return FtwHeader.create(spec.expert_format, len(spec.expert_layers), spec.moe.num_experts, spec.hidden_size,
                            spec.moe.expert_intermediate_size)


def _write_experts(weights: WeightSource, spec: ModelSpec, staging: Path, progress: Progress) -> str:
    header = _ftw_header(spec)
    task = progress.add_task("experts → FTW", total=header.num_rows)
    writer = FtwWriter(staging / EXPERTS_FILE, header)
    for layer in spec.expert_layers:
        for expert in range(spec.moe.num_experts):
            writer.append(weights.expert(layer, expert))
            progress.advance(task)
    return writer.close()


def _experts_in_memory(weights: WeightSource, spec: ModelSpec, progress: Progress) -> ExpertPool:
    """The FTW data region built in host memory, experts generated and encoded on all cores (torch
    releases the GIL while it draws), so a 60 GB model needs no 60 GB file."""
    header = _ftw_header(spec)
    pool = ExpertPool(header, torch.empty(header.data_bytes, dtype=torch.uint8))
    task = progress.add_task("experts → memory", total=header.num_rows)

    def fill(row: int) -> None:
        layer, expert = divmod(row, header.num_experts)
        encoded = header.format.rows_of(weights.expert(spec.expert_layers[layer], expert))
        for name, dst in header.rows(pool.experts[row]).items():
            dst.copy_(encoded[name])
        progress.advance(task)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as ex:
        list(ex.map(fill, range(header.num_rows)))
    return pool


def _write_tokenizer(spec: ModelSpec, checkpoint: Path | None, staging: Path) -> None:
    """The checkpoint's tokenizer.json (checked when the compile began) with the spec's special
    tokens marked special; random weights get a byte-level one."""
    if checkpoint is not None:
        control_tokenizer(spec, checkpoint / TOKENIZER_FILE, staging / TOKENIZER_FILE)
    else:
        build_byte_tokenizer(spec, staging / TOKENIZER_FILE)


def _write_chat_template(spec: ModelSpec, checkpoint: Path | None, staging: Path) -> None:
    """The checkpoint's chat template (chat_template.jinja, else tokenizer_config.json's default
    one), else the family's; checked for syntax here so that a bad one fails the compile."""
    text, source = None, None
    if checkpoint is not None and (checkpoint / CHAT_TEMPLATE_FILE).is_file():
        source = checkpoint / CHAT_TEMPLATE_FILE
        text = source.read_text(encoding="utf-8")
    elif checkpoint is not None and (checkpoint / "tokenizer_config.json").is_file():
        source = checkpoint / "tokenizer_config.json"
        try:
            text = json.loads(source.read_text(encoding="utf-8")).get("chat_template")
        except json.JSONDecodeError as e:
            raise SpecError(f"{source}: not valid JSON ({e})") from None
        if isinstance(text, list):  # named templates: the default one
            text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
        if text is not None and not isinstance(text, str):
            raise SpecError(f"{source}: field 'chat_template' must be a string or a list of named templates")
    if text is None:
        source = family(spec.family).chat_template_path
        text = source.read_text(encoding="utf-8")
    try:
        ChatTemplate(text, str(source))
    except ChatTemplateError as e:
        raise SpecError(str(e)) from None
    (staging / CHAT_TEMPLATE_FILE).write_text(text, encoding="utf-8")


def _check_kernels(spec: ModelSpec, plan: Plan, staging: Path, pool: ExpertPool | None, tick) -> list[dict]:
    """Runs the built kernel on the engine's own experts (the written file, mapped, unless they are
    in memory) for every bucket and compares with torch."""
    if pool is None:
        header, _ = read_header(staging / EXPERTS_FILE)
        data = np.memmap(staging / EXPERTS_FILE, dtype=np.uint8, mode="c", offset=header.data_offset,
                         shape=(header.data_bytes,))
        pool = ExpertPool(header, torch.from_numpy(data))
    kernel = CpuExpertKernel(staging / LIBRARY_FILE, plan.isa, spec.hidden_size,
                             spec.moe.expert_intermediate_size, worker_cpus(plan.cpu_threads))
    results = []
    for n_tokens in plan.batch_buckets:
        results.append(check_expert_kernel(kernel, pool, spec.moe.top_k, n_tokens, seed=n_tokens,
                                           swiglu_limit=spec.moe.swiglu_limit))
        tick()
    # a prompt chunk's many tokens per expert: the tiles where the kernel has them (past its
    # threshold, a partial block), else its largest bucket over and over
    many = (kernel.tile_min or 2 * max(plan.batch_buckets)) + 19
    results.append(check_expert_kernel(kernel, pool, spec.moe.top_k, many, seed=0,
                                       swiglu_limit=spec.moe.swiglu_limit, shared_experts=True))
    tick()
    return results


def _check_output(out: Path, force: bool) -> None:
    """`-o` deletes only an ftc engine, and that only with `force`: a file, a symlink or a non-empty
    directory without an engine's engine.json is refused, with or without it."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return  # an empty directory: nothing to lose
    if out.is_symlink() or not out.is_dir() or not _is_engine(out):
        raise FileExistsError(f"{out} exists and is not an ftc engine (no {MANIFEST} of format {FORMAT!r}); "
                              "choose another -o")
    if not force:
        raise FileExistsError(f"{out} holds an engine: pass --force to replace it")


def _is_engine(directory: Path) -> bool:
    try:
        raw = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # missing, unreadable or not JSON: not an engine
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def _fresh_dir(out: Path, what: str) -> Path:
    """A new directory beside `out`, created here: a fixed name (.NAME.partial) would delete
    whatever a user keeps there."""
    while True:
        path = out.parent / f".{out.name}.{what}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _replace(staging: Path, out: Path, force: bool) -> None:
    _check_output(out, force)  # again: the directory may have changed during the compile
    if out.is_dir():
        old = _fresh_dir(out, "old")
        out.rename(old / out.name)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out)
