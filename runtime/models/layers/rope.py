"""Rotary position embeddings (RoPE), over the whole head or its first part (`partial_rotary_factor`)."""

from __future__ import annotations

import torch

from ftc_runtime.spec import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """float64 inverse frequencies of the rotated part of a head (`partial_rotary_factor`)."""
    rot = int(spec.attention.head_dim * spec.rope.partial_rotary_factor) // 2 * 2
    return 1.0 / (spec.rope.theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))


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


