"""One MoE layer's cache plan for a decode step, as device data: which routed experts hit a slot,
which misses fill a victim slot and which the CPU computes, what the CPU job is, and the cache's
update. Every count is a device tensor and every list a fixed-shape buffer ([T·k] entries for T
tokens of k experts) whose unused entries are masked, and nothing is read back to the host, so a
CUDA graph can hold the whole step.

`CacheTables` mirrors `ExpertCache` on a device; `plan_layer` is the plan in torch: the reference
that the generated plan kernel is checked against, and the plan the CPU-emulated device runs. It
takes the decisions that `ExpertCache` and `MissPlanner` take on the host (`OffloadedExperts`'
general path and `TokenPlanner`), the same ones: misses the CPU computed lately first, then the
busiest, then ascending rows; q from m by the planner's rule (and at least the recent misses);
victims among empty slots first, then least recently used, lower slot first, never a slot this
call reads; tests hold the two to the same state step by step.

Masked writes go to one sink entry at the end of each table (row `num_ids`, slot `n_slots`), which
the plan resets after each update; no real row or slot is ever written for an unused entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.miss_planner import MissPlanner

_LAST = torch.iinfo(torch.int64).max  # a key that sorts after every real one
PLANNED_TOKENS = 16  # the largest call planned on the device: decode's batch buckets


@dataclass
class CacheTables:
    """`ExpertCache`'s arrays on `device`, each with a sink entry at the end: FTW row → slot
    (-1: not resident), slot → row (-1: empty), slot → step of last use, row → step last computed
    on the CPU, and the cache's step as a one-element tensor."""

    slot_of: torch.Tensor  # int64 [num_ids + 1]
    id_of: torch.Tensor  # int64 [n_slots + 1]
    last_used: torch.Tensor  # int64 [n_slots + 1]
    cpu_step: torch.Tensor  # int64 [num_ids + 1]
    step: torch.Tensor  # int64 [1]

    @property
    def num_ids(self) -> int:
        return self.slot_of.numel() - 1

    @property
    def n_slots(self) -> int:
        return self.id_of.numel() - 1

    @classmethod
    def of(cls, cache: ExpertCache, device: torch.device | str) -> CacheTables:
        """A device copy of `cache`'s state."""

        def table(a, sink: int) -> torch.Tensor:
            return torch.cat([torch.from_numpy(a), torch.tensor([sink])]).to(device)

        return cls(table(cache.slot_of, -1), table(cache.id_of, -1), table(cache.last_used, -1),
                   table(cache.cpu_step, -1), torch.tensor([cache.step], device=device))

    def load(self, cache: ExpertCache) -> None:
        """Takes `cache`'s state in place (the tables keep their addresses, which graphs hold)."""
        self._check_size(cache)
        for name in ("slot_of", "id_of", "last_used", "cpu_step"):
            getattr(self, name)[:-1].copy_(torch.from_numpy(getattr(cache, name)))
        self.step.fill_(cache.step)

    def write_to(self, cache: ExpertCache) -> None:
        """Makes `cache` hold this state (a safe point: nothing in flight reads either)."""
        self._check_size(cache)
        for name in ("slot_of", "id_of", "last_used", "cpu_step"):
            getattr(cache, name)[:] = getattr(self, name)[:-1].cpu().numpy()
        cache.step = int(self.step)

    def _check_size(self, cache: ExpertCache) -> None:
        if (self.num_ids, self.n_slots) != (cache.slot_of.size, cache.n_slots):
            raise ValueError(f"cache tables of {self.num_ids} rows and {self.n_slots} slots do not match a cache "
                             f"of {cache.slot_of.size} rows and {cache.n_slots} slots")

    def differences(self, cache: ExpertCache) -> list[str]:
        """The names of the tables (and `step`) where this state and `cache`'s differ."""
        names = [name for name in ("slot_of", "id_of", "last_used", "cpu_step")
                 if not torch.equal(getattr(self, name)[:-1].cpu(), torch.from_numpy(getattr(cache, name)))]
        return names + (["step"] if int(self.step) != cache.step else [])


TUNE_STEP = 2.0**-6  # how far one MoE layer's wait moves the split's bias (a power of two: exact sums)


@dataclass(frozen=True)
class PlanRule:
    """The split rule as data: q for m unique misses (`MissPlanner.fills`, m = 0 .. T·k), the
    recent window in cache steps (0: off) and whether misses may fill at all (not under the static
    cache policy, whose pinned set never changes).

    `bias` (fp32 [1]) corrects the split as the step runs it: q = q_for_m[m] + ⌊m · bias + ½⌋,
    within [0, m], then at least the recent misses; where q_for_m[m] is 0 or m (the planner found
    one side alone faster) the bias does not apply, and such calls do not tune it. The planner's
    rates price copies and CPU experts alone; in the one-graph step the device's own experts run
    after the fills, the CPU's job has a latency, and the CPU kernel's rate depends on the expert
    format, so the adaptive policy (`tune_step` > 0) lets every split layer's wait move it
    (`DoorbellKernels.wait_and_join`): up when the GPU waited for the CPU, down when the CPU was
    done first, so that both sides end together. It starts at 0, where q is the planner's."""

    q_for_m: torch.Tensor  # int64 [max_unique + 1]
    recent_steps: int
    allow_fills: bool
    bias: torch.Tensor  # fp32 [1]
    tune_step: float = 0.0
    keep_fills: bool = True  # False: a fill serves its call only (`MissPlanner.keeps_fills`)

    @classmethod
    def of(cls, planner: MissPlanner, max_unique: int, recent_steps: int, allow_fills: bool,
           device: torch.device | str) -> PlanRule:
        table = torch.tensor([planner.fills(m) for m in range(max_unique + 1)], dtype=torch.int64, device=device)
        return cls(table, recent_steps, allow_fills, torch.zeros(1, dtype=torch.float32, device=device),
                   TUNE_STEP if planner.policy == "adaptive" and allow_fills else 0.0, planner.keeps_fills)


@dataclass(frozen=True)
class LayerPlan:
    """The plan of one call of T tokens × k routed experts, n = T·k; entries past a count are -1
    (ids and slots) or 0 (tokens and weights)."""

    pair_slot: torch.Tensor  # int64 [T, k]: the slot serving each routed (token, expert); -1: the CPU's
    fill_rows: torch.Tensor  # int64 [n]: FTW rows to copy into `fill_slots`, `counts[1]` of them
    fill_slots: torch.Tensor  # int64 [n]
    cpu_ids: torch.Tensor  # int64 [n]: the CPU job's experts, `counts[2]` of them, in miss order
    cpu_offsets: torch.Tensor  # int64 [n + 1]: expert j serves entries cpu_offsets[j] .. [j + 1] - 1
    cpu_tok: torch.Tensor  # int64 [n]: token row of each CPU entry, ascending within an expert
    cpu_w: torch.Tensor  # fp32 [n]: its router weight
    counts: torch.Tensor  # int64 [4]: hits, fills, CPU experts (unique experts), the split's own q
    # (-1 where the rule sends this call's misses to one side alone: the waits do not tune it)
    pairs: torch.Tensor  # int32 [3, T·k]: the device kernel's pairs (slot, token row, weight bits) of
    # every routed entry, the CPU's with slot -1
    phase_pairs: torch.Tensor  # int32 [2, 3, T·k]: `pairs` split by when their slot is ready: [0] the
    # hits' (before this call's fills), [1] the fills' (after them); every other entry's slot -1


def _compact(values: torch.Tensor, keep: torch.Tensor, index: torch.Tensor, fill: int) -> torch.Tensor:
    """out[index[i]] = values[i] where keep[i], in a buffer of values' size prefilled with `fill`."""
    n = values.numel()
    out = torch.full((n + 1,), fill, dtype=values.dtype, device=values.device)
    out.scatter_(0, torch.where(keep, index, n), values)
    return out[:n]


def _pad(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    return torch.cat([x, torch.full((n - x.numel(),), fill, dtype=x.dtype, device=x.device)])


@dataclass(frozen=True)
class _Unique:
    """The call's routed experts, deduplicated: rows ascending (sink past `n`), tokens per row,
    and each routed entry's index among them."""

    rows: torch.Tensor  # int64 [n]
    count: torch.Tensor  # int64 [n]
    valid: torch.Tensor  # bool [n]
    of_entry: torch.Tensor  # int64 [n]: entry t·k + j → its unique index


def _dedupe(flat: torch.Tensor, sink: int) -> _Unique:
    n = flat.numel()
    rows, entry = torch.sort(flat, stable=True)
    first = torch.ones(n, dtype=torch.bool, device=flat.device)
    first[1:] = rows[1:] != rows[:-1]
    u_sorted = torch.cumsum(first, 0) - 1
    valid = torch.arange(n, device=flat.device) < first.sum()
    unique = torch.where(valid, _compact(rows, first, u_sorted, sink), sink)
    count = torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, u_sorted, torch.ones_like(u_sorted))
    of_entry = torch.empty_like(u_sorted).scatter_(0, entry, u_sorted)
    return _Unique(unique, count, valid, of_entry)


def _victims(t: CacheTables, hit: torch.Tensor, slot: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n least recently used slots (empty first, lower slot first among equals) that no hit of
    this call reads, padded with -1, and how many there are: K = n candidates from one pass, of
    which the call uses the first q (q ≤ misses ≤ n − hits)."""
    ns = t.n_slots
    if ns == 0:
        return torch.full((n,), -1, dtype=torch.int64, device=slot.device), slot.new_zeros(())
    key = t.last_used[:ns] * ns + torch.arange(ns, device=slot.device)
    key = torch.cat([key, key.new_zeros(1)]).scatter_(0, torch.where(hit, slot, ns), _LAST)[:ns]
    cand_key, cand_slot = torch.topk(key, min(n, ns), largest=False, sorted=True)
    return _pad(cand_slot, n, -1), (cand_key != _LAST).sum()


def plan_layer(t: CacheTables, rule: PlanRule, base_id: int, ids: torch.Tensor, weights: torch.Tensor) -> LayerPlan:
    """Plans the call whose routed `ids` [T, k] (indices within the MoE layer whose first FTW row
    is `base_id`) carry router `weights` [T, k], and updates `t` as the host cache would."""
    n_tok, k = ids.shape
    n, dev = n_tok * k, ids.device
    ar = torch.arange(n, device=dev)
    u = _dedupe(ids.reshape(-1).long() + base_id, t.num_ids)
    slot = t.slot_of[u.rows]
    hit, miss = u.valid & (slot >= 0), u.valid & (slot < 0)
    recent = miss & (t.cpu_step[u.rows] >= t.step - rule.recent_steps) if rule.recent_steps > 0 \
        else torch.zeros_like(miss)
    n_miss = miss.sum()
    q_rule = rule.q_for_m.index_select(0, n_miss.view(1)).squeeze(0)  # indexing by a tensor would sync
    splits = (q_rule > 0) & (q_rule < n_miss)  # the bias corrects a split, not one side alone
    q_split = q_rule + torch.where(splits, torch.floor(n_miss * rule.bias[0] + 0.5).long(), 0)
    q_split = torch.minimum(q_split.clamp(min=0), n_miss)
    q = torch.maximum(q_split, recent.sum()) if rule.allow_fills else n_miss.new_zeros(())
    # Misses in the host's order: recent first, then more tokens first, then ascending rows.
    order_key = ((~recent).long() * (n + 1) + (n - u.count)) * n + ar
    miss_u = torch.sort(torch.where(miss, order_key, _LAST)).indices  # unique index by miss rank
    rank = torch.empty_like(ar).scatter_(0, miss_u, ar)
    cand_slot, n_avail = _victims(t, hit, slot, n)
    n_fill = torch.minimum(q, n_avail)
    n_cpu = n_miss - n_fill
    is_fill, is_cpu = miss & (rank < n_fill), miss & (rank >= n_fill)
    where_u = torch.where(hit, slot, torch.where(is_fill, cand_slot[rank.clamp(max=n - 1)], -1))
    fill_rows = torch.where(ar < n_fill, u.rows[miss_u], -1)
    fill_slots = torch.where(ar < n_fill, cand_slot, -1)
    cpu_u = miss_u[(ar + n_fill).clamp(max=n - 1)]
    cpu_ids = torch.where(ar < n_cpu, u.rows[cpu_u], -1)
    cpu_offsets = torch.cat([ar.new_zeros(1), torch.cumsum(torch.where(ar < n_cpu, u.count[cpu_u], 0), 0)])
    entry_cpu = is_cpu[u.of_entry]
    cpu_entry = torch.sort(torch.where(entry_cpu, (rank[u.of_entry] - n_fill) * n + ar, _LAST)).indices
    in_job = ar < cpu_offsets[-1]
    cpu_tok = torch.where(in_job, cpu_entry // k, 0)
    cpu_w = torch.where(in_job, weights.reshape(-1).float()[cpu_entry], 0.0)
    stamp = t.step.expand(n)
    if not rule.keep_fills:  # fills serve this call only; hits on such slots leave them the next victims
        stamp = torch.where(is_fill | (hit & (t.last_used[slot.clamp(min=0)] < 0)), -1, stamp)
    _update(t, u.rows, is_cpu, fill_rows, fill_slots, ar < n_fill, where_u, stamp)
    counts = torch.stack([hit.sum(), n_fill, n_cpu, torch.where(splits, q_split, -1) if rule.allow_fills
                          else n_fill.new_full((), -1)])
    pair_slot = where_u[u.of_entry]
    pairs = torch.stack([pair_slot.int(), (ar // k).int(), weights.reshape(-1).float().contiguous().view(torch.int32)])
    phase_pairs = pairs.repeat(2, 1, 1)
    phase_pairs[0, 0] = torch.where(hit[u.of_entry], pairs[0], -1)
    phase_pairs[1, 0] = torch.where(is_fill[u.of_entry], pairs[0], -1)
    return LayerPlan(pair_slot.view(n_tok, k), fill_rows, fill_slots, cpu_ids, cpu_offsets, cpu_tok, cpu_w, counts,
                     pairs, phase_pairs)


def _update(t: CacheTables, rows: torch.Tensor, is_cpu: torch.Tensor, fill_rows: torch.Tensor,
            fill_slots: torch.Tensor, filling: torch.Tensor, where_u: torch.Tensor, stamp: torch.Tensor) -> None:
    """The host cache's update, masked: CPU experts stamped, fills installed over their victims,
    every slot the call reads stamped with `stamp` (per unique expert: the step, or -1 for a fill
    that serves this call only), the step advanced."""
    ns, sink_row = t.n_slots, t.num_ids
    step = t.step.expand(rows.numel())
    t.cpu_step.scatter_(0, torch.where(is_cpu, rows, sink_row), step)
    old = t.id_of[torch.where(filling, fill_slots, ns)]
    t.slot_of.scatter_(0, torch.where(old >= 0, old, sink_row), -1)
    t.id_of.scatter_(0, torch.where(filling, fill_slots, ns), fill_rows)
    t.slot_of.scatter_(0, torch.where(filling, fill_rows, sink_row), fill_slots)
    t.last_used.scatter_(0, torch.where(where_u >= 0, where_u, ns), stamp)
    t.slot_of[-1:] = -1
    t.id_of[-1:] = -1
    t.last_used[-1:] = -1
    t.cpu_step[-1:] = -1
    t.step += 1
