"""`ElasticVram`: one VRAM budget shared at run time by the KV caches and the expert slots.

The plan (`VramPlan`) fixes the non-expert weights and the workspace; what is left is split as
the sequences need it: when their KV caches grow, expert slots are given up; when sequences end,
slots come back. The budget also shrinks while other processes hold device memory (as
`cudaMemGetInfo` reports it) and grows back when they free it. Changes happen only at safe points
that the engine and the scheduler choose (between steps: nothing in flight holds a slot), where
the slot cache is rebuilt at its new size from the host pool (`OffloadedExperts.resize`).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ftc_runtime.experts.offload import OffloadedExperts
from ftc_runtime.experts.vram_plan import VramError, VramPlan, gib

# (total bytes of the device, bytes that other processes hold on it)
MemoryInfo = Callable[[], tuple[int, int]]
# A rebuild copies every kept expert back from host memory (tens of GB at real shapes), so rebuilds
# must be rare: a shrink goes this share of the count below the fit, so that a KV cache (or a
# prefix cache) growing turn by turn does not rebuild at every safe point (each would cost a turn's
# time to first token), and growing waits until the fit is twice that share above the count, so
# that a shrink is not undone at the next safe point.
HEADROOM = 0.05


def cuda_memory_info(device: torch.device) -> MemoryInfo:
    """What others hold: the device's used memory less what this process's allocator reserved
    (read from the allocator's nested statistics: `memory_reserved` flattens all of them first,
    which cost the decode loop half a millisecond per token)."""
    def info() -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_stats_as_nested_dict(device)["reserved_bytes"]["all"]["current"]
        return total, max(0, total - free - reserved)
    return info


@dataclass
class ElasticVram:
    plan: VramPlan
    experts: OffloadedExperts
    memory_info: MemoryInfo | None = None  # None: nothing else shares the device
    max_slots: int | None = None  # at most (default: the plan's count)
    changes: list[tuple[int, int]] = field(default_factory=list)  # (slots before, after)
    history: deque[dict] = field(default_factory=lambda: deque(maxlen=64))  # the last rebalances' splits
    others_at_start: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.max_slots is None:
            self.max_slots = self.plan.n_slots
        # What others held when the budget was planned: what they take beyond it comes out of the
        # budget, as on a card of the budget's size (`--vram-budget` standing in for a smaller one).
        if self.memory_info is not None:
            self.others_at_start = self.memory_info()[1]

    @property
    def slots(self) -> int:
        return self.experts.n_slots  # not `cache`: a safe point that would read the device's tables back

    def budget(self) -> int:
        """The budget as other processes leave it: less what they took since the start, and at
        most what the device has beside them."""
        if self.memory_info is None:
            return self.plan.budget
        total, others = self.memory_info()
        return min(self.plan.budget - max(0, others - self.others_at_start), total - others)

    def rebalance(self, kv_bytes: int) -> int:
        """At a safe point, for sequences whose KV caches need `kv_bytes` by the next safe point:
        the slot count, shrunk below the fit by HEADROOM whenever it no longer fits, grown to the
        fit once that is 2 × HEADROOM above it. Raises VramError when the KV alone does not fit."""
        budget, fixed, stride = self.budget(), self.plan.dense + self.plan.workspace, self.plan.expert_stride
        room = budget - fixed - kv_bytes
        if room < 0:
            raise VramError(f"VRAM budget {gib(budget)}: non-expert weights and workspace {gib(fixed)} and the "
                            f"KV cache's {gib(kv_bytes)} do not fit, even with no expert slots")
        fit, current = min(self.max_slots, room // stride), self.slots
        if fit < current:
            target = max(0, fit - int(HEADROOM * current))
        elif fit - current > 2 * HEADROOM * max(current, 1):
            target = fit
        else:
            target = current
        if target != current:
            self.experts.resize(target)
            self.changes.append((current, target))
            print(f"ftc: VRAM {gib(budget)}: KV {gib(kv_bytes)}, expert slots {current} → {target}", file=sys.stderr)
        self.history.append({"budget": budget, "fixed": fixed, "kv": kv_bytes, "slots": self.slots * stride})
        return self.slots
