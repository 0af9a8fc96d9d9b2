"""`Engine`: a compiled engine directory loaded for inference: every expert on the CPU, or (with an
`OffloadConfig`) the model on a device and the experts split between its slot cache and the CPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from safetensors import SafetensorError
from safetensors.torch import load_file

from ftc_runtime.artifact import (
    DENSE_FILE,
    TRITON_EXPERT_FILE,
    ArtifactError,
    EngineManifest,
    Plan,
    check_engine,
)
from ftc_runtime.cache.base import SequenceState
from ftc_runtime.cache.prefix import PrefixCache
from ftc_runtime.chat.template import ChatTemplate
from ftc_runtime.chat.tokenizer import Tokenizer
from ftc_runtime.chat.tool_parsers import hidden_token_ids, tool_parser
from ftc_runtime.cpu_info import gpu_engine_worker_cpus, pin_this_thread, worker_cpus
from ftc_runtime.decode.graphs import decode_graphs_for
from ftc_runtime.experts.cpu import CpuExperts
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.elastic_vram import ElasticVram, cuda_memory_info
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.offload import OffloadedExperts
from ftc_runtime.experts.prompt_split import PromptSplit, parse_prefill_split
from ftc_runtime.experts.slots import GpuExpertKernels
from ftc_runtime.experts.stream_cpu import RESULT_DTYPE
from ftc_runtime.experts.vram_plan import VramPlan, plan_vram
from ftc_runtime.generation import Sequence
from ftc_runtime.io import ftw
from ftc_runtime.kernel_sets import kernel_library
from ftc_runtime.models import family
from ftc_runtime.models.dense_layout import FP8_BLOCK, StoredTensors, fp8_names, scale_name, stored_bytes
from ftc_runtime.models.layers.fp8_linear import BlockFp8, has_fp8_conversion
from ftc_runtime.profile import RateProbe
from ftc_runtime.sampling import SamplingParams
from ftc_runtime.settings import settings
from ftc_runtime.spec import ModelSpec
from ftc_runtime.speculative.config import Speculation


@dataclass(frozen=True)
class OffloadConfig:
    """The model on `device`, routed experts through a slot cache there. `device="cpu"` runs the
    same path with the CPU standing in for the GPU (for tests and machines without one)."""

    device: str = "cuda"
    vram_budget: int | None = None  # bytes; None: the device's total memory (the CPU: 8 GiB)
    n_slots: int | None = None  # overrides the slot count that the budget gives
    miss_policy: str = "adaptive"
    cache_policy: str = "lru"
    # GB/s; None: the engine's target's (preset or `ftc profile`) where they were measured for this
    # GPU, else measured where the engine loads (`RateProbe`); without a GPU none, and every miss is filled
    b_p: float | None = None
    b_h: float | None = None
    max_context: int = 4096  # tokens of KV cache the budget reserves
    prefill_overlap: bool = True  # False: stream prompt layers through one buffer, load then compute
    cpu_experts: bool = False  # every routed expert on the CPU (no slots): only activations cross PCIe
    # Prompt chunks of at least this many tokens stream whole MoE layers (None: the engine's plan);
    # shorter ones take decode's path, their misses split between fills and the CPU.
    stream_min_tokens: int | None = None
    # Decode calls planned on the device as data (`experts.device.device_plan`), the host cache written
    # back at safe points: the plan that the one-graph decode step is built on. None: on a GPU
    # (FTC_DEVICE_PLAN=0 or 1 decides instead, for comparisons and for the CPU standing in).
    device_plan: bool | None = None
    # Streamed prompt chunks: "auto" lets the CPU compute part of each layer's uncached experts in
    # place, as many as the measured rates say it finishes beside the copies (`PromptSplit`; none
    # where there are no rates); "off" copies them all; a number in [0, 1] is a fixed share.
    prefill_split: str = "off"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0  # passes after the prompt's: a decode step, or a verification of drafts
    drafted: int = 0  # speculative draft tokens verified
    accepted: int = 0  # of those, the ones the acceptance rule kept

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens given out per pass after the prompt's (1 without speculation)."""
        return (self.new_tokens - 1) / self.decode_steps if self.decode_steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0


@dataclass
class Generation:
    """Iterate to receive token ids as they are produced; `stats` is complete afterwards."""

    _tokens: Iterator[int]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[int]:
        return self._tokens


class Engine:
    def __init__(self, manifest: EngineManifest, tokenizer: Tokenizer, model, pool: ftw.ExpertPool,
                 vram: VramPlan | None = None, prefill_chunk: int | None = None,
                 chat_template: ChatTemplate | None = None):
        self.manifest, self.spec, self.tokenizer, self.model, self.pool, self.vram = (
            manifest, manifest.spec, tokenizer, model, pool, vram)
        self.prefill_chunk = prefill_chunk or manifest.plan.prefill_chunk
        self.tool_parser = family(manifest.spec.family).tool_parser  # name in tool_parsers.TOOL_PARSERS
        # The control tokens an answer's text never shows, in the CLI and the APIs alike.
        self.hidden_token_ids = hidden_token_ids(tokenizer.special_tokens, tool_parser(self.tool_parser))
        self.boundary_ids = frozenset(manifest.spec.token_id(t) for t in manifest.spec.tokens.boundaries)
        self.prefix_cache: PrefixCache | None = None
        self.elastic: ElasticVram | None = None  # a GPU engine's budget split between KV and expert slots
        self.speculation: Speculation | None = None  # `generate`'s drafts (`enable_speculation`)
        # The conversation → prompt template (engines compiled before it was stored have none).
        self.chat_template = chat_template
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill chunk = {self.prefill_chunk}: expected a number of tokens >= 1")

    @classmethod
    def load(cls, path: str | Path, show_progress: bool = False, offload: OffloadConfig | None = None,
             pool: ftw.ExpertPool | None = None, prefill_chunk: int | None = None) -> Engine:
        """Loads an engine directory; `pool` supplies the experts of an engine compiled with its
        experts in memory (benchmarks of models larger than the disk); `prefill_chunk` replaces the
        plan's prompt chunk (tokens). A damaged engine raises ArtifactError or FtwError naming the file."""
        root = Path(path)
        checked = check_engine(root)
        manifest = checked.manifest
        spec, plan = manifest.spec, manifest.plan
        cpus, background = _worker_cpus(plan, offload)
        kernel = _cpu_kernel(manifest, cpus, background)
        pool = _expert_pool(manifest, pool, show_progress)
        dense = _load_dense(manifest.path(DENSE_FILE), spec)
        fam, stored, tokenizer = family(spec.family), checked.dense, checked.tokenizer
        if offload is None:
            return cls(manifest, tokenizer, fam.model(spec, dense, CpuExperts(pool, kernel)), pool,
                       prefill_chunk=prefill_chunk, chat_template=checked.chat_template)
        _check_fp8_device(spec, torch.device(offload.device))
        vram = _vram_plan(manifest, offload, stored, pool)
        if offload.cpu_experts:
            print("ftc: --cpu-experts: every routed expert runs on the CPU; only activations cross PCIe",
                  file=sys.stderr)
            vram = dataclasses.replace(vram, n_slots=0)
        probe = RateProbe(spec, pool, kernel, torch.device(offload.device))
        planner = _miss_planner(manifest, offload, probe, vram.n_slots)
        prompt_split = _prompt_split(manifest, offload, planner, pool.header.expert_stride)
        gpu_kernels = _gpu_expert_kernels(manifest, offload.device)
        stream_min = offload.stream_min_tokens or plan.prefill_stream_min_tokens
        experts = OffloadedExperts(pool, kernel, torch.device(offload.device), vram.n_slots, planner,
                                   offload.cache_policy, gpu_kernels, stream_min, offload.prefill_overlap,
                                   _device_plan(offload),
                                   spec.moe.swiglu_limit, prompt_split, spec.mtp_layers)
        model = fam.model(spec, dense, experts, device=offload.device)
        model.decode_graphs = decode_graphs_for(model, fam.decode_graphs, settings().decode_graphs,
                                                settings().torch_compile, settings().fused_body)
        engine = cls(manifest, tokenizer, model, pool, vram, prefill_chunk, checked.chat_template)
        if not offload.cpu_experts and offload.n_slots is None:  # an explicit slot count stays fixed
            device = torch.device(offload.device)
            engine.elastic = ElasticVram(vram, experts, cuda_memory_info(device) if device.type == "cuda" else None)
        return engine

    def _check_ids(self, ids: list[int]) -> torch.Tensor:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
        return torch.tensor(ids, dtype=torch.long)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits of every position of `ids` in one fresh sequence: [len(ids), vocab] fp32."""
        return self.prefill(self._check_ids(ids), self.model.new_cache(), all_logits=True)

    def default_prefix_cache_bytes(self) -> int:
        """The prefix cache's KV budget for a server or a conversation: an eighth of the device
        budget on a GPU engine (the elastic split gives the rest to expert slots), else a quarter of
        the host memory left after loading, at most 8 GiB. The hybrid models' checkpoints get as
        much again, in host memory."""
        if self.vram is not None:
            return self.vram.budget // 8
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(available // 4, 8 << 30)

    def enable_prefix_cache(self, kv_budget: int, checkpoint_budget: int) -> PrefixCache:
        """Keeps past sequences' keys and values, and for models whose state replaces their past
        (`ModelSpec.resumes_at_checkpoints`) that state after each of the spec's boundary tokens,
        so that `generate` resumes a prompt after its longest cached prefix (budgets in bytes)."""
        self.prefix_cache = PrefixCache(kv_budget, checkpoint_budget, self.spec.resumes_at_checkpoints)
        return self.prefix_cache

    def enable_speculation(self, speculation: Speculation | None) -> None:
        """`generate` drafts tokens and verifies them in one pass per step (None: off), and so does
        the server's scheduler for a request that decodes alone (`Speculation.check_family`:
        `mtp` needs the engine's MTP layer), and `auto` takes the engine's drafter."""
        self.speculation = speculation.for_spec(self.spec) if speculation is not None else None

    def rebalance(self, needs: list[tuple[object, int]]) -> None:
        """A safe point: fits the expert slots to the budget left by these sequences' caches
        (each to hold the given number of tokens) and the prefix cache's KV (its checkpoints live
        in host memory); a no-op without a budget."""
        if self.elastic is None:
            return
        prefix = self.prefix_cache
        kv = sum(cache.bytes_for(n) for cache, n in needs)
        self.elastic.rebalance(kv + (prefix.kv_used if prefix else 0))

    def boundaries_in(self, ids: list[int]) -> tuple[int, ...]:
        """Indices of the spec's boundary tokens in `ids`: where a hybrid model's state is kept."""
        return tuple(i for i, t in enumerate(ids) if t in self.boundary_ids)

    def prefill(self, ids: torch.Tensor, cache: SequenceState, all_logits: bool = False, checkpoints: bool = False,
                between_layers: Callable[[], None] | None = None,
                hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Runs the prompt `ids` after the cache's tokens in chunks of `prefill_chunk` tokens;
        returns the logits of its last token [1, vocab] (every token's with all_logits). With
        `checkpoints` (a hybrid model), the linear layers' state after every boundary token goes
        into `cache.checkpoints`, taken inside the chunks. `between_layers` (called after each
        layer) may raise to abandon the pass. `hidden` (a model with an MTP layer): each chunk's
        final hidden states are appended to it."""
        outs, more = [], {} if hidden is None else {"hidden": hidden}
        for a in range(0, ids.numel(), self.prefill_chunk):
            chunk = ids[a:a + self.prefill_chunk]
            at = self.boundaries_in(chunk.tolist()) if checkpoints else ()
            outs.append(self.model.forward(chunk, cache, all_logits, checkpoint_at=at, between_layers=between_layers,
                                           **more))
        return torch.cat(outs) if all_logits else outs[-1]

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams | None = None, stop_at_eos: bool = True) -> Generation:
        """One request run to its end through the steps that the server's scheduler runs
        (`generation.Sequence`): its tokens as they come. Leaving the iteration early ends it,
        what it ran kept in the prefix cache."""
        self._check_ids(prompt_ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: expected a number >= 0")
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        stop = frozenset(self.spec.eos_token_ids) if stop_at_eos else frozenset()
        seq = Sequence(list(prompt_ids), max_new_tokens, sampling or SamplingParams(), stop,
                       speculation=self.speculation)
        return Generation(self._run(seq, stats), stats)

    def _run(self, seq: Sequence, stats: GenerationStats) -> Iterator[int]:
        """Drives `seq` alone: its prompt in the engine's chunks, then a step at a time, each giving
        out one token or (speculating) several, one by one."""
        if seq.max_new_tokens == 0:
            return
        seq.start(self)
        try:
            t0 = time.perf_counter()
            self.rebalance([seq.kv_need()])  # alone, one safe point fits the slots to the whole prompt
            stats.reused_tokens = seq.reused_tokens
            token = None
            while token is None:
                token = seq.read_prompt(self, self.prefill_chunk)
            stats.prefill_s = time.perf_counter() - t0
            t0, tokens = time.perf_counter(), [token]
            while True:
                for token in tokens:
                    end = seq.accept(token)
                    stats.new_tokens, stats.decode_s = seq.produced, time.perf_counter() - t0
                    yield token
                    if end is not None:
                        return
                self.rebalance([seq.kv_need()])
                tokens = seq.step(self)
                stats.decode_steps, stats.drafted, stats.accepted = stats.decode_steps + 1, seq.drafted, seq.accepted
        finally:
            seq.finish()  # kept even when interrupted (the terminal chat's Ctrl-C): the next turn resumes there


def _expert_pool(manifest: EngineManifest, pool: ftw.ExpertPool | None, show_progress: bool) -> ftw.ExpertPool:
    """The engine's expert pool: `pool` where given (an engine compiled with its experts in
    memory has no file to load), else experts.ftw read into host memory; its shape checked."""
    if manifest.experts_in_memory and pool is None:
        raise ArtifactError(f"{manifest.root}: compiled with its experts in memory (a benchmark engine); "
                            "it has no experts.ftw to load")
    if pool is None:
        pool = _load_pool(manifest, show_progress)
    spec, h = manifest.spec, pool.header
    if (h.num_moe_layers, h.num_experts) != (len(spec.expert_layers), spec.moe.num_experts):
        raise ftw.FtwError(f"{manifest.path(manifest.expert_files[0])}: holds {h.num_moe_layers} MoE layers × "
                           f"{h.num_experts} experts, the spec needs {len(spec.expert_layers)} × "
                           f"{spec.moe.num_experts}")
    return pool


def _rates(manifest: EngineManifest, offload: OffloadConfig) -> tuple[float, float] | None:
    """(B_P, B_H): the options', else the target's; None where a CPU-only target has none."""
    b_p, b_h = offload.b_p or manifest.target.get("b_p"), offload.b_h or manifest.target.get("b_h")
    return None if b_p is None or b_h is None else (b_p, b_h)


def _miss_planner(manifest: EngineManifest, offload: OffloadConfig, probe: RateProbe, slots: int) -> MissPlanner:
    """The miss split at the machine's rates: the options' (explicit rates replace the whole
    profile), the engine's where they were measured for this GPU, else measured here (`probe`,
    where the engine has expert slots on a GPU); a CPU-only target has none, and every miss is filled."""
    if offload.b_p is not None or offload.b_h is not None:
        b_p, b_h = _rates(manifest, offload) or (1.0, 1.0)
        return MissPlanner(offload.miss_policy, b_p, b_h)
    target = manifest.target
    device = torch.device(offload.device)
    elsewhere = _rates_elsewhere(target, device) if slots and device.type == "cuda" else None
    rates = _measured_rates(elsewhere, probe) if elsewhere else None
    if rates is not None:
        return MissPlanner(offload.miss_policy, rates["b_p"], rates["b_h"], rates["b_p_during_cpu"],
                           rates["b_h_during_copy"])
    b_p, b_h = _rates(manifest, offload) or (1.0, 1.0)
    return MissPlanner(offload.miss_policy, b_p, b_h, target.get("b_p_concurrent"), target.get("b_h_concurrent"))


def _rates_elsewhere(target: dict, device: torch.device) -> str | None:
    """Why the engine's recorded rates are not this machine's GPU's, in words; None where they are."""
    here = torch.cuda.get_device_name(device)
    if target.get("b_p") is None or target.get("b_h") is None:
        return f"the engine records no bandwidths (target {target.get('name')}) for this {here}"
    if target.get("gpu") != here:
        return f"the engine's bandwidths are target {target.get('name')}'s ({target.get('gpu')}), not this {here}'s"
    return None


def _measured_rates(elsewhere: str, probe: RateProbe) -> dict[str, float] | None:
    """This machine's rates (`probe`); None, said, where they could not be measured."""
    try:
        rates = probe.measure()
    except (ValueError, RuntimeError) as e:
        print(f"ftc: {elsewhere}, and measuring them here failed ({e}); the engine's are used", file=sys.stderr)
        return None
    print(f"ftc: {elsewhere}: measured here, B_P {rates['b_p']} and B_H "
          f"{rates['b_h']} GB/s, beside each other {rates['b_p_during_cpu']} and {rates['b_h_during_copy']} "
          "(`ftc profile ENGINE --store` records them in the engine)", file=sys.stderr)
    return rates


def _prompt_split(manifest: EngineManifest, offload: OffloadConfig, planner: MissPlanner,
                  expert_bytes: int) -> PromptSplit | None:
    """The CPU's share of streamed prompt layers (`OffloadConfig.prefill_split`) at the planner's
    rates while both run; `auto` without rates (a CPU target where none were measured) copies every expert."""
    mode = parse_prefill_split(offload.prefill_split)
    if mode is None or (mode == "auto" and _rates(manifest, offload) is None and not planner.measured_concurrency):
        return None
    copy, cpu = planner.rates()
    spec = manifest.spec
    return PromptSplit(expert_bytes, spec.moe.top_k, spec.moe.num_experts, copy, cpu, max(manifest.plan.batch_buckets),
                       share=None if mode == "auto" else mode, copy_alone_gbps=planner.b_p,
                       token_bytes=spec.hidden_size * RESULT_DTYPE.itemsize)


def _device_plan(offload: OffloadConfig) -> bool:
    """Whether decode is planned on the device as data: OffloadConfig's word, else FTC_DEVICE_PLAN's,
    else wherever the device is a GPU (there each decode step is then one CUDA graph)."""
    if offload.device_plan is not None:
        return offload.device_plan
    setting = settings().device_plan
    return torch.device(offload.device).type == "cuda" if setting is None else setting


def _worker_cpus(plan: Plan, offload: OffloadConfig | None) -> tuple[list[int], bool]:
    """The CPU expert workers' cores, and whether they run in the background (a GPU engine)."""
    cpus = worker_cpus(settings().num_threads or plan.cpu_threads)
    background = offload is not None and torch.device(offload.device).type == "cuda" and len(cpus) > 1
    if background:
        # The thread that drives the GPU needs a core of its own: a worker sharing it waits a
        # scheduler time slice at every barrier. On a machine of 8 cores or more a second one
        # stays free for everything else that runs (the CUDA driver's threads, the OS). The rest
        # run the CPU experts in the background. The thread itself is left to the scheduler,
        # which finds it a free core: pinning it there was slower (docs/performance.md,
        # "Measured reasons"), and threads started later would inherit the pin.
        if settings().pin_gpu_thread:
            pin_this_thread(cpus[0])
        cpus = gpu_engine_worker_cpus(cpus)
        # That thread's own torch CPU ops (staging, small copies) stay on its core: spread over
        # torch's threads they would wait a time slice for each of the busy cores.
        torch.set_num_threads(1)
    return cpus, background


def _cpu_kernel(manifest: EngineManifest, cpus: list[int], background: bool) -> CpuExpertKernel:
    """The engine's kernel library (`kernel_library`); one that the dynamic loader refuses, or that
    lacks the kernel's symbols, is a damaged file (KernelError stays for a library built for other
    shapes or CPUs)."""
    path, isa = kernel_library(manifest)
    spec = manifest.spec
    try:
        return CpuExpertKernel(path, isa, spec.hidden_size, spec.moe.expert_intermediate_size, cpus, background)
    except (OSError, AttributeError) as e:
        raise ArtifactError(f"{path}: not a loadable ftc kernel library ({' '.join(str(e).split())})") from None


def _load_dense(path: Path, spec: ModelSpec) -> dict[str, torch.Tensor | BlockFp8]:
    """The dense tensors by name, each FP8 weight and its scales as one `BlockFp8`."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:  # check_engine read its header: this is damage since then
        raise ArtifactError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None
    for name in fp8_names(spec):
        tensors[name] = BlockFp8(tensors[name], tensors.pop(scale_name(name)), FP8_BLOCK)
    return tensors


def _check_fp8_device(spec: ModelSpec, device: torch.device) -> None:
    """FP8 projections need a GPU whose Triton converts e4m3 (compute capability 8.9 on): on an
    older one each decode step would dequantize every weight again."""
    if fp8_names(spec) and device.type == "cuda" and not has_fp8_conversion(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{spec.name}: its projections are FP8 (dense_format fp8), which this GPU (compute "
                         f"capability {major}.{minor}) reads only from 8.9 on (Ada, Hopper, Blackwell): compile "
                         "the engine with --dense-format bf16 for it")


def _load_pool(manifest: EngineManifest, show_progress: bool) -> ftw.ExpertPool:
    console = Console(stderr=True)
    with Progress(TextColumn("loading experts"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, disable=not (show_progress and console.is_terminal), transient=True) as bar:
        task = bar.add_task("experts", total=sum(manifest.files[r]["bytes"] for r in manifest.expert_files))
        return ftw.load(manifest.experts_source(), on_bytes=lambda n: bar.advance(task, n))


def _gpu_expert_kernels(manifest: EngineManifest, device: str) -> GpuExpertKernels | None:
    """The engine's generated Triton expert kernels on a CUDA device; None elsewhere (torch then)."""
    if torch.device(device).type != "cuda":
        return None
    # Through the manifest: the source it runs must be a listed (so hashed) file inside the engine.
    source = manifest.path(TRITON_EXPERT_FILE)
    spec = importlib.util.spec_from_file_location("ftc_engine_expert_ffn", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = ("expert_ffn", "expert_pair_outputs", "grouped_expert_ffn")
    missing = [name for name in names if not callable(getattr(module, name, None))]
    if missing:
        raise ArtifactError(f"{source}: defines no function {missing[0]}")
    return GpuExpertKernels(*(getattr(module, name) for name in names))


def _vram_plan(manifest: EngineManifest, cfg: OffloadConfig, stored: StoredTensors, pool: ftw.ExpertPool) -> VramPlan:
    device = torch.device(cfg.device)
    budget = cfg.vram_budget
    if budget is None:
        budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 8 << 30
    plan = plan_vram(manifest.spec, stored_bytes(stored), budget, pool.header.expert_stride, pool.header.num_rows,
                     cfg.max_context)
    if cfg.n_slots is not None:
        if not 0 <= cfg.n_slots <= plan.n_slots:
            raise ValueError(f"--slots {cfg.n_slots}: the budget holds 0 to {plan.n_slots} expert slots")
        plan = dataclasses.replace(plan, n_slots=cfg.n_slots)
    return plan
