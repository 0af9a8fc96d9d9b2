"""Environment settings, typed, in one place. Read once per process; each has a safe default."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class SettingsError(ValueError):
    """An FTC_* environment variable has a value that cannot be used."""


def _int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a positive integer") from None
    if value < 1:
        raise SettingsError(f"{name}={raw!r}: expected a positive integer")
    return value


def _bool(name: str, default: bool | None) -> bool | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r}: expected 1 or 0")


@dataclass(frozen=True)
class Settings:
    num_threads: int | None  # FTC_NUM_THREADS: CPU expert workers (default: the physical cores)
    cache_dir: Path  # FTC_CACHE_DIR: built kernel libraries, keyed by the hash of their sources
    decode_graphs: bool  # FTC_DECODE_GRAPHS: CUDA graphs for the non-expert work of decode (default 1)
    torch_compile: bool  # FTC_TORCH_COMPILE: fuse that work with torch.compile first (default 1)
    pin_gpu_thread: bool  # FTC_PIN_GPU_THREAD: pin the GPU-driving thread to the core the workers leave (default 0)
    device_plan: bool | None  # FTC_DEVICE_PLAN: plan decode calls on the device as data (unset: on a GPU)
    fused_body: bool  # FTC_FUSED_BODY: a decode layer's attention and router as fused kernels (default 1)
    pdl: bool  # FTC_PDL: a decode layer's body kernels launched with programmatic dependent launch (default 0)
    device_waits_cpu_part: bool  # FTC_DEVICE_WAITS_CPU_PART: the device, not the host, waits for a split's CPU part (1)

    @classmethod
    def from_env(cls) -> Settings:
        cache = os.environ.get("FTC_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ftc")
        return cls(num_threads=_int("FTC_NUM_THREADS"), cache_dir=Path(cache),
                   decode_graphs=_bool("FTC_DECODE_GRAPHS", True), torch_compile=_bool("FTC_TORCH_COMPILE", True),
                   pin_gpu_thread=_bool("FTC_PIN_GPU_THREAD", False), device_plan=_bool("FTC_DEVICE_PLAN", None),
                   fused_body=_bool("FTC_FUSED_BODY", True), pdl=pdl_setting(),
                   device_waits_cpu_part=_bool("FTC_DEVICE_WAITS_CPU_PART", True))


def settings() -> Settings:
    return Settings.from_env()


def pdl_setting() -> bool:
    """FTC_PDL alone: the kernels that may launch with programmatic dependent launch read it at
    each launch, where reading every setting would cost more than the launch."""
    return bool(_bool("FTC_PDL", False))


# How long torch's OpenMP threads spin after a parallel region before they sleep. The defaults
# (GNU: 300000 spins, Intel: 200 ms) keep every core busy between torch ops, and the expert
# workers, pinned to those same cores, then wait a scheduler time slice for their turn: on a
# 2-core machine that made CPU decode 6× slower. A short spin keeps torch's threads warm across
# the ops of one layer and out of the way during the expert kernel.
OPENMP_SPIN = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}


def limit_openmp_spinning() -> None:
    """Sets the OpenMP spin limits unless the user set them; effective only before torch loads."""
    for name, value in OPENMP_SPIN.items():
        os.environ.setdefault(name, value)
