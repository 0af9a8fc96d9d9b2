"""Grouped-query attention: the input half of a layer (norm, fused q/k/v, q/k norms, RoPE), the
one-token attention over a fixed-size KV storage that decode graphs replay, causal attention of a
prompt chunk over a KV cache, and the output half (o_proj, residual, post-attention norm).

The halves are functions of tensors only (no layer index), so that the eager path and the CUDA
graphs of decode run the same code, and torch.compile sees one function for all layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftc_runtime.cache.kv import KVCache
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.rope import apply_rope


def attention_in(x: torch.Tensor, norm_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                 q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, heads: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, fused q/k/v projection, q/k norms and RoPE: q [T, heads, d], k and v [T, kv, d]."""
    n_q, n_kv, d = heads
    t = x.shape[0]
    qkv = F.linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b)
    q, k, v = qkv.split((n_q * d, n_kv * d, n_kv * d), dim=-1)
    q, k, v = q.view(t, n_q, d), k.view(t, n_kv, d), v.view(t, n_kv, d)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_out(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                  norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection and residual, then the post-attention norm: (x, normalized x)."""
    x = x + F.linear(attn, o_w, o_b)
    return x, rms_norm(x, norm_w, eps)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                     heads: tuple[int, int, int], done: torch.Tensor | None = None) -> torch.Tensor:
    """One query q [1, heads, d] over keys/values [C, kv, d], of which it sees those up to
    `position` (int64 [1] on q's device): [1, heads · d]. Decode passes the cache's whole storage
    and the step's position, so that the shapes stay fixed for CUDA graphs. On a GPU two Triton
    kernels that read only the keys up to the position (`decode_attention_kernel`); elsewhere
    torch: the query heads of one KV head form its rows, two batched matmuls over the storage with
    its tail masked off. `done` (the GPU's, optional): a count per KV head at a fixed address, zero,
    with which the kernels are one (`decode_attention_gpu`)."""
    if q.is_cuda:
        from ftc_runtime.models.layers.decode_attention_kernel import decode_attention_gpu  # Triton: beside a GPU

        return decode_attention_gpu(q, keys, values, position, heads, done)
    n_q, n_kv, d = heads
    scores = torch.matmul(q.view(n_kv, n_q // n_kv, d), keys.permute(1, 2, 0)) * d ** -0.5
    scores = scores.masked_fill(torch.arange(keys.shape[0], device=q.device) > position, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values.transpose(0, 1)).reshape(1, n_q * d)


def cached_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     heads: tuple[int, int, int]) -> torch.Tensor:
    """Appends k/v [T, kv, d] to the cache's `layer` and attends q [T, heads, d] causally over all
    its tokens: [T, heads · d]."""
    n_q, n_kv, d = heads
    t = q.shape[0]
    keys, values = cache.append(layer, k, v)
    if t == 1:  # over the whole storage up to this token: the very kernels that decode graphs replay
        stored_k, stored_v = cache.storage(layer)
        position = torch.full((1,), keys.shape[0] - 1, dtype=torch.long, device=q.device)
        return decode_attention(q, stored_k, stored_v, position, heads)
    q, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=lower_right_causal(t, keys.shape[2], q.device),
                                         enable_gqa=n_q != n_kv)
    return out[0].transpose(0, 1).reshape(t, -1)


def lower_right_causal(t: int, s: int, device: torch.device) -> torch.Tensor | object:
    """The mask of t queries that follow s - t cached tokens: query i sees keys 0 .. i + s - t
    (`is_causal` would mean top-left). On CUDA torch's bias object, which keeps the flash kernel
    (a boolean mask falls back to the math kernel and materializes [heads, t, s] scores); its
    module imports torch._dynamo, seconds a CPU engine's start does not need, so only there."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(t, s)
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)


