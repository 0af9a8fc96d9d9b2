"""DeepSeek-V4's layer in a decode graph (`ftc_runtime.decode.graphs`): the residual is the
hyper-connections' streams ([n, streams, hidden] in the step's `x`); each block (attention, MoE)
collapses them into its input and spreads its output back (the mixing weights one kernel a
block: `hyper_connections.hc_mix`). Attention is `attention.attend_step`
on each sequence's state, with the step's position as data: the raw row into the window's ring,
the compressors' open windows and entries written in place, the indexer's top_k over the store's
capacity with the entries not yet closed masked off. The MoE block stages its routed experts
(chosen by token id in the hash layers, the step's token being data too) beside the shared
expert; its output joins the streams at the next layer's start, with the mixing its collapse
computed. Shapes follow the stores' capacities, so a graph stays valid until a store grows (the
sequence's `generation`). torch.compile fuses the functions of fixed shapes (the blocks' input and
output, the routers, the shared expert, the attention's input and output projections, a
compressor's step); those whose shapes follow a store's capacity (the indexer's scores and choice,
the attention kernel) run as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.decode.graphs import DecodeGraphs
from ftc_runtime.models.deepseek_v4.attention import StepFunctions, angles, attend_step, window_entry
from ftc_runtime.models.layers.hyper_connections import block_input, hc_expand
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.sink_attention import grouped_out, shared_kv_in
from ftc_runtime.models.layers.softplus_router import route_biased, route_hashed


class HyperDecodeGraphs(DecodeGraphs):
    """DeepSeek-V4's layers. The MoE block's (post, comb) of layer i are kept for the join at
    layer i + 1 (or the head), in tensors that live as long as the graphs that read them."""

    def __init__(self, model, compile_fns: bool, fused_body: bool = True):
        self.streams = model.spec.hyper_connections.streams
        self._mix: tuple[torch.Tensor, torch.Tensor] | None = None  # the last MoE block's (post, comb)
        super().__init__(model, compile_fns, fused_body)

    def functions(self) -> dict[str, Callable]:
        return {f.__name__: f for f in (block_input, hc_expand, dense_mlp, route_biased, route_hashed, shared_kv_in,
                                        grouped_out, window_entry)}

    def _warm_up(self) -> None:
        m, f, io = self.model, self.fns, self.io
        h, post, comb = self._block_in(0, "attn_hc.", "input_layernorm.weight", f)
        f["hc_expand"](io.x, h, post, comb)
        f["dense_mlp"](h, *self._shared_weights(0), limit=m.spec.moe.swiglu_limit)
        learned = [i for i in range(m.spec.num_layers) if i not in m.hash_layers]
        for i in sorted(m.hash_layers)[:1] + learned[:1]:
            self._route(i, h, f)
        s, w = m.shapes[0], m.attention_w[0]
        cos, sin = angles(io.position, m.inv_freq)
        q, _, _ = f["shared_kv_in"](h, w["q_a_proj.weight"], w["q_a_norm.weight"], w["q_b_proj.weight"],
                                    w["kv_proj.weight"], w["kv_norm.weight"], cos, sin, s.eps, s.heads)
        f["grouped_out"](q, cos, sin, w["o_a_proj.weight"], w["o_b_proj.weight"], s.o_groups)
        self._warm_up_compressors()

    def _warm_up_compressors(self) -> None:
        """`window_entry` once per kind of compressor (each layer kind's own, a CSA layer's
        indexer's), on copies of a fresh state's buffers."""
        m, io, seen = self.model, self.io, set()
        for i, state in enumerate(m.new_cache().layers):
            parts = (("compressor.", state.compressor), ("compressor.indexer.", state.indexer))
            for p, c in ((p, c) for p, c in parts if c is not None):
                kind = (c.rate, tuple(c.open_kv.shape), c.prior is None)
                if kind in seen:
                    continue
                seen.add(kind)
                w, row = m.attention_w[i], c.open_kv[:1].clone()
                prior = None if c.prior is None else tuple(t.clone() for t in c.prior)
                self.fns["window_entry"](c.open_kv.clone(), c.open_gate.clone(), prior, io.position, row, row,
                                         w[p + "position_bias"], w[p + "kv_norm.weight"], m.spec.norm.eps,
                                         m.compress_inv_freq)

    def _block_in(self, i: int, hc: str, norm: str, f: dict[str, Callable]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, h, p = self.model, self.model.spec.hyper_connections, f"model.layers.{i}."
        return f["block_input"](self.io.x, m.w[p + hc + "fn"], m.w[p + hc + "base"], m.w[p + hc + "scale"],
                             m.w[p + norm], m.spec.norm.eps, h.eps, h.sinkhorn_iters)

    def _shared_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p = f"model.layers.{i}.mlp.shared_experts."
        return tuple(self.model.w[p + n + "_proj.weight"] for n in ("gate", "up", "down"))

    def _prologue(self, tokens: torch.Tensor) -> None:
        m = self.model
        self.io.x.copy_(m.w["model.embed_tokens.weight"][tokens][:, None, :].expand_as(self.io.x))

    def _layer(self, i: int, caches: list[SequenceCache]) -> None:
        m, f, io = self.model, self.f, self.io
        self._join_previous(i)
        h, post, comb = self._block_in(i, "attn_hc.", "input_layernorm.weight", f)
        fns = StepFunctions(f["shared_kv_in"], f["grouped_out"], f["window_entry"])
        out = self.per_sequence(lambda r, cache: attend_step(
            m.attention_w[i], h[r:r + 1], io.position[r:r + 1], cache.layers[i], m.shapes[i], m.inv_freq,
            m.compress_inv_freq, fns), caches)
        io.x.copy_(f["hc_expand"](io.x, out, post, comb))
        h, post, comb = self._block_in(i, "ffn_hc.", "post_attention_layernorm.weight", f)
        self._mix = post, comb
        m.experts.stage(h.float(), *self._route(i, h, f))
        io.shared.copy_(f["dense_mlp"](h, *self._shared_weights(i), limit=m.spec.moe.swiglu_limit))

    def _route(self, i: int, h: torch.Tensor, f: dict[str, Callable]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's experts for the rows of h and their weights: by the step's tokens in a hash
        layer, by the router's scores elsewhere."""
        m, p = self.model, f"model.layers.{i}.mlp."
        moe = m.spec.moe
        if i in m.hash_layers:
            return f["route_hashed"](h, self.io.token, m.w[p + "gate.weight"], m.w[p + "gate.tid2eid"],
                                     moe.routed_scaling_factor)
        return f["route_biased"](h, m.w[p + "gate.weight"], m.w[p + "gate.e_score_correction_bias"], moe.top_k,
                                 moe.routed_scaling_factor)

    def _join_previous(self, i: int) -> None:
        """The streams after layer i - 1's MoE block: its routed experts' output (the device's part
        and the CPU's) and the shared expert's, spread back by the block's (post, comb)."""
        if i == 0:
            return
        m, io = self.model, self.io
        on_device, on_host = m.experts.token_outputs(io.width)
        if on_host is not None:  # the host path: the CPU's part copied in
            io.cpu_part.copy_(on_host, non_blocking=True)
            on_device = on_device + io.cpu_part
        io.mlp.copy_(on_device)
        io.x.copy_(self.f["hc_expand"](io.x, io.mlp + io.shared, *self._mix))

    def final_hidden(self) -> torch.Tensor:
        """The streams before the head's collapse, [n, streams · hidden] (the model's `hidden`)."""
        return self.io.x.flatten(1).clone()

    def _head(self) -> None:
        self._join_previous(self.model.spec.num_layers)
        self.io.logits.copy_(self.model.head(self.io.x))
