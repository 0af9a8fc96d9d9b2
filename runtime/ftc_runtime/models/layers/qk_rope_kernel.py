"""The tail of a decode token's attention input on the GPU as one Triton kernel: from the fused
q/k/v projection's row, each head's RMSNorm (q and k, where the model has them), the rotary
embedding (rotate-half, over the head's first `rotary` dims) and the KV cache's write at the
token's position (a device tensor), one program per head. In torch the same is a norm, RoPE and
a split per tensor and two index copies: five launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime import dependent_launch
from ftc_runtime.dependent_launch import wait_for_previous


@triton.jit
def _qk_norm_rope_store(qkv, q_norm_w, k_norm_w, cos, sin, position, q_out, keys, values, k_stride_c,
                        k_stride_h, v_stride_c, v_stride_h, eps, HQ: tl.constexpr, HKV: tl.constexpr,
                        D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr,
                        QS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    p = tl.program_id(0)
    d = tl.arange(0, DP)
    ok = d < D
    act = qkv.dtype.element_ty
    pos = tl.load(position)
    row = qkv + tl.where(p < HQ, p * QS, HQ * QS + (p - HQ) * D)  # a query head is QS apart (its gate after it)
    if p >= HQ + HKV:  # a value head: stored as it is
        h = p - HQ - HKV
        v = tl.load(row + d, mask=ok)
        tl.store(values + pos * v_stride_c + h * v_stride_h + d, v, mask=ok)
    else:
        half = R // 2
        partner = tl.where(d < half, d + half, d - half)
        x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(row + partner, mask=d < R, other=0.0).to(tl.float32)
        if QK_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            w = tl.load(tl.where(p < HQ, q_norm_w + d, k_norm_w + d), mask=ok, other=0.0).to(tl.float32)
            wp = tl.load(tl.where(p < HQ, q_norm_w + partner, k_norm_w + partner), mask=d < R, other=0.0)
            x = (x * rstd).to(act).to(tl.float32) * w
            xp = (xp * rstd).to(act).to(tl.float32) * wp.to(tl.float32)
            x, xp = x.to(act).to(tl.float32), xp.to(act).to(tl.float32)
        c = tl.load(cos + d, mask=d < R, other=1.0).to(tl.float32)
        s = tl.load(sin + d, mask=d < R, other=0.0).to(tl.float32)
        y = (x * c + tl.where(d < half, -xp, xp) * s).to(act)
        if p < HQ:
            tl.store(q_out + p * D + d, y, mask=ok)
        else:
            h = p - HQ
            tl.store(keys + pos * k_stride_c + h * k_stride_h + d, y, mask=ok)


def qk_norm_rope_store_gpu(qkv: torch.Tensor, q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
                           cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: tuple[int, int, int],
                           keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                           output_gate: bool = False) -> torch.Tensor:
    """qkv [1, (heads + 2 kv) · d] → q [1, heads, d] normed and rotated; k (normed, rotated) and v
    written to keys/values [C, kv, d] at `position` (int64 [1] on the device). cos and sin: [1, 1,
    rotary] as `rope.rope_cos_sin` gives them (rotary ≤ d). With `output_gate` each query head's d
    channels are followed by its gate's d (qkv [1, (2 heads + 2 kv) · d]), which stay where they are."""
    n_q, n_kv, d = heads
    width = ((2 if output_gate else 1) * n_q + 2 * n_kv) * d
    if qkv.shape != (1, width) or not qkv.is_contiguous():
        raise ValueError(f"qk_norm_rope_store: qkv of shape (1, {width}), contiguous, not {tuple(qkv.shape)}")
    if keys.stride(2) != 1 or values.stride(2) != 1:
        raise ValueError(f"qk_norm_rope_store: keys and values need unit stride along d, not "
                         f"{keys.stride()} and {values.stride()}")
    q = torch.empty(1, n_q, d, dtype=qkv.dtype, device=qkv.device)
    qk_norm = q_norm_w is not None
    pdl = dependent_launch.enabled(qkv.device)
    _qk_norm_rope_store[(n_q + 2 * n_kv,)](
        qkv, q_norm_w if qk_norm else qkv, k_norm_w if qk_norm else qkv, cos.contiguous(), sin.contiguous(),
        position, q, keys, values, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), eps,
        HQ=n_q, HKV=n_kv, D=d, DP=triton.next_power_of_2(d), R=cos.shape[-1], QK_NORM=qk_norm,
        QS=2 * d if output_gate else d, PDL=pdl, launch_pdl=pdl, num_warps=1)
    return q
