"""`HardwareProfile`: what the miss split needs to know about a machine, measured.

B_P is the decode step's fill rate: random experts of the engine's own pool read by its fill
kernel through the pool's device mapping, a few at a time as a layer's split copies them (the
host's side of that path differs between machines of one GPU: 48.9 GB/s in an H200 machine's
decode steps, 26-30 in an H100 machine's, docs/performance.md). B_H is the engine's own CPU expert kernel
on all its workers, over a pool far larger than the caches. With a GPU, those are the workers of
the GPU engine: the physical cores but one or two, left to the thread driving the GPU (with all
cores busy, that thread's copies stalled the kernel's barriers: 14.7 GB/s instead of 90 on the
device). Both are also measured while the other runs: the paper assumes the CPU keeps B_H − B_P
during copies, but where the cores rather than DRAM limit the kernel, DMA and CPU reads may add
up, and the split should follow what is measured.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import yaml

from ftc_runtime.artifact import PLAUSIBLE_GBPS, plausible_gbps
from ftc_runtime.cpu_info import gpu_engine_worker_cpus, physical_cpus
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.throughput import expert_kernel_gbps, l3_bytes, torch_read_gbps
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.spec import ModelSpec, short_repr

FILLS_PER_CALL = 4  # the fills B_P is measured with: about what a layer's split copies
RATES = ("host_read_gbps", "b_h", "b_p", "b_h_during_copy", "b_p_during_cpu")  # GB/s


@dataclass(frozen=True)
class HardwareProfile:
    isa: str
    physical_cores: int
    host_read_gbps: float
    b_h: float  # CPU expert kernel GB/s, all workers, batch 1
    pool_bytes: int  # the pool B_H was measured on (a pool within the caches overstates B_H)
    l3_bytes: int
    gpu: str | None = None
    vram_bytes: int | None = None
    b_p: float | None = None  # pinned host→GPU GB/s at one expert's size
    b_h_during_copy: float | None = None
    b_p_during_cpu: float | None = None

    def to_yaml(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def from_yaml(cls, path: Path) -> HardwareProfile:
        try:
            prof = cls(**yaml.safe_load(path.read_text()))
        except (OSError, yaml.YAMLError, TypeError) as e:
            raise ValueError(f"{path}: not a hardware profile ({e})") from None
        for name in RATES:
            v = getattr(prof, name)
            if (v is not None or name in ("host_read_gbps", "b_h")) and not plausible_gbps(v):
                raise ValueError(f"{path}: field '{name}' = {short_repr(v)}: expected GB/s in "
                                 f"[{PLAUSIBLE_GBPS[0]}, {PLAUSIBLE_GBPS[1]:g}]")
        return prof


def pinned_copy_gbps(device: torch.device, nbytes: int, seconds: float = 0.5, stop: threading.Event | None = None
                     ) -> float:
    """Pinned host→device copies of `nbytes` each, on a stream of their own, back to back; runs
    until `stop` is set when one is given."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _timed_gbps(device, nbytes, lambda _i: dst.copy_(src, non_blocking=True), seconds, stop)


def fill_gbps(pool: ExpertPool, device: torch.device, seconds: float = 0.5, stop: threading.Event | None = None,
              fills: int = FILLS_PER_CALL) -> float:
    """The decode step's fills as it makes them: `fills` random experts of the pool at a time, read
    by its fill kernel through the pool's device mapping into device memory, fresh rows each time
    (rows read again could come from the host's caches); a pool that cannot be mapped has no such
    fills (its experts all run on the CPU), and one pinned buffer's copies stand in."""
    from ftc_runtime.experts.device.gather_fills import gather_rows  # Triton: only beside a GPU
    from ftc_runtime.io.host_memory import MappedHost, mapped_address, pin_in_place

    rows, stride = pool.experts.shape[0], pool.header.expert_stride
    address = mapped_address(pool.buffer, pool.experts.data_ptr()) if pin_in_place(pool.buffer) else None
    if address is None:
        return pinned_copy_gbps(device, stride, seconds, stop)
    src, fills = MappedHost(address), min(fills, rows)
    picks = torch.stack([torch.randperm(rows)[:fills] for _ in range(64)]).to(device)
    slot_ids, counts = torch.arange(fills, device=device), torch.tensor([0, fills, 0, 0], device=device)
    dst = torch.empty(fills, stride, dtype=torch.uint8, device=device)
    return _timed_gbps(device, fills * stride, lambda i: gather_rows(src, dst, picks[i % len(picks)], slot_ids, counts),
                       seconds, stop)


def _timed_gbps(device: torch.device, nbytes: int, move: Callable[[int], object], seconds: float,
                stop: threading.Event | None) -> float:
    """GB/s of `move(i)` (`nbytes` each) on a stream of its own, one after another, each timed by
    events (the median), after one untimed (a kernel's first call compiles it); for `seconds`, or
    until `stop` is set."""
    stream, times, i = torch.cuda.Stream(device), [], 1
    with torch.cuda.device(device), torch.cuda.stream(stream):
        move(0)
        stream.synchronize()
        deadline = time.perf_counter() + seconds
        while not times or (time.perf_counter() < deadline if stop is None else not stop.is_set()):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            move(i)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            i += 1
    return nbytes / statistics.median(times) / 1e9


def measure_profile(spec: ModelSpec, pool: ExpertPool, kernel: CpuExpertKernel, device: str | None,
                    seconds: float = 2.0) -> HardwareProfile:
    """Measures this machine with the engine's own kernel and pool (and `device`, a CUDA GPU); a
    rate no machine has (cores held by other processes slow the kernel's spinning workers a
    hundredfold) is refused rather than written."""
    gpu = device is not None and torch.device(device).type == "cuda"
    rates = split_rates(spec, pool, kernel, torch.device(device) if gpu else None, seconds)
    host_read = torch_read_gbps()
    _check_plausible({"host_read_gbps": host_read})
    base = HardwareProfile(isa=kernel.isa, physical_cores=len(physical_cpus()), host_read_gbps=round(host_read, 2),
                           pool_bytes=pool.nbytes, l3_bytes=l3_bytes(), **rates)
    if not gpu:
        return base
    props = torch.cuda.get_device_properties(torch.device(device))
    return replace(base, gpu=props.name, vram_bytes=props.total_memory)


def split_rates(spec: ModelSpec, pool: ExpertPool, kernel: CpuExpertKernel, device: torch.device | None,
                seconds: float) -> dict[str, float]:
    """What the miss split prices with, in GB/s: B_H (`b_h`) and, with a GPU, B_P (`b_p`) and each
    beside the other (`b_p_during_cpu`, `b_h_during_copy`), rounded; refused where implausible."""
    cpus = physical_cpus()
    if device is not None and len(cpus) > 1 and not kernel.background:  # the GPU engine's workers (see above)
        kernel = kernel.on_cpus(gpu_engine_worker_cpus(cpus), background=True)
    rates = {"b_h": expert_kernel_gbps(spec, pool, kernel, 1, seconds)["gbps"]}
    if device is not None:
        rates["b_p"] = fill_gbps(pool, device, seconds)
        stop, result = threading.Event(), {}
        copier = threading.Thread(target=lambda: result.setdefault("b_p", fill_gbps(pool, device, stop=stop)))
        copier.start()
        try:
            rates["b_h_during_copy"] = expert_kernel_gbps(spec, pool, kernel, 1, seconds)["gbps"]
        finally:
            stop.set()
            copier.join()
        rates["b_p_during_cpu"] = result["b_p"]
    _check_plausible(rates)
    return {name: round(v, 2) for name, v in rates.items()}


def _check_plausible(rates: dict[str, float]) -> None:
    for name, v in rates.items():  # as measured: rounded, 0.097 would pass as 0.1
        if not plausible_gbps(v):
            raise ValueError(f"ftc profile measured {name} = {v} GB/s, outside what a machine has "
                             f"[{PLAUSIBLE_GBPS[0]}, {PLAUSIBLE_GBPS[1]:g}]: were its cores busy with other "
                             "processes? Measure again on an idle machine")


LOAD_SECONDS = 0.3  # each measurement of `RateProbe`: where an engine loads on a GPU its rates are not for


@dataclass(frozen=True)
class RateProbe:
    """`split_rates` of an engine's pool and kernel on `device`, measured once per process for each
    kind of pool (a server or a benchmark loads one engine again and again)."""

    spec: ModelSpec
    pool: ExpertPool
    kernel: CpuExpertKernel
    device: torch.device
    seconds: float = LOAD_SECONDS

    def measure(self) -> dict[str, float]:
        h = self.pool.header
        key = (str(self.device), self.kernel.isa, h.expert_stride, h.num_moe_layers, h.num_experts,
               self.spec.hidden_size)
        if key not in _PROBED:
            _PROBED[key] = split_rates(self.spec, self.pool, self.kernel, self.device, self.seconds)
        return _PROBED[key]


_PROBED: dict[tuple, dict[str, float]] = {}
