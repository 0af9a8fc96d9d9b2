"""The indexer of DeepSeek Sparse Attention (DSA, DeepSeek-V3.2 / GLM-MoE-DSA): a few small heads
score every cached token for each query, and the query's MLA attends only to its top_k tokens.
The indexer caches one key [head_dim] per token beside MLA's latent. Functions of tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.fp8_linear import Weight, linear
from ftc_runtime.models.layers.mla import interleaved_rope

KEY_NORM_EPS = 1e-6  # the key LayerNorm's eps, fixed by the reference (not in the config)


@dataclass(frozen=True)
class IndexerShape:
    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    rope_dim: int  # qk_rope_head_dim: the first rope_dim dims of q and k are rotated (interleaved), the rest pass
    top_k: int  # index_topk


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Interleaved RoPE of the first rope_dim dims of x [T, n, head_dim]; the rest pass unchanged."""
    return torch.cat((interleaved_rope(x[..., :rope_dim], cos, sin), x[..., rope_dim:]), dim=-1)


def indexer_keys(x: torch.Tensor, wk_w: Weight, k_norm_w: torch.Tensor, k_norm_b: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, shape: IndexerShape) -> torch.Tensor:
    """The indexer keys [T, head_dim] of the normalized input x [T, hidden] (one head, shared by the
    indexer's query heads): LayerNorm of wk x, then RoPE of its first rope_dim dims."""
    k = F.layer_norm(linear(x, wk_w), (shape.head_dim,), k_norm_w, k_norm_b, KEY_NORM_EPS)
    return _partial_rope(k[:, None, :], cos, sin, shape.rope_dim)[:, 0]


def index_scores(x: torch.Tensor, q_resid: torch.Tensor, wq_b_w: Weight, weights_proj_w: torch.Tensor,
                 keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: IndexerShape) -> torch.Tensor:
    """fp32 scores [T, C] of C cached keys [C, head_dim] for T queries: x [T, hidden] the normalized
    input, q_resid [T, q_lora] MLA's low-rank query (`mla_in`). score[t, c] = Σ_h w[t, h] ·
    ReLU(q[t, h] · keys[c] / √head_dim), with per-query head weights w = weights_proj x / √heads.
    The scores are selected by rank, so fp32 throughout, as the reference, lest bf16 rounding reorder
    them. Holds [T, heads, C] fp32 at once: a long prompt is scored in chunks of queries."""
    t = x.shape[0]
    q = linear(q_resid, wq_b_w).view(t, shape.num_heads, shape.head_dim)
    q = _partial_rope(q, cos, sin, shape.rope_dim)
    per_head = torch.relu(torch.matmul(q.float(), keys.float().T) * shape.head_dim ** -0.5)  # [T, heads, C]
    # [T, heads] in the weight's dtype (fp32 on every device), x converted to it as transformers does
    w = F.linear(x.to(weights_proj_w.dtype), weights_proj_w).float() * shape.num_heads ** -0.5
    return torch.matmul(w[:, None, :], per_head)[:, 0]


def select_keys(scores: torch.Tensor, positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """Which keys each query attends to, bool [T, C]: of the keys at or before its position
    (positions int64 [T]; key c is the token at position c), the top_k by score (scores [T, C]).
    A query with at most top_k such keys sees them all. Keys past a query's position (later tokens
    of its chunk, or the unused tail of a fixed-size cache) are never visible.
    Equal scores are common: a key that every head's ReLU zeroes scores exactly 0, and with
    negative head weights zeros rank mid-list. Among equals the latest keys win, so that the
    choice does not depend on how many columns the scores have (a prompt whole or in chunks, a
    resumed prefix). transformers' topk breaks such ties in no fixed order."""
    return top_k_visible(scores, _causal(scores, positions), top_k)


def select_key_indices(scores: torch.Tensor, positions: torch.Tensor, top_k: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_keys` as the keys' columns: (columns int64 [T, k], whether each is chosen [T, k]),
    k = min(top_k, C), so that attention can gather k cached rows instead of reading all C."""
    return top_k_indices(scores, _causal(scores, positions), top_k)


def _causal(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return torch.arange(scores.shape[1], device=scores.device)[None, :] <= positions[:, None]


def top_k_visible(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool [T, C]: each row's top_k columns by score among its `visible` ones (all of them where
    it has at most top_k), the latest columns first among equal scores (`select_keys` says why)."""
    columns, chosen = top_k_indices(scores, visible, top_k)
    return torch.zeros_like(visible).scatter_(-1, columns, chosen)


def top_k_indices(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k_visible` as columns: (columns [T, k], chosen [T, k]), k = min(top_k, C); where a row
    has fewer than k visible columns, the rest are invisible ones, not chosen. One top-k over
    int64 keys that order as the fp32 scores (their bits, negative ones' magnitude bits flipped;
    −0 counted as +0) with the column below them, so that among equal scores the later column
    ranks higher: no sort, and no tie for the top-k to break."""
    c = scores.shape[1]
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns −0 into +0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    column = torch.arange(c, device=scores.device)
    keys = torch.where(visible, ordered * (1 << 32) + column, torch.iinfo(torch.int64).min + column)
    columns = keys.topk(min(top_k, c), dim=-1).indices
    return columns, visible.gather(1, columns)
