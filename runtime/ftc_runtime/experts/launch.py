"""What each launch path of `OffloadedExperts` (the host's split, `HostSplit`; the device plan,
`DevicePath`) hands back to `finish_staged` (`Launched`), and how it counts its split."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.stats import OffloadStats


@dataclass(frozen=True)
class Launched:
    """A launched call: its two parts ([T, hidden] fp32; their sum is the layer's output), when its
    CPU part started (`time.perf_counter`), and the host's seconds of planning and of queueing
    fills, which the launch clock leaves to their own."""

    device_out: torch.Tensor  # the hits and fills, on the device
    cpu_out: torch.Tensor  # the CPU experts, on the host
    cpu_t0: float
    plan_s: float
    fills_s: float


def count_split(stats: OffloadStats, planner: MissPlanner, expert_bytes: int, hits: int, fills: int,
                cpu: int) -> None:
    """One call's unique experts by where they ran, and the planner's bound for its misses."""
    stats.add(1, hits, fills, cpu, planner.bound_s(fills + cpu, fills, expert_bytes))
