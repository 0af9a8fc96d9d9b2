"""`DevicePath`: the offloaded experts' calls of up to PLANNED_TOKENS tokens planned on the device
as data (`device_plan`: the plan that a one-graph decode step holds), and the one-graph step's MoE
layers (`DeviceStep`). It keeps the device's cache tables (`DeviceTables`), the plan's kernels
(Triton beside a GPU, else the torch reference), the fills gathered straight from the mapped pool,
and the CPU doorbell, which takes the plan's CPU job where the CPU kernel has a background pool and
holds that pool until a call takes the host path.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ftc_runtime.experts.base import DeviceRoutingHook, RoutingHook
from ftc_runtime.experts.call_buffers import CallBuffers
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.device.cpu_doorbell import CpuDoorbell
from ftc_runtime.experts.device.device_plan import PLANNED_TOKENS, LayerPlan, plan_layer
from ftc_runtime.experts.device.tables import DeviceTables
from ftc_runtime.experts.launch import Launched, count_split
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.slots import SlotStore
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.io.host_memory import MappedHost, mapped_address

if TYPE_CHECKING:  # Triton's: imported only beside a GPU
    from ftc_runtime.experts.device.device_step import DeviceStep


class DevicePath:
    """Over `store`'s slots, with `kernel` for the CPU's share and `buffers` for the staged calls;
    `device_kernels`: the plan's Triton kernels and the gathered fills (beside a GPU), else the
    torch plan and fills copied from the host."""

    def __init__(self, store: SlotStore, kernel: CpuExpertKernel, buffers: CallBuffers, device_kernels: bool):
        self.store, self.kernel, self.buffers = store, kernel, buffers
        self.tables = DeviceTables(store)
        self.plan_layer: Callable[..., LayerPlan] = plan_layer
        self.gather: Callable[[LayerPlan], None] | None = None  # the fills from the mapped pool, where mapped
        self.mapped_rows: MappedHost | None = None
        if device_kernels:
            self._use_device_kernels()
        self.step: DeviceStep | None = None  # whole-step decode graphs: the MoE layers' device part
        self.step_ran = False  # it ran since its counts were last folded into the statistics
        self.active = False  # the current decode step runs its MoE layers on the device
        self.kept: tuple[torch.Tensor, ...] = ()  # the device step's staged x, ids, weights
        self.doorbell: CpuDoorbell | None = None
        self._rung: tuple[int, int] | None = None  # the doorbell job of the current call and its tokens
        self._said: set[str] = set()  # why decode took the host path, each said once

    def _use_device_kernels(self) -> None:
        """The plan's Triton kernels, and its fills read straight from the pinned pool where the
        pool is mapped into the device (else they are copies)."""
        from ftc_runtime.experts.device.gather_fills import gather_fills  # Triton: only beside a GPU
        from ftc_runtime.experts.device.plan_kernel import plan_layer_triton

        self.plan_layer = plan_layer_triton
        pool = self.store.pool
        address = mapped_address(pool.buffer, pool.experts.data_ptr()) if self.store.pinned else None
        if address is not None:
            self.mapped_rows = rows = MappedHost(address)
            self.gather = lambda plan: gather_fills(rows, self.store.slots, plan)

    def ready(self, routing: RoutingHook | None) -> bool:
        """Whether the one-graph step has what it needs here (the caller checks the device and
        the call); where something lacks, says why, once for each reason."""
        lacking = self._lacks(routing)
        if lacking is not None and lacking not in self._said:
            print(f"ftc: decode steps take the host path (a host round trip per MoE layer): {lacking}",
                  file=sys.stderr)
            self._said.add(lacking)
        return lacking is None

    def _lacks(self, routing: RoutingHook | None) -> str | None:
        """What the one-graph device step lacks here, in words; None: nothing."""
        if self.gather is None:
            return "the expert pool is not mapped into the device (it could not be pinned)"
        if not self.kernel.background:
            return "the CPU expert kernel has no background worker pool (one CPU core)"
        if self.store.kernels is None:
            return "the engine has no generated device expert kernels"
        if routing is not None and not isinstance(routing, DeviceRoutingHook):
            return f"a routing hook ({type(routing).__name__}) that routes on the host"
        return None

    def launch(self, moe_layer: int, t: int, k: int, planner: MissPlanner, stats: OffloadStats) -> Launched:
        """The staged call planned on the device as data, then carried out in the one-graph step's
        order: the plan's fills copied, its CPU job started, its device pairs run. Here the host
        reads the plan's counts and lists back (a sync); the graph step keeps them on the device."""
        t0 = time.perf_counter()
        hidden = self.store.header.hidden
        packed = self.buffers.staged(t, k)
        tables, rule = self.tables.for_call(planner, PLANNED_TOKENS * k)
        plan = self.plan_layer(tables, rule, moe_layer * self.store.num_experts, packed[:, hidden:hidden + k].long(),
                               packed[:, hidden + k:])
        hits, n_fill, n_cpu = plan.counts[:3].tolist()
        count_split(stats, planner, self.store.header.expert_stride, hits, n_fill, n_cpu)
        cpu_out = self.buffers.cpu_out(t).zero_()
        cpu_t0 = time.perf_counter()
        self._start_cpu_job(plan, t, k, n_cpu, cpu_out)
        plan_s = time.perf_counter() - t0
        stats.host_s["plan"] += plan_s
        fills_s = self._fill(plan, n_fill, stats)
        out = self.buffers.device_out(t).zero_()
        if hits + n_fill:
            pairs = plan.pairs
            with stats.compute.measure():
                self.store.experts_on_device(packed[:, :hidden].contiguous(), pairs[:, pairs[0] >= 0], out)
        return Launched(out, cpu_out, cpu_t0, plan_s, fills_s)

    def _start_cpu_job(self, plan: LayerPlan, t: int, k: int, n_cpu: int, cpu_out: torch.Tensor) -> None:
        """The plan's CPU job: through the doorbell where the kernel has a background pool (as the
        graph step posts it), else started on the kernel from the plan's lists, read back."""
        if self.kernel.background:
            self._ring(plan, t, k)
        elif n_cpu:
            offsets = plan.cpu_offsets[:n_cpu + 1].cpu()
            entries = int(offsets[-1])
            x = self.buffers.staged_host(t, k)[:, :self.store.header.hidden].contiguous()
            self.kernel.start(self.store.pool.experts, x, cpu_out, plan.cpu_ids[:n_cpu].cpu(), offsets.int(),
                              plan.cpu_tok[:entries].int().cpu(), plan.cpu_w[:entries].cpu())

    def _fill(self, plan: LayerPlan, n_fill: int, stats: OffloadStats) -> float:
        """The plan's fills: gathered by the kernel (device time only), else copied from the host
        (the host's seconds returned)."""
        if self.gather is None:
            return self.store.fill(plan.fill_slots[:n_fill].cpu().numpy(), plan.fill_rows[:n_fill].cpu().numpy(),
                                   stats)
        with stats.copy.measure():
            self.gather(plan)
        return 0.0

    def _ring(self, plan: LayerPlan, t: int, k: int) -> None:
        """Writes the plan's CPU job and the layer's input into the doorbell's mailbox and rings
        (from the host here; in the one-graph step the device writes and rings)."""
        if self.doorbell is None:
            self._open_doorbell(k)
        bell, n = self.doorbell, t * k
        bell.n_tokens.fill_(t)
        bell.counts.copy_(plan.counts[:3])
        for box, part in ((bell.cpu_ids, plan.cpu_ids), (bell.cpu_tok, plan.cpu_tok), (bell.cpu_w, plan.cpu_w)):
            box[:n].copy_(part)
        bell.cpu_offsets[:n + 1].copy_(plan.cpu_offsets)
        bell.x[:t].copy_(self.buffers.staged_host(t, k)[:, :self.store.header.hidden])
        self._rung = (bell.ring(), t)

    def wait_rung(self, cpu_out: torch.Tensor) -> bool:
        """Waits for the launched call's doorbell job and copies its result into `cpu_out`; False
        where the call rang none (its CPU part is the kernel's own job)."""
        if self._rung is None:
            return False
        (seq, t), self._rung = self._rung, None
        self.doorbell.wait(seq)
        cpu_out.copy_(self.doorbell.out[:t])
        return True

    def _open_doorbell(self, k: int) -> None:
        with torch.inference_mode(False):  # its mailbox is written in place by later calls, in any mode
            self.doorbell = CpuDoorbell(self.kernel, self.store.pool.experts, PLANNED_TOKENS, PLANNED_TOKENS * k,
                                        pinned=self.store.on_gpu)

    def close_doorbell(self, stats: OffloadStats) -> None:
        """Gives the CPU kernel's pool back to the host path (a device step opens it again); the
        device step goes with it, its counts folded into `stats`."""
        if self.doorbell is not None:
            self.drop_step(stats)
            self.doorbell.close()
            self.doorbell = None

    def begin_step(self, k: int, planner: MissPlanner) -> bool:
        """Host work before a device step (eager or replayed): the tables take the host cache's
        state if it changed, the doorbell is open, the device's job numbers are current. True where
        the step was made anew: a new mailbox and counters, so graphs holding the old ones are stale."""
        tables, rule = self.tables.for_call(planner, PLANNED_TOKENS * k)
        if self.doorbell is None:
            self._open_doorbell(k)
        renewed = self.step is None or self.step.tables is not tables
        if renewed:
            from ftc_runtime.experts.device.device_step import DeviceStep  # Triton: only beside a GPU

            with torch.inference_mode(False):  # its counters are reset where stats are read, in any mode
                self.step = DeviceStep(self.store, planner, self.doorbell, self.mapped_rows, tables, rule)
        self.step.before_replay()
        self.step_ran = self.active = True
        return renewed

    def step_timed(self, width: int, seconds: float) -> None:
        """A device step's measured time, for the split's trials (`DeviceTables.step_timed`)."""
        self.tables.step_timed(width, seconds)

    def fold_into(self, stats: OffloadStats) -> None:
        """Adds the device steps' counts since the last fold to `stats` (reads the device)."""
        if self.step_ran:
            self.step.fold_into(stats)
            self.step_ran = False

    def drop_step(self, stats: OffloadStats) -> None:
        """Forgets the device step, its counts folded into `stats` first."""
        self.fold_into(stats)
        self.step = None
