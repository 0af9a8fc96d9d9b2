"""`ExpertCache`: the global cache of (layer, expert) slots on the GPU, shared by all MoE layers.

Host-side bookkeeping only: which FTW row (`id = l·E + e`) each slot holds, and when each slot was
last used. The slot memory itself belongs to the backend that computes on it. Policies:
- `lru`: misses that the planner sends to the GPU replace the least recently used slots that the
  current step does not use;
- `static`: a fixed set of experts is pinned once, after the prompt (its most frequent experts, as
  llama.cpp and KTransformers place them), and never replaced; until then every miss is computed
  on the CPU.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

CachePolicy = Literal["lru", "static"]
CACHE_POLICIES: tuple[str, ...] = ("lru", "static")
NEVER = -(1 << 62)  # the step of what never happened: older than any window reaches back


class ExpertCache:
    def __init__(self, num_ids: int, n_slots: int, policy: CachePolicy = "lru"):
        if policy not in CACHE_POLICIES:
            raise ValueError(f"cache policy {policy!r}: expected one of {', '.join(CACHE_POLICIES)}")
        if n_slots < 0:
            raise ValueError(f"n_slots = {n_slots}: expected a number >= 0")
        self.policy = policy
        self.n_slots = n_slots
        self.slot_of = np.full(num_ids, -1, dtype=np.int64)  # id → slot, -1 when not resident
        self.id_of = np.full(n_slots, -1, dtype=np.int64)  # slot → id, -1 when empty
        self.last_used = np.full(n_slots, -1, dtype=np.int64)  # step of last use; empty slots (and a fill that
        # served its call only, `MissPlanner.keeps_fills`): -1
        self.step = 0
        # id → the step its expert was last computed on the CPU (a miss the split kept off the GPU)
        self.cpu_step = np.full(num_ids, NEVER, dtype=np.int64)
        self.frozen = False  # static policy: True once the pinned set is placed

    @property
    def resident(self) -> int:
        return int((self.id_of >= 0).sum())

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slots of `ids` (-1 for misses)."""
        return self.slot_of[ids]

    def touch(self, slots: np.ndarray) -> None:
        """Marks slots as used by the current step, then advances the step."""
        self.last_used[slots] = self.step
        self.step += 1

    def computed_on_cpu_within(self, ids: np.ndarray, steps: int) -> np.ndarray:
        """Which of `ids` were computed on the CPU within the last `steps` steps (bool)."""
        return self.cpu_step[ids] >= self.step - steps

    def victims(self, q: int, in_use: np.ndarray) -> np.ndarray:
        """Up to q slots to refill: empty slots first, then least recently used; never a slot in
        `in_use` (this step reads it). The static policy never gives any: its set is placed by pin()."""
        if q <= 0 or self.policy == "static":
            return np.empty(0, dtype=np.int64)
        # Least recently used first, lower slot first among equals: one unique key per slot, so
        # that a partial selection (O(n), every MoE layer of every step) picks what a sort would.
        key = self.last_used * self.n_slots + np.arange(self.n_slots)
        need = q + in_use.size
        if need < self.n_slots:
            part = np.argpartition(key, need)[:need]
            order = part[np.argsort(key[part])]
        else:
            order = np.argsort(key)
        if in_use.size:
            order = order[~np.isin(order, in_use)]
        return order[:q]

    def scan_victims(self, q: int, in_use: np.ndarray, layer: int, num_layers: int) -> np.ndarray:
        """Up to q slots for a scan (a prompt chunk streaming every MoE layer in order, now at
        `layer`): the slots whose next use is farthest, as Belady's rule picks them, since a scan
        reads whole layers in a known order and the next scan (the next chunk, the next turn)
        repeats it. Empty slots first; then the layers just computed, most recent first (their
        next use is the next scan's); then the layers ahead, farthest first. Never a slot in
        `in_use` (the layers in flight). Scans longer than the cache thus keep a fixed set of
        layers cached and cycle the rest through the same slots; LRU, or evicting what the scan
        has not used yet, evicts each layer before the next scan needs it (seen on the device:
        87 % of the pool streamed per chunk with 45 % of it cached)."""
        if q <= 0:
            return np.empty(0, dtype=np.int64)
        per_layer = self.slot_of.size // num_layers
        held = self.id_of >= 0
        ahead = np.where(held, (self.id_of // per_layer - layer) % num_layers, num_layers)
        order = np.lexsort((np.arange(self.n_slots), -ahead))
        if in_use.size:
            order = order[~np.isin(order, in_use)]
        return order[:q]

    def install(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Records that `slots` now hold `ids` (the caller copies the rows)."""
        old = self.id_of[slots]
        self.slot_of[old[old >= 0]] = -1
        self.id_of[slots] = ids
        self.slot_of[ids] = slots

    def clear(self) -> None:
        """Empties every slot and forgets all use and CPU history (a fresh engine's state)."""
        self.slot_of.fill(-1)
        self.id_of.fill(-1)
        self.last_used.fill(-1)
        self.cpu_step.fill(NEVER)

    def pin(self, ids: np.ndarray) -> np.ndarray:
        """Static policy: places `ids` (at most n_slots) once; returns the slots to fill."""
        if self.policy != "static":
            raise ValueError("pin() is for the static cache policy")
        ids = ids[: self.n_slots]
        slots = np.arange(ids.size, dtype=np.int64)
        self.install(slots, ids)
        self.frozen = True
        return slots
