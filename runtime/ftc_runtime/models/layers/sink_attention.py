"""DeepSeek-V4's attention around its key/value entries: one shared key/value head (the same row is
key and value), queries from a low-rank path (`q_a` → RMSNorm → `q_b`, then an unweighted RMSNorm
per head), interleaved RoPE on the heads' trailing slice, a learned sink logit per head that
takes part in the softmax and is dropped after it, the conjugate rotation of the output's
rotary slice at the query's position (the value rows carried RoPE), and the grouped output
projection (`o_a` block-diagonal over `groups` groups of heads, then `o_b`). Functions of
tensors only; the caller builds the entries (sliding window, compressed) and which one each
query sees.
"""

from __future__ import annotations

import torch

from ftc_runtime.models.layers.fp8_linear import GEMV_ROWS, BlockFp8, Weight, linear
from ftc_runtime.models.layers.hyper_connections import unweighted_rms_norm
from ftc_runtime.models.layers.norm import rms_norm_fp32_weight
from ftc_runtime.models.layers.window_compressor import rotate_interleaved_tail


def shared_kv_in(h: torch.Tensor, q_a_w: Weight, q_a_norm_w: torch.Tensor, q_b_w: Weight,
                 kv_w: Weight, kv_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hidden] → q [T, heads, d], the key/value row [T, d] (both rotated at the tokens'
    positions: cos, sin [T, r]) and the query's low-rank residual [T, q_lora] (the indexer's input)."""
    t = h.shape[0]
    q_residual = rms_norm_fp32_weight(linear(h, q_a_w), q_a_norm_w, eps)
    q = unweighted_rms_norm(linear(q_residual, q_b_w).view(t, heads, -1), eps)
    q = rotate_interleaved_tail(q, cos[:, None], sin[:, None])
    kv = rotate_interleaved_tail(rms_norm_fp32_weight(linear(h, kv_w), kv_norm_w, eps), cos, sin)
    return q, kv, q_residual


def sink_attention(q: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [T, heads, d] over entries [S, d] (keys and values alike), `visible` bool [T, S]: the
    softmax of each head's scores beside its sink logit (`sinks` [heads]), the sink's share
    dropped. [T, heads, d]."""
    scores = torch.einsum("thd,sd->hts", q, entries) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("hts,sd->thd", probs.to(entries.dtype), entries)


def sink_attention_at(q: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, seen: torch.Tensor,
                      sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """`sink_attention` of one query q [1, heads, d] over the rows of a storage [C, d] at `columns`
    (int64 [k]) that `seen` (bool [k], at least one true) marks: [1, heads, d]. On a GPU one
    Triton kernel reads them in place (`sparse_mla_kernel`); elsewhere they are gathered."""
    if rows.is_cuda:
        from ftc_runtime.models.layers.sparse_mla_kernel import sparse_latent_attention_gpu

        out = sparse_latent_attention_gpu(q[0], rows, columns, seen, rows.shape[1], scale, sinks)
        return out[None].to(q.dtype)
    return sink_attention(q, rows[columns], seen[None], sinks, scale)


def grouped_out(attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, o_a_w: Weight, o_b_w: Weight,
                groups: int) -> torch.Tensor:
    """attn [T, heads, d] → [T, hidden]: the rotary slice turned back at the query's position,
    each group of heads projected by its block of `o_a` [groups · rank, heads · d / groups], then
    `o_b`. An FP8 `o_a` takes a decode step's groups as rows through the whole weight (one read
    of its codes, each group's own block of the product kept); a prompt's rows use it dequantized."""
    t = attn.shape[0]
    attn = rotate_interleaved_tail(attn, cos[:, None], -sin[:, None]).reshape(t, groups, -1)
    if isinstance(o_a_w, BlockFp8) and t * groups <= GEMV_ROWS:
        every = linear(attn.reshape(t * groups, -1), o_a_w).view(t, groups, groups, -1)
        low = every.diagonal(dim1=1, dim2=2).transpose(1, 2)
    else:
        w = o_a_w.dequantize(attn.dtype) if isinstance(o_a_w, BlockFp8) else o_a_w
        low = torch.einsum("tgi,gri->tgr", attn, w.view(groups, -1, attn.shape[-1]))
    return linear(low.reshape(t, -1), o_b_w)
