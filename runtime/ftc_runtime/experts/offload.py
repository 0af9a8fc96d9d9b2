"""`OffloadedExperts`: routed experts served from a device-side slot cache (`SlotStore`), with the
misses of each layer split between fills (host→device copies into LRU victims) and in-place CPU
computation.

The device is any `torch.device`. On a machine without a GPU it is the CPU, and every part of the
path (cache, split, fills as plain copies, merge) runs and is tested; only speed needs a GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftc_runtime.decode.cpu_doorbell import CpuDoorbell
from ftc_runtime.decode.device_plan import CacheTables, LayerPlan, PlanRule, plan_layer
from ftc_runtime.decode.timeline import DeviceTimeline
from ftc_runtime.experts.base import DeviceRoutingHook, ExpertBackend, Routing
from ftc_runtime.experts.cache import CachePolicy, ExpertCache
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.layer_stream import LayerStream, stream_slots
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.prompt_split import PromptSplit
from ftc_runtime.experts.slots import GpuExpertKernels, SlotStore
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.experts.stream_cpu import StreamCpuPart
from ftc_runtime.experts.token_plan import TokenPlanner
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.io.host_memory import MappedHost, mapped_address

if TYPE_CHECKING:  # Triton's: imported only beside a GPU
    from ftc_runtime.decode.device_step import DeviceStep


@dataclass(frozen=True)
class _TokenPath:
    """The fixed buffers of one-token calls (CUDA graphs hold their addresses) and their planner."""

    planner: TokenPlanner
    staged: torch.Tensor  # [1, hidden + 2k] fp32 on the host: x, ids, weights
    x: torch.Tensor  # [1, hidden] fp32 on the device
    device_out: torch.Tensor  # [1, hidden] fp32 on the device: the hits and fills
    cpu_out: torch.Tensor  # [1, hidden] fp32 on the host: the CPU experts
    pairs: torch.Tensor  # [3, k] int32 on the device: the planner's pairs, copied


PLANNED_TOKENS = 16  # the largest call that `device_plan` plans on the device: decode's batch buckets


class OffloadedExperts(ExpertBackend):
    """Per MoE layer call: `stage` queues one device→host copy of the layer's input and routing
    (CUDA graphs capture it); `launch_staged` waits for it (the one sync: the device's queue is
    then empty, so fills need no stream of their own), looks the experts up, splits the misses,
    starts the CPU experts in the background at once, and queues the fills and then the hits +
    fills on the device; `finish_staged` waits for the CPU part. One token (decode) is planned by
    one native call (`TokenPlanner`) and its device part is one CUDA graph; several tokens take
    the general path here. Buffers for one token are sized once and never move (graphs hold their
    addresses); a buffer is reused by the next call only after that call's sync, which orders it
    after every copy of this one.

    `device_plan`: calls of up to PLANNED_TOKENS tokens are planned on the device as data
    (`decode.device_plan`: the plan a one-graph decode step holds) and carried out from it; the
    device's copy of the cache tables is then ahead of `ExpertCache`, which is brought up to date
    at the next safe point (any read of `cache`, a resize, a streamed prompt chunk). Where the CPU
    kernel has a background pool (beside a GPU), the plan's CPU job goes through the CPU doorbell
    (`decode.cpu_doorbell`), which holds the pool until a call takes the host path."""

    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel, device: torch.device, n_slots: int,
                 planner: MissPlanner, cache_policy: CachePolicy = "lru", kernels: GpuExpertKernels | None = None,
                 stream_min_tokens: int | None = None, stream_overlap: bool = True, device_plan: bool = False,
                 swiglu_limit: float = 0.0, prompt_split: PromptSplit | None = None):
        h = pool.header
        self.pool, self.kernel, self.planner = pool, kernel, planner
        # The slots, their cache and the engine's generated device kernels (None: torch).
        self.store = SlotStore(pool, device, n_slots, cache_policy, kernels, swiglu_limit)
        self.device, self.on_gpu, self.num_experts = self.store.device, self.store.on_gpu, h.num_experts
        self.hidden = h.hidden
        self._stats = OffloadStats(self.device)
        self.prompt_counts = np.zeros(h.num_rows, dtype=np.int64)  # static policy: routed ids of the prompt
        self._token: _TokenPath | None = None  # built at the first one-token call
        self.native_token_plan = True  # False: one-token calls take the general path (tests compare both)
        self._token_graph: torch.cuda.CUDAGraph | None = None
        self._token_device_calls = 0
        self._buffers: dict[tuple[str, bool], torch.Tensor] = {}
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        # Prompt chunks of at least stream_min_tokens (None: never) stream whole layers when the
        # cache can lend the layer buffers; else their routed experts load on demand. With a
        # prompt split the CPU computes part of each streamed layer's uncached experts in place.
        self.stream_min_tokens, self.stream_overlap = stream_min_tokens, stream_overlap
        self.prompt_split = prompt_split
        self._stream: LayerStream | None = None
        self._said_no_stream = False
        self._said_host_step: set[str] = set()  # why decode took the host path, each said once
        self._plan_s = self._fills_s = 0.0  # host time of the current call's planning and fills
        self.device_plan = device_plan
        self._plan_layer, self._gather_fills, self._mapped_rows = plan_layer, None, None
        if device_plan and self.on_gpu:
            self._use_device_kernels(pool)
        self._tables: tuple[CacheTables, PlanRule] | None = None  # the device plan's cache tables and rule
        self._tables_newer = False  # they hold state that the host cache lacks
        self._host_touched = True  # the host cache may have changed since they took its state
        self._device_step: DeviceStep | None = None  # whole-step decode graphs: the MoE layers' device part
        self._device_step_ran = False  # it ran since its counts were last folded into `stats`
        self.device_step_active = False  # the current decode step runs its MoE layers on the device
        self.generation = 0  # bumped when the slots or the device step's buffers change: graphs holding them are stale
        self._doorbell: CpuDoorbell | None = None
        self._rung: tuple[int, int] | None = None  # the doorbell job of the current call and its tokens
        self._on_device_call: tuple[torch.Tensor, ...] = ()  # a device step's staged x, ids, weights

    @property
    def cache(self) -> ExpertCache:
        """Which expert each slot holds (`resize` replaces it), up to date: a read is a safe point,
        where the device's tables, if ahead, are written back."""
        if self._tables_newer:
            self._tables[0].write_to(self.store.cache)
            self._tables_newer = False
        self._host_touched = True  # whoever reads it may change it
        return self.store.cache

    @property
    def split_bias(self) -> float:
        """Where the device steps' waits have moved the split (`PlanRule.bias`; reads the device)."""
        return float(self._tables[1].bias) if self._tables is not None else 0.0

    @property
    def n_slots(self) -> int:
        """The slot count, without a safe point (`cache` writes the device's tables back)."""
        return self.store.cache.n_slots

    @property
    def stats(self) -> OffloadStats:
        """What the path did; the device steps' counts are folded in when read."""
        if self._device_step_ran:
            self._device_step.fold_into(self._stats)
            self._device_step_ran = False
        return self._stats

    @stats.setter
    def stats(self, value: OffloadStats) -> None:
        if self._device_step_ran:  # counts of the steps before: dropped with the old statistics
            self._device_step.fold_into(OffloadStats(self.device))
            self._device_step_ran = False
        self._stats = value

    def resize(self, n_slots: int) -> None:
        """Rebuilds the slot cache with n_slots slots at a safe point (no CPU job, copy or kernel
        in flight), keeping the most recently used experts that fit (`SlotStore.resize`); misses
        refill it as usual."""
        _ = self.cache  # the device's tables, if ahead, written back first
        self.store.resize(n_slots)
        # The token planner and its graph hold the old arrays' and slots' addresses.
        self._token, self._token_graph, self._token_device_calls, self._stream = None, None, 0, None
        self._tables, self._tables_newer = None, False
        self._drop_device_step()
        self.generation += 1

    @property
    def recent_steps(self) -> int:
        """The planner's recent window in cache steps (a token takes one per MoE layer); 0 but
        for the adaptive split."""
        if self.planner.policy != "adaptive":
            return 0
        return self.planner.recent_tokens * self.pool.header.num_moe_layers

    @property
    def stream_slots(self) -> int:
        """Slots that streaming a prompt chunk's layers borrows: one or two full layers."""
        return stream_slots(self.num_experts, self.stream_overlap)

    def begin_pass(self, n_tokens: int, prompt: bool = True,
                   known_routes: Mapping[int, np.ndarray] | None = None) -> None:
        """A prompt chunk of n_tokens is streamed layer by layer when it is long enough and the
        cache can lend the buffers (LRU policy only: the static set is never replaced); a decode
        batch never is. Either way a pass left unfinished (a failed or abandoned chunk) is dropped
        here, once the device's queue waits for its copies still in flight (their slots count as
        filled). The layers of `known_routes` stream only their routed experts, queued from the
        start (a routing hook, which replaces the router's choice, voids them)."""
        if self._stream is not None:
            self._stream.abandon()
        self._stream = None
        if not prompt or self.stream_min_tokens is None or n_tokens < self.stream_min_tokens \
                or self.cache.policy != "lru":
            return
        if self.cache.n_slots < self.stream_slots:
            if not self._said_no_stream:
                print(f"ftc: prefill loads routed experts on demand: streaming whole layers needs "
                      f"{self.stream_slots} expert slots, the VRAM budget gives {self.cache.n_slots}",
                      file=sys.stderr)
                self._said_no_stream = True
            return
        cpu = None
        if self.prompt_split is not None:
            self._close_doorbell()  # the CPU part starts the kernel itself
            cpu = StreamCpuPart(self.kernel, self.pool.experts, self.prompt_split,
                                lambda name, t, width, dtype, zeroed: self._buffer(name, t, width, dtype=dtype,
                                                                                   zeroed=zeroed), self.stats,
                                n_tokens, self.device)
        self._stream = LayerStream(self.store, self.stats, self.stream_overlap,
                                   known_routes if self.routing is None else None, cpu, n_tokens)

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int = 0) -> torch.Tensor:
        if self._stream is not None and ids.shape[0] > 1:
            if self.routing is not None:  # the hook sees the router's choice on the host (a sync)
                host_ids, host_w = self.routed(moe_layer, first_position, ids.cpu().numpy().astype(np.int64),
                                               weights.float().cpu().numpy())
                ids, weights = torch.from_numpy(host_ids).to(x.device), torch.from_numpy(host_w).to(x.device)
            out = self._stream.forward(moe_layer, x, ids, weights)
            if moe_layer == self.pool.header.num_moe_layers - 1:
                self._stream = None  # the chunk's last MoE layer
            return out
        self.stage(x, ids, weights)
        return self.forward_staged(moe_layer, ids.shape[0], ids.shape[1], first_position)

    def stage(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Queues x (fp32), ids and weights into one device buffer [T, hidden + 2k] and its copy to
        the host (ids are exact in fp32 below 2^24). Capturable in a CUDA graph. In a device step
        they are only kept: `run_staged_on_device`, next in the same graph, reads them where they are."""
        if self.device_step_active:
            self._on_device_call = (x, ids, weights)
            return
        (t, hidden), k = x.shape, ids.shape[1]
        packed = self._buffer("in", t, hidden + 2 * k, self.device)
        packed[:, :hidden].copy_(x)
        packed[:, hidden:hidden + k].copy_(ids)
        packed[:, hidden + k:].copy_(weights)
        if self.on_gpu:
            self._buffer("in_host", t, hidden + 2 * k).copy_(packed, non_blocking=True)

    def forward_staged(self, moe_layer: int, t: int, k: int, first_position: int = 0) -> torch.Tensor:
        """The routed experts of the call that `stage` queued: T tokens, k experts each."""
        self.launch_staged(moe_layer, t, k, first_position)
        on_device, on_cpu = self.finish_staged()
        return on_device + on_cpu.to(self.device, non_blocking=True)

    def token_outputs(self, t: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where decode calls of t tokens leave their two parts ([t, hidden] fp32, on the device
        and on the host): their sum is the layer's output. Fixed buffers, for CUDA graphs to read
        (a batch's: one of PLANNED_TOKENS rows, never regrown). In a device step the device part
        holds the whole output (the host part: None)."""
        if t == 1:
            device_out = self._buffer("device_out", 1, self.hidden, self.device)
        else:
            device_out = self._buffer("batch_out", PLANNED_TOKENS, self.hidden, self.device)[:t]
        return device_out, None if self.device_step_active else self._buffer("cpu_out", t, self.hidden)

    def device_step_ready(self, t: int = 1) -> bool:
        """Whether a decode step of t tokens can run its MoE layers on the device in one graph:
        the device plan on a GPU, t within its calls, no static cache still counting its prompt,
        and none of `_device_step_lacks`. Where the plan is on and something lacks, decode takes
        the host path, and says why once."""
        cache = self.store.cache
        if not (self.device_plan and self.on_gpu and t <= PLANNED_TOKENS) or (
                cache.policy == "static" and not cache.frozen):
            return False
        lacking = self._device_step_lacks()
        if lacking is not None and lacking not in self._said_host_step:
            print(f"ftc: decode steps take the host path (a host round trip per MoE layer): {lacking}",
                  file=sys.stderr)
            self._said_host_step.add(lacking)
        return lacking is None

    def _device_step_lacks(self) -> str | None:
        """What the one-graph device step lacks here, in words; None: nothing."""
        if self._gather_fills is None:
            return "the expert pool is not mapped into the device (it could not be pinned)"
        if not self.kernel.background:
            return "the CPU expert kernel has no background worker pool (one CPU core)"
        if self.store.kernels is None:
            return "the engine has no generated device expert kernels"
        if self.routing is not None and not isinstance(self.routing, DeviceRoutingHook):
            return f"a routing hook ({type(self.routing).__name__}) that routes on the host"
        return None

    def begin_device_step(self, k: int) -> None:
        """Host work before a device step (eager or replayed): the tables take the host cache's
        state if it changed, the doorbell is open, the device's job numbers are current."""
        tables, rule = self._plan_tables(k)
        if self._doorbell is None:
            self._open_doorbell(k)
        if self._device_step is None or self._device_step.tables is not tables:
            from ftc_runtime.decode.device_step import DeviceStep  # Triton: only beside a GPU

            with torch.inference_mode(False):  # its counters are reset where stats are read, in any mode
                self._device_step = DeviceStep(self.store, self.planner, self._doorbell, self._mapped_rows, tables,
                                               rule)
            self.generation += 1  # a new mailbox and counters: graphs holding the old ones are stale
        self._device_step.before_replay()
        self._device_step_ran = True
        self.device_step_active = True

    def end_device_step(self) -> None:
        self.device_step_active = False

    def run_staged_on_device(self, moe_layer: int, k: int, position: torch.Tensor,
                             timeline: DeviceTimeline | None = None) -> None:
        """The decode call `stage` queued (t tokens, one per sequence, at `position`: int64 [t] on
        the device), carried out on the device alone (`DeviceStep`): no host work, so that the
        step's graph holds it; its output lands in `token_outputs(t)[0]`. `timeline`: its phases
        marked."""
        x, ids, weights = self._on_device_call
        if self.routing is not None:  # a `DeviceRoutingHook` (device_step_ready)
            ids, weights = self.routing.route_on_device(moe_layer, position, ids, weights)
        out = self.token_outputs(x.shape[0])[0]
        self._device_step.run(moe_layer * self.num_experts, x, ids, weights, out, timeline, first=moe_layer == 0,
                              last=moe_layer == self.pool.header.num_moe_layers - 1)

    def launch_staged(self, moe_layer: int, t: int, k: int, first_position: int = 0) -> None:
        """Plans the staged call and starts both parts; `finish_staged` returns them."""
        clock = self.stats.host_s
        t0 = time.perf_counter()
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        clock["sync"] += t1 - t0
        host_cache = self.store.cache  # not `cache`: that would write the device's tables back
        static_counting = host_cache.policy == "static" and not host_cache.frozen
        if self.device_plan and t <= PLANNED_TOKENS and self.routing is None and not static_counting:
            self._launch_planned(moe_layer, t, k)
        elif t == 1 and self.native_token_plan and not static_counting:
            self._close_doorbell()  # the host path starts the CPU kernel itself
            self._launch_token(moe_layer, k, first_position)
        else:
            self._close_doorbell()
            self._launch_general(moe_layer, t, k, first_position)
        clock["launch"] += time.perf_counter() - t1 - self._plan_s - self._fills_s

    def finish_staged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device part, CPU part) of the launched call, once the CPU part is done."""
        t0 = time.perf_counter()
        if self._rung is not None:
            (seq, t), self._rung = self._rung, None
            self._doorbell.wait(seq)
            self._outputs[1].copy_(self._doorbell.out[:t])
        else:
            self.kernel.wait()
        t1 = time.perf_counter()
        self.stats.host_s["cpu_wait"] += t1 - t0
        self.stats.cpu_s += t1 - self._cpu_t0
        return self._outputs

    def end_of_prompt(self) -> None:
        """Static policy: pins the experts the prompt routed to most, once."""
        if self.cache.policy != "static" or self.cache.frozen:
            return
        order = np.argsort(-self.prompt_counts, kind="stable")
        chosen = order[: self.cache.n_slots]
        chosen = chosen[self.prompt_counts[chosen] > 0]
        slots = self.cache.pin(chosen)
        self._copy_rows(slots, chosen)

    def _launch_token(self, moe_layer: int, k: int, first_position: int) -> None:
        t0 = time.perf_counter()
        tok = self._token or self._make_token_path(k)
        if self.routing is not None:
            arr, h = tok.staged.numpy(), self.hidden
            ids, w = self.routed(moe_layer, first_position, arr[:, h:h + k].astype(np.int64), arr[:, h + k:])
            arr[:, h:h + k], arr[:, h + k:] = ids, w
        self._cpu_t0 = time.perf_counter()
        n_fill = tok.planner.plan(moe_layer * self.num_experts, allow_fills=self.cache.policy == "lru")
        hits, fills, cpu = tok.planner.counts.tolist()
        self._count(hits, fills, cpu)
        self._plan_s = time.perf_counter() - t0
        self.stats.host_s["plan"] += self._plan_s
        self._copy_rows(tok.planner.fills[1, :n_fill], tok.planner.fills[0, :n_fill])
        self._outputs = (tok.device_out, tok.cpu_out)
        with self.stats.compute.measure():
            self._token_device_part(tok, hits + fills)

    def _make_token_path(self, k: int) -> _TokenPath:
        staged = self._staged_host(1, k)
        device_out, cpu_out = self.token_outputs()
        planner = TokenPlanner(self.kernel, self.pool.experts, self.cache, self.planner, k, staged, cpu_out,
                               self.on_gpu, self.recent_steps)
        x = self._buffer("in", 1, self.hidden + 2 * k, self.device)[:, :self.hidden]
        pairs = torch.zeros(3, k, dtype=torch.int32, device=self.device)
        self._token = _TokenPath(planner, staged, x, device_out, cpu_out, pairs)
        return self._token

    def _token_device_part(self, tok: _TokenPath, n_pairs: int) -> None:
        """One token's hits and fills from the slots into `device_out`: on a GPU with the engine's
        kernel, one CUDA graph over all k pair entries (unused ones skipped), captured at the
        second call (the first compiles the kernel); elsewhere torch over the n_pairs used."""
        if not self.on_gpu or self.store.kernels is None:
            tok.device_out.zero_()
            if n_pairs:
                self.store.experts_on_device(tok.x, tok.planner.pairs[:, :n_pairs].to(self.device), tok.device_out)
            return
        if self._token_graph is not None:
            self._token_graph.replay()
            return

        def work() -> None:
            tok.pairs.copy_(tok.planner.pairs, non_blocking=True)
            tok.device_out.zero_()
            self.store.experts_on_device(tok.x, tok.pairs, tok.device_out)

        self._token_device_calls += 1
        if self._token_device_calls == 1:
            work()
            return
        self._token_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._token_graph):
            work()
        self._token_graph.replay()

    def _launch_general(self, moe_layer: int, t: int, k: int, first_position: int) -> None:
        t0 = time.perf_counter()
        hidden = self.hidden
        packed = self._buffer("in", t, hidden + 2 * k, self.device)
        host = self._staged_host(t, k)
        arr = host.numpy()
        ids, w = self.routed(moe_layer, first_position, arr[:, hidden:hidden + k].astype(np.int64),
                             arr[:, hidden + k:])
        r = Routing.build(moe_layer * self.num_experts, ids, w)
        slots = self.cache.lookup(r.ids)
        hit, miss = np.flatnonzero(slots >= 0), np.flatnonzero(slots < 0)
        if self.cache.policy == "static" and not self.cache.frozen:
            self.prompt_counts[r.ids] += r.counts()
        # Misses the CPU computed lately are filled first (they recur), then the busiest: they
        # carry the most tokens.
        recent = self.cache.computed_on_cpu_within(r.ids[miss], self.recent_steps)
        busy = -r.counts()[miss] if t > 1 else np.zeros(miss.size, dtype=np.int64)
        miss = miss[np.lexsort((busy, ~recent))]
        victims = self.cache.victims(self.planner.fills_for(miss.size, int(recent.sum())), in_use=slots[hit])
        fill, cpu = miss[: victims.size], miss[victims.size:]
        self.cache.cpu_step[r.ids[cpu]] = self.cache.step
        cpu_out = self._buffer("cpu_out", t, hidden).zero_()
        self._cpu_t0 = time.perf_counter()
        if cpu.size:
            self.kernel.start(self.pool.experts, host[:, :hidden].contiguous(), cpu_out, *r.tensors(cpu))
        self.cache.install(victims, r.ids[fill])
        on_device, device_slots = np.concatenate([hit, fill]), np.concatenate([slots[hit], victims])
        self.cache.touch(device_slots)
        self._count(hit.size, fill.size, cpu.size)
        self._plan_s = time.perf_counter() - t0
        self.stats.host_s["plan"] += self._plan_s
        self._copy_rows(victims, r.ids[fill])
        out = self._buffer("device_out", t, hidden, self.device).zero_()
        self._outputs = (out, cpu_out)
        if on_device.size:
            pairs = self._pairs(r, on_device, device_slots)
            # Many tokens per expert (a prompt): GEMM tiles; a few (decode batches): one pass per pair.
            run = self.store.grouped_on_device if pairs.shape[1] >= 4 * on_device.size else self.store.experts_on_device
            with self.stats.compute.measure():
                run(packed[:, :hidden].contiguous(), pairs, out)

    def _launch_planned(self, moe_layer: int, t: int, k: int) -> None:
        """The staged call planned on the device as data, then carried out in the one-graph step's
        order: the plan's fills copied, its CPU job started, its device pairs run. Here the host
        reads the plan's counts and lists back (a sync); the graph step keeps them on the device."""
        t0 = time.perf_counter()
        hidden = self.hidden
        packed = self._buffer("in", t, hidden + 2 * k, self.device)
        tables, rule = self._plan_tables(k)
        weights = packed[:, hidden + k:]
        plan = self._plan_layer(tables, rule, moe_layer * self.num_experts, packed[:, hidden:hidden + k].long(),
                                weights)
        hits, n_fill, n_cpu = plan.counts[:3].tolist()
        self._count(hits, n_fill, n_cpu)
        cpu_out = self._buffer("cpu_out", t, hidden).zero_()
        self._cpu_t0 = time.perf_counter()
        if self.kernel.background:
            self._ring_doorbell(plan, t, k)
        elif n_cpu:
            offsets = plan.cpu_offsets[:n_cpu + 1].cpu()
            entries = int(offsets[-1])
            self.kernel.start(self.pool.experts, self._staged_host(t, k)[:, :hidden].contiguous(), cpu_out,
                              plan.cpu_ids[:n_cpu].cpu(), offsets.int(), plan.cpu_tok[:entries].int().cpu(),
                              plan.cpu_w[:entries].cpu())
        self._plan_s = time.perf_counter() - t0
        self.stats.host_s["plan"] += self._plan_s
        if self._gather_fills is not None:
            with self.stats.copy.measure():
                self._gather_fills(plan)
        else:
            self._copy_rows(plan.fill_slots[:n_fill].cpu().numpy(), plan.fill_rows[:n_fill].cpu().numpy())
        out = self._buffer("device_out", t, hidden, self.device).zero_()
        self._outputs = (out, cpu_out)
        if hits + n_fill:
            pairs = plan.pairs
            with self.stats.compute.measure():
                self.store.experts_on_device(packed[:, :hidden].contiguous(), pairs[:, pairs[0] >= 0], out)

    def _use_device_kernels(self, pool: ExpertPool) -> None:
        """The plan's Triton kernels, and its fills read straight from the pinned pool where the
        pool is mapped into the device (else they are copies)."""
        from ftc_runtime.decode.gather_fills import gather_fills  # Triton: only beside a GPU
        from ftc_runtime.decode.plan_kernel import plan_layer_triton

        self._plan_layer = plan_layer_triton
        address = mapped_address(pool.buffer, pool.experts.data_ptr()) if self.store.pinned else None
        if address is not None:
            self._mapped_rows = rows = MappedHost(address)
            self._gather_fills = lambda plan: gather_fills(rows, self.store.slots, plan)

    def _ring_doorbell(self, plan: LayerPlan, t: int, k: int) -> None:
        """Writes the plan's CPU job and the layer's input into the doorbell's mailbox and rings
        (from the host here; in the one-graph step the device writes and rings)."""
        if self._doorbell is None:
            self._open_doorbell(k)
        bell, n = self._doorbell, t * k
        bell.n_tokens.fill_(t)
        bell.counts.copy_(plan.counts[:3])
        for box, part in ((bell.cpu_ids, plan.cpu_ids), (bell.cpu_tok, plan.cpu_tok), (bell.cpu_w, plan.cpu_w)):
            box[:n].copy_(part)
        bell.cpu_offsets[:n + 1].copy_(plan.cpu_offsets)
        bell.x[:t].copy_(self._staged_host(t, k)[:, :self.hidden])
        self._rung = (bell.ring(), t)

    def _open_doorbell(self, k: int) -> None:
        with torch.inference_mode(False):  # its mailbox is written in place by later calls, in any mode
            self._doorbell = CpuDoorbell(self.kernel, self.pool.experts, PLANNED_TOKENS, PLANNED_TOKENS * k,
                                         pinned=self.on_gpu)

    def _close_doorbell(self) -> None:
        """Gives the CPU kernel's pool back to the host path (a device step opens it again)."""
        if self._doorbell is not None:
            self._drop_device_step()
            self._doorbell.close()
            self._doorbell = None

    def _drop_device_step(self) -> None:
        """Forgets the device step (its counts folded into `stats` first)."""
        _ = self.stats
        self._device_step = None

    def _plan_tables(self, k: int) -> tuple[CacheTables, PlanRule]:
        """The device's cache tables and split rule, taking the host cache's state when it may
        have changed (the first planned call after a safe point), in place."""
        cache = self.store.cache
        if self._tables is None:
            with torch.inference_mode(False):  # loaded in place at safe points, in any mode
                rule = PlanRule.of(self.planner, PLANNED_TOKENS * k, self.recent_steps, cache.policy == "lru",
                                   self.device)
                self._tables = (CacheTables.of(cache, self.device), rule)
        elif self._host_touched:
            self._tables[0].load(cache)
        self._host_touched, self._tables_newer = False, True
        return self._tables

    def _staged_host(self, t: int, k: int) -> torch.Tensor:
        """The staged call on the host: its pinned copy beside a GPU, else the buffer itself."""
        return self._buffer("in_host" if self.on_gpu else "in", t, self.hidden + 2 * k,
                            None if self.on_gpu else self.device)

    def _buffer(self, name: str, t: int, width: int, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32, zeroed: bool = False) -> torch.Tensor:
        """A reused buffer [t, width] on `device` (None: the host, pinned beside a GPU), all zeros
        when made where `zeroed`. One-token buffers are sized once; others grow when a call needs
        more."""
        key = (name, t == 1)
        n = t * width
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            on_host = device is None or device.type == "cpu"
            make = torch.zeros if zeroed else torch.empty
            with torch.inference_mode(False):  # written in place by later calls, in or out of inference mode
                buf = make(n, dtype=dtype, device=device or "cpu", pin_memory=on_host and self.on_gpu)
            self._buffers[key] = buf
        return buf[:n].view(t, width)

    def _count(self, hits: int, fills: int, cpu: int) -> None:
        self.stats.add(1, hits, fills, cpu, self.planner.bound_s(fills + cpu, fills, self.pool.header.expert_stride))

    def _copy_rows(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Copies FTW rows `ids` into `slots` on the current stream, which is idle here (every call
        begins with a sync), so no earlier kernel can still read a victim."""
        self._fills_s = 0.0
        if not slots.size:
            return
        t0 = time.perf_counter()
        with self.stats.copy.measure():
            self.store.copy_rows_now(slots, ids)
        self._fills_s = time.perf_counter() - t0
        self.stats.host_s["fills"] += self._fills_s

    def _pairs(self, r: Routing, which: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """int32 [3, pairs] on the device: slot, token row, router weight (its bits)."""
        _, offsets, tok_idx, tok_w = r.subset(which)
        host = self._buffer("pair_list", 3, tok_idx.size, dtype=torch.int32)
        arr = host.numpy()
        arr[0] = np.repeat(slots, np.diff(offsets))
        arr[1] = tok_idx
        arr[2] = tok_w.view(np.int32)
        return host.to(self.device, non_blocking=True)
