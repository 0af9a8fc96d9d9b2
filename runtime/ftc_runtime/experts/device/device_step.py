"""`DeviceStep`: one MoE layer of a decode step carried out on the GPU with no host involvement, for
the step's single CUDA graph (`DecodeGraphs` in whole-step mode): the plan's kernel on the staged
routing, the CPU job posted through the doorbell, the fills gathered from the mapped pool while
the hits run on a side stream, the filled experts, then one join that waits for the CPU and sums
its result and every device pair's output into the layer's output. Off the path the fills wait
on: the next layer's LRU candidates (they depend only on the slots' last use, which this layer's
plan has just written) and the step's counters on a third stream, joined before that layer plans.
The split's counts and the planner's bound accumulate on the device and are folded into the host's
statistics when those are read.
"""

from __future__ import annotations

import torch

from ftc_runtime.experts.device.cpu_doorbell import RING, CpuDoorbell
from ftc_runtime.experts.device.device_plan import CacheTables, PlanRule
from ftc_runtime.experts.device.doorbell_kernels import DoorbellKernels
from ftc_runtime.experts.device.gather_fills import gather_fills
from ftc_runtime.experts.device.plan_kernel import candidates_buffer, lru_candidates, plan_layer_triton
from ftc_runtime.experts.device.step_counts import StepCounts
from ftc_runtime.experts.device.timeline import DeviceTimeline
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.slots import SlotStore
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.io.host_memory import MappedHost


class DeviceStep:
    """Over `store`'s slots and cache, with `bell` for the CPU's share; `rows` is the pool as the
    device maps it. `tables` and `rule` are the device plan's (kept at fixed addresses: a graph
    holds them)."""

    def __init__(self, store: SlotStore, planner: MissPlanner, bell: CpuDoorbell, rows: MappedHost,
                 tables: CacheTables, rule: PlanRule):
        self.store, self.rows, self.tables, self.rule = store, rows, tables, rule
        self.bell, self.kernels = bell, DoorbellKernels(bell, store.device)
        self.counts = StepCounts(planner, store.header.expert_stride, store.device)
        self.side = torch.cuda.Stream(store.device)  # the hits, beside the fills
        self.ahead = torch.cuda.Stream(store.device)  # the next layer's LRU candidates
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def before_replay(self) -> None:
        """Host work before the step's graph runs: where the host rang since (its planned calls
        do), the device's job numbers continue from that ring. Its job was waited for, so every
        earlier device step was over and the flag is current."""
        if self.bell.rung_by_host:
            self.kernels.counter.fill_(int(self.bell.flags[RING]))
            self.bell.rung_by_host = False

    def run(self, base_id: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
            timeline: DeviceTimeline | None = None, first: bool = True, last: bool = True) -> None:
        """The call of x ([T, hidden] fp32, contiguous) routed to `ids` [T, k] (in the MoE layer
        whose first FTW row is `base_id`) with fp32 `weights` [T, k]; out ([T, hidden] fp32) = its
        routed experts. `first` and `last`: whether it is the step's first or last MoE call (the
        first computes its LRU candidates itself, each other one takes those the call before
        computed ahead). `timeline`: the call's phases marked.

        Three parts run at once: the CPU's job and the hits (posted and launched on a side stream,
        the hits' slots ready already) and the fills over PCIe; the filled experts follow their
        fills."""
        mark = timeline.mark if timeline is not None else lambda _phase: None
        mark("body")
        main = torch.cuda.current_stream(self.store.device)
        n = ids.numel()
        cands = self._buffer("candidates", n)
        if first:
            lru_candidates(self.tables, n, cands)
        else:
            main.wait_stream(self.ahead)
        plan = plan_layer_triton(self.tables, self.rule, base_id, ids, weights, cands)
        if not last:  # the step's counters too, off the paths that the layer's join waits for
            self.ahead.wait_stream(main)
            with torch.cuda.stream(self.ahead):
                lru_candidates(self.tables, n, cands)
                self.counts.add(plan.counts)
        mark("plan")
        hits, fills = self._buffer("hits", n), self._buffer("fills", n)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            # The CPU's job off the fills' path: the fills start right after the plan.
            self.kernels.post_job(plan, x)
            if last:
                self.counts.add(plan.counts)
            self.store.pair_outputs_on_device(x, plan.phase_pairs[0], hits)
        gather_fills(self.rows, self.store.slots, plan)
        mark("fills")
        self.store.pair_outputs_on_device(x, plan.phase_pairs[1], fills)
        main.wait_stream(self.side)
        mark("hits")
        self.kernels.wait_and_join(out, plan, self.rule, hits, fills)
        mark("cpu_wait")

    def _buffer(self, name: str, n: int) -> torch.Tensor:
        """The fixed buffer `name` of calls of n routed entries (kept: a graph holds its address):
        the LRU candidates, or the pairs' output rows of the hits or of the fills ([n, hidden] fp32)."""
        key = (name, n)
        if key not in self._buffers:
            dev = self.store.device
            self._buffers[key] = candidates_buffer(self.tables, n, dev) if name == "candidates" else \
                torch.empty(n, self.store.header.hidden, dtype=torch.float32, device=dev)
        return self._buffers[key]

    def fold_into(self, stats: OffloadStats) -> None:
        """Adds the counts since the last fold to `stats` (reads the device: a safe point)."""
        self.kernels.check()
        counts, bound_s = self.counts.take()
        stats.add(*counts, bound_s)
