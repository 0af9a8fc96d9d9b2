"""Attention with a sigmoid output gate and partial RoPE (Qwen3-Next, Qwen3.5): q_proj also yields a
per-channel gate, and the attention output is multiplied by sigmoid(gate) before o_proj. Functions
of tensors only, shared by the eager path and the CUDA graphs of decode."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.rope import apply_rope


def gated_attention_in(h: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor,
                       q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float, heads: tuple[int, int, int], output_gate: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Projections, q/k norms and partial RoPE of the normalized input h [T, hidden]: q [T, heads,
    d], k and v [T, kv heads, d], and the output gate's logits [T, heads · d] (or None)."""
    n_q, n_kv, d = heads
    t = h.shape[0]
    q = F.linear(h, q_w)
    gate = None
    if output_gate:  # per head: d query channels, then d gate channels
        q, gate = q.view(t, n_q, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(t, n_q * d)
    q = apply_rope(rms_norm(q.reshape(t, n_q, d), q_norm_w, eps), cos, sin)
    k = apply_rope(rms_norm(F.linear(h, k_w).view(t, n_kv, d), k_norm_w, eps), cos, sin)
    return q, k, F.linear(h, v_w).view(t, n_kv, d), gate


def gated_attention_out(attn: torch.Tensor, gate: torch.Tensor | None, o_w: torch.Tensor) -> torch.Tensor:
    return F.linear(attn if gate is None else attn * torch.sigmoid(gate), o_w)


def residual_norm(x: torch.Tensor, out: torch.Tensor, norm_w: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x + out, and its post-attention norm."""
    x = x + out
    return x, rms_norm(x, norm_w, eps)
