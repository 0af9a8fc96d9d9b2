"""DeepSeek-V4's compressed attention entries: every complete window of `rate` source tokens
becomes one KV entry, rows pooled by a softmax over their `gate` rows plus a learned per-slot bias
(per channel, in fp32), RMSNorm'd, and rotated (interleaved RoPE on the head's trailing rotary
slice) at the window's first position. Heavily compressed attention (HCA) pools each window's own
rows; compressed sparse attention (CSA, and its indexer's keys) pools overlapping windows: each
token projects two series, and entry w pools the first series of window w - 1 with the second of
window w (width 2 · rate, stride rate). A query at position t sees the entries of windows that
closed by t: entry w where w < (t + 1) // rate. Functions of tensors only; the rotary tables come
from the caller (`cos`, `sin` of the entries' positions, one value per rotated pair).
"""

from __future__ import annotations

import torch

from ftc_runtime.models.layers.norm import rms_norm_fp32_weight


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
    """HCA: kv and gate [n · rate, d] (n complete windows), position_bias [rate, d] fp32, the
    entries' rotary tables [n, r] → entries [n, d] in kv's dtype."""
    rate, d = position_bias.shape
    n = kv.shape[0] // rate
    gates = gate[:n * rate].view(n, rate, d) + position_bias
    return _pool(kv[:n * rate].view(n, rate, d), gates, norm_w, eps, cos, sin)


def compress_overlapping_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                                 norm_w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                                 prior: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """CSA: kv and gate [n · rate, 2d] (series a, then b), position_bias [rate, 2d] fp32 → entries
    [n, d]. Window 0's first half is `prior` (the first series of the window before these tokens
    and its biased gate, [rate, d] each), or empty (no weight) at the sequence's start."""
    rate, d = position_bias.shape[0], position_bias.shape[1] // 2
    n = kv.shape[0] // rate
    kv2 = kv[:n * rate].view(n, rate, 2 * d)
    gate2 = gate[:n * rate].view(n, rate, 2 * d) + position_bias
    first_kv, first_gate = kv2.new_zeros(1, rate, d), gate2.new_full((1, rate, d), float("-inf"))
    if prior is not None:
        first_kv, first_gate = prior[0][None].to(kv2.dtype), prior[1][None].to(gate2.dtype)
    windows = torch.cat([torch.cat([first_kv, kv2[:-1, :, :d]]), kv2[:, :, d:]], dim=1)
    gates = torch.cat([torch.cat([first_gate, gate2[:-1, :, :d]]), gate2[:, :, d:]], dim=1)
    return _pool(windows, gates, norm_w, eps, cos, sin)


def _pool(windows: torch.Tensor, gates: torch.Tensor, norm_w: torch.Tensor, eps: float, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    """windows [n, w, d] and their biased gates → the entries [n, d]: softmax-pooled over the
    window (fp32 weights), RMSNorm'd with an fp32 weight, rotated."""
    pooled = (windows * gates.softmax(dim=1, dtype=torch.float32).to(windows.dtype)).sum(dim=1)
    return rotate_interleaved_tail(rms_norm_fp32_weight(pooled, norm_w, eps), cos, sin)


def visible_entries(positions: torch.Tensor, n_entries: int, rate: int) -> torch.Tensor:
    """bool [T, n_entries]: which entries a query at each position sees (their windows closed)."""
    return torch.arange(n_entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]
