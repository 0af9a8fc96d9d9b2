"""`HardwareProfile`: what the miss split needs to know about a machine, measured.

B_P is pinned host→GPU bandwidth at one expert's size; B_H is the engine's own CPU expert kernel
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
    stream = torch.cuda.Stream(device)
    times = []
    deadline = time.perf_counter() + seconds
    with torch.cuda.stream(stream):
        while (stop is None and time.perf_counter() < deadline) or (stop is not None and not stop.is_set()):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:] or times) / 1e9


def measure_profile(spec: ModelSpec, pool: ExpertPool, kernel: CpuExpertKernel, device: str | None,
                    seconds: float = 2.0) -> HardwareProfile:
    """Measures this machine with the engine's own kernel and pool (and `device`, a CUDA GPU); a
    rate no machine has (cores held by other processes slow the kernel's spinning workers a
    hundredfold) is refused rather than written."""
    prof = _measure(spec, pool, kernel, device, seconds)
    rates = {name: v for name, v in asdict(prof).items() if name in RATES and v is not None}
    for name, v in rates.items():  # as measured: rounded, 0.097 would pass as 0.1
        if not plausible_gbps(v):
            raise ValueError(f"ftc profile measured {name} = {v} GB/s, outside what a machine has "
                             f"[{PLAUSIBLE_GBPS[0]}, {PLAUSIBLE_GBPS[1]:g}]: were its cores busy with other "
                             "processes? Measure again on an idle machine")
    return replace(prof, **{name: round(v, 2) for name, v in rates.items()})


def _measure(spec: ModelSpec, pool: ExpertPool, kernel: CpuExpertKernel, device: str | None,
             seconds: float) -> HardwareProfile:
    gpu = device is not None and torch.device(device).type == "cuda"
    cpus = physical_cpus()
    if gpu and len(cpus) > 1 and not kernel.background:  # the GPU engine's workers (see above)
        kernel = kernel.on_cpus(gpu_engine_worker_cpus(cpus), background=True)
    b_h = expert_kernel_gbps(spec, pool, kernel, 1, seconds)["gbps"]
    base = dict(isa=kernel.isa, physical_cores=len(physical_cpus()), host_read_gbps=torch_read_gbps(), b_h=b_h,
                pool_bytes=pool.nbytes, l3_bytes=l3_bytes())
    if not gpu:
        return HardwareProfile(**base)
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    expert = pool.header.expert_stride
    b_p = pinned_copy_gbps(dev, expert, seconds)
    stop, result = threading.Event(), {}
    copier = threading.Thread(target=lambda: result.setdefault("b_p", pinned_copy_gbps(dev, expert, stop=stop)))
    copier.start()
    try:
        b_h_during = expert_kernel_gbps(spec, pool, kernel, 1, seconds)["gbps"]
    finally:
        stop.set()
        copier.join()
    return HardwareProfile(**base, gpu=props.name, vram_bytes=props.total_memory, b_p=b_p,
                           b_h_during_copy=b_h_during, b_p_during_cpu=result["b_p"])
