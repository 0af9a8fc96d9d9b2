"""A decode plan's fills as one Triton kernel: every (FTW row, slot) of the plan's fill list, up to
its device-side count, read from the pinned host pool through the pool's device mapping (over
PCIe, no copy engine) and written into its slot. Unlike `cudaMemcpyAsync` calls, whose number and
sizes the host must know, the kernel's grid is fixed (one row of programs per fill-list entry,
those past the count returning at once), so that a CUDA graph can hold the fills with the rest of
the step. A 2026-11-30 probe on the device machine moved 50-51 GB/s this way with 16 or more
programs per row, against 54.6 for copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime.experts.device.device_plan import LayerPlan
from ftc_runtime.io.host_memory import MappedHost

PARTS = 32  # programs per row
CHUNK = 2048  # 32-bit words a program moves per step


@triton.jit
def _gather_rows(src, dst, rows, slots, counts, row_words, STEPS: tl.constexpr, CHUNK: tl.constexpr):
    """Program (j, p) copies chunks p·STEPS .. (p + 1)·STEPS − 1 of fill j's row."""
    j = tl.program_id(0)
    if j < tl.load(counts + 1):
        row = tl.load(rows + j).to(tl.int64)
        slot = tl.load(slots + j).to(tl.int64)
        for i in range(STEPS):
            offs = (tl.program_id(1) * STEPS + i) * CHUNK + tl.arange(0, CHUNK)
            mask = offs < row_words
            tl.store(dst + slot * row_words + offs, tl.load(src + row * row_words + offs, mask=mask), mask=mask)


def gather_fills(src: MappedHost | torch.Tensor, slots: torch.Tensor, plan: LayerPlan, parts: int = PARTS,
                 chunk: int = CHUNK, num_warps: int = 4) -> None:
    """Copies the plan's fills from `src` (the pool's rows as int32 words: its device mapping, or a
    tensor the kernel can read) into `slots` ([n_slots, stride] bytes, stride a multiple of 4).
    `parts`, `chunk` and `num_warps`: the kernel's shape (`bench/dev/gather_fill_rate.py` sweeps them)."""
    gather_rows(src, slots, plan.fill_rows, plan.fill_slots, plan.counts, parts, chunk, num_warps)


def gather_rows(src: MappedHost | torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, slot_ids: torch.Tensor,
                counts: torch.Tensor, parts: int = PARTS, chunk: int = CHUNK, num_warps: int = 4) -> None:
    """`gather_fills` of a list: rows[j] of `src` into slots[slot_ids[j]] for j < counts[1]
    (device int64 tensors; `counts` as a plan's: [hits, fills, ...])."""
    stride = slots.shape[1]
    if stride % 4:
        raise ValueError(f"gather_fills: slot stride {stride} is not a multiple of 4 bytes")
    words = stride // 4
    _gather_rows[(rows.numel(), parts)](src, slots.view(torch.int32), rows, slot_ids, counts, words,
                                        STEPS=triton.cdiv(words, parts * chunk), CHUNK=chunk, num_warps=num_warps)
