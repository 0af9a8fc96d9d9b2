"""`MissPlanner`: how many of a layer's unique cache misses cross PCIe into the GPU cache (`q`);
the other `m − q` are computed in place on the CPU. Nothing is dropped: both parts are summed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MissPolicy = Literal["adaptive", "gpu", "cpu", "half"]
MISS_POLICIES: tuple[str, ...] = ("adaptive", "gpu", "cpu", "half")


@dataclass(frozen=True)
class MissPlanner:
    """`adaptive`: q = round(m · B_P / B_H) clamped to [1, m] (all m when B_H ≤ B_P), the split at
    which copying q experts and computing m − q on the CPU take the same time; `gpu`: q = m;
    `cpu`: q = 0; `half`: q = ceil(m / 2)."""

    policy: MissPolicy = "adaptive"
    b_p: float = 1.0  # pinned host→GPU GB/s for one expert
    b_h: float = 1.0  # CPU expert kernel GB/s, all workers

    def __post_init__(self) -> None:
        if self.policy not in MISS_POLICIES:
            raise ValueError(f"miss policy {self.policy!r}: expected one of {', '.join(MISS_POLICIES)}")
        if self.b_p <= 0 or self.b_h <= 0:
            raise ValueError(f"bandwidths must be positive (B_P = {self.b_p}, B_H = {self.b_h})")

    def fills(self, m: int) -> int:
        if m <= 0 or self.policy == "cpu":
            return 0
        if self.policy == "half":
            return (m + 1) // 2
        if self.policy == "gpu" or self.b_h <= self.b_p:
            return m
        q = math.floor(m * self.b_p / self.b_h + 0.5)  # round half up, not to even
        return min(m, max(1, q))


def miss_bound_s(m: int, q: int, expert_bytes: int, b_p: float, b_h: float) -> float:
    """DESIGN.md's time for one layer's misses: q copies over PCIe beside m − q CPU experts, the
    CPU keeping B_H − B_P of the memory bandwidth while the copies run (B_H when B_H ≤ B_P)."""
    cpu_rate = b_h - b_p if b_h > b_p else b_h
    return max(q * expert_bytes / (b_p * 1e9), (m - q) * expert_bytes / (cpu_rate * 1e9))
