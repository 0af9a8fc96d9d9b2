"""`DeviceStep`: one MoE layer of a decode step carried out on the GPU with no host involvement, for
the step's single CUDA graph (`DecodeGraphs` in whole-step mode): the plan's kernels on the staged
routing, the CPU job posted through the doorbell, the fills gathered from the mapped pool, the
device pairs on the slots, the CPU's result joined into the layer's output. The split's counts
and the planner's bound accumulate on the device and are folded into the host's statistics when
those are read.
"""

from __future__ import annotations

import torch

from ftc_runtime.decode.cpu_doorbell import RING, CpuDoorbell
from ftc_runtime.decode.device_plan import CacheTables, LayerPlan, PlanRule
from ftc_runtime.decode.doorbell_kernels import DoorbellKernels
from ftc_runtime.decode.gather_fills import MappedRows, gather_fills
from ftc_runtime.decode.plan_kernel import plan_layer_triton
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.slots import SlotStore
from ftc_runtime.experts.stats import OffloadStats


class DeviceStep:
    """Over `store`'s slots and cache, with `bell` for the CPU's share; `rows` is the pool as the
    device maps it. `tables` and `rule` are the device plan's (kept at fixed addresses: a graph
    holds them)."""

    def __init__(self, store: SlotStore, planner: MissPlanner, bell: CpuDoorbell, rows: MappedRows,
                 tables: CacheTables, rule: PlanRule):
        self.store, self.planner, self.rows, self.tables, self.rule = store, planner, rows, tables, rule
        self.bell, self.kernels = bell, DoorbellKernels(bell, store.device)
        self.counts = torch.zeros(4, dtype=torch.int64, device=store.device)  # calls, hits, fills, CPU experts
        self.bound_s = torch.zeros(1, dtype=torch.float64, device=store.device)

    def before_replay(self) -> None:
        """Host work before the step's graph runs: where the host rang since (its planned calls
        do), the device's job numbers continue from that ring. Its job was waited for, so every
        earlier device step was over and the flag is current."""
        if self.bell.rung_by_host:
            self.kernels.counter.fill_(int(self.bell.flags[RING]))
            self.bell.rung_by_host = False

    def run(self, base_id: int, packed: torch.Tensor, k: int, out: torch.Tensor) -> None:
        """The call staged in `packed` ([T, hidden + 2k]: x, ids, weights in fp32) for the MoE
        layer whose first FTW row is `base_id`; out ([T, hidden] fp32) = its routed experts."""
        hidden = out.shape[1]
        x = packed[:, :hidden].contiguous()
        weights = packed[:, hidden + k:]
        plan = plan_layer_triton(self.tables, self.rule, base_id, packed[:, hidden:hidden + k].long(), weights)
        # The CPU's job first: it computes while the GPU fills slots and runs the device pairs.
        self.kernels.post_job(plan, x)
        self._count(plan)
        gather_fills(self.rows, self.store.slots, plan)
        out.zero_()
        # The device kernel skips the CPU's pairs (slot -1).
        self.store.experts_on_device(x, plan.device_pairs(weights), out)
        self.kernels.wait_and_join(out)

    def _count(self, plan: LayerPlan) -> None:
        """The call's counts and its miss bound."""
        self.counts[0] += 1
        self.counts[1:] += plan.counts
        fills, cpu = plan.counts[1].double(), plan.counts[2].double()
        self.bound_s += self.planner.bound_s_tensor(fills + cpu, fills, self.store.header.expert_stride)

    def fold_into(self, stats: OffloadStats) -> None:
        """Adds the counts since the last fold to `stats` (reads the device: a safe point)."""
        self.kernels.check()
        stats.add(*self.counts.tolist(), float(self.bound_s))
        self.counts.zero_()
        self.bound_s.zero_()
