"""`DeviceStep`: one MoE layer of a decode step carried out on the GPU with no host involvement, for
the step's single CUDA graph (`DecodeGraphs` in whole-step mode): the plan's kernels on the staged
routing, the CPU job posted through the doorbell, the fills gathered from the mapped pool while
the hits run on a side stream, the filled experts, the CPU's result joined into the layer's output. The split's counts
and the planner's bound accumulate on the device and are folded into the host's statistics when
those are read.
"""

from __future__ import annotations

import torch

from ftc_runtime.decode.cpu_doorbell import RING, CpuDoorbell
from ftc_runtime.decode.device_plan import CacheTables, PlanRule
from ftc_runtime.decode.doorbell_kernels import DoorbellKernels
from ftc_runtime.decode.gather_fills import MappedRows, gather_fills
from ftc_runtime.decode.plan_kernel import plan_layer_triton
from ftc_runtime.decode.step_counts import StepCounts
from ftc_runtime.decode.timeline import DeviceTimeline
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.slots import SlotStore
from ftc_runtime.experts.stats import OffloadStats


class DeviceStep:
    """Over `store`'s slots and cache, with `bell` for the CPU's share; `rows` is the pool as the
    device maps it. `tables` and `rule` are the device plan's (kept at fixed addresses: a graph
    holds them)."""

    def __init__(self, store: SlotStore, planner: MissPlanner, bell: CpuDoorbell, rows: MappedRows,
                 tables: CacheTables, rule: PlanRule):
        self.store, self.rows, self.tables, self.rule = store, rows, tables, rule
        self.bell, self.kernels = bell, DoorbellKernels(bell, store.device)
        self.counts = StepCounts(planner, store.header.expert_stride, store.device)
        self.side = torch.cuda.Stream(store.device)  # the hits, beside the fills
        self._hits: dict[int, torch.Tensor] = {}

    def before_replay(self) -> None:
        """Host work before the step's graph runs: where the host rang since (its planned calls
        do), the device's job numbers continue from that ring. Its job was waited for, so every
        earlier device step was over and the flag is current."""
        if self.bell.rung_by_host:
            self.kernels.counter.fill_(int(self.bell.flags[RING]))
            self.bell.rung_by_host = False

    def run(self, base_id: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
            timeline: DeviceTimeline | None = None) -> None:
        """The call of x ([T, hidden] fp32, contiguous) routed to `ids` [T, k] (in the MoE layer
        whose first FTW row is `base_id`) with fp32 `weights` [T, k]; out ([T, hidden] fp32) = its
        routed experts. `timeline`: the call's phases marked.

        Three parts run at once: the CPU's job and the hits (posted and launched on a side stream,
        the hits' slots ready already) and the fills over PCIe; the filled experts follow their
        fills."""
        mark = timeline.mark if timeline is not None else lambda _phase: None
        mark("body")
        plan = plan_layer_triton(self.tables, self.rule, base_id, ids, weights)
        mark("plan")
        main = torch.cuda.current_stream(self.store.device)
        self.side.wait_stream(main)
        hits_out = self._hits_out(out.shape[0])
        with torch.cuda.stream(self.side):
            # The CPU's job and the counts off the fills' path: the fills start right after the plan.
            self.kernels.post_job(plan, x)
            self.counts.add(plan.counts)
            hits_out.zero_()
            # The device kernel skips the pairs of other phases (slot -1).
            self.store.experts_on_device(x, plan.phase_pairs[0], hits_out)
        gather_fills(self.rows, self.store.slots, plan)
        mark("fills")
        out.zero_()
        self.store.experts_on_device(x, plan.phase_pairs[1], out)
        main.wait_stream(self.side)
        mark("hits")
        self.kernels.wait_and_join(out, plan, self.rule, also=hits_out)
        mark("cpu_wait")

    def _hits_out(self, rows: int) -> torch.Tensor:
        """The hits' output buffer for calls of `rows` tokens (kept: a graph holds its address)."""
        if rows not in self._hits:
            self._hits[rows] = torch.empty(rows, self.store.header.hidden, dtype=torch.float32,
                                           device=self.store.device)
        return self._hits[rows]

    def fold_into(self, stats: OffloadStats) -> None:
        """Adds the counts since the last fold to `stats` (reads the device: a safe point)."""
        self.kernels.check()
        counts, bound_s = self.counts.take()
        stats.add(*counts, bound_s)
