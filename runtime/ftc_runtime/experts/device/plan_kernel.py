"""`plan_layer` (device_plan.py) as two Triton kernels, for a CUDA graph to hold: the same
plan, the same table updates, in fixed-size launches with every count on the device.

- `_lru_candidates`, one program per block of slots: each block's n smallest LRU keys
  ((last use + 1) · n_slots + slot: empty slots first, then least recently used, lower slot first).
- `_plan`, one program: the n smallest of those (a call of n = T·k routed entries needs at most
  n victims plus the slots its hits read), then dedupe, lookup, split, victims, lists and the
  cache update. The call's entries fit in one program (n ≤ 16 · top-k), so every set operation is
  a pairwise comparison of [n, n] tiles instead of a sort: entry e's unique is the first entry with
  its row, a rank is a count of smaller keys, and a list is a store at that rank.

Fixed code shipped with the runtime: nothing in it depends on a model but n, which Triton
specializes on as a constant. Warps grow with n, as the [n, n] tiles do (docs/history/performance-log.md
has the compiler's register report).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime.experts.device.device_plan import CacheTables, LayerPlan, PlanRule

_LAST: tl.constexpr = tl.constexpr(2**63 - 1)
BLOCK = 1024  # slots per candidate program


@triton.jit
def _lru_candidates(last_used, n_slots, cands, NP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    s = b * BLOCK + tl.arange(0, BLOCK)
    used = tl.load(last_used + s, mask=s < n_slots, other=0)
    key = tl.where(s < n_slots, (used + 1) * n_slots + s, _LAST)
    tl.store(cands + b * NP + tl.arange(0, NP), -tl.topk(-key, NP))


@triton.jit
def _victims(cands, n_cands, n_slots, slot, hit, NP: tl.constexpr, CANDS: tl.constexpr):
    """The n least recently used slots that no hit reads, in order: their slots, and each one's
    position among them (-1: not available)."""
    c = tl.arange(0, CANDS)
    key = -tl.topk(-tl.load(cands + c, mask=c < n_cands, other=_LAST), NP)
    cslot = tl.where(key != _LAST, key % n_slots, -1)
    in_use = tl.sum(((cslot[:, None] == slot[None, :]) & hit[None, :]).to(tl.int32), axis=1) > 0
    avail = (key != _LAST) & ~in_use
    position = tl.where(avail, tl.cumsum(avail.to(tl.int32), axis=0) - 1, -1)
    return cslot, position


@triton.jit
def _plan(ids, ids_stride, weights, weights_stride, base_id, n, k, slot_of, id_of, last_used, cpu_step, step_ptr,
          q_for_m, bias, recent_steps, allow_fills, keep_fills, cands, n_cands, n_slots, pair_slot, fill_rows,
          fill_slots, cpu_ids, cpu_offsets, cpu_tok, cpu_w, counts, pairs, phase_pairs, NP: tl.constexpr,
          CANDS: tl.constexpr):
    e = tl.arange(0, NP)
    valid = e < n
    # entry e is token e // k's j = e % k: its id and weight read in place (rows `*_stride` apart)
    entry_id = tl.load(ids + e // k * ids_stride + e % k, mask=valid, other=0).to(tl.int64)
    weight = tl.load(weights + e // k * weights_stride + e % k, mask=valid, other=0.0).to(tl.float32)
    row = tl.where(valid, base_id + entry_id, -1)
    eq = (row[:, None] == row[None, :]) & valid[:, None] & valid[None, :]
    before = eq & (e[None, :] < e[:, None])  # the same row at an earlier entry
    first = valid & (tl.sum(before.to(tl.int32), axis=1) == 0)
    count = tl.sum(eq.to(tl.int32), axis=1).to(tl.int64)
    uidx = tl.sum((first[None, :] & (row[None, :] < row[:, None])).to(tl.int64), axis=1)
    slot = tl.load(slot_of + row, mask=first, other=-1)
    hit, miss = first & (slot >= 0), first & (slot < 0)
    step = tl.load(step_ptr)
    last_cpu = tl.load(cpu_step + row, mask=miss, other=-1)
    recent = miss & (last_cpu >= step - recent_steps) & (recent_steps > 0)
    n_miss = tl.sum(miss.to(tl.int64))
    q_rule = tl.load(q_for_m + n_miss)
    splits = (q_rule > 0) & (q_rule < n_miss)  # the bias corrects a split, not one side alone
    q_split = q_rule + tl.where(splits, tl.floor(n_miss.to(tl.float32) * tl.load(bias) + 0.5).to(tl.int64), 0)
    q_split = tl.minimum(tl.maximum(q_split, 0), n_miss)
    q = tl.maximum(q_split, tl.sum(recent.to(tl.int64)))
    q = tl.where(allow_fills != 0, q, 0)
    # Misses in the host's order: recent first, then more tokens first, then ascending rows.
    okey = tl.where(miss, ((1 - recent.to(tl.int64)) * (n + 1) + (n - count)) * n + uidx, _LAST)
    rank = tl.sum((miss[None, :] & (okey[None, :] < okey[:, None])).to(tl.int64), axis=1)
    cslot, position = _victims(cands, n_cands, n_slots, slot, hit, NP, CANDS)
    n_fill = tl.minimum(q, tl.sum((position >= 0).to(tl.int64)))
    victim = tl.sum(tl.where(position[None, :] == rank[:, None], cslot[None, :], 0), axis=1)
    is_fill, is_cpu = miss & (rank < n_fill), miss & (rank >= n_fill)
    where_first = tl.where(hit, slot, tl.where(is_fill, victim, -1))
    own = eq & first[None, :]  # entry → the first entry of its row
    where_all = tl.sum(tl.where(own, where_first[None, :] + 1, 0), axis=1) - 1
    tl.store(pair_slot + e, where_all, mask=valid)
    tl.store(pairs + e, where_all.to(tl.int32), mask=valid)
    tl.store(pairs + n + e, (e // k).to(tl.int32), mask=valid)
    tl.store(pairs + 2 * n + e, weight.to(tl.int32, bitcast=True), mask=valid)
    _store_phase_pairs(phase_pairs, n, e, k, valid, weight, where_all,
                       tl.sum((own & hit[None, :]).to(tl.int32), axis=1) > 0,
                       tl.sum((own & is_fill[None, :]).to(tl.int32), axis=1) > 0)
    tl.store(fill_rows + rank, row, mask=is_fill)
    tl.store(fill_slots + rank, victim, mask=is_fill)
    tl.store(fill_rows + e, -1, mask=valid & (e >= n_fill))
    tl.store(fill_slots + e, -1, mask=valid & (e >= n_fill))
    # The CPU job grouped by expert in miss order, each expert's tokens ascending.
    n_cpu = n_miss - n_fill
    crank = rank - n_fill
    start = tl.sum(tl.where(is_cpu[None, :] & (crank[None, :] < crank[:, None]), count[None, :], 0), axis=1)
    total = tl.sum(tl.where(is_cpu, count, 0))
    tl.store(cpu_ids + crank, row, mask=is_cpu)
    tl.store(cpu_ids + e, -1, mask=valid & (e >= n_cpu))
    tl.store(cpu_offsets + crank, start, mask=is_cpu)
    tl.store(cpu_offsets + e, total, mask=valid & (e >= n_cpu))
    tl.store(cpu_offsets + n, total)
    on_cpu = valid & (where_all < 0)
    at = tl.sum(tl.where(own, start[None, :], 0), axis=1) + tl.sum(before.to(tl.int64), axis=1)
    tl.store(cpu_tok + at, e // k, mask=on_cpu)
    tl.store(cpu_w + at, weight, mask=on_cpu)
    tl.store(cpu_tok + e, 0, mask=valid & (e >= total))
    tl.store(cpu_w + e, 0.0, mask=valid & (e >= total))
    tl.store(counts + 0, tl.sum(hit.to(tl.int64)))
    tl.store(counts + 1, n_fill)
    tl.store(counts + 2, n_cpu)
    tl.store(counts + 3, tl.where((allow_fills != 0) & splits, q_split, -1))
    # Fills that serve this call only (keep_fills 0), and hits on such slots, stay the next victims.
    passing = is_fill | (hit & (tl.load(last_used + slot, mask=hit, other=0) < 0))
    stamp = tl.where(passing & (keep_fills == 0), -1, step)
    _update(slot_of, id_of, last_used, cpu_step, step_ptr, step, row, first, is_fill, is_cpu, victim, where_first,
            stamp)


@triton.jit
def _store_phase_pairs(phase_pairs, n, e, k, valid, weight, where_all, entry_hit, entry_fill):
    """The pairs again, twice: [0] with only the hits' slots, [1] with only the fills'."""
    for phase in tl.static_range(2):
        mine = entry_hit if phase == 0 else entry_fill
        base = phase_pairs + phase * 3 * n
        tl.store(base + e, tl.where(mine, where_all, -1).to(tl.int32), mask=valid)
        tl.store(base + n + e, (e // k).to(tl.int32), mask=valid)
        tl.store(base + 2 * n + e, weight.to(tl.int32, bitcast=True), mask=valid)


@triton.jit
def _update(slot_of, id_of, last_used, cpu_step, step_ptr, step, row, first, is_fill, is_cpu, victim, where_first,
            stamp):
    tl.debug_barrier()  # every lookup of this call is done before the tables change
    tl.store(cpu_step + row, step, mask=is_cpu)
    old = tl.load(id_of + victim, mask=is_fill, other=-1)
    tl.store(slot_of + old, -1, mask=is_fill & (old >= 0))
    tl.store(id_of + victim, row, mask=is_fill)
    tl.store(slot_of + row, victim, mask=is_fill)
    tl.store(last_used + where_first, stamp, mask=first & (where_first >= 0))
    tl.debug_barrier()
    tl.store(step_ptr, step + 1)


def candidates_buffer(t: CacheTables, n: int, device: torch.device) -> torch.Tensor:
    """The buffer `lru_candidates` fills for a call of n routed entries (int64)."""
    return torch.empty(max(triton.cdiv(t.n_slots, BLOCK), 1) * padded_entries(n), dtype=torch.int64, device=device)


def lru_candidates(t: CacheTables, n: int, cands: torch.Tensor) -> None:
    """Writes into `cands` (`candidates_buffer`'s) the slots among which a call of n routed entries
    takes its victims: each block of BLOCK slots' n least recently used, as LRU keys. They depend
    on `last_used` alone, so a decode step computes the next call's beside the rest of a layer."""
    blocks = triton.cdiv(t.n_slots, BLOCK)
    if blocks:
        _lru_candidates[(blocks,)](t.last_used, t.n_slots, cands, NP=padded_entries(n), BLOCK=BLOCK)


def padded_entries(n: int) -> int:
    """The block size of a call's n routed entries in the plan's (and the join's) tiles."""
    return max(16, triton.next_power_of_2(n))


def plan_layer_triton(t: CacheTables, rule: PlanRule, base_id: int, ids: torch.Tensor,
                      weights: torch.Tensor, cands: torch.Tensor | None = None) -> LayerPlan:
    """`device_plan.plan_layer` on the GPU: the same arguments, plan and table updates. `ids` and
    `weights` [T, k] are read in place (rows of any stride, unit stride within one): the ids may
    be integers or exact floats (as `OffloadedExperts.stage` packs them beside x). `cands`: the
    call's `lru_candidates`, computed already from the tables as they are now (None: here)."""
    n_tok, k = ids.shape
    n, dev = n_tok * k, ids.device
    np2, blocks = padded_entries(n), triton.cdiv(t.n_slots, BLOCK)
    if cands is None:
        cands = candidates_buffer(t, n, dev)
        lru_candidates(t, n, cands)
    if ids.stride(1) != 1 or weights.stride(1) != 1:
        raise ValueError(f"plan_layer_triton: ids and weights need unit stride within a row, not "
                         f"{ids.stride()} and {weights.stride()}")
    shapes = ((n_tok, k), (n,), (n,), (n,), (n + 1,), (n,), (n,), (4,), (3, n), (2, 3, n))  # LayerPlan's fields
    dtypes = {6: torch.float32, 8: torch.int32, 9: torch.int32}
    out = LayerPlan(*(torch.empty(shape, dtype=dtypes.get(i, torch.int64), device=dev)
                      for i, shape in enumerate(shapes)))
    _plan[(1,)](ids, ids.stride(0), weights, weights.stride(0), base_id, n, k,
                t.slot_of, t.id_of, t.last_used, t.cpu_step, t.step, rule.q_for_m, rule.bias, rule.recent_steps,
                int(rule.allow_fills), int(rule.keep_fills), cands, blocks * np2, max(t.n_slots, 1), out.pair_slot,
                out.fill_rows, out.fill_slots, out.cpu_ids, out.cpu_offsets, out.cpu_tok, out.cpu_w, out.counts,
                out.pairs, out.phase_pairs, NP=np2, CANDS=max(np2, triton.next_power_of_2(blocks * np2)),
                num_warps=max(4, min(32, np2 // 4)))
    return out
