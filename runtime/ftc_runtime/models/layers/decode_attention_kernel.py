"""One decode token's grouped-query attention over a KV storage of fixed capacity, up to the
token's position (a device tensor), as two Triton kernels for the decode graphs:

- `_partial`, one program per (KV head, span of keys): the query heads of that KV head against
  the span's keys up to the position, an online softmax in fp32 ("flash decoding"): the span's
  running maximum, sum and weighted values;
- `_combine`, one program per KV head: the spans up to the position rescaled to the global
  maximum and summed; or, given a count per KV head (`done`, zero between calls, at a fixed
  address for a graph), by the last of the head's `_partial` programs to finish: one kernel.

Only the keys up to the position are read, however large the storage (its tail is never touched),
and the graph's grid stays fixed: spans past the position return at once. Spans are as short as
one step of keys while the storage is small, so that a short context spreads over several
programs per head, and grow with the storage so that there are never more than `MAX_SPANS` of
them for the combine to walk. In torch the same attention is two batched matmuls over the whole
storage, a mask, a softmax and conversions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime import dependent_launch
from ftc_runtime.dependent_launch import wait_for_previous

MIN_SPAN = 64  # keys per program of `_partial` at the least: one step of keys
MAX_SPANS = 64  # spans per KV head at the most


def span_for(capacity: int) -> int:
    """Keys per program of `_partial` over a storage of `capacity` keys."""
    return max(MIN_SPAN, triton.next_power_of_2(triton.cdiv(capacity, MAX_SPANS)))


@triton.jit
def _combine_head(h, acc_in, max_in, sum_in, position, out, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
                  DP: tl.constexpr, SPANS: tl.constexpr, SPANS_P: tl.constexpr, SPAN: tl.constexpr,
                  VOLATILE: tl.constexpr):
    """KV head h's spans up to the position rescaled to their common maximum and summed into
    its query heads' rows of `out`; `VOLATILE`: the spans were written by other programs of the
    running kernel (not through the cache)."""
    g, d = tl.arange(0, GP), tl.arange(0, DP)
    s_all = tl.arange(0, SPANS_P)
    last = tl.load(position) // SPAN  # the spans after it saw no key
    # span 0 always holds key 0: the maximum is finite
    seen = (s_all[:, None] <= last) & (s_all[:, None] < SPANS)
    maxima = tl.load(max_in + (h * SPANS + s_all[:, None]) * GP + g[None, :], mask=seen, other=float("-inf"),
                     volatile=VOLATILE)
    top = tl.max(maxima, 0)
    num = tl.zeros([GP, DP], dtype=tl.float32)
    den = tl.zeros([GP], dtype=tl.float32)
    for s in range(0, SPANS):  # a fixed loop (the interpreter's loop bounds are no loaded values)
        if s <= last:
            at = (h * SPANS + s) * GP + g
            w = tl.exp(tl.load(max_in + at, volatile=VOLATILE) - top)
            num += tl.load(acc_in + at[:, None] * DP + d[None, :], volatile=VOLATILE) * w[:, None]
            den += tl.load(sum_in + at, volatile=VOLATILE) * w
    result = num / den[:, None]
    tl.store(out + (h * G + g[:, None]) * D + d[None, :], result.to(out.dtype.element_ty),
             mask=(g[:, None] < G) & (d[None, :] < D))


@triton.jit
def _partial(q, keys, values, position, acc_out, max_out, sum_out, out, done, scale, k_stride_c, k_stride_h,
             v_stride_c, v_stride_h, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
             BLOCK_N: tl.constexpr, SPAN: tl.constexpr, SPANS: tl.constexpr, SPANS_P: tl.constexpr,
             PRECISION: tl.constexpr, COMBINE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    h, s = tl.program_id(0), tl.program_id(1)
    g, d = tl.arange(0, GP), tl.arange(0, DP)
    # Tiles in fp32, dots in tf32 for 16-bit inputs (which tf32 holds exactly) or full fp32.
    q_tile = tl.load(q + (h * G + g[:, None]) * D + d[None, :], mask=(g[:, None] < G) & (d[None, :] < D),
                     other=0.0).to(tl.float32)
    lo = s * SPAN
    hi = tl.minimum(lo + SPAN, tl.load(position) + 1)  # keys lo .. hi - 1 (none past the position)
    m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    # A fixed loop whose steps past the position do nothing: Triton's interpreter (the CPU tests)
    # takes no loaded value as a loop bound.
    for step in range(0, SPAN, BLOCK_N):
        if lo + step < hi:
            n = lo + step + tl.arange(0, BLOCK_N)
            kv_mask = (n[:, None] < hi) & (d[None, :] < D)
            k = tl.load(keys + n[:, None] * k_stride_c + h * k_stride_h + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            scores = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(n[None, :] < hi, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(values + n[:, None] * v_stride_c + h * v_stride_h + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
    at = (h * SPANS + s) * GP + g
    tl.store(acc_out + at[:, None] * DP + d[None, :], acc)
    tl.store(max_out + at, m_i)
    tl.store(sum_out + at, l_i)
    if COMBINE:  # the head's last program to finish combines its spans
        tl.debug_barrier()  # the program's every store before its count, whose release covers them
        if tl.atomic_add(done + h, 1, sem="acq_rel", scope="gpu") == SPANS - 1:
            _combine_head(h, acc_out, max_out, sum_out, position, out, G, D, GP, DP, SPANS, SPANS_P, SPAN, True)
            tl.store(done + h, 0)


@triton.jit
def _combine(acc_in, max_in, sum_in, position, out, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
             DP: tl.constexpr, SPANS: tl.constexpr, SPANS_P: tl.constexpr, SPAN: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    _combine_head(tl.program_id(0), acc_in, max_in, sum_in, position, out, G, D, GP, DP, SPANS, SPANS_P, SPAN,
                  False)


def decode_attention_gpu(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                         heads: tuple[int, int, int], done: torch.Tensor | None = None) -> torch.Tensor:
    """`attention.decode_attention` on the GPU: q [1, heads, d] over keys/values [C, kv, d] up to
    `position` (int64 [1] on the device): [1, heads · d] in q's dtype. `done`: int32 counts, one
    per KV head, zero (and left zero): the spans are combined by the kernel that computes them."""
    n_q, n_kv, d = heads
    group = n_q // n_kv
    if keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError(f"decode attention: keys and values need unit stride along d, not "
                         f"{keys.stride()} and {values.stride()}")
    span = span_for(keys.shape[0])
    spans = triton.cdiv(keys.shape[0], span)
    gp, dp = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(d))
    partial = torch.empty(n_kv, spans, gp, dp, dtype=torch.float32, device=q.device)
    maxima = torch.empty(n_kv, spans, gp, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxima)
    out = torch.empty(1, n_q * d, dtype=q.dtype, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # keys per step and warps: a step's key and value tiles are BLOCK_N × dp fp32 in registers
    block_n, warps = (64, 4) if dp <= 128 else (32, 8)
    if done is not None and (done.dtype != torch.int32 or done.numel() < n_kv):
        raise ValueError(f"decode attention: done must hold an int32 count per KV head ({n_kv}), "
                         f"not {done.numel()} of {done.dtype}")
    spans_p = triton.next_power_of_2(spans)
    pdl = dependent_launch.enabled(q.device)
    _partial[(n_kv, spans)](q.contiguous(), keys, values, position, partial, maxima, sums, out,
                            out if done is None else done, d ** -0.5, keys.stride(0), keys.stride(1),
                            values.stride(0), values.stride(1), G=group, D=d, GP=gp, DP=dp,
                            BLOCK_N=min(block_n, span), SPAN=span, SPANS=spans, SPANS_P=spans_p, PRECISION=precision,
                            COMBINE=done is not None, PDL=pdl, launch_pdl=pdl, num_warps=warps)
    if done is None:
        _combine[(n_kv,)](partial, maxima, sums, position, out, G=group, D=d, GP=gp, DP=dp, SPANS=spans,
                          SPANS_P=spans_p, SPAN=span, PDL=pdl, launch_pdl=pdl)
    return out
