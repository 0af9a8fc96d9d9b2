"""`OffloadedExperts`: routed experts served from a device-side slot cache, with the misses of each
layer split between fills (host→device copies into LRU victims) and in-place CPU computation.

The device is any `torch.device`. On a machine without a GPU it is the CPU, and every part of the
path (cache, split, fills as plain copies, merge) runs and is tested; only speed needs a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .expert_cache import ExpertCache
from .experts import ExpertBackend, Routing
from .ftw import ExpertPool
from .host_memory import pin_in_place
from .kernels import CpuExpertKernel
from .miss_planner import MissPlanner


class _Timer:
    """Seconds spent in measured regions: CUDA events on a GPU (read when asked), else wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.total = 0.0

    @contextmanager
    def measure(self, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.total += time.perf_counter() - t0
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self.pending.append((start, end))

    def seconds(self) -> float:
        for start, end in self.pending:
            end.synchronize()
            self.total += start.elapsed_time(end) / 1e3
        self.pending.clear()
        return self.total


@dataclass
class OffloadStats:
    """Totals over MoE layer calls (unique experts per call, not token-expert pairs), the planner's
    bound for the misses that happened, and the time in each part: CPU experts, host→device
    copies, device experts. Constant size: an engine serving for days keeps the same counters."""

    device: torch.device
    calls: int = 0
    unique: int = 0
    hits: int = 0
    fills: int = 0
    cpu: int = 0
    miss_bound_s: float = 0.0  # Σ MissPlanner.bound_s(m, q) over the calls
    cpu_s: float = 0.0
    copy: _Timer = field(init=False)
    compute: _Timer = field(init=False)

    def __post_init__(self) -> None:
        self.copy, self.compute = _Timer(self.device), _Timer(self.device)

    @property
    def misses(self) -> int:
        return self.fills + self.cpu

    def to_dict(self) -> dict:
        n = max(self.calls, 1)
        return {"calls": self.calls, "unique": self.unique, "hits": self.hits, "fills": self.fills, "cpu": self.cpu,
                "misses": self.misses, "miss_rate": self.misses / self.unique if self.unique else 0.0,
                "mean_m": self.misses / n, "mean_q": self.fills / n,
                "ms_per_call": {"cpu": 1e3 * self.cpu_s / n, "copy": 1e3 * self.copy.seconds() / n,
                                "device": 1e3 * self.compute.seconds() / n}}


class OffloadedExperts(ExpertBackend):
    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel, device: torch.device, n_slots: int,
                 planner: MissPlanner, cache_policy: str = "lru", device_kernel: Callable | None = None):
        h = pool.header
        self.pool, self.kernel, self.device, self.planner = pool, kernel, torch.device(device), planner
        self.num_experts = h.num_experts
        self.cache = ExpertCache(h.num_rows, n_slots, cache_policy)
        self.host_rows = pool.buffer.view(h.num_rows, h.expert_stride)
        # The slots keep FTW's expert-major row layout, so a fill is one contiguous copy.
        self.slots = torch.empty(n_slots, h.expert_stride, dtype=torch.uint8, device=self.device)
        self.banks = {b.name: (b.offset, b.row_bytes, b.row_shape) for b in h.banks}
        self.stats = OffloadStats(self.device)
        # The engine's generated GPU kernel (x, slots, pair_slot, pair_tok, pair_w, out); None: torch.
        self.device_kernel = device_kernel
        self.prompt_counts = np.zeros(h.num_rows, dtype=np.int64)  # static policy: routed ids of the prompt
        on_gpu = self.device.type == "cuda"
        self.pinned = on_gpu and pin_in_place(pool.buffer)
        self.copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.cpu_thread = ThreadPoolExecutor(max_workers=1) if on_gpu else None

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        r = Routing.build(moe_layer * self.num_experts, ids, weights)
        slots = self.cache.lookup(r.ids)
        hit = np.flatnonzero(slots >= 0)
        miss = np.flatnonzero(slots < 0)
        if self.cache.policy == "static" and not self.cache.frozen:
            self.prompt_counts[r.ids] += r.counts()
        # The busiest misses are the ones worth a copy: they carry the most tokens.
        miss = miss[np.argsort(-r.counts()[miss], kind="stable")]
        victims = self.cache.victims(self.planner.fills(miss.size), in_use=slots[hit])
        fill, cpu = miss[: victims.size], miss[victims.size:]
        self._fill(victims, r.ids[fill])
        gpu = np.concatenate([hit, fill])
        gpu_slots = np.concatenate([slots[hit], victims])
        self.cache.touch(gpu_slots)
        self.stats.calls += 1
        self.stats.unique += r.ids.size
        self.stats.hits += hit.size
        self.stats.fills += fill.size
        self.stats.cpu += cpu.size
        self.stats.miss_bound_s += self.planner.bound_s(miss.size, fill.size, self.host_rows.shape[1])
        x = x.float().contiguous()
        cpu_out = self._start_cpu(x, r, cpu)
        with self.stats.compute.measure():
            out = self._device_part(x, r, gpu, gpu_slots)
        cpu_result = cpu_out.result() if self.cpu_thread else cpu_out
        return out + cpu_result.to(self.device, non_blocking=True)

    def end_of_prompt(self) -> None:
        """Static policy: pins the experts the prompt routed to most, once."""
        if self.cache.policy != "static" or self.cache.frozen:
            return
        order = np.argsort(-self.prompt_counts, kind="stable")
        chosen = order[: self.cache.n_slots]
        chosen = chosen[self.prompt_counts[chosen] > 0]
        slots = self.cache.pin(chosen)
        self._copy_rows(slots, chosen)

    def _fill(self, victims: np.ndarray, ids: np.ndarray) -> None:
        self.cache.install(victims, ids)
        self._copy_rows(victims, ids)

    def _copy_rows(self, slots: np.ndarray, ids: np.ndarray) -> None:
        if not slots.size:
            return
        if self.copy_stream is None:
            with self.stats.copy.measure():
                self.slots[torch.from_numpy(slots)] = self.host_rows[torch.from_numpy(ids)]
            return
        # A victim may still be read by kernels queued before this step: copy after them.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream), self.stats.copy.measure(self.copy_stream):
            for s, i in zip(slots.tolist(), ids.tolist(), strict=True):
                self.slots[s].copy_(self.host_rows[i], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def _start_cpu(self, x: torch.Tensor, r: Routing, which: np.ndarray):
        """The CPU experts' partial output (a future when a GPU runs beside it)."""
        def run() -> torch.Tensor:
            t0 = time.perf_counter()
            host_x = x.cpu()
            out = torch.zeros_like(host_x)
            if which.size:
                self.kernel.run(self.pool.bank("gate_up"), self.pool.bank("down"), host_x, out, *r.tensors(which))
            self.stats.cpu_s += time.perf_counter() - t0
            return out

        return self.cpu_thread.submit(run) if self.cpu_thread else run()

    def _weight(self, slot: int, bank: str) -> torch.Tensor:
        offset, nbytes, shape = self.banks[bank]
        return self.slots[slot, offset:offset + nbytes].view(torch.bfloat16).view(shape)

    def _device_part(self, x: torch.Tensor, r: Routing, which: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """Hits and fills on the device, expert by expert, from the slot rows (fp32 arithmetic)."""
        out = torch.zeros_like(x)
        if not which.size:
            return out
        _, offsets, tok_idx, tok_w = r.subset(which)
        if self.device_kernel is not None:
            pair_slot = np.repeat(slots, np.diff(offsets)).astype(np.int32)
            self.device_kernel(x, self.slots, torch.from_numpy(pair_slot).to(self.device),
                               torch.from_numpy(tok_idx).to(self.device), torch.from_numpy(tok_w).to(self.device), out)
            return out
        tok_idx = torch.from_numpy(tok_idx).to(self.device, torch.int64)
        tok_w = torch.from_numpy(tok_w).to(self.device)
        for j, slot in enumerate(slots.tolist()):
            rows = slice(int(offsets[j]), int(offsets[j + 1]))
            t = tok_idx[rows]
            gate, up = F.linear(x[t], self._weight(slot, "gate_up").float()).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self._weight(slot, "down").float())
            out.index_add_(0, t, y * tok_w[rows, None])
        return out
