"""`OffloadedExperts`: routed experts served from a device-side slot cache (`SlotStore`), with the
misses of each layer split between fills (host→device copies into LRU victims) and in-place CPU
computation.

The device is any `torch.device`. On a machine without a GPU it is the CPU, and every part of the
path (cache, split, fills as plain copies, merge) runs and is tested; only speed needs a GPU.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping

import numpy as np
import torch

from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.experts.cache import CachePolicy, ExpertCache
from ftc_runtime.experts.call_buffers import CallBuffers
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.device.device_plan import PLANNED_TOKENS
from ftc_runtime.experts.device.path import DevicePath
from ftc_runtime.experts.device.timeline import DeviceTimeline
from ftc_runtime.experts.host_split import HostSplit, Route
from ftc_runtime.experts.launch import Launched
from ftc_runtime.experts.layer_stream import LayerStream, stream_slots
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.prompt_split import PromptSplit
from ftc_runtime.experts.recurrence import RecurrenceMeter
from ftc_runtime.experts.slots import GpuExpertKernels, SlotStore
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.experts.stream_cpu import StreamCpuPart
from ftc_runtime.io.ftw import ExpertPool


class OffloadedExperts(ExpertBackend):
    """Per MoE layer call: `stage` queues one device→host copy of the layer's input and routing
    (CUDA graphs capture it); `launch_staged` waits for it (the one sync: the device's queue is
    then empty, so fills need no stream of their own), looks the experts up, splits the misses,
    starts the CPU experts in the background at once, and queues the fills and then the hits +
    fills on the device; `finish_staged` waits for the CPU part. A call's buffers are reused by the
    next call only after that call's sync, which orders it after every copy of this one.

    The parts it composes: `store`, the slots and their fills; `buffers`, the calls' reused
    buffers; `host_split`, the lookup and miss split planned on the host (one token by one native
    call, whose device part is one CUDA graph; several tokens by the general path); `device_path`,
    with `device_plan` on, calls of up to PLANNED_TOKENS tokens planned on the device as data and
    the one-graph decode step. The device's copy of the cache tables is then ahead of
    `ExpertCache`, which is brought up to date at the next safe point (any read of `cache`, a
    resize, a streamed prompt chunk). A prompt chunk long enough streams whole layers instead
    (`LayerStream`)."""

    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel, device: torch.device, n_slots: int,
                 planner: MissPlanner, cache_policy: CachePolicy = "lru", kernels: GpuExpertKernels | None = None,
                 stream_min_tokens: int | None = None, stream_overlap: bool = True, device_plan: bool = False,
                 swiglu_limit: float = 0.0, prompt_split: PromptSplit | None = None, mtp_layers: int = 0):
        h = pool.header
        self.pool, self.kernel, self.planner = pool, kernel, planner
        # The slots, their cache and the engine's generated device kernels (None: torch).
        self.store = SlotStore(pool, device, n_slots, cache_policy, kernels, swiglu_limit)
        self.device, self.on_gpu, self.num_experts = self.store.device, self.store.on_gpu, h.num_experts
        self.hidden = h.hidden
        # The MoE layers a model pass runs, in order: the pool's but the multi-token-prediction
        # layers' after them, which the head runs on its own.
        self.pass_layers = h.num_moe_layers - mtp_layers
        self._stats = OffloadStats(self.device)
        self.buffers = CallBuffers(self.device, h.hidden)
        self.host_split = HostSplit(self.store, kernel, self.buffers)
        self.native_token_plan = True  # False: one-token calls take the general path (tests compare both)
        self.device_plan = device_plan
        self.device_path = DevicePath(self.store, kernel, self.buffers, device_plan and self.on_gpu)
        self._launched: Launched | None = None  # the call between `launch_staged` and `finish_staged`
        # Prompt chunks of at least stream_min_tokens (None: never) stream whole layers when the
        # cache can lend the layer buffers; else their routed experts load on demand. With a
        # prompt split the CPU computes part of each streamed layer's uncached experts in place.
        self.stream_min_tokens, self.stream_overlap = stream_min_tokens, stream_overlap
        self.prompt_split = prompt_split
        self._stream: LayerStream | None = None
        self._said_no_stream = False
        # The adaptive split's recency rule (`MissPlanner.recent_tokens`) runs where the prompts'
        # routing recurs (`RecurrenceMeter`); the meter counts the routes of prompt passes.
        self.recency_window = planner.recent_tokens
        self.recurrence = RecurrenceMeter(h.num_experts, planner.recent_tokens) \
            if planner.policy == "adaptive" and planner.recent_tokens > 0 else None
        self._prompt_pass = False
        self.generation = 0  # bumped when the slots or the device step's buffers change: graphs holding them are stale

    @property
    def cache(self) -> ExpertCache:
        """Which expert each slot holds (`resize` replaces it), up to date: a read is a safe point,
        where the device's tables, if ahead, are written back."""
        return self.device_path.tables.host_cache()

    @property
    def split_bias(self) -> float:
        """Where the device steps' waits have moved the split (`PlanRule.bias`; reads the device)."""
        return self.device_path.tables.split_bias

    @property
    def n_slots(self) -> int:
        """The slot count, without a safe point (`cache` writes the device's tables back)."""
        return self.store.cache.n_slots

    @property
    def stats(self) -> OffloadStats:
        """What the path did; the device steps' counts are folded in when read."""
        self.device_path.fold_into(self._stats)
        return self._stats

    @stats.setter
    def stats(self, value: OffloadStats) -> None:
        self.device_path.fold_into(OffloadStats(self.device))  # counts of the steps before: dropped with the old
        self._stats = value

    def resize(self, n_slots: int) -> None:
        """Rebuilds the slot cache with n_slots slots at a safe point (no CPU job, copy or kernel
        in flight), keeping the most recently used experts that fit (`SlotStore.resize`); misses
        refill it as usual."""
        _ = self.cache  # the device's tables, if ahead, written back first
        self.store.resize(n_slots)
        self.host_split.forget_slots()
        self._stream = None
        self.device_path.tables.forget()
        self.device_path.drop_step(self._stats)
        self.generation += 1

    @property
    def recent_steps(self) -> int:
        """The planner's recent window in cache steps (`MissPlanner.recent_steps`)."""
        return self.planner.recent_steps(self.pool.header.num_moe_layers)

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
        self._prompt_pass = prompt
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
            self.device_path.close_doorbell(self._stats)  # the CPU part starts the kernel itself
            cpu = StreamCpuPart(self.kernel, self.pool.experts, self.prompt_split, self.buffers.host, self.stats,
                                n_tokens, self.device)
        self._stream = LayerStream(self.store, self.stats, self.stream_overlap, self.pass_layers,
                                   known_routes if self.routing is None else None, cpu, n_tokens)

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int = 0) -> torch.Tensor:
        if self._stream is not None and ids.shape[0] > 1:
            if self.routing is not None:  # the hook sees the router's choice on the host (a sync)
                host_ids, host_w = self.routed(moe_layer, first_position, ids.cpu().numpy().astype(np.int64),
                                               weights.float().cpu().numpy())
                ids, weights = torch.from_numpy(host_ids).to(x.device), torch.from_numpy(host_w).to(x.device)
            if self._observes(ids.shape[0]):
                self.recurrence.observe(ids)
            out = self._stream.forward(moe_layer, x, ids, weights)
            if moe_layer == self.pass_layers - 1:
                self._stream = None  # the chunk's last MoE layer
            return out
        if not self._prompt_pass and self.device_step_ready(ids.shape[0]):
            return self._device_call(moe_layer, x, ids, weights, first_position)
        if self._observes(ids.shape[0]):  # with a hook, its choice (which the launch makes again)
            self.recurrence.observe(ids if self.routing is None else self.routed(
                moe_layer, first_position, ids.cpu().numpy().astype(np.int64), weights.float().cpu().numpy())[0])
        self.stage(x, ids, weights)
        return self.forward_staged(moe_layer, ids.shape[0], ids.shape[1], first_position)

    def _device_call(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     first_position: int) -> torch.Tensor:
        """A decode call outside the step's graph (a multi-token-prediction layer's) on the device
        plan, as a step's layer runs there: the host path would take the CPU's pool back from the
        doorbell, and the next step would make the device step, and so its graphs, anew."""
        t, k = ids.shape
        self.begin_device_step(k)
        try:
            self.stage(x.float().contiguous(), ids, weights.float())
            positions = torch.arange(first_position, first_position + t, device=self.device)
            self.run_staged_on_device(moe_layer, k, positions, alone=True)
        finally:
            self.end_device_step()
        return self.token_outputs(t)[0].clone()

    def _observes(self, n_tokens: int) -> bool:
        """Whether the recurrence meter counts this call's routes: a prompt pass's, long enough."""
        return self.recurrence is not None and self._prompt_pass and n_tokens > self.recurrence.window

    def stage(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Queues x (fp32), ids and weights into one device buffer [T, hidden + 2k] and its copy to
        the host (`CallBuffers.stage`). Capturable in a CUDA graph. In a device step they are only
        kept: `run_staged_on_device`, next in the same graph, reads them where they are."""
        if self.device_path.active:
            self.device_path.kept = (x, ids, weights)
            return
        self.buffers.stage(x, ids, weights)

    def forward_staged(self, moe_layer: int, t: int, k: int, first_position: int = 0) -> torch.Tensor:
        """The routed experts of the call that `stage` queued: T tokens, k experts each."""
        self.launch_staged(moe_layer, t, k, first_position)
        on_device, on_cpu = self.finish_staged()
        return on_device + on_cpu.to(self.device, non_blocking=True)

    def token_outputs(self, t: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where decode calls of t tokens leave their two parts ([t, hidden] fp32, on the device
        and on the host): their sum is the layer's output. Fixed buffers, for CUDA graphs to read
        (a batch's: one of PLANNED_TOKENS rows, never regrown). In a device step the device part
        holds the whole output (the host part: None, and no host buffer is made under a capture)."""
        device_out = self.buffers.step_out(t)
        return device_out, None if self.device_path.active else self.buffers.cpu_out(t)

    def device_step_ready(self, t: int = 1) -> bool:
        """Whether a decode step of t tokens can run its MoE layers on the device in one graph:
        the device plan on a GPU, t within its calls, no static cache still counting its prompt,
        and nothing that `DevicePath.ready` finds lacking (which it says, once)."""
        cache = self.store.cache
        if not (self.device_plan and self.on_gpu and t <= PLANNED_TOKENS) or (
                cache.policy == "static" and not cache.frozen):
            return False
        return self.device_path.ready(self.routing)

    def begin_device_step(self, k: int) -> None:
        """Host work before a device step (eager or replayed), `DevicePath.begin_step`."""
        if self.device_path.begin_step(k, self.planner):
            self.generation += 1  # a new mailbox and counters: graphs holding the old ones are stale

    def end_device_step(self) -> None:
        self.device_path.active = False

    def step_timed(self, width: int, seconds: float) -> None:
        """A device step of `width` tokens, replayed from its graph, took `seconds` from its begin
        to its end: the adaptive split's trials against the CPU alone take it (`SplitTrials`)."""
        self.device_path.step_timed(width, seconds)

    @property
    def split_trials(self) -> dict | None:
        """What the split's trials chose (`SplitTrials.summary`); None where no round ran."""
        trials = self.device_path.tables.trials
        return trials.summary() if trials.rounds else None

    def run_staged_on_device(self, moe_layer: int, k: int, position: torch.Tensor,
                             timeline: DeviceTimeline | None = None, alone: bool = False) -> None:
        """The decode call `stage` queued (t tokens, one per sequence, at `position`: int64 [t] on
        the device), carried out on the device alone (`DeviceStep`): no host work, so that the
        step's graph holds it; its output lands in `token_outputs(t)[0]`. `timeline`: its phases
        marked. `alone`: a call outside a step's run of layers (its first and its last)."""
        x, ids, weights = self.device_path.kept
        if self.routing is not None:  # a `DeviceRoutingHook` (device_step_ready)
            ids, weights = self.routing.route_on_device(moe_layer, position, ids, weights)
        out = self.token_outputs(x.shape[0])[0]
        self.device_path.step.run(moe_layer * self.num_experts, x, ids, weights, out, timeline,
                                  first=alone or moe_layer == 0, last=alone or moe_layer == self.pass_layers - 1)

    def launch_staged(self, moe_layer: int, t: int, k: int, first_position: int = 0) -> None:
        """Plans the staged call and starts both parts; `finish_staged` returns them."""
        stats = self.stats
        t0 = time.perf_counter()
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        stats.host_s["sync"] += t1 - t0
        host_cache = self.store.cache  # not `cache`: that would write the device's tables back
        static_counting = host_cache.policy == "static" and not host_cache.frozen
        if self.device_plan and t <= PLANNED_TOKENS and self.routing is None and not static_counting:
            launched = self.device_path.launch(moe_layer, t, k, self.planner, stats)
        else:
            self.device_path.close_doorbell(stats)  # the host path starts the CPU kernel itself
            route = self._route(moe_layer, first_position)
            if t == 1 and self.native_token_plan and not static_counting:
                launched = self.host_split.launch_token(moe_layer, k, self.cache, self.planner, stats, route)
            else:
                launched = self.host_split.launch_general(moe_layer, t, k, self.cache, self.planner, stats, route)
        self._launched = launched
        stats.host_s["launch"] += time.perf_counter() - t1 - launched.plan_s - launched.fills_s

    def _route(self, moe_layer: int, first_position: int) -> Route | None:
        """The routing hook's choice for the call's tokens on the host; None: no hook."""
        if self.routing is None:
            return None
        return lambda ids, weights: self.routed(moe_layer, first_position, ids, weights)

    def finish_staged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device part, CPU part) of the launched call, once the CPU part is done."""
        launched = self._launched
        t0 = time.perf_counter()
        if not self.device_path.wait_rung(launched.cpu_out):
            self.kernel.wait()
        t1 = time.perf_counter()
        self.stats.host_s["cpu_wait"] += t1 - t0
        self.stats.cpu_s += t1 - launched.cpu_t0
        return launched.device_out, launched.cpu_out

    def end_of_prompt(self) -> None:
        """Static policy: pins the experts the prompt routed to most, once (`HostSplit.end_of_prompt`).
        Adaptive: the recency rule on or off by how the prompt's routing recurred."""
        self.host_split.end_of_prompt(self.cache, self.stats)
        recurs = self.recurrence.decide() if self.recurrence is not None else None
        window = self.recency_window if recurs else 0
        if recurs is None or self.planner.recent_tokens == window:
            return
        _ = self.cache  # a safe point: the device's tables written back before they are remade
        self.planner = dataclasses.replace(self.planner, recent_tokens=window)
        self.host_split.forget_slots()  # the native token planner holds the window
        self.device_path.tables.forget()  # and the device plan's rule
        self.generation += 1
