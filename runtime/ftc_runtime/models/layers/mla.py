"""Multi-head latent attention (MLA, DeepSeek-V3 / GLM-MoE-DSA): keys and values of all heads are
up-projections of one small per-token latent, so the cache holds only that latent [kv_lora_rank]
and one rotary key [rope_dim] shared by the heads. Attention runs in the absorbed form: the key
up-projection is folded into the query and the value up-projection applied after the softmax, so
that a long context is never expanded to per-head keys and values. Functions of tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ftc_runtime.models.layers.fp8_linear import Weight, linear
from ftc_runtime.models.layers.norm import rms_norm


@dataclass(frozen=True)
class MlaShape:
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim: the part of a head's query/key without position
    rope_dim: int  # qk_rope_head_dim: the rotary part, its key shared by all heads
    v_dim: int  # v_head_dim
    eps: float  # the q_a and kv_a RMSNorms' eps (transformers leaves them at the RMSNorm default 1e-6)
    scale: float  # softmax scale: (nope + rope)^-0.5, times mscale² where YaRN sets mscale_all_dim


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [T, n, r] whose rotated pairs are interleaved, (x0, x1), (x2, x3), ..., with cos and
    sin [T, 1, r] laid out as cat(freqs, freqs) (`rope_cos_sin`). Pair i turns by frequency i; the
    result comes de-interleaved, the rotated evens then the rotated odds, as in transformers. Queries
    and keys are permuted alike, so their dot products are those of the interleaved layout."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def mla_in(x: torch.Tensor, q_a_w: Weight, q_a_norm_w: torch.Tensor, q_b_w: Weight,
           kv_a_w: Weight, kv_a_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           shape: MlaShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projections of the normalized input x [T, hidden]: q_nope [T, heads, nope], the rotated
    q_rope [T, heads, rope], the normalized latent [T, kv_lora] and the rotated k_rope [T, rope] (the
    two that the cache keeps), and q_resid [T, q_lora], the low-rank query the DSA indexer reads too.
    Weights as in the checkpoint: q_a [q_lora, hidden], q_b [heads · (nope + rope), q_lora],
    kv_a [kv_lora + rope, hidden]; no biases."""
    t = x.shape[0]
    q_resid = rms_norm(linear(x, q_a_w), q_a_norm_w, shape.eps)
    q = linear(q_resid, q_b_w).view(t, shape.num_heads, shape.nope_dim + shape.rope_dim)
    q_nope, q_rope = q.split((shape.nope_dim, shape.rope_dim), dim=-1)
    latent, k_rope = linear(x, kv_a_w).split((shape.kv_lora_rank, shape.rope_dim), dim=-1)
    latent = rms_norm(latent, kv_a_norm_w, shape.eps)
    k_rope = interleaved_rope(k_rope[:, None, :], cos, sin)[:, 0]  # one key head, shared by all query heads
    return q_nope, interleaved_rope(q_rope, cos, sin), latent, k_rope, q_resid


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latents: torch.Tensor, rope_keys: torch.Tensor,
                  kv_b_w: torch.Tensor, visible: torch.Tensor, shape: MlaShape) -> torch.Tensor:
    """Attention of T queries (q_nope [T, heads, nope], q_rope [T, heads, rope]) over C cached tokens
    (latents [C, kv_lora], rope_keys [C, rope]), each query over the keys that visible (bool [T, C])
    marks, which must hold at least one per query (causality and the indexer's selection):
    [T, heads · v], before o_proj.

    kv_b [heads · (nope + v), kv_lora] holds per head the nope rows of W_UK, then the v rows of W_UV.
    Since k_nope = W_UK latent, q_nope · k_nope = (W_UK^T q_nope) · latent: the queries move into the
    latent space, and the values' up-projection W_UV is applied once to the attended latents. The
    cache is read as stored, never expanded per head; the scores [heads, T, C] are held at once."""
    t, h = q_nope.shape[0], shape.num_heads
    w = kv_b_w.view(h, shape.nope_dim + shape.v_dim, shape.kv_lora_rank)
    w_uk, w_uv = w[:, :shape.nope_dim], w[:, shape.nope_dim:]  # [heads, nope, kv_lora], [heads, v, kv_lora]
    q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk)  # [heads, T, kv_lora]
    scores = torch.matmul(q_lat, latents.T) + torch.matmul(q_rope.transpose(0, 1), rope_keys.T)
    scores = (scores * shape.scale).masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latents.dtype)
    ctx = torch.matmul(probs, latents)  # [heads, T, kv_lora]
    return torch.matmul(ctx, w_uv.transpose(1, 2)).transpose(0, 1).reshape(t, h * shape.v_dim)


def attend_cached(q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, kv_b_w: torch.Tensor,
                  visible: torch.Tensor | tuple[torch.Tensor, torch.Tensor], shape: MlaShape) -> torch.Tensor:
    """`mla_attention` over a cache's rows [C, kv_lora + rope] (each token's latent, then its
    rotary key): `visible` a mask [T, C], or for one query the columns of the rows it was given
    and which of them it sees ([1, k] each; the DSA indexer's choice), those rows gathered first,
    so that the step reads k rows however long the cache (on a GPU one kernel reads them in place,
    `sparse_mla_kernel`)."""
    kv = shape.kv_lora_rank
    if isinstance(visible, tuple):
        columns, visible = visible
        if rows.is_cuda:
            return _sparse_attention_gpu(q_nope, q_rope, rows, kv_b_w, columns[0], visible[0], shape)
        rows = rows[columns[0]]
    return mla_attention(q_nope, q_rope, rows[:, :kv], rows[:, kv:], kv_b_w, visible, shape)


def _sparse_attention_gpu(q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, kv_b_w: torch.Tensor,
                          columns: torch.Tensor, seen: torch.Tensor, shape: MlaShape) -> torch.Tensor:
    """`mla_attention` of one query over the chosen rows on the GPU: the absorbed query, the
    attention over the rows in place, the values' up-projection."""
    from ftc_runtime.models.layers.sparse_mla_kernel import sparse_latent_attention_gpu

    h = shape.num_heads
    w = kv_b_w.view(h, shape.nope_dim + shape.v_dim, shape.kv_lora_rank)
    w_uk, w_uv = w[:, :shape.nope_dim], w[:, shape.nope_dim:]
    q_lat = torch.matmul(q_nope.transpose(0, 1), w_uk)[:, 0]  # [heads, kv_lora]
    ctx = sparse_latent_attention_gpu(torch.cat([q_lat, q_rope[0]], dim=-1), rows, columns, seen,
                                      shape.kv_lora_rank, shape.scale)
    return torch.matmul(ctx.to(rows.dtype)[:, None], w_uv.transpose(1, 2)).transpose(0, 1).reshape(1, h * shape.v_dim)
