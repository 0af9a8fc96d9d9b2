"""`TokenPlanner`: one decode token's host work for one MoE layer in a single native call
(`csrc/token_plan.cpp`): cache lookup, miss split, victims, cache update, the CPU experts started
in the background, and the fill and pair lists for the device side.

It works on `ExpertCache`'s own arrays, so the general path (prompts, several tokens) and this one
share one cache state. Every argument that stays fixed from token to token (buffers, banks, the
pool's rows) is bound once in a `TokenPlanArgs` struct; a call passes four numbers.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.miss_planner import MissPlanner

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class TokenPlanArgs(ctypes.Structure):
    """Mirrors `TokenPlanArgs` in csrc/token_plan.cpp (every field 8 bytes)."""

    _fields_ = [(name, kind) for name, kind in (
        ("pool", _p), ("workspace", _p), ("experts", _p), ("expert_stride", _i64), ("hidden", _i64), ("k", _i64),
        ("staged", _p), ("slot_of", _p), ("id_of", _p), ("last_used", _p), ("n_slots", _i64), ("fills_for_m", _p),
        ("cpu_out", _p), ("cpu_ids", _p), ("cpu_offsets", _p), ("cpu_tok", _p), ("cpu_w", _p), ("pairs", _p),
        ("fills", _p), ("counts", _p), ("cpu_step", _p), ("recent_steps", _i64), ("keep_fills", _i64))]


class TokenPlanner:
    """Plans one token (T = 1) of k routed experts, reading `staged` ([1, hidden + 2k] fp32, as
    `OffloadedExperts.stage` packs it) and writing the CPU part into `cpu_out` ([1, hidden] fp32).
    Both must keep their addresses for the planner's life. `pinned`: the pair list lives in pinned
    memory, so that a captured host→device copy can read it. `recent_steps`: misses the CPU
    computed within that many cache steps are filled first, and at least all of them
    (`MissPlanner.fills_for`); 0: off. Fills stay cached where the planner `keeps_fills`."""

    def __init__(self, kernel: CpuExpertKernel, experts: torch.Tensor, cache: ExpertCache,
                 planner: MissPlanner, k: int, staged: torch.Tensor, cpu_out: torch.Tensor, pinned: bool,
                 recent_steps: int = 0):
        if k > 64:
            raise ValueError(f"top_k = {k}: the one-token planner handles at most 64 experts per token")
        hidden = cpu_out.shape[1]
        if staged.shape != (1, hidden + 2 * k) or staged.dtype != torch.float32 or cpu_out.dtype != torch.float32:
            raise ValueError(f"TokenPlanner: staged must be [1, {hidden + 2 * k}] fp32, got {tuple(staged.shape)}")
        self.kernel, self.cache, self.k = kernel, cache, k
        self._fn = kernel.lib.ftc_plan_token
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(TokenPlanArgs), _i64, _i64, ctypes.c_int]
        self.fills_for_m = np.array([planner.fills(m) for m in range(k + 1)], dtype=np.int32)
        self.pairs = torch.zeros(3, k, dtype=torch.int32, pin_memory=pinned)  # slot, token, weight bits
        self.fills = np.zeros((2, k), dtype=np.int64)  # FTW row, slot
        self.counts = np.zeros(3, dtype=np.int32)  # hits, fills, CPU experts
        self._cpu_args = (np.zeros(k, dtype=np.int64), np.zeros(k + 1, dtype=np.int32),
                          np.zeros(k, dtype=np.int32), np.zeros(k, dtype=np.float32))
        self._workspace = torch.empty(kernel.workspace_bytes(1, k), dtype=torch.uint8)
        self._keep = (experts, staged, cpu_out, self.pairs, self._workspace, self._cpu_args)
        ids, offsets, tok, w = self._cpu_args
        self._args = TokenPlanArgs(
            kernel.pool_handle, self._workspace.data_ptr(), experts.data_ptr(), experts.stride(0), hidden, k,
            staged.data_ptr(), _addr(cache.slot_of), _addr(cache.id_of), _addr(cache.last_used), cache.n_slots,
            _addr(self.fills_for_m), cpu_out.data_ptr(), _addr(ids), _addr(offsets), _addr(tok), _addr(w),
            self.pairs.data_ptr(), _addr(self.fills), _addr(self.counts), _addr(cache.cpu_step), recent_steps,
            int(planner.keeps_fills))
        self._ref = ctypes.byref(self._args)

    def plan(self, base_id: int, allow_fills: bool) -> int:
        """Plans the staged token for the layer whose first FTW row is `base_id`, starts its CPU
        experts (joined by `kernel.wait()`) and advances the cache's step; returns the fills."""
        self.kernel.hold(self._keep)
        n_fill = self._fn(self._ref, base_id, self.cache.step, int(allow_fills))
        self.cache.step += 1
        return n_fill


def _addr(a: np.ndarray) -> int:
    if not a.flags.c_contiguous:
        raise ValueError("TokenPlanner: arrays must be contiguous")
    return a.ctypes.data
