"""What this CPU can run: instruction sets and physical cores (for kernel choice and pinning)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

# The kernel ISAs that ftc generates, best first, with the cpuinfo flags each one needs.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16"),
    "avx2": ("avx2", "fma"),
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported_isas() -> list[str]:
    flags = cpu_flags()
    return [isa for isa, need in ISA_FLAGS.items() if all(f in flags for f in need)]


def missing_flags(isa: str) -> list[str]:
    return [f for f in ISA_FLAGS[isa] if f not in cpu_flags()]


# The CPUs this process may use, read once before any thread is pinned (the GPU-driving thread
# pins itself to one core: asked later, sched_getaffinity would answer that one core).
_PROCESS_CPUS = sorted(os.sched_getaffinity(0))


def physical_cpus() -> list[int]:
    """One logical CPU per physical core that this process may run on (SMT siblings dropped)."""
    allowed = _PROCESS_CPUS
    seen: set[tuple[str, str]] = set()
    chosen = []
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = (str(cpu), "")
        if key not in seen:
            seen.add(key)
            chosen.append(cpu)
    return chosen


def worker_cpus(threads: int | None = None) -> list[int]:
    """The CPUs the expert workers are pinned to: the first `threads` physical cores (all of them
    when None), never more than this machine has."""
    cpus = physical_cpus()
    return cpus[: max(1, min(threads or len(cpus), len(cpus)))]


def gpu_engine_worker_cpus(cpus: list[int]) -> list[int]:
    """The CPU expert workers of a GPU engine: all of `cpus` but the first one (8 or more: two),
    left free for the thread that drives the GPU and for the rest (CUDA driver threads, the OS)."""
    return cpus[2 if len(cpus) >= 8 else 1:]


def pin_this_thread(cpu: int) -> None:
    """Keeps the calling thread on `cpu` (best effort): off the cores of pinned expert workers,
    which spin between MoE layers and would take its time slices."""
    try:
        os.sched_setaffinity(0, {cpu})
    except (OSError, AttributeError):
        pass
