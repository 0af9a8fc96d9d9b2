"""`HybridDecodeGraphs`: the CUDA graphs of one decode step (`ftc_runtime.decode.graphs`) for the
hybrid family (`Qwen3NextModel`). Per layer one graph:
- the previous MoE layer's output (device part, the copy of its CPU part, the shared expert) joins x;
- input norm, then either the Gated DeltaNet step (projections and the convolution, the recurrence
  on flash-linear-attention's fused kernel where it is installed, the gated norm and the output
  projection), its conv and recurrent state updated in place, or gated attention over the KV
  cache's whole capacity with the positions after this token masked off;
- residual and post-attention norm, the router, the staging of the experts' input for the host,
  and the shared expert behind its gate (written to `shared`, added at the next join).
A sequence's linear-layer state never moves (`DeltaNetState.assign`), so graphs captured on a
cache stay valid until its KV storage moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftc_runtime.cache.kv import INITIAL_CAPACITY
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.decode.graphs import DecodeGraphs
from ftc_runtime.models.layers.attention import decode_attention
from ftc_runtime.models.layers.gated_attention import gated_attention_in, gated_attention_out, residual_norm
from ftc_runtime.models.layers.gated_deltanet import DeltaNetState, delta_rule, finish, project
from ftc_runtime.models.layers.mlp import dense_mlp, shared_expert
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.router import route


class HybridDecodeGraphs(DecodeGraphs):
    def functions(self) -> dict[str, Callable]:
        return {f.__name__: f for f in (rms_norm, project, finish, gated_attention_in, decode_attention,
                                        gated_attention_out, residual_norm, route, shared_expert, dense_mlp)}

    def _warm_up(self) -> None:
        m, f, io, eps = self.model, self.fns, self.io, self.model.spec.norm.eps
        h = f["rms_norm"](io.x, m.w["model.layers.0.input_layernorm.weight"], eps)
        for i in [*m.linear_index][:1]:
            w, shape = m.delta_weights[i], m.delta_shape
            conv = torch.zeros(shape.conv_channels, shape.conv_kernel - 1, dtype=m.dtype, device=m.device)
            q, k, v, g, beta, _, _ = f["project"](h, *w.projections(), conv, shape.heads)
            f["finish"](v.float(), h, *w.outputs(), eps)
        for i in [*m.kv_index][:1]:
            q, k, v, gate = f["gated_attention_in"](h, *m.attention_in_weights(i), io.cos, io.sin, eps, m.heads,
                                                    m.spec.attention.output_gate)
            keys = k.new_zeros(INITIAL_CAPACITY, *k.shape[1:])
            attn = f["decode_attention"](q, keys, keys, io.position, m.heads)
            f["gated_attention_out"](attn, gate, m.w[f"model.layers.{i}.self_attn.o_proj.weight"])
        _, h = f["residual_norm"](io.x, h, m.w["model.layers.0.post_attention_layernorm.weight"], eps)
        for i in [*m.moe_index][:1]:
            f["route"](h, *m.router_args(i))
            if m.spec.moe.num_shared_experts:
                f["shared_expert"](h, *m.shared_expert_weights(i))
        for i in [i for i in range(m.spec.num_layers) if not m.is_moe(i)][:1]:
            f["dense_mlp"](h, *m.dense_mlp_weights(i))

    def _layer(self, i: int, caches: list[SequenceCache]) -> None:
        m, f, io, eps = self.model, self.f, self.io, self.model.spec.norm.eps
        p = f"model.layers.{i}."
        self._join_previous(i)
        h = f["rms_norm"](io.x, m.w[p + "input_layernorm.weight"], eps)
        out = self._linear(i, h, caches) if i in m.linear_index else self._attention(i, h, caches)
        x, h = f["residual_norm"](io.x, out, m.w[p + "post_attention_layernorm.weight"], eps)
        io.x.copy_(x)
        if m.is_moe(i):
            ids, weights = f["route"](h, *m.router_args(i))
            m.experts.stage(h.float(), ids, weights)
            if io.shared is not None:
                io.shared.copy_(f["shared_expert"](h, *m.shared_expert_weights(i)))
        else:
            io.mlp.copy_(f["dense_mlp"](h, *m.dense_mlp_weights(i)))

    def _linear(self, i: int, h: torch.Tensor, caches: list[SequenceCache]) -> torch.Tensor:
        """The Gated DeltaNet step of each sequence on its own state, then the gated norm and the
        output projection over the rows."""
        m, f = self.model, self.f
        w, shape, j = m.delta_weights[i], m.delta_shape, m.linear_index[i]

        def recurrence(r: int, cache: SequenceCache) -> torch.Tensor:
            state = cache.linear[j]
            q, k, v, g, beta, _, conv = f["project"](h[r:r + 1], *w.projections(), state.conv, shape.heads)
            out, recurrent, _ = delta_rule(q, k, v, g, beta, state.recurrent)
            state.assign(DeltaNetState(conv, recurrent))
            return out

        return f["finish"](self.per_sequence(recurrence, caches), h, *w.outputs(), shape.eps)

    def _attention(self, i: int, h: torch.Tensor, caches: list[SequenceCache]) -> torch.Tensor:
        m, f, io = self.model, self.f, self.io
        q, k, v, gate = f["gated_attention_in"](h, *m.attention_in_weights(i), io.cos, io.sin,
                                                m.spec.norm.eps, m.heads, m.spec.attention.output_gate)
        attn = self.attend(m.kv_index[i], q, k, v, caches)
        return f["gated_attention_out"](attn, gate, m.w[f"model.layers.{i}.self_attn.o_proj.weight"])
