"""Qwen3-MoE's layer in a decode graph (`ftc_runtime.decode.graphs`): attention over the KV cache,
then the router (the experts' input staged for the host) or a dense MLP."""

from __future__ import annotations

from collections.abc import Callable

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
