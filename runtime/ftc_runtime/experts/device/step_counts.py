"""A decode step's MoE call counted on the device by one Triton kernel, for the step's CUDA graph:
the call, its hits, fills and CPU experts added to the step's counters, and its miss bound
(`MissPlanner.bound_s`, in fp64) to their sum. Written as torch operations these were some twenty
kernels per MoE layer: a thousand nodes of a 48-layer step's graph, each one a launch to replay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime.experts.miss_planner import MissPlanner


@triton.jit
def _count_call(plan_counts, counts, bound_s, seconds):
    hits, fills, cpu = tl.load(plan_counts), tl.load(plan_counts + 1), tl.load(plan_counts + 2)
    tl.store(counts, tl.load(counts) + 1)
    tl.store(counts + 1, tl.load(counts + 1) + hits)
    tl.store(counts + 2, tl.load(counts + 2) + fills)
    tl.store(counts + 3, tl.load(counts + 3) + cpu)
    # seconds per expert: a copy and a CPU expert while both run, then each alone
    copy, on_cpu = tl.load(seconds), tl.load(seconds + 1)
    alone_copy, alone_cpu = tl.load(seconds + 2), tl.load(seconds + 3)
    q, m = fills.to(tl.float64), (fills + cpu).to(tl.float64)
    both = tl.maximum(q * copy, (m - q) * on_cpu)
    alone = tl.where(fills == 0, m * alone_cpu, m * alone_copy)
    tl.store(bound_s, tl.load(bound_s) + tl.where((fills == 0) | (cpu == 0), alone, both))


class StepCounts:
    """The step's counters on `device`: calls, hits, fills, CPU experts (int64 [4]) and the sum of
    the calls' miss bounds in seconds (fp64 [1]), at the planner's rates."""

    def __init__(self, planner: MissPlanner, expert_bytes: int, device: torch.device):
        self.counts = torch.zeros(4, dtype=torch.int64, device=device)
        self.bound_s = torch.zeros(1, dtype=torch.float64, device=device)
        gbps = (*planner.rates(), planner.b_p, planner.b_h)
        self.seconds = torch.tensor([expert_bytes / (r * 1e9) for r in gbps], dtype=torch.float64, device=device)

    def add(self, plan_counts: torch.Tensor) -> None:
        """Counts one call whose plan counted `plan_counts` (hits, fills, CPU experts, ...)."""
        _count_call[(1,)](plan_counts, self.counts, self.bound_s, self.seconds, num_warps=1)

    def take(self) -> tuple[list[int], float]:
        """The counts and the bound so far, the counters then reset (reads the device)."""
        counts, bound = self.counts.tolist(), float(self.bound_s)
        self.counts.zero_()
        self.bound_s.zero_()
        return counts, bound
