"""DeepSeek-V4's heavily compressed attention (HCA) entries: every complete window of `rate` source
tokens becomes one KV entry, the window's `kv` rows pooled by a softmax over their `gate` rows
plus a learned per-slot bias (per channel, in fp32), RMSNorm'd, and rotated (interleaved RoPE on
the head's trailing rotary slice) at the window's first position. A query at position t sees the
entries of windows that closed by t: entry w where w < (t + 1) // rate. Functions of tensors
only; the rotary tables come from the caller (`cos`, `sin` of the entries' positions, one value
per rotated pair).
"""

from __future__ import annotations

import torch


def rotate_interleaved_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] with its last 2 · r channels rotated in pairs (2i, 2i + 1) by cos, sin [..., r]
    (broadcast over x's leading dims), in fp32; the leading channels pass unchanged."""
    r2 = 2 * cos.shape[-1]
    nope, rope = x[..., :-r2], x[..., -r2:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, norm_w: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kv and gate [n · rate, d] (n complete windows), position_bias [rate, d] fp32, the entries'
    rotary tables [n, r] → entries [n, d] in kv's dtype."""
    rate, d = position_bias.shape
    n = kv.shape[0] // rate
    windows = kv[:n * rate].view(n, rate, d)
    weights = (gate[:n * rate].view(n, rate, d) + position_bias).softmax(dim=1, dtype=torch.float32)
    pooled = (windows * weights.to(kv.dtype)).sum(dim=1).float()
    normed = (norm_w.float() * (pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps))).to(kv.dtype)
    return rotate_interleaved_tail(normed, cos, sin)


def visible_entries(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """bool [T, n_entries]: which entries a query at each position sees (their windows closed)."""
    return torch.arange(n_entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]
