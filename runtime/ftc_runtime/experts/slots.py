"""`SlotStore`: the device's expert slots, which expert each holds, and the experts computed on them.

The slots keep FTW's expert-major row layout (slot `s` is one expert's whole stretch: every bank's
row with its padding), so a fill is one contiguous copy of a host row and the kernels read the
bytes the CPU kernel reads. `cache` (an `ExpertCache`) is the host-side truth of which FTW row
each slot holds. The experts of (slot, token) pairs run on the engine's generated device kernels,
or on torch over the format's reference dequantization where there are none.

The device is any `torch.device`: on a machine without a GPU it is the CPU, fills are plain
copies and the torch path computes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from ftc_runtime.experts.base import swiglu
from ftc_runtime.experts.cache import CachePolicy, ExpertCache
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.io.host_memory import pin_in_place

# (x [T, hidden] fp32, slots, pair_slot int32, pair_tok int32, pair_w fp32, out [T, hidden] fp32): out += ...
DeviceKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class GpuExpertKernels(NamedTuple):
    """The engine's generated device kernels of its expert format (kernels/expert_ffn_triton.py):
    `decode` for a few tokens per expert (pairs with a negative slot skipped), `pair_outputs` the
    same with each pair's output row left unsummed (last argument [pairs, hidden] fp32, written),
    `grouped` for many tokens per expert (pairs sorted by slot; None: torch)."""

    decode: DeviceKernel
    pair_outputs: DeviceKernel
    grouped: DeviceKernel | None


def consecutive_runs(slots: np.ndarray, ids: np.ndarray) -> list[tuple[int, int, int]]:
    """(first slot, first id, length) of each run where both slots and ids go up by one. A plain
    loop: a decode layer's few fills cost it about 3 µs, where numpy's array calls cost 35."""
    runs: list[tuple[int, int, int]] = []
    for s, i in zip(slots.tolist(), ids.tolist(), strict=True):
        if runs and (s, i) == (runs[-1][0] + runs[-1][2], runs[-1][1] + runs[-1][2]):
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, i, 1))
    return runs


class SlotStore:
    """n_slots expert slots on `device` over the host pool `pool`; the experts on them run on
    `kernels` (None: torch)."""

    def __init__(self, pool: ExpertPool, device: torch.device, n_slots: int, policy: CachePolicy = "lru",
                 kernels: GpuExpertKernels | None = None, swiglu_limit: float = 0.0):
        h = pool.header
        self.pool, self.header, self.device = pool, h, torch.device(device)
        self.swiglu_limit = swiglu_limit  # the torch path's clamp, as the generated kernels have it
        self.on_gpu = self.device.type == "cuda"
        self.pinned = self.on_gpu and pin_in_place(pool.buffer)
        if self.on_gpu and not self.pinned and n_slots:
            # Copies from pageable memory would run at a fraction of PCIe speed, synchronously.
            print("ftc: the expert pool could not be pinned (page-locked) for DMA: every routed expert runs "
                  "on the CPU; only activations cross PCIe", file=sys.stderr)
            n_slots = 0
        self.host_rows = pool.experts
        self.cache = ExpertCache(h.num_rows, n_slots, policy)
        self.slots = torch.empty(n_slots, h.expert_stride, dtype=torch.uint8, device=self.device)
        self.kernels = kernels

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer."""
        return self.header.num_experts

    def resize(self, n_slots: int) -> None:
        """Rebuilds the slots and the cache with n_slots slots, at a safe point (no copy or kernel
        in flight): the most recently used experts that fit are copied back from the host pool
        (never from disk), the rest dropped. The old slots are freed before the new ones are
        allocated, so the two never need memory together."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        old = self.cache
        held = np.flatnonzero(old.id_of >= 0)
        keep = held[np.argsort(-old.last_used[held], kind="stable")][:n_slots]
        keep = keep[np.argsort(old.last_used[keep], kind="stable")]  # oldest first: LRU order survives
        ids = old.id_of[keep]
        self.slots = None
        if self.on_gpu:
            torch.cuda.empty_cache()
        self.slots = torch.empty(n_slots, self.header.expert_stride, dtype=torch.uint8, device=self.device)
        self.cache = ExpertCache(old.slot_of.size, n_slots, old.policy)
        self.cache.step, self.cache.frozen, self.cache.cpu_step[:] = old.step, old.frozen, old.cpu_step
        slots = np.arange(ids.size, dtype=np.int64)
        self.cache.install(slots, ids)
        self.cache.last_used[slots] = old.last_used[keep]
        self.copy_rows_now(slots, ids)

    def copy_rows_now(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Queues the copies of FTW rows `ids` into `slots` on the current stream: one copy per
        run of consecutive slots that takes consecutive rows (a streamed layer is one or a few),
        since each copy costs the host several µs to queue."""
        for s, i, n in consecutive_runs(slots, ids):
            self.slots[s:s + n].copy_(self.host_rows[i:i + n], non_blocking=self.on_gpu)

    def fill(self, slots: np.ndarray, ids: np.ndarray, stats: OffloadStats) -> float:
        """`copy_rows_now`, its copies' device time and the host's time queueing them counted in
        `stats`; returns the host's seconds. Callers fill where the current stream is idle (an
        offloaded call begins with a sync), so no earlier kernel can still read a victim."""
        if not slots.size:
            return 0.0
        t0 = time.perf_counter()
        with stats.copy.measure():
            self.copy_rows_now(slots, ids)
        seconds = time.perf_counter() - t0
        stats.host_s["fills"] += seconds
        return seconds

    def experts_on_device(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        """out += the pairs' experts ([3, P] int32: slot, token, weight bits) with the decode kernel
        (a few tokens per expert), else torch."""
        self._run(None if self.kernels is None else self.kernels.decode, x, pairs, out)

    def grouped_on_device(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        """out += the pairs' experts with the grouped GEMM kernel (many tokens per expert), else torch."""
        self._run(None if self.kernels is None else self.kernels.grouped, x, pairs, out)

    def pair_outputs_on_device(self, x: torch.Tensor, pairs: torch.Tensor, pair_out: torch.Tensor) -> None:
        """pair_out [P, hidden] fp32 = each pair's weighted expert output, a zero row for a pair
        whose slot is negative (the decode kernel's: `kernels` needed)."""
        self.kernels.pair_outputs(x, self.slots, pairs[0], pairs[1], pairs[2].view(torch.float32), pair_out)

    def _run(self, kernel: DeviceKernel | None, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        if kernel is None:
            self._torch_experts(x, pairs, out)
        else:
            kernel(x, self.slots, pairs[0], pairs[1], pairs[2].view(torch.float32), out)

    def _torch_experts(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        """out += the pairs' experts ([3, P] int32: slot, token, weight bits; the pairs of a slot
        adjacent) with torch, one expert at a time over all its tokens, fp32 arithmetic."""
        pair_slot, pair_tok, pair_w = pairs[0], pairs[1], pairs[2].view(torch.float32)
        slots = pair_slot.tolist()
        starts = [0] + [j for j in range(1, len(slots)) if slots[j] != slots[j - 1]] + [len(slots)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            t = pair_tok[a:b].long()
            gate_up, down = self.header.dequantize(self.slots[slots[a]])  # the format's reference
            gate, up = F.linear(x[t], gate_up.float()).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, self.swiglu_limit), down.float())
            out.index_add_(0, t, y * pair_w[a:b, None])
