"""A replayed routing trace's choice for a decode step on the GPU as one Triton kernel, one
program per token: the trace row of the token's position (its experts left-aligned, -1 after),
the model's own ranking filling the ranks the row leaves empty (skipping experts the row already
has), uniform weights. The same as `routing_trace.fill_missing` in torch, which takes about ten
launches per MoE layer: a benchmark that replays a trace would time them as the engine's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime import dependent_launch
from ftc_runtime.dependent_launch import wait_for_previous


@triton.jit
def _replay(table, positions, own, ids_out, weights_out, layer, rows, row_stride, layer_stride,
            K: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    j = tl.arange(0, KP)
    row = tl.load(positions + t) % rows
    picks = tl.load(table + row * row_stride + layer * layer_stride + j, mask=j < K, other=-1)
    mine = tl.load(own + t * K + j, mask=j < K, other=-1)
    taken = tl.max((mine[:, None] == picks[None, :]).to(tl.int32), 1) > 0
    free = (mine >= 0) & ~taken
    # the i-th free expert of the model's ranking goes to rank (picks' count + i)
    target = tl.sum((picks >= 0).to(tl.int32), 0) + tl.cumsum(free.to(tl.int32), 0) - 1
    lands = free[:, None] & (target[:, None] == j[None, :])  # [own rank, output rank]
    filled = tl.sum(tl.where(lands, mine[:, None], 0), 0)
    out = tl.where(tl.max(lands.to(tl.int32), 0) > 0, filled, picks)
    tl.store(ids_out + t * K + j, out, mask=j < K)
    tl.store(weights_out + t * K + j, tl.full([KP], 1.0 / K, dtype=tl.float32), mask=j < K)


def replay_route_gpu(table: torch.Tensor, layer: int, positions: torch.Tensor,
                     own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """table int64 [T, L, k] (`TraceReplay._table`), positions int64 [n], own ids int64 [n, k] →
    ids int64 [n, k] and fp32 weights 1/k."""
    n, k = own.shape
    ids = torch.empty(n, k, dtype=torch.int64, device=own.device)
    weights = torch.empty(n, k, dtype=torch.float32, device=own.device)
    if n:
        pdl = dependent_launch.enabled(own.device)
        _replay[(n,)](table, positions, own.contiguous(), ids, weights, layer, table.shape[0], table.stride(0),
                      table.stride(1), K=k, KP=triton.next_power_of_2(k), PDL=pdl, launch_pdl=pdl, num_warps=1)
    return ids, weights
