"""One token's linear layer on the GPU as one Triton kernel, with the work around it that would
otherwise be kernels of their own in a decode step: an RMSNorm of the input in front (its
normalized row also written out, for the router's experts) and the residual add behind.

    y = residual + (RMSNorm(x) · norm_w) Wᵀ + b      (each part where given)

One program per block of output rows reads its rows of W once; every program normalizes the
input row itself (a few KB from L2), so the norm costs no launch and no round trip through
memory. At batch 1 the layer is a stream of W's bytes: the blocks are sized so that enough of
them are in flight to keep the device's memory busy (`gemv_blocks`). Rounding follows the torch
functions it replaces on 16-bit activations: the norm's output and the product are rounded to
the activation dtype, the residual add too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv(x, w, out, norm_w, bias, residual, normed_out, N, eps, K: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
          NORMED_OUT: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    act = x.dtype.element_ty
    rstd = 1.0
    if NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
            squares += xk * xk
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x + kk, mask=kk < K, other=0.0).to(tl.float32)
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
    if RESIDUAL:
        y = (tl.load(residual + n, mask=n_ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(act)
    tl.store(out + n, y, mask=n_ok)


def gemv_blocks(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, K per step, warps) for an [n, k] weight: at least ~512 programs where
    the rows allow (several per SM, so that their loads overlap), steps of 4-16 KB."""
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < 512:
        block_n //= 2
    block_k = min(triton.next_power_of_2(k), max(256, 4096 // block_n))
    return block_n, block_k, 4


def linear_gpu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_w: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, normed_out: torch.Tensor | None = None) -> torch.Tensor:
    """One row x [1, K] times w [N, K]ᵀ (+ bias), optionally on RMSNorm(x) · norm_w (written to
    `normed_out` [1, K] fp32 where given) and plus `residual` [1, N]: [1, N] in x's dtype, into
    `out` where given (which may be `residual` itself: each program reads its rows before it
    writes them)."""
    if x.shape[0] != 1 or not x.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"linear_gpu: one contiguous row times a contiguous weight, not {tuple(x.shape)} "
                         f"{tuple(x.stride())} and {tuple(w.stride())}")
    n, k = w.shape
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_blocks(n, k)
    _gemv[(triton.cdiv(n, block_n),)](
        x, w, out, x if norm_w is None else norm_w, x if bias is None else bias,
        x if residual is None else residual, x if normed_out is None else normed_out, n, eps,
        K=k, BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm_w is not None, BIAS=bias is not None,
        RESIDUAL=residual is not None, NORMED_OUT=normed_out is not None, num_warps=warps)
    return out
