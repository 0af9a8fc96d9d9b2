"""`OffloadedExperts`: routed experts served from a device-side slot cache, with the misses of each
layer split between fills (host→device copies into LRU victims) and in-place CPU computation.

The device is any `torch.device`. On a machine without a GPU it is the CPU, and every part of the
path (cache, split, fills as plain copies, merge) runs and is tested; only speed needs a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
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
        if len(self.pending) >= 1024:  # an engine serving for days keeps a bounded list
            self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        done = 0
        for start, end in self.pending:
            if not wait and not end.query():
                break
            end.synchronize()
            self.total += start.elapsed_time(end) / 1e3
            done += 1
        del self.pending[:done]

    def seconds(self) -> float:
        self._collect(wait=True)
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
    """Per MoE layer call: one device→host copy of the layer's input and routing (one sync), the
    cache lookup and miss split on the host, the CPU experts started in the background at once,
    the fills copied on a copy stream, the hits and then the fills computed on the device, and the
    CPU part added when it is done. The pinned staging buffers are reused by the next call only
    after that call's sync, which orders it after every copy of this one."""

    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel, device: torch.device, n_slots: int,
                 planner: MissPlanner, cache_policy: str = "lru", device_kernel: Callable | None = None):
        h = pool.header
        self.pool, self.kernel, self.device, self.planner = pool, kernel, torch.device(device), planner
        self.num_experts = h.num_experts
        self.cache = ExpertCache(h.num_rows, n_slots, cache_policy)
        self.host_rows = pool.buffer.view(h.num_rows, h.expert_stride)
        self.gate_up, self.down = pool.bank("gate_up"), pool.bank("down")
        # The slots keep FTW's expert-major row layout, so a fill is one contiguous copy.
        self.slots = torch.empty(n_slots, h.expert_stride, dtype=torch.uint8, device=self.device)
        self.banks = {b.name: (b.offset, b.row_bytes, b.row_shape) for b in h.banks}
        self.stats = OffloadStats(self.device)
        # The engine's generated GPU kernel (x, slots, pair_slot, pair_tok, pair_w, out); None: torch.
        self.device_kernel = device_kernel
        self.prompt_counts = np.zeros(h.num_rows, dtype=np.int64)  # static policy: routed ids of the prompt
        self.on_gpu = self.device.type == "cuda"
        self.pinned = self.on_gpu and pin_in_place(pool.buffer)
        self.copy_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self._staging: dict[str, torch.Tensor] = {}

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        hidden = x.shape[1]
        host = self._to_host(x, ids, weights)
        hx, k = host[:, :hidden].contiguous(), ids.shape[1]
        r = Routing.build(moe_layer * self.num_experts, host[:, hidden:hidden + k].long(), host[:, hidden + k:])
        slots = self.cache.lookup(r.ids)
        hit, miss = np.flatnonzero(slots >= 0), np.flatnonzero(slots < 0)
        if self.cache.policy == "static" and not self.cache.frozen:
            self.prompt_counts[r.ids] += r.counts()
        # The busiest misses are the ones worth a copy: they carry the most tokens.
        miss = miss[np.argsort(-r.counts()[miss], kind="stable")]
        victims = self.cache.victims(self.planner.fills(miss.size), in_use=slots[hit])
        fill, cpu = miss[: victims.size], miss[victims.size:]
        cpu_out = self._start_cpu(hx, r, cpu)
        self.cache.install(victims, r.ids[fill])
        self._copy_rows(victims, r.ids[fill])
        self.cache.touch(np.concatenate([slots[hit], victims]))
        self._count(r, hit, fill, cpu)
        out = self._device_part(x.float(), r, hit, slots[hit], fill, victims)
        self._finish_cpu()
        return out + cpu_out.to(self.device, non_blocking=True)

    def end_of_prompt(self) -> None:
        """Static policy: pins the experts the prompt routed to most, once."""
        if self.cache.policy != "static" or self.cache.frozen:
            return
        order = np.argsort(-self.prompt_counts, kind="stable")
        chosen = order[: self.cache.n_slots]
        chosen = chosen[self.prompt_counts[chosen] > 0]
        slots = self.cache.pin(chosen)
        self._copy_rows(slots, chosen)

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused host buffer (pinned with a GPU), grown when a call needs more."""
        n = int(np.prod(shape))
        buf = self._staging.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = torch.empty(max(n, 1), dtype=dtype, pin_memory=self.on_gpu)
            self._staging[name] = buf
        return buf[:n].view(shape)

    def _to_host(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[T, hidden + 2k] fp32 on the host: x, the ids (exact in fp32 below 2^24) and the weights,
        in one copy and one sync."""
        packed = torch.cat([x.float(), ids.float(), weights.float()], dim=1)
        if not self.on_gpu:
            return packed
        host = self._buffer("in", tuple(packed.shape), torch.float32)
        host.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def _count(self, r: Routing, hit: np.ndarray, fill: np.ndarray, cpu: np.ndarray) -> None:
        s = self.stats
        s.calls += 1
        s.unique += r.ids.size
        s.hits += hit.size
        s.fills += fill.size
        s.cpu += cpu.size
        s.miss_bound_s += self.planner.bound_s(fill.size + cpu.size, fill.size, self.host_rows.shape[1])

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

    def _start_cpu(self, x: torch.Tensor, r: Routing, which: np.ndarray) -> torch.Tensor:
        """Starts the CPU experts at `which` (in the background where the kernel has its own
        workers); returns their output buffer, complete after `_finish_cpu`."""
        out = self._buffer("cpu_out", tuple(x.shape), torch.float32).zero_()
        self._cpu_t0 = time.perf_counter()
        if which.size:
            self.kernel.start(self.gate_up, self.down, x, out, *r.tensors(which))
        return out

    def _finish_cpu(self) -> None:
        self.kernel.wait()
        self.stats.cpu_s += time.perf_counter() - self._cpu_t0

    def _device_part(self, x: torch.Tensor, r: Routing, hit: np.ndarray, hit_slots: np.ndarray, fill: np.ndarray,
                     fill_slots: np.ndarray) -> torch.Tensor:
        """Hits, then (once their copies have landed) fills, on the device from the slot rows."""
        out = torch.zeros_like(x)
        pairs = self._pairs(r, hit, hit_slots, fill, fill_slots)
        with self.stats.compute.measure():
            n_hit = int(r.offsets[hit + 1].sum() - r.offsets[hit].sum())
            self._experts_on_device(x, pairs[:, :n_hit], out)
            if self.copy_stream is not None and fill.size:
                torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self._experts_on_device(x, pairs[:, n_hit:], out)
        return out

    def _pairs(self, r: Routing, hit: np.ndarray, hit_slots: np.ndarray, fill: np.ndarray,
               fill_slots: np.ndarray) -> torch.Tensor:
        """int32 [3, pairs] on the device, hits first: slot, token row, router weight (its bits)."""
        which, slots = np.concatenate([hit, fill]), np.concatenate([hit_slots, fill_slots])
        _, offsets, tok_idx, tok_w = r.subset(which)
        host = self._buffer("pairs", (3, tok_idx.size), torch.int32)
        arr = host.numpy()
        arr[0] = np.repeat(slots, np.diff(offsets))
        arr[1] = tok_idx
        arr[2] = tok_w.view(np.int32)
        return host.to(self.device, non_blocking=True)

    def _experts_on_device(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        if not pairs.shape[1]:
            return
        pair_slot, pair_tok, pair_w = pairs[0], pairs[1], pairs[2].view(torch.float32)
        if self.device_kernel is not None:
            self.device_kernel(x, self.slots, pair_slot, pair_tok, pair_w, out)
            return
        # torch: one expert at a time (pairs of one slot are adjacent), fp32 arithmetic.
        slots = pair_slot.tolist()
        starts = [0] + [j for j in range(1, len(slots)) if slots[j] != slots[j - 1]] + [len(slots)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            t = pair_tok[a:b].long()
            gate, up = F.linear(x[t], self._weight(slots[a], "gate_up").float()).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self._weight(slots[a], "down").float())
            out.index_add_(0, t, y * pair_w[a:b, None])

    def _weight(self, slot: int, bank: str) -> torch.Tensor:
        offset, nbytes, shape = self.banks[bank]
        return self.slots[slot, offset:offset + nbytes].view(torch.bfloat16).view(shape)
