"""`OffloadStats`: what the offloaded expert path did and where its time went, in constant space
(an engine serving for days keeps the same counters)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class _Timer:
    """Seconds spent in measured regions: CUDA events on a GPU (read when asked), else wall time.
    Event pairs are reused once read: creating two events per region cost ~10 µs of host time in
    every MoE layer of decode."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.total = 0.0

    @contextmanager
    def measure(self, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.total += time.perf_counter() - t0
            return
        if len(self.pending) >= 1024:  # an engine serving for days keeps a bounded list
            self._collect(wait=False)
        start, end = self.free.pop() if self.free else (torch.cuda.Event(enable_timing=True),
                                                        torch.cuda.Event(enable_timing=True))
        start.record(stream)
        yield
        end.record(stream)
        self.pending.append((start, end))

    def _collect(self, wait: bool) -> None:
        done = 0
        for start, end in self.pending:
            if not wait and not end.query():
                break
            end.synchronize()
            self.total += start.elapsed_time(end) / 1e3
            done += 1
        self.free.extend(self.pending[:done])
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
    stream_layers: int = 0  # MoE layers of prompt chunks streamed whole (`LayerStream`)
    streamed: int = 0  # experts those layers copied to the device
    stream_cpu: int = 0  # experts of those layers that the CPU computed in place instead (`PromptSplit`)
    cpu_s: float = 0.0
    # Host time of each phase of a call: waiting for the device's routing, planning (cache, split,
    # CPU start), queueing the fills, launching the device's experts, waiting for the CPU's; and
    # (decode graphs) launching the graph of the layer's non-expert work.
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("sync", "plan", "fills", "launch", "cpu_wait", "layer_launch"), 0.0))
    copy: _Timer = field(init=False)
    compute: _Timer = field(init=False)

    def __post_init__(self) -> None:
        self.copy, self.compute = _Timer(self.device), _Timer(self.device)

    def add(self, calls: int, hits: int, fills: int, cpu: int, miss_bound_s: float) -> None:
        """Counts `calls` MoE layer calls with these unique experts and the planner's bound."""
        self.calls += calls
        self.unique += hits + fills + cpu
        self.hits += hits
        self.fills += fills
        self.cpu += cpu
        self.miss_bound_s += miss_bound_s

    @property
    def misses(self) -> int:
        return self.fills + self.cpu

    def to_dict(self) -> dict:
        n = max(self.calls, 1)
        return {"calls": self.calls, "unique": self.unique, "hits": self.hits, "fills": self.fills, "cpu": self.cpu,
                "misses": self.misses, "miss_rate": self.misses / self.unique if self.unique else 0.0,
                "mean_m": self.misses / n, "mean_q": self.fills / n,
                "stream_layers": self.stream_layers, "streamed": self.streamed, "stream_cpu": self.stream_cpu,
                "ms_per_call": {"cpu": 1e3 * self.cpu_s / n, "copy": 1e3 * self.copy.seconds() / n,
                                "device": 1e3 * self.compute.seconds() / n},
                "host_ms_per_call": {k: round(1e3 * v / n, 4) for k, v in self.host_s.items()}}
