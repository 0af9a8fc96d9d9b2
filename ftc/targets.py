"""Hardware targets: named presets, or `auto` (this machine, detected)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ftc_runtime.cpu_info import physical_cpus, supported_isas

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, Target] = {
    # Portable x86-64-v3: runs on any AVX2 machine, with every physical core it finds there.
    "cpu": Target("cpu", "avx2", None),
}


def resolve_target(name: str) -> Target:
    if name == "auto":
        isas = supported_isas()
        if not isas:
            raise TargetError("--target auto: this CPU supports none of the kernel ISAs "
                              "(avx512_bf16, avx2); ftc needs at least AVX2 with FMA")
        return Target("auto", isas[0], len(physical_cpus()))
    try:
        return PRESETS[name]
    except KeyError:
        raise TargetError(f"--target {name!r}: unknown; expected auto or one of {', '.join(PRESETS)}") from None
