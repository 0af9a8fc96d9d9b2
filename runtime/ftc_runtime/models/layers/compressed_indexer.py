"""DeepSeek-V4's lightning indexer for compressed sparse attention: its own keys are the entries of
an overlapping-window compressor at `index_head_dim` (`window_compressor`), its queries
`q_b(q_residual)` rotated at the tokens' positions, and score[t, s] = Σ_h w[t, h] · ReLU(q[t, h] ·
key[s]) / √index_head_dim with w = weights_proj(h) / √heads, in fp32. Each query attends to the
`top_k` best of the entries it may see (all of them while there are at most top_k). Functions
of tensors only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.dsa_indexer import top_k_visible
from ftc_runtime.models.layers.window_compressor import rotate_interleaved_tail, visible_entries


def compressed_index_scores(h: torch.Tensor, q_residual: torch.Tensor, q_b_w: torch.Tensor,
                            weights_proj_w: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> torch.Tensor:
    """fp32 scores [T, S] of the S indexer keys [S, d] for T tokens (h [T, hidden] the layer's
    input, q_residual [T, q_lora], cos and sin [T, r] at their positions)."""
    t, d = h.shape[0], keys.shape[1]
    q = rotate_interleaved_tail(F.linear(q_residual, q_b_w).view(t, -1, d), cos[:, None], sin[:, None])
    per_head = torch.relu(torch.matmul(q.float(), keys.float().T)) * d ** -0.5  # [T, heads, S]
    w = F.linear(h, weights_proj_w).float() * q.shape[1] ** -0.5
    return torch.matmul(w[:, None, :], per_head)[:, 0]


def select_entries(scores: torch.Tensor, positions: torch.Tensor, rate: int, top_k: int) -> torch.Tensor:
    """bool [T, S]: the top_k entries by score among those each query may see (`visible_entries`);
    among equal scores the latest entries win, so that a choice does not depend on how many
    entries there are."""
    return top_k_visible(scores, visible_entries(positions, scores.shape[1], rate), top_k)
