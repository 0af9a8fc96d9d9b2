"""One token's linear layer on the GPU as one Triton kernel, with the work around it that would
otherwise be kernels of their own in a decode step: the previous layer's output joined into the
input row (the joined row also written out: the residual stream's next value), an RMSNorm of the
input in front (its normalized row also written out, for the router's experts), a SwiGLU of two
halves of it (a shared expert's down projection) or a sigmoid gate per input column (gated
attention's output projection); a scalar sigmoid gate and the residual add behind; a router's
softmax top-k of the whole output row, by the program that finishes last.

    y = residual + sigmoid(s) · ((RMSNorm(x + plus) · norm_w) Wᵀ + b)      (each part where given)

One program per block of output rows reads its rows of W once; every program normalizes the
input row itself (a few KB from L2), so the norm costs no launch and no round trip through
memory. At batch 1 the layer is a stream of W's bytes: the blocks are sized so that enough of
them are in flight to keep the device's memory busy (`gemv_blocks`). Rounding follows the torch
functions it replaces on 16-bit activations: the norm's output and the product are rounded to
the activation dtype, the residual add too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ftc_runtime import dependent_launch
from ftc_runtime.dependent_launch import wait_for_previous
from ftc_runtime.models.layers.router_kernel import store_softmax_top_k


class TopK(NamedTuple):
    """A router's selection as the projection's epilogue: the softmax top-`k` of the output row's
    first `among` values (0: all; a router's rows may lead a fused weight's), `renormalize`d where
    the model says so, written to `ids` ([1, k] int64) and `weights` ([1, k] fp32). `done` (int32
    [1], zero between calls, at a fixed address for a graph) counts the programs as they finish:
    the last one selects, then zeroes it."""

    k: int
    renormalize: bool
    ids: torch.Tensor
    weights: torch.Tensor
    done: torch.Tensor
    among: int = 0


@triton.jit
def _swiglu_input(x, kk, K: tl.constexpr, act):
    """SiLU(gate) · up of a row [gate (K) | up (K)] at columns kk, each factor rounded as torch's."""
    g = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
    u = tl.load(x + K + kk, mask=kk < K, other=0.0).to(tl.float32)
    return ((g / (1.0 + tl.exp(-g))).to(act).to(tl.float32) * u).to(act).to(tl.float32)


@triton.jit
def _gated_input(x, in_gate, kk, K: tl.constexpr, HEAD: tl.constexpr, act):
    """x · sigmoid(gate) at columns kk, the gate of column c at c // HEAD · 2 HEAD + HEAD + c % HEAD
    (each head's gate after its query in the q projection's row), rounded as torch's."""
    xk = tl.load(x + kk, mask=kk < K, other=0.0)
    g = tl.load(in_gate + kk // HEAD * 2 * HEAD + HEAD + kk % HEAD, mask=kk < K, other=0.0).to(tl.float32)
    return (xk.to(tl.float32) * tl.sigmoid(g).to(act).to(tl.float32)).to(act).to(tl.float32)


@triton.jit
def _row(x, plus, kk, K: tl.constexpr, act, PLUS: tl.constexpr):
    """x at columns kk in fp32, `plus` (fp32) added first where given: rounded to x's dtype, then
    added and rounded again, as torch's copy into a buffer of x's dtype and in-place add."""
    xk = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
    if PLUS:
        xk = (xk + tl.load(plus + kk, mask=kk < K, other=0.0).to(act).to(tl.float32)).to(act).to(tl.float32)
    return xk


@triton.jit
def _select_when_last(out, E, ids_out, weights_out, done, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                      RENORMALIZE: tl.constexpr):
    """The program that finishes last (counted in `done`) selects the top k of `out`'s first E
    values, which every program has stored by then, and zeroes `done` for the next call."""
    tl.debug_barrier()  # the program's every store before its count, whose release covers them
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        e = tl.arange(0, EP)
        x = tl.load(out + e, mask=e < E, other=float("-inf"), volatile=True).to(tl.float32)
        store_softmax_top_k(x, ids_out, weights_out, EP, K, KP, RENORMALIZE)
        tl.store(done, 0)


@triton.jit
def _gemv(x, w, out, norm_w, bias, residual, normed_out, out_gate, in_gate, plus, joined_out, ids_out,
          weights_out, done, N, among, eps, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, NORMED_OUT: tl.constexpr,
          SWIGLU: tl.constexpr, OUT_GATE: tl.constexpr, IN_GATE_HEAD: tl.constexpr, PLUS: tl.constexpr,
          TOP_K: tl.constexpr, TOP_KP: tl.constexpr, EP: tl.constexpr, RENORMALIZE: tl.constexpr,
          PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    act = x.dtype.element_ty
    rstd = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xk = _row(x, plus, kk, K, act, PLUS)
            squares += xk * xk
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if SWIGLU:
            xk = _swiglu_input(x, kk, K, act)
        elif IN_GATE_HEAD > 0:
            xk = _gated_input(x, in_gate, kk, K, IN_GATE_HEAD, act)
        else:
            xk = _row(x, plus, kk, K, act, PLUS)
            if PLUS:
                tl.store(joined_out + kk, xk, mask=(kk < K) & (pid == 0))
        if NORM:
            xk = (xk * rstd).to(act).to(tl.float32)
            xk = (xk * tl.load(norm_w + kk, mask=kk < K, other=0.0).to(tl.float32)).to(act).to(tl.float32)
            if NORMED_OUT:
                tl.store(normed_out + kk, xk, mask=(kk < K) & (pid == 0))
        wt = tl.load(w + n[:, None] * K + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K), other=0.0)
        acc += wt.to(tl.float32) * xk[None, :]
    y = tl.sum(acc, 1)
    if BIAS:
        y += tl.load(bias + n, mask=n_ok, other=0.0).to(tl.float32)
    y = y.to(act)
    if OUT_GATE:
        y = (tl.sigmoid(tl.load(out_gate).to(tl.float32)).to(act).to(tl.float32) * y.to(tl.float32)).to(act)
    if RESIDUAL:
        y = (tl.load(residual + n, mask=n_ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(act)
    tl.store(out + n, y, mask=n_ok)
    if TOP_K > 0:
        _select_when_last(out, among, ids_out, weights_out, done, EP, TOP_K, TOP_KP, RENORMALIZE)


def gemv_blocks(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, K per step, warps) for an [n, k] weight: two rows per program, so that
    even a router's few rows spread over many SMs, in steps of 1024 columns (4 KB of bf16 per
    row), whose loads each thread issues together (docs/history/performance-log.md has the sweep)."""
    return 2, min(triton.next_power_of_2(k), 1024), 4


def _check_input(x: torch.Tensor, w: torch.Tensor, norm: bool, swiglu: bool, gated: bool,
                 plus: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Raises unless `linear_gpu` can take x and w with these options."""
    k = w.shape[1] * (2 if swiglu else 1)
    if x.shape != (1, k) or not x.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"linear_gpu: one contiguous row of {k} times a contiguous weight, "
                         f"not {tuple(x.shape)} {tuple(x.stride())} and {tuple(w.shape)} {tuple(w.stride())}")
    if norm + swiglu + gated > 1 or swiglu + gated + (plus is not None) > 1:
        raise ValueError("linear_gpu: one of a SwiGLU, a gated or a joined input, and a norm only with the last")
    if plus is not None and (plus[0].shape != x.shape or plus[1].shape != x.shape or plus[1].dtype != x.dtype
                             or plus[1].data_ptr() == x.data_ptr()):
        raise ValueError(f"linear_gpu: `plus` needs a row and a joined row of {tuple(x.shape)}, the latter in "
                         f"{x.dtype} and apart from x")


def linear_gpu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_w: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, normed_out: torch.Tensor | None = None, swiglu: bool = False,
               out_gate: torch.Tensor | None = None, in_gate: tuple[torch.Tensor, int] | None = None,
               plus: tuple[torch.Tensor, torch.Tensor] | None = None, top_k: TopK | None = None) -> torch.Tensor:
    """One row x [1, K] times w [N, K]ᵀ (+ bias), optionally on RMSNorm(x) · norm_w (written to
    `normed_out` [1, K] fp32 where given), on SiLU(gate) · up of x = [gate | up] [1, 2K] where
    `swiglu`, or on x · sigmoid(gate) where `in_gate` = (a q projection's row whose heads of d
    channels are each followed by their gate's d, d); times sigmoid(`out_gate`) (one element)
    where given, and plus `residual` [1, N]: [1, N] in x's dtype, into `out` where given (which
    may be `residual` itself: each program reads its rows before it writes them). `plus` =
    (p [1, K] fp32, joined [1, K] in x's dtype, not x): the row is x + p instead of x (p rounded
    to x's dtype first), and is written to `joined`. `top_k`: the output row's softmax top-k
    selected too (a router's logits)."""
    _check_input(x, w, norm_w is not None, swiglu, in_gate is not None, plus)
    n, k = w.shape
    among = n if top_k is None or not top_k.among else top_k.among
    if top_k is not None and not (0 < top_k.k <= among <= n and top_k.ids.shape == top_k.weights.shape == (1, top_k.k)
                                  and top_k.ids.dtype == torch.int64 and top_k.weights.dtype == torch.float32
                                  and top_k.done.dtype == torch.int32):
        raise ValueError(f"linear_gpu: top_k {top_k.k} of {among} of {n} outputs needs ids [1, k] int64, "
                         "weights [1, k] fp32 and an int32 count")
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_blocks(n, k)
    plus_row, joined = (x, x) if plus is None else plus
    sel = TopK(0, False, x, x, x) if top_k is None else top_k
    pdl = dependent_launch.enabled(x.device)
    _gemv[(triton.cdiv(n, block_n),)](
        x, w, out, x if norm_w is None else norm_w, x if bias is None else bias,
        x if residual is None else residual, x if normed_out is None else normed_out,
        x if out_gate is None else out_gate, x if in_gate is None else in_gate[0], plus_row, joined, sel.ids,
        sel.weights, sel.done, n, among, eps, K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_w is not None,
        BIAS=bias is not None, RESIDUAL=residual is not None, NORMED_OUT=normed_out is not None, SWIGLU=swiglu,
        OUT_GATE=out_gate is not None, IN_GATE_HEAD=0 if in_gate is None else in_gate[1], PLUS=plus is not None,
        TOP_K=sel.k, TOP_KP=triton.next_power_of_2(max(sel.k, 1)), EP=triton.next_power_of_2(among) if sel.k else 1,
        RENORMALIZE=sel.renormalize, PDL=pdl, launch_pdl=pdl, num_warps=warps)
    return out
