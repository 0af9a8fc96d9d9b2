"""Hardware targets: named presets, or `auto` (this machine, detected)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Token-tile sizes each kernel ISA is specialized for, largest first: what fits its registers
# (AVX-512: 32 zmm, 2·NB accumulators for gate/up; AVX2: 16 ymm).
BATCH_BUCKETS = {"avx512_bf16": (8, 4, 2, 1), "avx2": (4, 2, 1)}


class TargetError(ValueError):
    """Unknown target name, or this machine cannot run any kernel ISA."""


@dataclass(frozen=True)
class Target:
    name: str
    isa: str
    cpu_threads: int | None  # None: all physical cores of the machine that runs the engine
    gpu: str | None = None
    vram_bytes: int | None = None
    b_p: float | None = None  # pinned host→GPU GB/s at one expert's size
    b_h: float | None = None  # CPU expert kernel GB/s with all workers
    b_p_concurrent: float | None = None  # host→GPU GB/s while the CPU kernel runs
    b_h_concurrent: float | None = None  # CPU kernel GB/s while copies run
    gpu_read_gbps: float | None = None  # the GPU's memory bandwidth (its data sheet's)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_GB = 10**9
PRESETS: dict[str, Target] = {
    # Portable x86-64-v3: runs on any AVX2 machine, with every physical core it finds there.
    "cpu": Target("cpu", "avx2", None),
    # The FreeToken paper's machines (B_P, B_H as it measured them); their CPUs are taken as AVX2.
    # GPU memory bandwidths from the data sheets.
    "rtx-4060-laptop": Target("rtx-4060-laptop", "avx2", None, "RTX 4060 Laptop", 8 * _GB, 11.8, 47.5,
                              gpu_read_gbps=256.0),
    "rtx-3090": Target("rtx-3090", "avx2", None, "RTX 3090", 24 * _GB, 25.3, 56.7, gpu_read_gbps=936.0),
    "rtx-4090": Target("rtx-4090", "avx2", None, "RTX 4090", 24 * _GB, 25.1, 63.2, gpu_read_gbps=1008.0),
    "rtx-5090": Target("rtx-5090", "avx2", None, "RTX 5090", 32 * _GB, 49.0, 53.8, gpu_read_gbps=1792.0),
    "rtx-5090-server": Target("rtx-5090-server", "avx2", None, "RTX 5090", 32 * _GB, 52.7, 77.3,
                              gpu_read_gbps=1792.0),
    # The paper's workstation for GLM-5.2: a Xeon 8559C (AVX-512 with BF16, and AMX), so its CPU
    # kernels are AVX-512 BF16; compiled on a CPU without it, they are checked where the engine loads.
    "rtx-pro-6000": Target("rtx-pro-6000", "avx512_bf16", None, "RTX PRO 6000", 96 * _GB, 51.5, 178.0,
                           gpu_read_gbps=1792.0),
    # The device machine, its rates as the one-graph decode step keeps them (docs/performance.md,
    # "The h200 target's rates"): qwen3-30b-a3b bf16 experts (9 MiB) at 32 GiB with uniform routing,
    # each phase's device time per MoE layer: copies alone (`gpu`) 48.9 GB/s, the CPU experts alone
    # (`cpu`: post to answer) 112.5, and beside each other (`adaptive`) 49.1 and 75.7, the host's
    # memory bus shared; the GPU's read rate as torch measures it there.
    "h200": Target("h200", "avx512_bf16", 16, "NVIDIA H200", 143771 * 2**20, 48.9, 112.5, 49.1, 75.7,
                   gpu_read_gbps=4057.2),
}


def resolve_target(name: str) -> Target:
    """`auto`, a preset name, or a profile YAML written by `ftc profile`."""
    # Here, not at the top: the CLI imports this module for its help text, without torch.
    from ftc_runtime.cpu_info import supported_isas
    from ftc_runtime.profile import HardwareProfile

    if name.endswith((".yaml", ".yml")):
        try:
            prof = HardwareProfile.from_yaml(Path(name))
        except ValueError as e:
            raise TargetError(f"--target {name}: {e}") from None
        return Target(Path(name).stem, prof.isa, prof.physical_cores, prof.gpu, prof.vram_bytes, prof.b_p, prof.b_h,
                      prof.b_p_during_cpu, prof.b_h_during_copy)
    if name == "auto":
        isas = supported_isas()
        if not isas:
            raise TargetError("--target auto: this CPU supports none of the kernel ISAs "
                              "(avx512_bf16, avx2); ftc needs at least AVX2 with FMA")
        return Target("auto", isas[0], None)  # every core of the machine that runs it, not of this one
    try:
        return PRESETS[name]
    except KeyError:
        raise TargetError(f"--target {name!r}: unknown; expected auto, a profile .yaml from `ftc profile`, "
                          f"or one of {', '.join(PRESETS)}") from None
