"""Rotary position embeddings (RoPE), over the whole head or its first part (`partial_rotary_factor`)."""

from __future__ import annotations

import math

import torch

from ftc_runtime.spec import ModelSpec


def plain_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """float64 inverse frequencies [rotary_dim // 2] of base `theta`: pair i turns at theta^(-2i / rotary_dim)."""
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """float64 inverse frequencies of the rotated part of a head (`partial_rotary_factor`)."""
    return plain_inv_freq(spec.rope.theta, int(spec.attention.head_dim * spec.rope.partial_rotary_factor) // 2 * 2)


def yarn_inv_freq(theta: float, rotary_dim: int, factor: float, original_max_position: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True, *,
                  attention_factor: float | None = None, mscale: float | None = None,
                  mscale_all_dim: float | None = None) -> tuple[torch.Tensor, float]:
    """YaRN's (arXiv 2309.00071) float64 inverse frequencies [rotary_dim // 2] of an even `rotary_dim`, and its
    attention factor, as transformers' `_compute_yarn_parameters` makes them: stretching a base trained on
    `original_max_position` tokens to `factor` times as many. Pairs that turn more than `beta_fast` times over the
    original context keep their frequency (they saw every angle in training), those that turn fewer than
    `beta_slow` times are divided by `factor` (so that longer contexts stay within the angles they saw), a linear
    ramp between. transformers multiplies cos and sin by the attention factor; DeepSeek-V4's config pins it to 1
    for its compressed branch."""
    def pair_of(turns: float) -> float:
        # the (fractional) pair whose wavelength fits `turns` times into the original context
        return rotary_dim * math.log(original_max_position / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: a one-step ramp rather than a division by zero
    # 0 up to the fast pairs (kept), 1 from the slow ones (interpolated)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    inv_freq = plain_inv_freq(theta, rotary_dim)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def get_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    # transformers takes the ratio only when both are set and nonzero, else the paper's 0.1 ln(factor) + 1
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = get_mscale(mscale) / get_mscale(mscale_all_dim)
    elif attention_factor is None:
        attention_factor = get_mscale(1)
    return inv_freq, float(attention_factor)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, 1, rotary dim] of the given positions."""
    freqs = positions[:, None].double() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return torch.cat((rotated, x[..., r:]), dim=-1)


