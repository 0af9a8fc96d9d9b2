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
    """`adaptive`: the balanced split, where copies and CPU experts end together while both run,
    q / B_P' = (m − q) / B_H', so q = round(m · B_P' / (B_P' + B_H')), at least one (a fill also
    caches its expert); unless the performance model (`bound_s`) prices another q from 0 to m
    faster, then that one. B_P' and B_H' are the rates measured with both running (`ftc
    profile`); a side alone keeps its own, B_P or B_H. Where both share the host's memory bus,
    B_P' + B_H' is not much more than B_H, and a split of a few misses (whole experts on either
    side) loses to the CPU alone: then q = 0. Without measured rates the paper's model holds
    (B_P' = B_P, B_H' = B_H − B_P), in which every split takes at least the CPU's time alone, so it
    cannot rank them: q is the balanced one, the paper's q* = m · B_P / B_H, and all m go to the
    GPU when B_H ≤ B_P. `gpu`: q = m; `cpu`: q = 0; `half`: q = ceil(m / 2).

    That split prices one step only. With temporal locality (real routing) an expert computed on
    the CPU comes back, a miss again each time, where a fill would make it a hit: on the device the
    adaptive split decoded 22% slower than `gpu` with the model's own routing
    (docs/history/performance-log.md, issue 3).
    So adaptive also fills every miss that the CPU computed within the last `recent_tokens` tokens
    (q = max(q, those), filled first). Without locality few misses recur that soon, and each such
    fill evicts an expert as likely to come back as the one it brings: `OffloadedExperts` sets the
    window to 0 where a prompt's routing recurs no more than random routing does (`RecurrenceMeter`).
    Then a fill only serves its own call (`keeps_fills` False): its slot goes back to the front of
    the victims' order, as an empty slot's, and the next fill takes it again, so the cache keeps
    what the prompt left. A streamed prompt leaves whole layers (`ExpertCache.scan_victims`), whose
    calls have no misses, and the other layers' misses go to the CPU in fewer, larger jobs, which
    its kernel runs faster than as many experts spread over every layer."""

    policy: MissPolicy = "adaptive"
    b_p: float = 1.0  # pinned host→GPU GB/s for one expert
    b_h: float = 1.0  # CPU expert kernel GB/s, all workers
    b_p_concurrent: float | None = None  # host→GPU GB/s while the CPU kernel runs
    b_h_concurrent: float | None = None  # CPU kernel GB/s while copies run
    recent_tokens: int = 4  # adaptive: misses computed on the CPU this recently are filled

    def __post_init__(self) -> None:
        if self.policy not in MISS_POLICIES:
            raise ValueError(f"miss policy {self.policy!r}: expected one of {', '.join(MISS_POLICIES)}")
        rates = (self.b_p, self.b_h, self.b_p_concurrent or 1.0, self.b_h_concurrent or 1.0)
        if min(rates) <= 0:
            raise ValueError(f"bandwidths must be positive (B_P = {self.b_p}, B_H = {self.b_h}, "
                             f"concurrent {self.b_p_concurrent}, {self.b_h_concurrent})")

    @property
    def measured_concurrency(self) -> bool:
        return self.b_p_concurrent is not None and self.b_h_concurrent is not None

    def rates(self) -> tuple[float, float]:
        """(copy GB/s, CPU GB/s) while both run; the paper's model unless measured."""
        if self.measured_concurrency:
            return self.b_p_concurrent, self.b_h_concurrent
        return self.b_p, (self.b_h - self.b_p if self.b_h > self.b_p else self.b_h)

    def fills(self, m: int) -> int:
        if m <= 0 or self.policy == "cpu":
            return 0
        if self.policy == "half":
            return (m + 1) // 2
        if self.policy == "gpu" or (not self.measured_concurrency and self.b_h <= self.b_p):
            return m
        balanced = self._balanced(m)
        if not self.measured_concurrency:
            return balanced
        fastest = min(self._candidates(m), key=lambda q: self.bound_s(m, q, 1))  # the first: the fewest fills
        return balanced if self.bound_s(m, balanced, 1) <= self.bound_s(m, fastest, 1) * (1 + 1e-9) else fastest

    def _candidates(self, m: int) -> list[int]:
        """Where the least `bound_s` over q = 0..m lies, ascending: one side alone (0, m), or a split
        next to where both sides end together; the split's time falls before that point and rises
        after it, so no other split is faster. O(1) per call: the general path plans each call."""
        copy, cpu = self.rates()
        x = m * copy / (copy + cpu)
        splits = {min(max(q, 1), m - 1) for q in (math.floor(x), math.ceil(x))} if m > 1 else set()
        return sorted({0, m} | splits)

    def _balanced(self, m: int) -> int:
        """The q at which copies and CPU experts end together while both run, within [1, m]."""
        copy, cpu = self.rates()
        return min(m, max(1, math.floor(m * copy / (copy + cpu) + 0.5)))  # round half up, not to even

    @property
    def keeps_fills(self) -> bool:
        """Whether a fill stays cached for later calls; False: it only serves its call (adaptive
        without the recency rule: routing that does not recur)."""
        return self.policy != "adaptive" or self.recent_tokens > 0

    def fills_for(self, m: int, recent: int) -> int:
        """q for m misses of which `recent` were computed on the CPU within `recent_tokens` tokens."""
        q = self.fills(m)
        return max(q, min(recent, m)) if self.policy == "adaptive" else q

    def recent_steps(self, moe_layers: int) -> int:
        """`recent_tokens` in cache steps (a token takes one per MoE layer); 0 but for the adaptive
        split, the only one that fills recent misses first."""
        return self.recent_tokens * moe_layers if self.policy == "adaptive" else 0

    def bound_s(self, m: int, q: int, expert_bytes: int) -> float:
        """The performance model's time for one layer's misses (docs/structures.md): q copies
        beside m − q CPU experts, at the rates both keep while they run together; a side that runs
        alone keeps its own full rate (B_P for copies only, B_H for CPU experts only)."""
        if q == 0:
            return m * expert_bytes / (self.b_h * 1e9)
        if q == m:
            return m * expert_bytes / (self.b_p * 1e9)
        copy, cpu = self.rates()
        return max(q * expert_bytes / (copy * 1e9), (m - q) * expert_bytes / (cpu * 1e9))
