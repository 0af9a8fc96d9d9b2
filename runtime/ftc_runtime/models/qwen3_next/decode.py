"""`HybridDecodeGraphs`: the CUDA graphs of one decode step (`ftc_runtime.decode.graphs`) for the
hybrid family (`Qwen3NextModel`). Per layer one graph:
- the previous MoE layer's output (device part, the copy of its CPU part, the shared expert) joins x;
- input norm, then either the Gated DeltaNet step (projections and the convolution, the recurrence
  on flash-linear-attention's fused kernel where it is installed, the gated norm and the output
  projection), its conv and recurrent state updated in place, or gated attention over the KV
  cache's whole capacity with the positions after this token masked off;
- residual and post-attention norm, the router, the staging of the experts' input for the host,
  and the shared expert behind its gate (written to `shared`, added at the next join).
With `fused_body`, a sequence's linear layer runs as four kernels of its own, a full-attention
layer as four and a MoE block with a shared expert as two (`_fused_linear`, `_fused_attention`,
`_fused_moe_block`), on the model's fused projections.
A sequence's linear-layer state never moves (`DeltaNetState.assign`), so graphs captured on a
cache stay valid until its KV storage moves. In a verification pass (the rows one sequence's
tokens) each row's state is also copied into the pass's `row_states`, which a rejected draft
rewinds to.
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

    def _row_state(self, cache: SequenceCache) -> tuple[DeltaNetState, ...]:
        return tuple(state.clone() for state in cache.linear)

    def _layer(self, i: int, caches: list[SequenceCache]) -> None:
        m, io = self.model, self.io
        self._join_previous(i)
        fused = self.fused_body and io.width == 1
        out = None
        if fused and i in m.linear_index:
            self._fused_linear(i, caches[0])  # x += its output
        elif fused and m.fused_weight(i, "self_attn.qkv_proj.weight") is not None:
            self._fused_attention(i, caches[0])
        else:
            out = self._mix(i, caches)
        if fused and m.fused_weight(i, "mlp.in_proj.weight") is not None:
            if out is not None:
                io.x.add_(out)
            self._fused_moe_block(i)
        else:
            self._mlp(i, out)

    def _mix(self, i: int, caches: list[SequenceCache]) -> torch.Tensor:
        """The token mixer's output on the input norm: linear attention or full attention."""
        m, eps = self.model, self.model.spec.norm.eps
        h = self.f["rms_norm"](self.io.x, m.w[f"model.layers.{i}.input_layernorm.weight"], eps)
        return self._linear(i, h, caches) if i in m.linear_index else self._attention(i, h, caches)

    def _mlp(self, i: int, out: torch.Tensor | None) -> None:
        """x += out (where the mixer's output is not in x yet), then the post-attention norm and
        either the router, the staging and the shared expert, or a dense MLP."""
        m, f, io, eps = self.model, self.f, self.io, self.model.spec.norm.eps
        post_w = m.w[f"model.layers.{i}.post_attention_layernorm.weight"]
        if out is None:
            h = f["rms_norm"](io.x, post_w, eps)
        else:
            x, h = f["residual_norm"](io.x, out, post_w, eps)
            io.x.copy_(x)
        if m.is_moe(i):
            ids, weights = f["route"](h, *m.router_args(i))
            m.experts.stage(h.float(), ids, weights)
            if io.shared is not None:
                io.shared.copy_(f["shared_expert"](h, *m.shared_expert_weights(i)))
        else:
            io.mlp.copy_(f["dense_mlp"](h, *m.dense_mlp_weights(i)))

    def _fused_linear(self, i: int, cache: SequenceCache) -> None:
        """A Gated DeltaNet layer of one sequence as four kernels: the input norm with the fused
        input projection, the convolution's step, the recurrence with the gated norm, and the
        output projection with the residual add."""
        from ftc_runtime.models.layers.deltanet_step_kernel import deltanet_step_gpu  # Triton: beside a GPU
        from ftc_runtime.models.layers.gemv_kernel import linear_gpu

        m, io = self.model, self.io
        w, state = m.delta_weights[i], cache.linear[m.linear_index[i]]
        proj = linear_gpu(io.x, m.fused_weight(i, "linear_attn.in_proj.weight"),
                          norm_w=m.w[f"model.layers.{i}.input_layernorm.weight"], eps=m.spec.norm.eps)
        gated = deltanet_step_gpu(proj, w.conv1d, state.conv, state.recurrent, w.A_log, w.dt_bias, w.norm,
                                  m.delta_shape)
        linear_gpu(gated, w.out_proj, residual=io.x, out=io.x)

    def _fused_attention(self, i: int, cache: SequenceCache) -> None:
        """A full-attention layer of one sequence as four kernels: the input norm with the fused
        q (and gate), k and v projection, the q/k norms with RoPE and the KV write, decode
        attention, and the output projection on the gated output with the residual add."""
        from ftc_runtime.models.layers.gemv_kernel import linear_gpu  # Triton: beside a GPU
        from ftc_runtime.models.layers.qk_rope_kernel import qk_norm_rope_store_gpu

        m, io, eps, gate = self.model, self.io, self.model.spec.norm.eps, self.model.spec.attention.output_gate
        p = f"model.layers.{i}."
        *_, q_norm_w, k_norm_w = m.attention_in_weights(i)
        qkv = linear_gpu(io.x, m.fused_weight(i, "self_attn.qkv_proj.weight"), norm_w=m.w[p + "input_layernorm.weight"],
                         eps=eps)
        keys, values = cache.kv.storage(m.kv_index[i])
        q = qk_norm_rope_store_gpu(qkv, q_norm_w, k_norm_w, io.cos, io.sin, eps, m.heads, keys, values, io.position,
                                   output_gate=gate)
        attn = self.f["decode_attention"](q, keys, values, io.position, m.heads, io.done)
        linear_gpu(attn, m.w[p + "self_attn.o_proj.weight"], residual=io.x, out=io.x,
                   in_gate=(qkv, m.heads[2]) if gate else None)

    def _fused_moe_block(self, i: int) -> None:
        """The post-attention norm with the router's, the shared gate's and the shared expert's
        gate and up projections (one GEMV, the router's top-k its epilogue), the staging, and the
        shared expert's down projection on their SwiGLU behind its sigmoid gate: two kernels."""
        from ftc_runtime.models.layers.gemv_kernel import TopK, linear_gpu  # Triton: beside a GPU

        m, io, e = self.model, self.io, self.model.spec.moe.num_experts
        p = f"model.layers.{i}."
        h = torch.empty(1, m.spec.hidden_size, dtype=torch.float32, device=m.device)
        _, top_k, renormalize = m.router_args(i)
        ids = torch.empty(1, top_k, dtype=torch.int64, device=m.device)
        weights = torch.empty(1, top_k, dtype=torch.float32, device=m.device)
        proj = linear_gpu(io.x, m.fused_weight(i, "mlp.in_proj.weight"),
                          norm_w=m.w[p + "post_attention_layernorm.weight"], eps=m.spec.norm.eps, normed_out=h,
                          top_k=TopK(top_k, renormalize, ids, weights, io.done[:1], among=e))
        m.experts.stage(h, ids, weights)
        linear_gpu(proj[:, e + 1:], m.w[p + "mlp.shared_expert.down_proj.weight"], swiglu=True,
                   out_gate=proj[:, e], out=io.shared)

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
            if self.row_states is not None:  # a verification pass: the state after this row, kept
                self.row_states[r][j].assign(state)
            return out

        return f["finish"](self.per_sequence(recurrence, caches), h, *w.outputs(), shape.eps)

    def _attention(self, i: int, h: torch.Tensor, caches: list[SequenceCache]) -> torch.Tensor:
        m, f, io = self.model, self.f, self.io
        q, k, v, gate = f["gated_attention_in"](h, *m.attention_in_weights(i), io.cos, io.sin,
                                                m.spec.norm.eps, m.heads, m.spec.attention.output_gate)
        attn = self.attend(m.kv_index[i], q, k, v, caches)
        return f["gated_attention_out"](attn, gate, m.w[f"model.layers.{i}.self_attn.o_proj.weight"])
