"""Qwen3-MoE's layer in a decode graph (`ftc_runtime.decode.graphs`): attention over the KV cache,
then the router (the experts' input staged for the host) or a dense MLP. A MoE layer of one
sequence runs as five kernels where `fused_body` is on: the previous MoE layer's output joined
with the input norm and the q/k/v projection, the q/k norms with RoPE and the KV write, decode
attention, the output projection with the residual, the post-attention norm with the router's
projection and its top-k."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftc_runtime.cache.kv import INITIAL_CAPACITY
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.decode.graphs import DecodeGraphs
from ftc_runtime.models.layers.attention import attention_in, attention_out, decode_attention
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.router import route


class AttentionDecodeGraphs(DecodeGraphs):
    """Qwen3-MoE's layers: attention over the KV cache, then the router or a dense MLP."""

    def functions(self) -> dict[str, Callable]:
        return {f.__name__: f for f in (attention_in, attention_out, decode_attention, route, dense_mlp)}

    def _warm_up(self) -> None:
        m, eps = self.model, self.model.spec.norm.eps
        io = self.io
        q, k, _ = self.fns["attention_in"](io.x, *m.attention_in_weights(0), io.cos, io.sin, eps, m.heads)
        keys = k.new_zeros(INITIAL_CAPACITY, *k.shape[1:])
        attn = self.fns["decode_attention"](q, keys, keys, io.position, m.heads)
        _, h = self.fns["attention_out"](io.x, attn, *m.attention_out_weights(0), eps)
        kinds = {m.is_moe(i): i for i in reversed(range(m.spec.num_layers))}
        if True in kinds:
            self.fns["route"](h, *m.router_args(kinds[True]))
        if False in kinds:
            self.fns["dense_mlp"](h, *m.dense_mlp_weights(kinds[False]))

    def _layer(self, i: int, caches: list[SequenceCache]) -> None:
        m, f, io, eps = self.model, self.f, self.io, self.model.spec.norm.eps
        if self.fused_body and io.width == 1 and m.is_moe(i):
            part = self._joinable(i)
            if part is None:
                self._join_previous(i)
            self._fused_moe_layer(i, caches[0], part)
            return
        self._join_previous(i)
        q, k, v = f["attention_in"](io.x, *m.attention_in_weights(i), io.cos, io.sin, eps, m.heads)
        attn = self.attend(i, q, k, v, caches)
        x, h = f["attention_out"](io.x, attn, *m.attention_out_weights(i), eps)
        io.x.copy_(x)
        if m.is_moe(i):
            ids, weights = f["route"](h, *m.router_args(i))
            m.experts.stage(h.float(), ids, weights)
        else:
            io.mlp.copy_(f["dense_mlp"](h, *m.dense_mlp_weights(i)))

    def _fused_moe_layer(self, i: int, cache: SequenceCache, part: torch.Tensor | None) -> None:
        """Layer i as five kernels; `part`: the previous layer's output, joined into the residual
        stream by the first (else already joined)."""
        from ftc_runtime.models.layers.gemv_kernel import TopK, linear_gpu  # Triton: beside a GPU
        from ftc_runtime.models.layers.qk_rope_kernel import qk_norm_rope_store_gpu

        m, io, eps = self.model, self.io, self.model.spec.norm.eps
        norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w = m.attention_in_weights(i)
        residual = io.x if part is None else io.joined
        qkv = linear_gpu(io.x, qkv_w, qkv_b, norm_w=norm_w, eps=eps, plus=None if part is None else (part, io.joined))
        keys, values = cache.kv.storage(i)
        q = qk_norm_rope_store_gpu(qkv, q_norm_w, k_norm_w, io.cos, io.sin, eps, m.heads, keys, values, io.position)
        attn = self.f["decode_attention"](q, keys, values, io.position, m.heads, io.done)
        o_w, o_b, post_w = m.attention_out_weights(i)
        linear_gpu(attn, o_w, o_b, residual=residual, out=io.x)
        h = torch.empty(1, m.spec.hidden_size, dtype=torch.float32, device=m.device)
        gate_w, top_k, renormalize = m.router_args(i)
        ids = torch.empty(1, top_k, dtype=torch.int64, device=m.device)
        weights = torch.empty(1, top_k, dtype=torch.float32, device=m.device)
        linear_gpu(io.x, gate_w, norm_w=post_w, eps=eps, normed_out=h,
                   top_k=TopK(top_k, renormalize, ids, weights, io.done[:1]))
        m.experts.stage(h, ids, weights)
