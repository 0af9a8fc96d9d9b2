"""Checks shared by the offload tests on the CPU and on the GPU."""

from __future__ import annotations

import torch


def check_slots_hold_their_rows(experts) -> None:
    """Every filled slot of an `OffloadedExperts`' slot store (on any device) holds its expert's row
    of the host pool. Reads the cache through the backend (a safe point: a device plan's tables
    are written back first)."""
    store, cache = experts.store, experts.cache
    for slot, row in enumerate(cache.id_of.tolist()):
        if row >= 0:
            assert torch.equal(store.slots[slot].cpu(), store.host_rows[row]), (slot, row)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def near_best_share(a: torch.Tensor, b: torch.Tensor) -> float:
    """Logits [positions, vocab]: the share of positions where a's top token scores, in the
    reference b, within a quarter of b's rms logit of b's best. Random tiny models have near ties
    that bf16 rounding flips (about 4e-2 relative error); a wrong engine picks tokens far down."""
    a, b = a.float(), b.float()
    picked = b.gather(-1, a.argmax(-1, keepdim=True)).squeeze(-1)
    return float((picked >= b.max(-1).values - 0.25 * b.pow(2).mean().sqrt()).float().mean())


def assert_graphs_match(got: list[torch.Tensor], want: list[torch.Tensor], reference, compiled: bool) -> None:
    """Decode graphs' logits `got` against the eager path's `want`: uncompiled the same kernels,
    so within 1e-3 at every step; compiled, both held to the fp32 CPU engine's (`reference()`),
    the graphs' error at most 4× the eager bf16 one (plus 2e-3)."""
    if not compiled:
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert rel(a, b) < 1e-3, f"step {step}: {rel(a, b):.2e}"
        return
    ref = reference()
    err_graphs = sum(rel(a, r) for a, r in zip(got, ref, strict=True)) / len(ref)
    err_eager = sum(rel(b, r) for b, r in zip(want, ref, strict=True)) / len(ref)
    assert err_graphs < 4 * err_eager + 2e-3, f"compiled {err_graphs:.2e}, eager bf16 {err_eager:.2e}"
