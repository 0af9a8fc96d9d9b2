"""Sparse attention of one query on the GPU over chosen rows of a storage, read straight from it by
their columns, never gathered into a copy: GLM-5.x's decode step (every head's absorbed query
against the k latent rows the DSA indexer chose; `mla.attend_cached` on the CPU gathers, then runs
torch) and DeepSeek-V4's (64 heads against the shared key/value rows of the window and the chosen
compressed entries, beside a sink logit per head; `sink_attention.sink_attention_at`).

- `_partial`, one program per (block of heads, span of the chosen columns): scores of the heads'
  queries [latent | rope] against the span's rows, masked to the columns the query sees, an online
  softmax in fp32 ("flash decoding"), the span's maximum, sum and weighted latents;
- `_combine`, one program per block of heads: the spans (and each head's sink logit, where given:
  a share of the softmax that adds no value) rescaled to the global maximum and summed.

A span whose columns the query sees none of keeps a maximum of -inf and adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADS = 16  # heads per program: the smallest tile of a tensor-core product
SPAN = 128  # chosen columns per program of `_partial`
BLOCK_N = 32  # columns per step: a step's rows (36 KB in bf16) leave room within the 99 KB of shared memory of sm_120


@triton.jit
def _partial(q, rows, columns, seen, acc_out, max_out, sum_out, H, K, row_stride, spans, scale,
             R: tl.constexpr, P: tl.constexpr, RP: tl.constexpr, PP: tl.constexpr, BH: tl.constexpr,
             BLOCK_N: tl.constexpr, SPAN: tl.constexpr, EXACT: tl.constexpr):
    hb, s = tl.program_id(0), tl.program_id(1)
    h = hb * BH + tl.arange(0, BH)
    r, p = tl.arange(0, RP), tl.arange(0, PP)
    h_ok = h < H
    # The products in the storage's dtype on the tensor cores, accumulated in fp32; fp32 storage
    # (the CPU tests under the interpreter, which makes NaN of 16-bit products) in full precision.
    dt = rows.dtype.element_ty
    precision: tl.constexpr = "ieee" if EXACT else "tf32"
    q_lat = tl.load(q + h[:, None] * (R + P) + r[None, :], mask=h_ok[:, None] & (r[None, :] < R), other=0.0).to(dt)
    q_rope = tl.load(q + h[:, None] * (R + P) + R + p[None, :], mask=h_ok[:, None] & (p[None, :] < P),
                     other=0.0).to(dt)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, RP], dtype=tl.float32)
    for step in range(0, SPAN, BLOCK_N):
        j = s * SPAN + step + tl.arange(0, BLOCK_N)
        in_range = j < K
        col = tl.load(columns + j, mask=in_range, other=0)
        ok = in_range & (tl.load(seen + j, mask=in_range, other=0) != 0)
        row = rows + col.to(tl.int64)[:, None] * row_stride
        lat = tl.load(row + r[None, :], mask=ok[:, None] & (r[None, :] < R), other=0.0)
        k_rope = tl.load(row + R + p[None, :], mask=ok[:, None] & (p[None, :] < P), other=0.0)
        scores = tl.dot(q_lat, tl.trans(lat), input_precision=precision)
        scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision=precision) * scale
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        weights = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(weights, 1)
        acc = tl.dot(weights.to(dt), lat, acc * alpha[:, None], input_precision=precision)
        m_i = m_new
    at = (hb * spans + s) * BH + tl.arange(0, BH)
    tl.store(acc_out + at[:, None] * RP + r[None, :], acc)
    tl.store(max_out + at, m_i)
    tl.store(sum_out + at, l_i)


@triton.jit
def _combine(acc_in, max_in, sum_in, sinks, out, H, R: tl.constexpr, RP: tl.constexpr, BH: tl.constexpr,
             SPANS: tl.constexpr, SPANS_P: tl.constexpr, SINKS: tl.constexpr):
    hb = tl.program_id(0)
    h, r = hb * BH + tl.arange(0, BH), tl.arange(0, RP)
    s_all = tl.arange(0, SPANS_P)
    maxima = tl.load(max_in + (hb * SPANS + s_all[:, None]) * BH + tl.arange(0, BH)[None, :],
                     mask=s_all[:, None] < SPANS, other=float("-inf"))
    top = tl.max(maxima, 0)  # finite: the query sees at least one column
    num = tl.zeros([BH, RP], dtype=tl.float32)
    den = tl.zeros([BH], dtype=tl.float32)
    if SINKS:
        sink = tl.load(sinks + h, mask=h < H, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, sink)
        den = tl.exp(sink - top)
    for s in range(0, SPANS):
        at = (hb * SPANS + s) * BH + tl.arange(0, BH)
        w = tl.exp(tl.load(max_in + at) - top)
        num += tl.load(acc_in + at[:, None] * RP + r[None, :]) * w[:, None]
        den += tl.load(sum_in + at) * w
    tl.store(out + h[:, None] * R + r[None, :], num / den[:, None], mask=(h[:, None] < H) & (r[None, :] < R))


def sparse_latent_attention_gpu(q: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, seen: torch.Tensor,
                                kv_lora: int, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of q [heads, kv_lora + rope] (each head's absorbed query, then its rotary
    query; or rope 0: its query) over the rows [C, kv_lora + rope] of the storage at `columns`
    (int64 [k]) that `seen` (bool [k], at least one true) marks, beside each head's logit in
    `sinks` ([heads], where given), the first kv_lora channels of those rows as values:
    [heads, kv_lora] fp32 (for latent attention, before the values' up-projection)."""
    heads, width = q.shape
    if rows.shape[1] != width or rows.stride(1) != 1 or columns.shape != seen.shape or columns.dim() != 1:
        raise ValueError(f"sparse latent attention: q {list(q.shape)}, rows {list(rows.shape)} (strides "
                         f"{list(rows.stride())}), columns {list(columns.shape)} and seen {list(seen.shape)}")
    return launch(q, rows, columns, seen, kv_lora, scale, SPAN, BLOCK_N, 4, sinks)


def launch(q: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, seen: torch.Tensor, kv_lora: int,
           scale: float, span: int, block_n: int, warps: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The two kernels at a given tiling (`bench/dev/sparse_mla.py` sweeps it)."""
    heads, width = q.shape
    k, rope = columns.shape[0], width - kv_lora
    blocks, spans = triton.cdiv(heads, HEADS), triton.cdiv(k, span)
    rp, pp = max(16, triton.next_power_of_2(kv_lora)), max(16, triton.next_power_of_2(rope))
    partial = torch.empty(blocks, spans, HEADS, rp, dtype=torch.float32, device=q.device)
    maxima = torch.empty(blocks, spans, HEADS, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxima)
    out = torch.empty(heads, kv_lora, dtype=torch.float32, device=q.device)
    _partial[(blocks, spans)](q.contiguous(), rows, columns, seen.to(torch.int8), partial, maxima, sums, heads, k,
                              rows.stride(0), spans, scale, R=kv_lora, P=rope, RP=rp, PP=pp, BH=HEADS,
                              BLOCK_N=block_n, SPAN=span, EXACT=rows.dtype == torch.float32, num_warps=warps)
    _combine[(blocks,)](partial, maxima, sums, maxima if sinks is None else sinks.float().contiguous(), out, heads,
                        R=kv_lora, RP=rp, BH=HEADS, SPANS=spans, SPANS_P=triton.next_power_of_2(spans),
                        SINKS=sinks is not None)
    return out
