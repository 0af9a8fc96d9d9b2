"""`HostSplit`: a staged call's experts looked up and its misses split on the host, the
`MissPlanner`'s use: misses that the CPU computed lately are filled first (they recur), then the
busiest (they carry the most tokens), into victim slots, up to the planner's q; the CPU computes
the rest in place, in the background, while the hits and fills run on the device. One token
(decode) is planned by one native call (`TokenPlanner`) and its device part is one CUDA graph;
several tokens (prompt chunks, decode batches) take the general path in numpy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ftc_runtime.experts.base import Routing
from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.call_buffers import CallBuffers
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.launch import Launched, count_split
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.slots import SlotStore
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.experts.token_plan import TokenPlanner

# The routing hook's choice for the router's (ids int64 [T, k], weights fp32 [T, k]), on the host.
Route = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class _TokenPath:
    """The fixed buffers of one-token calls (CUDA graphs hold their addresses) and their planner."""

    planner: TokenPlanner
    staged: torch.Tensor  # [1, hidden + 2k] fp32 on the host: x, ids, weights
    x: torch.Tensor  # [1, hidden] fp32 on the device
    device_out: torch.Tensor  # [1, hidden] fp32 on the device: the hits and fills
    cpu_out: torch.Tensor  # [1, hidden] fp32 on the host: the CPU experts
    pairs: torch.Tensor  # [3, k] int32 on the device: the planner's pairs, copied


class _Split(NamedTuple):
    """One call's unique experts (positions in its `Routing`) by where they run, and their slots."""

    hit: np.ndarray
    fill: np.ndarray
    cpu: np.ndarray
    slots: np.ndarray  # the cache's slot of every unique expert (-1: a miss)
    victims: np.ndarray  # the slots that the fills take, in the order of `fill`


class HostSplit:
    """Plans staged calls on the host over `store`'s cache and starts them: the CPU experts on
    `kernel`, the fills and the device experts on the slots; `buffers` holds the staged input and
    the outputs. Under the static cache policy it also counts the prompt's routed experts, which
    `end_of_prompt` pins. Each launch takes the cache at a safe point (the device plan's tables,
    if ahead, written back) and the current planner: both may change between calls."""

    def __init__(self, store: SlotStore, kernel: CpuExpertKernel, buffers: CallBuffers):
        self.store, self.kernel, self.buffers = store, kernel, buffers
        self.prompt_counts = np.zeros(store.header.num_rows, dtype=np.int64)  # static policy: routed ids of the prompt
        self.token: _TokenPath | None = None  # built at the first one-token call
        self._token_graph: torch.cuda.CUDAGraph | None = None
        self._token_device_calls = 0

    def forget_slots(self) -> None:
        """The slots and the cache were rebuilt: the token planner and its graph hold the old
        arrays' and slots' addresses."""
        self.token, self._token_graph, self._token_device_calls = None, None, 0

    def launch_token(self, moe_layer: int, k: int, cache: ExpertCache, planner: MissPlanner, stats: OffloadStats,
                     route: Route | None) -> Launched:
        """The staged one-token call planned by the native planner; `route`: a routing hook's."""
        t0 = time.perf_counter()
        tok = self.token or self._make_token_path(k, cache, planner)
        if route is not None:  # the hook's choice replaces the router's where the planner reads it
            arr, h = tok.staged.numpy(), self.store.header.hidden
            ids, w = route(arr[:, h:h + k].astype(np.int64), arr[:, h + k:])
            arr[:, h:h + k], arr[:, h + k:] = ids, w
        cpu_t0 = time.perf_counter()
        n_fill = tok.planner.plan(moe_layer * self.store.num_experts, allow_fills=cache.policy == "lru")
        hits, fills, cpu = tok.planner.counts.tolist()
        count_split(stats, planner, self.store.header.expert_stride, hits, fills, cpu)
        plan_s = time.perf_counter() - t0
        stats.host_s["plan"] += plan_s
        fills_s = self.store.fill(tok.planner.fills[1, :n_fill], tok.planner.fills[0, :n_fill], stats)
        with stats.compute.measure():
            self._token_device_part(tok, hits + fills)
        return Launched(tok.device_out, tok.cpu_out, cpu_t0, plan_s, fills_s)

    def _make_token_path(self, k: int, cache: ExpertCache, planner: MissPlanner) -> _TokenPath:
        staged = self.buffers.staged_host(1, k)
        device_out, cpu_out = self.buffers.device_out(1), self.buffers.cpu_out(1)
        store = self.store
        native = TokenPlanner(self.kernel, store.pool.experts, cache, planner, k, staged, cpu_out, store.on_gpu,
                              planner.recent_steps(store.header.num_moe_layers))
        x = self.buffers.staged(1, k)[:, :store.header.hidden]
        pairs = torch.zeros(3, k, dtype=torch.int32, device=store.device)
        self.token = _TokenPath(native, staged, x, device_out, cpu_out, pairs)
        return self.token

    def _token_device_part(self, tok: _TokenPath, n_pairs: int) -> None:
        """One token's hits and fills from the slots into `device_out`: on a GPU with the engine's
        kernel, one CUDA graph over all k pair entries (unused ones skipped), captured at the
        second call (the first compiles the kernel); elsewhere torch over the n_pairs used."""
        store = self.store
        if not store.on_gpu or store.kernels is None:
            tok.device_out.zero_()
            if n_pairs:
                store.experts_on_device(tok.x, tok.planner.pairs[:, :n_pairs].to(store.device), tok.device_out)
            return
        if self._token_graph is not None:
            self._token_graph.replay()
            return

        def work() -> None:
            tok.pairs.copy_(tok.planner.pairs, non_blocking=True)
            tok.device_out.zero_()
            store.experts_on_device(tok.x, tok.pairs, tok.device_out)

        self._token_device_calls += 1
        if self._token_device_calls == 1:
            work()
            return
        self._token_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._token_graph):
            work()
        self._token_graph.replay()

    def launch_general(self, moe_layer: int, t: int, k: int, cache: ExpertCache, planner: MissPlanner,
                       stats: OffloadStats, route: Route | None) -> Launched:
        """The staged call of t tokens planned in numpy; `route`: a routing hook's."""
        t0 = time.perf_counter()
        hidden = self.store.header.hidden
        host = self.buffers.staged_host(t, k)
        arr = host.numpy()
        ids, w = arr[:, hidden:hidden + k].astype(np.int64), arr[:, hidden + k:]
        if route is not None:
            ids, w = route(ids, w)
        r = Routing.build(moe_layer * self.store.num_experts, ids, w)
        if cache.policy == "static" and not cache.frozen:
            self.prompt_counts[r.ids] += r.counts()
        split = self._split(r, t, cache, planner)
        cpu_out = self.buffers.cpu_out(t).zero_()
        cpu_t0 = time.perf_counter()
        if split.cpu.size:
            self.kernel.start(self.store.pool.experts, host[:, :hidden].contiguous(), cpu_out, *r.tensors(split.cpu))
        cache.install(split.victims, r.ids[split.fill])
        on_device = np.concatenate([split.hit, split.fill])
        hit_slots = split.slots[split.hit]
        device_slots = np.concatenate([hit_slots, split.victims])
        stay = None if planner.keeps_fills else \
            np.concatenate([split.victims, hit_slots[cache.last_used[hit_slots] < 0]])
        cache.touch(device_slots)
        if stay is not None:  # fills that serve this call only, and hits on such slots, stay the next victims
            cache.last_used[stay] = -1
        count_split(stats, planner, self.store.header.expert_stride, split.hit.size, split.fill.size, split.cpu.size)
        plan_s = time.perf_counter() - t0
        stats.host_s["plan"] += plan_s
        fills_s = self.store.fill(split.victims, r.ids[split.fill], stats)
        out = self.buffers.device_out(t).zero_()
        if on_device.size:
            pairs = self._pairs(r, on_device, device_slots)
            # Many tokens per expert (a prompt): GEMM tiles; a few (decode batches): one pass per pair.
            run = self.store.grouped_on_device if pairs.shape[1] >= 4 * on_device.size \
                else self.store.experts_on_device
            with stats.compute.measure():
                run(self.buffers.staged(t, k)[:, :hidden].contiguous(), pairs, out)
        return Launched(out, cpu_out, cpu_t0, plan_s, fills_s)

    def _split(self, r: Routing, t: int, cache: ExpertCache, planner: MissPlanner) -> _Split:
        """Looks the call's experts up and splits the misses: the first q fill victims (none of the
        hits' slots), the CPU computes the others (and the cache notes when)."""
        slots = cache.lookup(r.ids)
        hit, miss = np.flatnonzero(slots >= 0), np.flatnonzero(slots < 0)
        recent = cache.computed_on_cpu_within(r.ids[miss], planner.recent_steps(self.store.header.num_moe_layers))
        busy = -r.counts()[miss] if t > 1 else np.zeros(miss.size, dtype=np.int64)
        miss = miss[np.lexsort((busy, ~recent))]
        victims = cache.victims(planner.fills_for(miss.size, int(recent.sum())), in_use=slots[hit])
        fill, cpu = miss[: victims.size], miss[victims.size:]
        cache.cpu_step[r.ids[cpu]] = cache.step
        return _Split(hit, fill, cpu, slots, victims)

    def _pairs(self, r: Routing, which: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """int32 [3, pairs] on the device: slot, token row, router weight (its bits)."""
        _, offsets, tok_idx, tok_w = r.subset(which)
        host = self.buffers.get("pair_list", 3, tok_idx.size, dtype=torch.int32)
        arr = host.numpy()
        arr[0] = np.repeat(slots, np.diff(offsets))
        arr[1] = tok_idx
        arr[2] = tok_w.view(np.int32)
        return host.to(self.store.device, non_blocking=True)

    def end_of_prompt(self, cache: ExpertCache, stats: OffloadStats) -> None:
        """Static policy: pins the experts that the prompt routed to most, once."""
        if cache.policy != "static" or cache.frozen:
            return
        order = np.argsort(-self.prompt_counts, kind="stable")
        chosen = order[: cache.n_slots]
        chosen = chosen[self.prompt_counts[chosen] > 0]
        self.store.fill(cache.pin(chosen), chosen, stats)
