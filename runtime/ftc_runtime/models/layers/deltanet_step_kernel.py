"""One token of a Gated DeltaNet layer (gated_deltanet.py) on the GPU as two Triton kernels, from
the row of its fused input projection [q k v | z | b | a]:

- `_conv_step`, one program per block of channels: the causal depthwise convolution's step and
  SiLU on the q/k/v channels, the convolution's state (its last K − 1 inputs) shifted in place;
- `_delta_step`, one program per value head: q and k L2-normalized (q scaled by 1/√dk), the
  decay and beta from a and b, the delta rule on the head's fp32 state in place, the output, and
  the gated RMSNorm (norm(o) · w · SiLU(z)) that the output projection reads.

In torch the same step is some fifteen launches. Rounding follows the torch functions on 16-bit
activations: the convolution's output and its SiLU, the recurrence's output and each factor of
the gated norm are rounded to the activation dtype where they are there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime import dependent_launch
from ftc_runtime.dependent_launch import wait_for_previous
from ftc_runtime.models.layers.gated_deltanet import DeltaNetShape

CONV_BLOCK = 256  # channels per program


@triton.jit
def _conv_step(proj, conv_w, state, mixed, C, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
               PDL: tl.constexpr):
    wait_for_previous(PDL)
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, KP)
    ok = c < C
    act = proj.dtype.element_ty
    now = tl.load(proj + c, mask=ok, other=0.0)
    # tap j < K − 1 reads the state's column j, tap K − 1 the current input
    prev = tl.load(state + c[:, None] * (K - 1) + j[None, :], mask=ok[:, None] & (j[None, :] < K - 1), other=0.0)
    seq = tl.where(j[None, :] == K - 1, now[:, None], prev)
    w = tl.load(conv_w + c[:, None] * K + j[None, :], mask=ok[:, None] & (j[None, :] < K), other=0.0)
    y = tl.sum(seq.to(tl.float32) * w.to(tl.float32), axis=1).to(act).to(tl.float32)
    tl.store(mixed + c, (y / (1.0 + tl.exp(-y))).to(act), mask=ok)
    shifted = tl.load(state + c[:, None] * (K - 1) + j[None, :] + 1, mask=ok[:, None] & (j[None, :] < K - 2),
                      other=0.0)
    shifted = tl.where(j[None, :] == K - 2, now[:, None], shifted)
    tl.store(state + c[:, None] * (K - 1) + j[None, :], shifted, mask=ok[:, None] & (j[None, :] < K - 1))


@triton.jit
def _softplus(x):
    """log(1 + eˣ) as torch's: x itself above 20; eˣ itself where 1 + eˣ would round to 1."""
    e = tl.exp(tl.minimum(x, 20.0))
    return tl.where(x > 20.0, x, tl.where(x < -15.0, e, tl.log(1.0 + e)))


@triton.jit
def _delta_step(mixed, proj, A_log, dt_bias, norm_w, recurrent, gated, scale, eps, Z_OFF, B_OFF, A_OFF,
                NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DKP: tl.constexpr,
                DVP: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    h = tl.program_id(0)
    kh = h // (NV // NK)  # the query/key head this value head shares
    dk, dv = tl.arange(0, DKP), tl.arange(0, DVP)
    k_ok, v_ok = dk < DK, dv < DV
    act = mixed.dtype.element_ty
    q = tl.load(mixed + kh * DK + dk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(mixed + NK * DK + kh * DK + dk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(mixed + 2 * NK * DK + h * DV + dv, mask=v_ok, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    a = tl.load(proj + A_OFF + h).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
    decay = tl.exp(-tl.exp(tl.load(A_log + h).to(tl.float32)) * _softplus(a))
    beta = tl.sigmoid(tl.load(proj + B_OFF + h).to(tl.float32))
    at = recurrent + h * DK * DV + dk[:, None] * DV + dv[None, :]
    s_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(at, mask=s_ok, other=0.0) * decay
    u = (v - tl.sum(k[:, None] * s, 0)) * beta
    s = s + k[:, None] * u[None, :]
    tl.store(at, s, mask=s_ok)
    o = tl.sum(q[:, None] * s, 0).to(act).to(tl.float32)
    normed = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(act).to(tl.float32)
    y = (tl.load(norm_w + dv, mask=v_ok, other=0.0).to(tl.float32) * normed).to(act).to(tl.float32)
    z = tl.load(proj + Z_OFF + h * DV + dv, mask=v_ok, other=0.0).to(tl.float32)
    y = y * (z / (1.0 + tl.exp(-z))).to(act).to(tl.float32)
    tl.store(gated + h * DV + dv, y.to(act), mask=v_ok)


def deltanet_step_gpu(proj: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor,
                      shape: DeltaNetShape) -> torch.Tensor:
    """proj [1, channels + v heads · v dim + 2 · v heads] (the fused projection of the layer's
    normalized input: q k v, z, b, a) → the gated norm's output [1, v heads · v dim], the output
    projection's input; `conv_state` [channels, K − 1] and `recurrent` [v heads, dk, dv] fp32 are
    updated in place."""
    nk, nv, dk, dv = shape.heads
    c, kernel = shape.conv_channels, shape.conv_kernel
    width = c + nv * dv + 2 * nv
    if proj.shape != (1, width) or not proj.is_contiguous():
        raise ValueError(f"deltanet_step: a contiguous projection row of shape (1, {width}), not {tuple(proj.shape)}")
    if not (conv_state.is_contiguous() and recurrent.is_contiguous()):
        raise ValueError("deltanet_step: the convolution's and the recurrence's states must be contiguous")
    mixed = torch.empty(1, c, dtype=proj.dtype, device=proj.device)
    pdl = dependent_launch.enabled(proj.device)
    _conv_step[(triton.cdiv(c, CONV_BLOCK),)](proj, conv_w, conv_state, mixed, c, K=kernel,
                                              KP=triton.next_power_of_2(kernel), BLOCK=CONV_BLOCK, PDL=pdl,
                                              launch_pdl=pdl)
    gated = torch.empty(1, nv * dv, dtype=proj.dtype, device=proj.device)
    _delta_step[(nv,)](mixed, proj, A_log, dt_bias, norm_w, recurrent, gated, dk ** -0.5, shape.eps, c, c + nv * dv,
                       c + nv * dv + nv, NK=nk, NV=nv, DK=dk, DV=dv, DKP=triton.next_power_of_2(dk),
                       DVP=triton.next_power_of_2(dv), PDL=pdl, launch_pdl=pdl, num_warps=8)
    return gated
